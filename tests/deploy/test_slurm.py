"""deploy/slurm/gradq.sbatch on a real one-node Slurm cluster: the training's verdict, and nothing left running.

deploy/slurm/start-test-cluster.sh starts the cluster (munged, slurmctld and slurmd as root; .ci/run runs
it). Without sbatch these tests skip here and fail under CI=true. Each job runs the aggregator step and
one torchrun of 2 ranks (examples/torchrun_train.py) on the one node; a job's processes are told apart
from everything else on the machine by the SLURM_JOB_ID in their environment.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from dependencies import require_program
from waiting import wait_until

pytestmark = pytest.mark.e2e  # a slow end-to-end run: deselected unless --e2e

REPO = Path(__file__).resolve().parents[2]
SBATCH_SCRIPT = REPO / "deploy" / "slurm" / "gradq.sbatch"
START_CLUSTER = "bash deploy/slurm/start-test-cluster.sh (as root)"
STEPS = 12
# Rank 0's last line: both ranks on one node are one host of 2 ranks (two-level aggregation).
FINISHED = re.compile(
    r"attempt 0: job (\S+) incarnation \w+ mode gradq \(host 0 of 1, local rank 0 of 2\): "
    r"(\d+) steps, loss ([\d.]+) -> ([\d.]+)"
)
# Every state a job ends in; COMPLETING is not one (Slurm is still ending its processes).
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}


def slurm(*args: str) -> str:
    """Run a Slurm client command; its stdout."""
    done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}"
    return done.stdout


@pytest.fixture(scope="module", autouse=True)
def cluster() -> None:
    require_program("sbatch", install=START_CLUSTER)
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    assert "UP" in ping.stdout, f"no Slurm controller answers ({ping.stdout.strip()}); run {START_CLUSTER}"


def submit(output_dir: Path, *script_args: str, **variables: str) -> str:
    """Submit gradq.sbatch on 1 node with 2 ranks, from the repository's root; the job id."""
    env = {
        **os.environ,
        "GRADQ_VENV": str(Path(sys.executable).parent.parent),  # this interpreter's venv, not resolved
        "GRADQ_NPROC_PER_NODE": "2",
        "GRADQ_BITS": "4",
        "GRADQ_ERROR_FEEDBACK": "1",
        **variables,
    }
    command = ["sbatch", "--parsable", "--nodes=1", "--time=5", f"--output={output_dir}/slurm-%j.out"]
    done = subprocess.run(
        [*command, str(SBATCH_SCRIPT), *script_args], cwd=REPO, env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def job_record(job_id: str) -> dict[str, str]:
    """The job's fields as `scontrol show job` has them (kept MinJobAge seconds after it ends)."""
    return dict(re.findall(r"(\w+)=(\S*)", slurm("scontrol", "show", "job", "--oneliner", job_id)))


def wait_for_end(job_id: str, timeout_s: float = 150) -> dict[str, str]:
    wait_until(lambda: job_record(job_id)["JobState"] in ENDED, f"job {job_id} ended", timeout_s, poll_s=0.5)
    return job_record(job_id)


def job_processes(job_id: str) -> list[str]:
    """'pid: command line' of every live process that Slurm started for the job."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.status() == psutil.STATUS_ZOMBIE:  # exited; only its parent's reaping is left
                continue
            if process.environ().get("SLURM_JOB_ID") == job_id:
                found.append(f"{process.pid}: {' '.join(process.cmdline())}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def assert_nothing_left(job_id: str) -> None:
    assert slurm("squeue", "--noheader", "--steps", "--jobs", job_id).strip() == ""
    assert job_processes(job_id) == []


def output_of(output_dir: Path, job_id: str) -> str:
    path = output_dir / f"slurm-{job_id}.out"
    return path.read_text() if path.exists() else ""


def test_a_job_trains_through_its_aggregator_and_leaves_nothing_running(tmp_path: Path) -> None:
    job_id = submit(tmp_path, "--steps", str(STEPS))
    record = wait_for_end(job_id)
    output = output_of(tmp_path, job_id)
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), output[-4000:]
    finished = FINISHED.findall(output)
    assert len(finished) == 1, output[-4000:]
    job, steps, first_loss, last_loss = finished[0]
    assert (job, steps) == (f"slurm-{job_id}", str(STEPS))
    assert float(last_loss) < 0.5 * float(first_loss)  # the loss fell: the aggregator averaged the gradients
    assert f"aggregator serving at {os.uname().nodename}:" in output
    assert f"job 'slurm-{job_id}' finished: every rank left" in output
    # The script stopped the aggregator once training ended, gracefully; Slurm had no step left to cancel
    # (it would have, "*** STEP <id>.0 ON <node> CANCELLED ***", had the script left it running).
    tail = output[output.index("training exited with status 0") :]
    assert "received SIGTERM" in tail and "gradq.server.app: stopped" in tail, tail
    assert "CANCELLED" not in output, tail
    assert_nothing_left(job_id)


def test_scancel_during_training_ends_every_shard_and_rank(tmp_path: Path) -> None:
    job_id = submit(tmp_path, "--steps", "1000000", GRADQ_SHARDS="2")
    wait_until(lambda: "join rank 0 to job" in output_of(tmp_path, job_id), f"job {job_id} training", 120, poll_s=0.5)
    running = job_processes(job_id)
    # The supervisor and both shards, torchrun and its 2 ranks are there to be ended.
    assert sum("gradq.server" in line or "gradq serve" in line for line in running) == 3, running
    assert sum("examples/torchrun_train.py" in line for line in running) >= 3, running
    slurm("scancel", job_id)
    record = wait_for_end(job_id, 90)
    assert record["JobState"] == "CANCELLED"
    output = output_of(tmp_path, job_id)
    assert "SIGTERM (scancel or the time limit); stopping" in output
    assert "gradq.server.supervisor: received SIGTERM: stopping 2 shards" in output, output[-4000:]
    assert_nothing_left(job_id)
