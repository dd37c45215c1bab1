"""Accelerate: `use_gradq(accelerator)` trains 2 CPU processes through a real aggregator; misuse is refused clearly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from dependencies import require_module
from torch import nn

from gradq.client.ddp import GradqHookState
from gradq.client.integrations.registration import GradqIntegrationError
from gradq.server.app import AggregatorServer
from gradq.server.process import free_port

pytestmark = pytest.mark.e2e  # a slow end-to-end run: deselected unless --e2e

SCRIPT = Path(__file__).with_name("accelerate_train.py")
STEPS = 8


def launch_two_ranks(aggregator: AggregatorServer, out_dir: Path, *extra: str) -> list[dict[str, Any]]:
    """Run accelerate_train.py on 2 CPU processes against ``aggregator``; what each rank reported."""
    require_module("accelerate", "accelerate")
    env = {
        **os.environ,
        "GRADQ_AGGREGATORS": f"127.0.0.1:{aggregator.port}",
        "GRADQ_JOB_ID": "accelerate",
        "OMP_NUM_THREADS": "1",
    }
    # --multi_gpu with Accelerator(cpu=True): on CPU, `--cpu --num_processes 2` would start one process.
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", str(free_port()), str(SCRIPT), str(STEPS), str(out_dir), *extra]
    done = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_accelerate_launch_trains_through_gradq(aggregator: AggregatorServer, tmp_path: Path) -> None:
    ranks = launch_two_ranks(aggregator, tmp_path)
    for report in ranks:
        assert (report["model"], report["mode"], report["steps"]) == ("DistributedDataParallel", "gradq", STEPS)
        assert report["losses"][-1] < report["losses"][0]
    assert ranks[0]["weights"] == ranks[1]["weights"]  # the same mean applied on both ranks
    pushes = ranks[0]["pushes"]
    assert pushes >= STEPS
    # The launcher names the node, so the 2 ranks are one host under two-level aggregation:
    # each rank pushes its own piece of every bucket, one contribution per round.
    assert aggregator.table.counters["rounds_completed"] == 2 * pushes
    assert aggregator.table.counters["contributions"] == 2 * pushes
    assert aggregator.table.counters["rounds_failed"] == 0
    assert aggregator.table.active_jobs() == {}  # both ranks left


def test_use_gradq_after_prepare_is_refused_on_every_rank(aggregator: AggregatorServer, tmp_path: Path) -> None:
    ranks = launch_two_ranks(aggregator, tmp_path, "late")
    for report in ranks:
        assert report["error"] == (
            "use_gradq(accelerator) was called after accelerator.prepare wrapped Sequential in "
            "DistributedDataParallel: that model already trains with plain allreduce, and Accelerate keeps only the "
            "module inside, so gradq has no DDP model to register on; call use_gradq(accelerator) before "
            "accelerator.prepare(model, ...)"
        )
    assert aggregator.table.counters["contributions"] == 0


def test_a_single_process_gets_a_clear_error() -> None:
    accelerate = require_module("accelerate", "accelerate")
    from gradq.client.integrations.accelerate import use_gradq

    accelerator = accelerate.Accelerator(cpu=True)
    use_gradq(accelerator, GradqHookState("127.0.0.1:1"))
    with pytest.raises(
        GradqIntegrationError,
        match=r"accelerator.prepare returned a Linear, not a torch Distr.*"
        r"runs 1 process\(es\).*accelerate launch --multi_gpu --num_processes 2",
    ):
        accelerator.prepare(nn.Linear(2, 2))
    assert isinstance(accelerator.prepare_model(nn.Linear(2, 2), evaluation_mode=True), nn.Linear)
    with pytest.raises(GradqIntegrationError, match="already called on this accelerator"):
        use_gradq(accelerator, GradqHookState("127.0.0.1:1"))


def test_something_else_than_an_accelerator_is_refused() -> None:
    from gradq.client.integrations.accelerate import use_gradq

    with pytest.raises(GradqIntegrationError, match=r"has no prepare_model; expected an accelerate\.Accelerator"):
        use_gradq(object(), GradqHookState("127.0.0.1:1"))
