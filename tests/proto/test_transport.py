"""The allocator setting every gradq process applies, checked in fresh interpreters."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "from gradq.proto.transport import keep_large_buffers as k; print(k(), k())"


def probe(**environment: str) -> str:
    env = {name: value for name, value in os.environ.items() if not name.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    env.update(environment)
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_large_buffers_are_kept_once_per_process() -> None:
    assert probe() == "True True\n"


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("MALLOC_MMAP_THRESHOLD_", "131072"),
        ("MALLOC_TRIM_THRESHOLD_", "131072"),
        ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=131072"),
    ],
)
def test_the_users_own_malloc_settings_win(variable: str, value: str) -> None:
    assert probe(**{variable: value}) == "False False\n"
