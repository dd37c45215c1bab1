"""The HF Trainer: `GradqCallback(trainer)` trains 2 CPU processes (torchrun) through a real aggregator, twice, with
gradient accumulation; a single process is refused clearly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dependencies import require_module

from gradq.client.ddp import GradqHookState
from gradq.client.integrations.registration import GradqIntegrationError
from gradq.server.app import AggregatorServer
from gradq.server.process import free_port

pytestmark = pytest.mark.e2e  # a slow end-to-end run: deselected unless --e2e

SCRIPT = Path(__file__).with_name("transformers_train.py")
STEPS = 6


def test_the_trainer_trains_through_gradq_twice_with_accumulation(aggregator: AggregatorServer, tmp_path: Path) -> None:
    require_module("transformers", "transformers")
    env = {
        **os.environ,
        "GRADQ_AGGREGATORS": f"127.0.0.1:{aggregator.port}",
        "GRADQ_JOB_ID": "hf-trainer",
        "OMP_NUM_THREADS": "1",
    }
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    launch += ["--master_port", str(free_port()), str(SCRIPT), str(STEPS), str(tmp_path)]
    done = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for report in ranks:
        assert (report["model"], report["same_ddp"], report["mode"]) == ("DistributedDataParallel", True, "gradq")
        # Two train() calls of STEPS optimizer steps, 2 micro-batches each: DDP reduces once per optimizer step.
        assert report["hook_steps"] == report["pushes"] == 2 * STEPS
        losses = report["losses"]
        assert len(losses) == 2 * STEPS and sum(losses[-3:]) < sum(losses[:3])
    assert ranks[0]["weights"] == ranks[1]["weights"]  # the same means applied on both ranks
    # torchrun names the node, so the 2 ranks are one host under two-level aggregation:
    # each rank pushes its own piece of every bucket, one contribution per round.
    assert aggregator.table.counters["rounds_completed"] == 2 * ranks[0]["pushes"]
    assert aggregator.table.counters["rounds_failed"] == 0
    assert aggregator.table.active_jobs() == {}  # both ranks left


def test_a_single_process_trainer_gets_a_clear_error(tmp_path: Path) -> None:
    transformers = require_module("transformers", "transformers")
    from gradq.client.integrations.transformers import GradqCallback

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, max_steps=1, report_to=[])
    trainer = transformers.Trainer(model=model, args=args, train_dataset=[{"x": torch.zeros(2)}])
    trainer.add_callback(GradqCallback(trainer, GradqHookState("127.0.0.1:1")))
    with pytest.raises(
        GradqIntegrationError,
        match=r"Trainer \(its model_wrapped\) returned a Sequential, not a torch DistributedDataParallel.*torchrun",
    ):
        trainer.train()


def test_the_callback_needs_a_trainer_and_the_gradq_environment() -> None:
    require_module("transformers", "transformers")
    from gradq.client.integrations.transformers import GradqCallback

    with pytest.raises(GradqIntegrationError, match=r"has no model_wrapped; expected a transformers\.Trainer"):
        GradqCallback(object(), GradqHookState("127.0.0.1:1"))

    class Bare:
        model_wrapped = None

    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("GRADQ_AGGREGATORS", raising=False)
        with pytest.raises(ValueError, match="GRADQ_AGGREGATORS=''"):
            GradqCallback(Bare())
