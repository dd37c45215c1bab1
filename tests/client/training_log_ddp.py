"""A DDP script that uses gradq's hook and configures no logging: what gradq prints by default lands on stderr.

Run by tests/client/test_training_log.py as ``python training_log_ddp.py STEPS [--configure-logging]``
with GRADQ_AGGREGATORS set: one rank (a gloo group of its own, as DDP needs),
``STEPS`` steps of a small MLP through ``gradq_hook``; the hook state is never
closed, so its summary comes when it is collected or at exit.
``--configure-logging`` configures logging first (root at WARNING), as a
program with its own logging setup does: gradq then adds nothing.
"""

from __future__ import annotations

import logging
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradq.client.ddp import GradqHookState, gradq_hook
from gradq.server.process import free_port


def main(steps: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    model.register_comm_hook(GradqHookState.from_env(), gradq_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        inputs = torch.randn(8, 32)
        nn.functional.mse_loss(model(inputs), inputs[:, :4]).backward()
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    if "--configure-logging" in sys.argv:
        logging.basicConfig(level=logging.WARNING)
    main(int(sys.argv[1]))
