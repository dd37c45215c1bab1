"""Ray Train's train_func for tests/client/test_ray_shards.py: training through shards Ray placed, one killed midway.

The config holds ``steps``, ``out_dir``, the gradq keys (``gradq_aggregators``: one shard's address) and, for the
kill, ``pause_at``: before that step worker 0 writes OUT_DIR/reached and waits for OUT_DIR/killed, which the driver
writes once it has SIGKILLed a shard's actor process, so the kill falls between two steps of a run in progress.
Each worker writes what it saw to OUT_DIR/rank<N>.json.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch
from torch import nn
from waiting import wait_until

from gradq.client.integrations.ray_train import use_gradq

# How long worker 0 waits for the driver's kill.
_KILL_WAIT_S = 120.0


def train_func(config: dict[str, Any]) -> None:
    """Train y = tanh(x @ w) on this worker's half of the data through gradq; report losses, weights and shards."""
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
    state = use_gradq(model, config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with torch.no_grad():
        loss_before = nn.functional.mse_loss(model(inputs), targets).item()
    for step in range(config["steps"]):
        if step == config.get("pause_at") and rank == 0:
            (out_dir / "reached").write_text(str(step))
            wait_until(lambda: (out_dir / "killed").exists(), "the driver's kill of a shard", _KILL_WAIT_S)
        batch = slice(step * 16 % len(inputs), step * 16 % len(inputs) + 16)
        loss = nn.functional.mse_loss(model(inputs[batch]), targets[batch])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        loss_after = nn.functional.mse_loss(model(inputs), targets).item()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    client = state.client
    report = {
        "mode": state.mode,
        "steps": state.step,
        "addresses": client.addresses if client is not None else None,
        "loss_before": loss_before,
        "loss_after": loss_after,
        "weights": hashlib.sha256(weights.numpy().tobytes()).hexdigest(),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    state.close()
