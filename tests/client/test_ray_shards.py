"""Shards placed by Ray (gradq.server.ray_shards): two shards as actors on a local Ray cluster, a 2-worker TorchTrainer
given one shard's address trains through both, one shard's actor process is SIGKILLed midway, Ray restarts it on the
same address, and training ends with the weights of the same run without the kill."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dependencies import require_module
from waiting import wait_until

from gradq.server.app import ServerOptions
from gradq.server.policy import RoundPolicy

pytestmark = pytest.mark.e2e  # a slow end-to-end run: deselected unless --e2e

require_module("ray", "ray")

STEPS = 8
PAUSE_AT = 3


@pytest.fixture(scope="module")
def shards(ray_cluster: None) -> Iterator[Any]:
    from gradq.server.ray_shards import start_shards

    # Half a CPU each: the cluster's 2 CPUs hold both shards and the two training workers (half a CPU each too).
    options = ServerOptions("0.0.0.0:0", grace_s=1.0, metrics_port=0)  # metrics too: each shard its own port
    started = start_shards(2, RoundPolicy(round_timeout_s=60.0), options, num_cpus=0.5)
    yield started
    started.stop()


def fit(config: dict[str, Any], tmp_path: Path, name: str) -> list[dict[str, Any]]:
    """Run ray_shards_loop.train_func in a TorchTrainer of 2 CPU workers; each worker's report."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray_shards_loop import train_func

    out_dir = tmp_path / name
    out_dir.mkdir()
    run = RunConfig(name=f"gradq-{tmp_path.name}-{name}", storage_path=str(tmp_path / "ray"))
    scaling = ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 0.5})
    TorchTrainer(
        train_func, train_loop_config={**config, "out_dir": str(out_dir)}, scaling_config=scaling, run_config=run
    ).fit()
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_a_shard_ray_restarts_after_sigkill_lets_training_finish_with_the_right_weights(
    shards: Any, tmp_path: Path
) -> None:
    assert len(shards.addresses) == 2 and len(set(shards.addresses)) == 2
    # One address: the workers learn the second shard from it; small rounds, so both shards carry every step.
    config = {"steps": STEPS, "gradq_aggregators": shards.address, "gradq_chunk_elements": 256}
    # A push's rejoin waits this long for the killed shard: Ray restarts its actor within seconds on an idle
    # machine, but took more than the 10 s default on 2 cores under load (a fresh clone's e2e run beside two
    # busy loops failed "unreachable: tried for 10.6 s").
    config["gradq_connect_timeout"] = 120
    before = shards.pids()
    kill_dir = tmp_path / "killed-run"
    killed: list[int] = []

    def kill_a_shard_midway() -> None:
        try:
            wait_until(lambda: (kill_dir / "reached").exists(), f"worker 0 paused before step {PAUSE_AT}", 600)
        except AssertionError:
            return  # the run ended first: fit() raises, or the assert on ``killed`` below names it
        os.kill(before[0], signal.SIGKILL)  # the actor's own process, as a crash or the OOM killer would
        killed.append(before[0])
        (kill_dir / "killed").write_text("")

    killer = threading.Thread(target=kill_a_shard_midway, daemon=True)
    killer.start()
    reports = fit({**config, "pause_at": PAUSE_AT}, tmp_path, "killed-run")
    killer.join(timeout=5)
    assert killed == [before[0]]
    after = shards.pids()
    assert after[0] != before[0] and after[1] == before[1]  # Ray restarted the killed shard's actor, and only it
    counters = shards.counters()
    assert counters[0]["rounds_completed"] > 0  # the restarted shard, on the same address, took the later steps
    # ... and serves its metrics on the same port too, counting this job's rounds since its restart.
    with urllib.request.urlopen(f"http://{shards.metrics_addresses[0]}/metrics", timeout=10) as response:
        assert f'gradq_contributions_total{{job="ray-gradq-{tmp_path.name}-killed-run"}}' in response.read().decode()
    for report in reports:
        assert (report["mode"], report["steps"]) == ("gradq", STEPS)
        assert report["addresses"] == shards.addresses
        assert report["loss_after"] < 0.7 * report["loss_before"]
    assert reports[0]["weights"] == reports[1]["weights"]

    # The same run without the kill, through the same shards: the kill changed nothing of the result.
    reference = fit(config, tmp_path, "reference-run")
    assert reference[0]["weights"] == reports[0]["weights"]
    assert shards.pids() == after  # nothing died this time
