"""Lightning's own DDP strategy with gradq's hook: `python lightning_train.py STEPS` (Lightning starts rank 1).

Configured by GRADQ_* like any worker; rank 0 prints what the hook state saw.
Lightning 2.6 registers ``ddp_comm_hook`` only when the root device is CUDA
(``DDPStrategy._register_ddp_hooks``), so on CPU a callback registers it.
"""

from __future__ import annotations

import sys

import lightning
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from gradq.client.ddp import GradqHookState, gradq_hook


class Regression(lightning.LightningModule):
    """y = tanh(x @ w): small enough for two CPU ranks, real enough for the loss to fall."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_index: int) -> torch.Tensor:
        inputs, targets = batch
        loss = nn.functional.mse_loss(self.net(inputs), targets)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class RegisterOnCpu(lightning.Callback):
    """Registers the hook where Lightning skips it: DDP on CPU (gloo)."""

    def __init__(self, state: GradqHookState) -> None:
        self.state = state

    def on_fit_start(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        model = trainer.strategy.model
        if trainer.strategy.root_device.type != "cuda" and isinstance(model, DistributedDataParallel):
            model.register_comm_hook(self.state, gradq_hook)


def main(steps: int) -> None:
    """Fit for ``steps`` steps on 2 CPU ranks through the aggregator GRADQ_AGGREGATORS names."""
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(512, 16, generator=generator)
    targets = torch.tanh(inputs @ torch.randn(16, 1, generator=generator))
    state = GradqHookState.from_env()
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo", ddp_comm_state=state, ddp_comm_hook=gradq_hook),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[RegisterOnCpu(state)],
    )
    module = Regression()
    trainer.fit(module, DataLoader(TensorDataset(inputs, targets), batch_size=32, shuffle=False))
    if trainer.global_rank == 0:
        stats = state.stats()
        print(
            f"mode={state.mode} steps={state.step} pushes={stats.pushes if stats else 0} "
            f"loss={module.losses[0]:.4f}->{module.losses[-1]:.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main(int(sys.argv[1]))
