"""Ray Train: `use_gradq(model, config)` trains a 2-worker TorchTrainer through a real aggregator (from gradq_* keys
or a pickled GradqConfig), survives Ray's restart of the group after a worker is killed, and refuses misuse clearly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from dependencies import require_module

from gradq.client.config import GradqConfig
from gradq.server.app import AggregatorServer

pytestmark = pytest.mark.e2e  # a slow end-to-end run: deselected unless --e2e

require_module("ray", "ray")  # every test here runs Ray Train (the train loops import it)

STEPS = 8


def fit(train_func: Any, config: dict[str, Any], tmp_path: Path, workers: int, max_failures: int = 0) -> None:
    """Run ``train_func`` in a TorchTrainer of ``workers`` CPU workers (0: Ray Train's local mode, in this process)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    run = RunConfig(
        name=f"gradq-{tmp_path.name}",  # the job id gradq derives: ray-<run name>
        storage_path=str(tmp_path / "ray"),
        failure_config=FailureConfig(max_failures=max_failures),
    )
    scaling = ScalingConfig(num_workers=workers, use_gpu=False)
    TorchTrainer(train_func, train_loop_config=config, scaling_config=scaling, run_config=run).fit()


def read_ranks(tmp_path: Path) -> list[dict[str, Any]]:
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for report in ranks:
        assert (report["model"], report["mode"], report["steps"]) == ("DistributedDataParallel", "gradq", STEPS)
        assert report["job_id"] == f"ray-gradq-{tmp_path.name}"
        assert report["loss_after"] < 0.7 * report["loss_before"]
        assert report["twice"] == (
            "use_gradq(model) was already called on this model; call it once per model (DDP takes one comm hook)"
        )
    assert ranks[0]["incarnation"] == ranks[1]["incarnation"]
    assert ranks[0]["weights"] == ranks[1]["weights"]  # the same means applied on both workers
    return ranks


def test_a_torch_trainer_of_2_workers_trains_through_gradq(
    ray_cluster: None, aggregator: AggregatorServer, tmp_path: Path
) -> None:
    from ray_train_loop import train_func

    config = {"steps": STEPS, "out_dir": str(tmp_path), "gradq_aggregators": [f"127.0.0.1:{aggregator.port}"]}
    fit(train_func, config, tmp_path, workers=2)
    pushes = read_ranks(tmp_path)[0]["pushes"]
    assert pushes == STEPS  # one bucket per step
    # Ray Train sets NODE_RANK, so the 2 workers of this node are one host under two-level aggregation:
    # each pushes its own piece of every bucket, one contribution per round.
    assert aggregator.table.counters["rounds_completed"] == 2 * pushes
    assert aggregator.table.counters["contributions"] == 2 * pushes
    assert aggregator.table.counters["rounds_failed"] == 0
    assert aggregator.table.active_jobs() == {}  # both workers left


def test_a_killed_worker_restarts_the_group_as_a_new_incarnation(
    ray_cluster: None, aggregator: AggregatorServer, tmp_path: Path
) -> None:
    from ray_train_loop import train_func

    # A whole GradqConfig, pickled to the workers; its job id left to the run's name.
    config = {"steps": STEPS, "out_dir": str(tmp_path), "gradq": GradqConfig.of(f"127.0.0.1:{aggregator.port}")}
    kill_at = 3
    fit(train_func, {**config, "kill_at": kill_at}, tmp_path, workers=2, max_failures=1)
    killed_incarnation = (tmp_path / "killed").read_text()  # worker 1 of the first group wrote it, then died
    ranks = read_ranks(tmp_path)  # the restarted group trained all STEPS from step 0, in step
    assert killed_incarnation not in ("", "None", ranks[0]["incarnation"])
    # The first group completed its first kill_at steps; nothing of it was mixed into the second's rounds.
    assert aggregator.table.counters["rounds_completed"] == 2 * (kill_at + ranks[0]["pushes"])
    assert aggregator.table.active_jobs() == {}


def test_misuse_gets_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ray_train_loop import misuse_func

    monkeypatch.delenv("GRADQ_AGGREGATORS", raising=False)
    # Local mode (0 workers) runs train_func here at world size 1, where prepare_model wraps nothing.
    fit(misuse_func, {"out_dir": str(tmp_path)}, tmp_path, workers=0)
    errors = json.loads((tmp_path / "misuse.json").read_text())
    assert errors["model"] == "Linear"
    assert errors["no_address"].startswith(
        "no aggregator address: train_loop_config has no 'gradq_aggregators' and GRADQ_AGGREGATORS is unset"
    )
    assert errors["unknown_key"].startswith("train_loop_config['gradq_bitz'] is unknown; expected one of ")
    assert "gradq_bits" in errors["unknown_key"]
    assert errors["not_a_config"] == (
        "train_loop_config['gradq']='127.0.0.1:1' is invalid; expected a gradq.client.config.GradqConfig"
    )
    assert errors["config_and_keys"] == (
        "train_loop_config has both 'gradq' and 'gradq_bits'; pass the whole GradqConfig or the gradq_* keys, not both"
    )
    assert errors["not_ddp"] == (
        "ray.train.torch.prepare_model returned a Linear, not a torch DistributedDataParallel: gradq reduces DDP's "
        "gradient buckets, so it has nothing to hook into; this Ray Train worker group has world size 1 and "
        "prepare_model wraps nothing in DDP; run ScalingConfig(num_workers=2) or more"
    )
