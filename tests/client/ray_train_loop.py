"""Ray Train's train_func for tests/client/test_ray_train.py: each worker writes what it saw to OUT_DIR/rank<N>.json.

The config holds ``steps``, ``out_dir``, the gradq keys (``gradq_aggregators``, ...) or a GradqConfig (``gradq``)
and, for the restart test,
``kill_at``: worker 1 of the first attempt kills itself (SIGKILL) before that step, so Ray restarts the group.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch
from torch import nn

from gradq.client.config import GradqConfig
from gradq.client.integrations.ray_train import GradqIntegrationError, use_gradq


def train_func(config: dict[str, Any]) -> None:
    """Train y = tanh(x @ w) on this worker's half of the data through gradq; report losses and weights."""
    torch.set_num_threads(1)
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    out_dir = Path(config["out_dir"])
    torch.manual_seed(0)  # the same initial weights on every worker
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(512, 16, generator=generator)
    targets = torch.tanh(inputs @ torch.randn(16, 1, generator=generator))
    inputs, targets = inputs[rank::world_size], targets[rank::world_size]
    model = ray.train.torch.prepare_model(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)))
    state = use_gradq(model, config)  # the one line
    twice = "no error"
    try:
        use_gradq(model, config)
    except GradqIntegrationError as error:
        twice = str(error)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    marker = out_dir / "killed"
    losses: list[float] = []  # per step
    with torch.no_grad():  # on this worker's whole half; no_grad: DDP expects a backward after a forward with grad
        loss_before = nn.functional.mse_loss(model(inputs), targets).item()
    for step in range(config["steps"]):
        if step == config.get("kill_at") and rank == 1 and not marker.exists():
            marker.write_text(str(state.incarnation))
            os.kill(os.getpid(), signal.SIGKILL)
        batch = slice(step * 16 % len(inputs), step * 16 % len(inputs) + 16)
        loss = nn.functional.mse_loss(model(inputs[batch]), targets[batch])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        loss_after = nn.functional.mse_loss(model(inputs), targets).item()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    stats = state.stats()
    report = {
        "model": type(model).__name__,
        "mode": state.mode,
        "job_id": state.job_id,
        "incarnation": state.incarnation,
        "steps": state.step,
        "pushes": stats.pushes if stats else 0,
        "losses": losses,
        "loss_before": loss_before,
        "loss_after": loss_after,
        "weights": hashlib.sha256(weights.numpy().tobytes()).hexdigest(),
        "twice": twice,
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    state.close()


def misuse_func(config: dict[str, Any]) -> None:
    """At world size 1: report the errors for no aggregator address, an unknown gradq key, a "gradq" that is no
    GradqConfig or comes with gradq keys, and a model Ray did not wrap."""
    model = ray.train.torch.prepare_model(nn.Linear(2, 2))
    errors: dict[str, str] = {}
    cases: dict[str, dict[str, Any]] = {
        "no_address": {},
        "unknown_key": {"gradq_aggregators": "127.0.0.1:1", "gradq_bitz": 4},
        "not_a_config": {"gradq": "127.0.0.1:1"},
        "config_and_keys": {"gradq": GradqConfig.of("127.0.0.1:1"), "gradq_bits": 4},
        "not_ddp": {"gradq_aggregators": "127.0.0.1:1"},
    }
    for case, gradq_config in cases.items():
        try:
            use_gradq(model, gradq_config)
        except GradqIntegrationError as error:
            errors[case] = str(error)
    (Path(config["out_dir"]) / "misuse.json").write_text(json.dumps({"model": type(model).__name__, **errors}))
