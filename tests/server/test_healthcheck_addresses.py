"""`python -m gradq.server.healthcheck ADDRESS`: a malformed address is refused, an unresolvable one named as such."""

from __future__ import annotations

import os
import subprocess
import sys


def check(*args: str) -> subprocess.CompletedProcess[str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("GRADQ_")}
    return subprocess.run(
        [sys.executable, "-m", "gradq.server.healthcheck", *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_an_address_without_a_port_is_refused_naming_it() -> None:
    completed = check("localhost")
    assert completed.returncode == 2
    assert completed.stderr.splitlines()[-1] == (
        "python -m gradq.server.healthcheck: error: address='localhost' is invalid; expected host:port; "
        "'localhost' has no port, e.g. localhost:50051"
    )


def test_a_host_that_does_not_resolve_is_said_so() -> None:
    completed = check("no-such-aggregator.invalid:50051")
    assert completed.returncode == 1
    [line] = completed.stdout.splitlines()
    assert line.startswith("no-such-aggregator.invalid:50051: not serving; cannot resolve no-such-aggregator.invalid: ")
    assert line.endswith("; check the host name")
