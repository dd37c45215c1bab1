"""Elastic hosts as real processes (examples/elastic_train.py), and what their step reports say."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from waiting import wait_until

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "elastic_train.py"


@dataclass
class ElasticHost:
    """One host process and the JSON-lines report it appends to."""

    process: subprocess.Popen[bytes]
    report: Path
    started_at: float

    def records(self, kind: str = "step") -> list[dict[str, Any]]:
        if not self.report.exists():
            return []
        lines = self.report.read_text().splitlines()
        # The last line may be half written while the host runs.
        return [record for line in lines if line.endswith("}") and (record := json.loads(line))["kind"] == kind]

    def steps(self) -> dict[int, dict[str, Any]]:
        return {record["step"]: record for record in self.records()}

    def last_step(self) -> int:
        records = self.records()
        return records[-1]["step"] if records else -1

    def result(self) -> dict[str, Any]:
        (result,) = self.records("result")
        return result


def start_host(
    address: str,
    job_id: str,
    hosts: int,
    steps: int,
    report: Path,
    step_sleep_s: float,
    join_when: Path | None = None,
    ranks: int = 1,
    hidden: int = 64,
) -> ElasticHost:
    """Start one host of ``job_id``; it trains until ``steps`` and reports every step to ``report``.

    With ``join_when`` it is a standby: it loads torch and builds its model, then joins once that file exists.
    With ``ranks`` > 1 the host is a torchrun of that many processes (their group reduces together first).
    ``hidden`` is the model's width: another than the job's makes a mis-built host.
    """
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    command = [*(launcher if ranks > 1 else [sys.executable]), str(EXAMPLE)]
    command += ["--aggregator", address, "--job-id", job_id, "--hosts", str(hosts)]
    command += ["--steps", str(steps), "--step-sleep", str(step_sleep_s), "--report", str(report)]
    command += ["--hidden", str(hidden)]
    # On several shards, the model's one bucket travels in chunks, which take turns over the shards: every
    # shard then carries rounds (and its membership matters), not the first alone.
    command += ["--chunk-elements", "1024"] if "," in address else []
    command += ["--join-when", str(join_when)] if join_when is not None else []
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return ElasticHost(process, report, time.time())


def wait_for(what: str, done: Callable[[], bool], timeout_s: float, hosts: list[ElasticHost]) -> None:
    """Poll ``done`` until true; on timeout fail with what each host printed."""

    def printed() -> str:
        outputs = []
        for host in hosts:
            if host.process.poll() is not None and host.process.stdout is not None:
                outputs.append(host.process.stdout.read().decode(errors="replace")[-2000:])
        return f"exited hosts printed: {outputs}"

    wait_until(done, what, timeout_s, detail=printed)


def stop(host: ElasticHost) -> None:
    """Kill a host and every process it started (a torchrun's ranks), and reap it."""
    try:
        children = psutil.Process(host.process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    host.process.kill()
    host.process.wait()


def finish(hosts: list[ElasticHost], timeout_s: float) -> None:
    """Wait for every host to exit 0."""
    for host in hosts:
        try:
            output, _ = host.process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            host.process.kill()
            output, _ = host.process.communicate()
        assert host.process.returncode == 0, output.decode(errors="replace")[-3000:]
