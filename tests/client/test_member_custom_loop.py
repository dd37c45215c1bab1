"""A loop of the user's own (examples/custom_loop.py) trains elastically through the session alone.

Two hosts as real processes against a real aggregator: both train the job's
steps to the end and hold bit-identical parameters (each applies the same
mean with the same optimizer). A third host started once the others train
joins at a step boundary through ``member.receive`` and ends identical too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import wait_until

from gradq.server.app import AggregatorServer

pytestmark = pytest.mark.e2e  # real processes: deselected unless --e2e

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "custom_loop.py"
RUN_TIMEOUT_S = 240


def start(aggregator: AggregatorServer, out: Path, seed: int, *args: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "GRADQ_AGGREGATORS": f"127.0.0.1:{aggregator.port}",
        "GRADQ_JOB_ID": "custom-loop",
        "GRADQ_ELASTIC_HOSTS": "2",
        "OMP_NUM_THREADS": "1",
    }
    log = (out / f"host{seed}.log").open("w")
    command = [sys.executable, str(EXAMPLE), "--data-seed", str(seed), "--report", str(out / f"host{seed}.json")]
    return subprocess.Popen([*command, *args], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def result(process: subprocess.Popen[bytes], out: Path, seed: int) -> dict[str, object]:
    code = process.wait(timeout=RUN_TIMEOUT_S)
    assert code == 0, (out / f"host{seed}.log").read_text()[-3000:]
    return dict(json.loads((out / f"host{seed}.json").read_text()))


def test_two_hosts_and_a_joiner_of_a_custom_loop_end_identical(aggregator: AggregatorServer, tmp_path: Path) -> None:
    steps = 200  # 10 s at least at 0.05 s a step: the joiner, started once both train, finds the job training
    hosts = [start(aggregator, tmp_path, seed, "--steps", str(steps), "--step-sleep", "0.05") for seed in (0, 1)]
    started = list(hosts)
    try:
        wait_until(
            lambda: all("connected to aggregator" in (tmp_path / f"host{seed}.log").read_text() for seed in (0, 1)),
            "both hosts connected",
            timeout_s=120,
            alive=lambda: all(process.poll() is None for process in hosts),
            detail=lambda: "\n".join((tmp_path / f"host{seed}.log").read_text()[-2000:] for seed in (0, 1)),
            poll_s=0.2,
        )
        joiner = start(aggregator, tmp_path, 2, "--steps", str(steps))
        started.append(joiner)
        first, second = (result(process, tmp_path, seed) for seed, process in zip((0, 1), hosts, strict=True))
        third = result(joiner, tmp_path, 2)
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert first["step"] == second["step"] == third["step"] == steps
    assert first["trained"] == second["trained"] == steps
    assert 0 <= int(str(third["trained"])) < steps  # it took a live host's state and trained the rest
    assert first["digest"] == second["digest"] == third["digest"]
    assert first["rejoins"] == second["rejoins"] == third["rejoins"] == 0
