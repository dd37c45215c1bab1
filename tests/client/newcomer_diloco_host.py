"""One DiLoCo host as a newcomer writes it: plain ``python``, no torch.distributed, configured by GRADQ_* alone.

Run by tests/client/test_newcomer_diloco.py and test_training_log.py as
``python newcomer_diloco_host.py OUT ROUNDS FRAGMENTS SEED``: a small MLP,
AdamW inner steps on data of its own (SEED), ``diloco.steps(ROUNDS * SYNC_EVERY)``; it writes to ``OUT`` the
global parameters, the outer rounds reached, whether the aggregator holds the
same global state, and whether torch.distributed was ever initialized. It
never configures logging: what gradq prints by default lands on stderr.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from gradq.client.config import GradqConfig
from gradq.client.diloco import DiLoCo

SYNC_EVERY = 2


def main(out: str, rounds: int, fragments: int, seed: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))  # 178 parameters: far under one round key
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(seed)
    with DiLoCo(GradqConfig.from_env(), model, inner, sync_every=SYNC_EVERY, fragments=fragments) as diloco:
        for _ in diloco.steps(rounds * SYNC_EVERY):
            inputs = torch.randn(4, 8, generator=generator)
            nn.functional.mse_loss(model(inputs), inputs[:, :2]).backward()
            inner.step()
            inner.zero_grad()
        matches = diloco.matches_aggregator()
        torch.save(
            {
                "global_parameters": [values.clone() for values in diloco.global_parameters],
                "outer_round": diloco.outer_round,
                "round_keys": len(diloco.buckets),
                "matches_aggregator": matches,
                "distributed": dist.is_initialized(),
            },
            out,
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
