"""One DiLoCo host of the token-weighted test: a linear model, its own batch size, one outer round reported.

Run by tests/client/test_diloco_weights.py as ``python diloco_weighted_host.py ADDRESS JOB HOST BATCH OUT``.
It trains ``SYNC_EVERY`` inner steps on batches of ``BATCH`` rows (counting
each row as one token), then writes to ``OUT`` what the test checks the
aggregator's weighted mean against: the global parameters before the round,
its own pseudo-gradient (taken just before DiLoCo's outer round, by an inner
optimizer hook registered before DiLoCo's), the tokens it counted, and the
global parameters after the round.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
from torch import nn

from gradq.client.config import GradqConfig
from gradq.client.diloco import DiLoCo
from gradq.qcore import QuantConfig

SYNC_EVERY = 3


def main(address: str, job: str, host: int, batch: int, out: str) -> None:
    torch.set_num_threads(1)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    # lr 1, no momentum: the global parameters move by exactly the mean, which the test recomputes.
    outer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.0)
    config = GradqConfig((address,), QuantConfig(bits=8), job_id=job, elastic_hosts=2, timeout_s=60.0)
    own: dict[str, torch.Tensor] = {}
    # Registered before DiLoCo's hook, so it runs first: the local parameters the pseudo-gradient is taken from.
    inner.register_step_post_hook(
        lambda *_: own.update(local=nn.utils.parameters_to_vector(model.parameters()).detach().clone())
    )
    generator = torch.Generator().manual_seed(100 + host)
    with DiLoCo(config, model, inner, outer, sync_every=SYNC_EVERY, token_weighted=True) as diloco:
        before = nn.utils.parameters_to_vector(diloco.global_parameters).detach().clone()
        for _ in diloco.steps(SYNC_EVERY):
            inputs = torch.randn(batch, 16, generator=generator)
            targets = torch.randn(batch, 4, generator=generator) + host  # each host pulls its own way
            nn.functional.mse_loss(model(inputs), targets).backward()
            diloco.count_tokens(batch)
            inner.step()
            inner.zero_grad()
        after = nn.utils.parameters_to_vector(diloco.global_parameters).detach().clone()
        matches = diloco.matches_aggregator()
    torch.save(
        {
            "before": before,
            "pseudo_gradient": before - own["local"],
            "tokens": batch * SYNC_EVERY,
            "after": after,
            "matches_aggregator": matches,
        },
        out,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
