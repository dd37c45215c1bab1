"""A small real DDP training script whose gradients go through gradq; launch it with torchrun.

    gradq serve --host 127.0.0.1 --port 50051 &
    GRADQ_AGGREGATORS=127.0.0.1:50051 GRADQ_JOB_ID=example GRADQ_BITS=4 GRADQ_ERROR_FEEDBACK=1 \\
        torchrun --standalone --nproc_per_node=2 examples/torchrun_train.py

The only gradq lines are the two that build and register the hook state. The
script never calls ``close()``: the state leaves its job when the process
exits. Rerunning it with the same GRADQ_JOB_ID, or torchrun restarting it
(``--max-restarts``), starts a new incarnation of the job at step 0. With
restarts on gloo, also set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: otherwise the
restarted ranks can read the old ranks' addresses from torchrun's store
(pytorch/pytorch#135712) and hang in ``init_process_group``.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradq.client.ddp import GradqHookState, gradq_hook


def teacher_data(samples: int, features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression task every rank builds identically: y = tanh(x @ w) + noise."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(samples, features, generator=generator)
    weights = torch.randn(features, 1, generator=generator)
    return inputs, torch.tanh(inputs @ weights) + 0.01 * torch.randn(samples, 1, generator=generator)


def main() -> None:
    """Train for ``--steps`` steps; rank 0 prints the loss before and after."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument(
        "--crash-at-step",
        type=int,
        default=-1,
        help="on torchrun's first attempt the last rank kills itself (SIGKILL) at this step, so torchrun "
        "--max-restarts restarts the group; -1 never",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("gloo")  # torchrun's environment names the rank, world size and rendezvous
    rank, world_size = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    inputs, targets = teacher_data(512, 16)
    mine = slice(rank, None, world_size)  # each rank trains on its own share
    torch.manual_seed(attempt)  # DDP broadcasts rank 0's initial weights anyway
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)))
    state = GradqHookState.from_env()  # GRADQ_AGGREGATORS, GRADQ_BITS, GRADQ_JOB_ID, ...
    model.register_comm_hook(state, gradq_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(args.steps):
        if step == args.crash_at_step and attempt == 0 and rank == world_size - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = nn.functional.mse_loss(model(inputs[mine]), targets[mine])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    if rank == 0:
        hosts = state.host_group.describe() if state.host_group is not None else "not connected"
        print(
            f"attempt {attempt}: job {state.job_id} incarnation {state.incarnation} mode {state.mode} ({hosts}): "
            f"{args.steps} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
