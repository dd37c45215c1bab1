"""examples/torchrun_train.py under real torchrun against a real `gradq serve`: reruns and an elastic restart.

The aggregator's log is the test-visible record of membership: every join and
leave is one INFO line, so replaying them says which ranks are still joined.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gradq.server.process import spawn_aggregator

pytestmark = pytest.mark.e2e  # a slow end-to-end run: deselected unless --e2e

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchrun_train.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
STEPS = 12

# "join rank 0 to job 'x' (incarnation='y') (1 joined; it starts with 2)", "leave rank 0 from job 'x' (incarnation='y')"
MEMBERSHIP = re.compile(r"\b(join|rejoin|leave) rank (\d+) .*?job '([^']*)'(?: \(incarnation='([^']*)'\))?")
# torchrun puts both ranks on one node (GROUP_RANK=0): one host of 2 ranks, two-level aggregation.
FINISHED = re.compile(
    r"attempt (\d+): job (\S+) incarnation (\w+) mode gradq \(host 0 of 1, local rank 0 of 2\): "
    r"(\d+) steps, loss ([\d.]+) -> ([\d.]+)"
)


@dataclass
class Aggregator:
    address: str
    log: Path

    def joined(self) -> dict[str, set[int]]:
        """Job id -> ranks still joined, replaying the log (a new incarnation starts the job afresh)."""
        members: dict[str, tuple[str | None, set[int]]] = {}
        for event, rank, job, incarnation in MEMBERSHIP.findall(self.log.read_text()):
            current, ranks = members.get(job, (incarnation, set()))
            if incarnation != current:
                ranks = set()
            if event == "leave":
                ranks.discard(int(rank))
            else:
                ranks.add(int(rank))
            members[job] = (incarnation, ranks)
        return {job: ranks for job, (_, ranks) in members.items() if ranks}


@contextlib.contextmanager
def serving(log: Path, *flags: str) -> Iterator[Aggregator]:
    """A real `gradq serve` with ``flags``, logging to ``log``, stopped at the end."""
    with log.open("w") as sink:
        process, port = spawn_aggregator("--log-level", "INFO", "--round-timeout", "60", *flags, stderr=sink)
    try:
        yield Aggregator(f"127.0.0.1:{port}", log)
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def aggregator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Aggregator]:
    with serving(tmp_path_factory.mktemp("aggregator") / "serve.log") as served:
        yield served


def torchrun(
    aggregator: Aggregator,
    job_id: str,
    launcher: tuple[str, ...] = (),
    script: tuple[str, ...] = (),
    succeeds: bool = True,
) -> tuple[list[tuple[str, ...]], str]:
    """Run the example on 2 ranks; returns rank 0's "attempt" lines (parsed) and torchrun's stderr."""
    env = {
        **os.environ,
        "GRADQ_AGGREGATORS": aggregator.address,
        "GRADQ_JOB_ID": job_id,
        "GRADQ_BITS": "4",
        "GRADQ_ERROR_FEEDBACK": "1",
        # A restarted group must not read the killed one's gloo addresses from torchrun's
        # shared store (pytorch/pytorch#135712): without this the restart hangs or fails.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    command = [
        str(TORCHRUN),
        "--standalone",
        "--nproc_per_node=2",
        *launcher,
        str(EXAMPLE),
        "--steps",
        str(STEPS),
        *script,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert (done.returncode == 0) == succeeds, done.stderr[-4000:]
    return FINISHED.findall(done.stdout), done.stderr


def assert_trained(finished: tuple[str, ...], attempt: int, job_id: str) -> None:
    assert finished[0] == str(attempt) and finished[1] == job_id and finished[3] == str(STEPS)
    assert float(finished[5]) < 0.5 * float(finished[4]), finished  # the loss fell: gradients were averaged


def test_the_example_runs_twice_with_the_same_job_id(aggregator: Aggregator) -> None:
    runs = [torchrun(aggregator, "torchrun-twice")[0] for _ in range(2)]
    assert [len(run) for run in runs] == [1, 1]
    for run in runs:
        assert_trained(run[0], 0, "torchrun-twice")
    assert runs[0][0][2] != runs[1][0][2]  # each run is its own incarnation
    assert "torchrun-twice" not in aggregator.joined()  # no script called close(): exit left the job


def test_an_elastic_restart_with_a_killed_worker_completes(aggregator: Aggregator) -> None:
    finished, stderr = torchrun(aggregator, "torchrun-elastic", ("--max-restarts=1",), ("--crash-at-step", "5"))
    assert "exitcode: -9" in stderr  # the last rank really died on the first attempt
    assert len(finished) == 1
    assert_trained(finished[0], 1, "torchrun-elastic")
    assert "torchrun-elastic" not in aggregator.joined()


def test_serve_world_size_counts_the_ranks_of_a_two_level_host(tmp_path: Path) -> None:
    # One host of 2 ranks joins as one member standing for 2 ranks: --world-size 2 is that job.
    with serving(tmp_path / "serve.log", "--world-size", "2") as fixed:
        finished, _ = torchrun(fixed, "torchrun-world-2")
    assert len(finished) == 1
    assert_trained(finished[0], 0, "torchrun-world-2")


def test_a_world_size_mismatch_is_named_as_one(tmp_path: Path) -> None:
    with serving(tmp_path / "serve.log", "--world-size", "4") as fixed:
        _, stderr = torchrun(fixed, "torchrun-world-4", succeeds=False)
    assert "unreachable" not in stderr
    assert "refused the Join" in stderr and "configuration mismatch" in stderr, stderr[-3000:]
    assert "--world-size=4" in stderr and "this job has 2 ranks" in stderr, stderr[-3000:]
