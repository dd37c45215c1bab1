"""Lightning's DDPStrategy(ddp_comm_state=..., ddp_comm_hook=gradq_hook) trains through a real aggregator."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dependencies import require_module

from gradq.server.app import AggregatorServer
from gradq.server.process import free_port

pytestmark = pytest.mark.e2e  # a slow end-to-end run: deselected unless --e2e

require_module("lightning", "dev")  # under CI a missing lightning fails, not skips

SCRIPT = Path(__file__).with_name("lightning_train.py")
STEPS = 10


def joined(server: AggregatorServer) -> dict[str, list[int]]:
    """Job id -> its joined ranks, as the aggregator's table holds them now."""
    with server.table.jobs.lock:
        return {job.job_id: sorted(job.joined) for job in server.table.jobs.all()}


def test_lightning_ddp_strategy_trains_through_gradq(aggregator: AggregatorServer) -> None:
    env = {
        **os.environ,
        "GRADQ_AGGREGATORS": f"127.0.0.1:{aggregator.port}",
        "GRADQ_JOB_ID": "lightning",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(STEPS)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found = re.search(r"mode=(\w+) steps=(\d+) pushes=(\d+) loss=([\d.]+)->([\d.]+)", done.stdout)
    assert found, done.stdout
    mode, steps, pushes, first, last = found.groups()
    assert (mode, int(steps)) == ("gradq", STEPS) and int(pushes) >= STEPS
    assert float(last) < float(first)
    # Lightning names the node (NODE_RANK), so its 2 ranks are one host under two-level aggregation:
    # each rank pushes its own piece of every bucket, one contribution per round.
    assert aggregator.table.counters["rounds_completed"] == 2 * int(pushes)
    assert aggregator.table.counters["contributions"] == 2 * int(pushes)
    assert joined(aggregator) == {}  # both ranks left when Lightning's processes ended
