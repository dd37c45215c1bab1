"""Accelerate with gradq: `accelerate launch --multi_gpu --num_processes 2 accelerate_train.py STEPS OUT_DIR [late]`.

Configured by GRADQ_* like any worker; each rank writes what it saw to OUT_DIR/rank<N>.json.
With ``late``, use_gradq is called after prepare (too late): each rank reports the error it raised instead.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradq.client.integrations.accelerate import GradqIntegrationError, use_gradq


def main(steps: int, out_dir: Path, late: bool) -> None:
    """Train y = tanh(x @ w) for ``steps`` steps on this rank's half of the data; report losses and weights."""
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial weights on every rank
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(512, 16, generator=generator)
    targets = torch.tanh(inputs @ torch.randn(16, 1, generator=generator))
    accelerator = Accelerator(cpu=True)
    # A model prepared for evaluation only gets no DDP: it does not make use_gradq too late.
    accelerator.prepare_model(nn.Linear(16, 1), evaluation_mode=True)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=32, shuffle=False)
    if late:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        refusal = None  # use_gradq returning here would leave the model on plain allreduce
        try:
            use_gradq(accelerator)
        except GradqIntegrationError as error:
            refusal = str(error)
        (out_dir / f"rank{accelerator.process_index}.json").write_text(json.dumps({"error": refusal}))
        accelerator.wait_for_everyone()
        return
    state = use_gradq(accelerator)  # the one line: prepare now returns a model reducing through gradq
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses: list[float] = []
    batches = iter(loader)
    for _ in range(steps):
        batch_inputs, batch_targets = next(batches)
        loss = nn.functional.mse_loss(model(batch_inputs), batch_targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    stats = state.stats()
    report = {
        "model": type(model).__name__,
        "mode": state.mode,
        "steps": state.step,
        "pushes": stats.pushes if stats else 0,
        "losses": losses,
        "weights": hashlib.sha256(weights.numpy().tobytes()).hexdigest(),
    }
    (out_dir / f"rank{accelerator.process_index}.json").write_text(json.dumps(report))
    state.close()
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:] == ["late"])
