"""Spawned-rank helpers for the DDP tests: one parameter whose gradient each rank chooses."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradq.client.ddp import GradqHookState, gradq_hook
from gradq.client.ddp.allgather_hooks import allgather_perchannel_hook, allgather_pertensor_hook


class Probe(nn.Module):
    """loss = sum(w * g): the gradient of w is exactly g.

    With ``pieces`` > 1, w is split into that many parameters and DDP (given a
    tiny bucket cap) puts each in its own bucket: several buckets in flight.
    """

    def __init__(self, numel: int, dtype: torch.dtype, pieces: int = 1) -> None:
        super().__init__()
        sizes = [numel // pieces + (1 if i < numel % pieces else 0) for i in range(pieces)]
        self.pieces = nn.ParameterList(nn.Parameter(torch.zeros(size, dtype=dtype)) for size in sizes)

    def forward(self, gradient: torch.Tensor) -> torch.Tensor:
        return (torch.cat(list(self.pieces)) * gradient).sum()


def reduced_gradients(
    rank: int,
    world: int,
    init_method: str,
    hook: str,
    gradients: list[list[np.ndarray]],
    dtype: str,
    state: GradqHookState | None,
    queue: mp.SimpleQueue,
    pieces: int,
) -> None:
    """Run ``len(gradients[rank])`` backward passes; put the reduced gradients on ``queue``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        torch_dtype = getattr(torch, dtype)
        probe = Probe(gradients[0][0].size, torch_dtype, pieces)
        model = DistributedDataParallel(probe, bucket_cap_mb=1e-6 if pieces > 1 else 25)
        if hook == "gradq":
            assert state is not None
            model.register_comm_hook(state, gradq_hook)
        elif hook == "allgather_pertensor":
            model.register_comm_hook(None, allgather_pertensor_hook)
        elif hook == "allgather_perchannel":
            model.register_comm_hook(None, allgather_perchannel_hook)
        reduced = []
        for step_gradient in gradients[rank]:
            model.zero_grad()
            model(torch.from_numpy(step_gradient).to(torch_dtype)).backward()
            grads = [piece.grad for piece in probe.pieces]
            assert all(grad is not None and grad.dtype == torch_dtype for grad in grads)
            reduced.append(torch.cat([grad.float() for grad in grads if grad is not None]).numpy().copy())
        queue.put((rank, reduced))
        if state is not None:
            state.close()
        dist.barrier()  # no rank tears gloo down while a peer's last collective is in flight
    finally:
        dist.destroy_process_group()
    # The results are on the queue: leave without finalizing the interpreter. Once
    # in CI, with four buckets' collectives just finished, finalization under gloo's
    # still-exiting worker threads aborted the rank ("terminate called without an
    # active exception"); a hard exit has nothing left to finalize.
    os._exit(0)


def run(
    world: int,
    init_method: str,
    hook: str,
    gradients: list[list[np.ndarray]],
    dtype: str = "float32",
    state: GradqHookState | None = None,
    pieces: int = 1,
) -> dict[int, list[np.ndarray]]:
    """Spawn ``world`` ranks; returns rank -> reduced gradient per step."""
    queue: mp.SimpleQueue = mp.get_context("spawn").SimpleQueue()
    ranks = mp.spawn(
        reduced_gradients,
        args=(world, init_method, hook, gradients, dtype, state, queue, pieces),
        nprocs=world,
        join=False,
    )
    results: dict[int, list[np.ndarray]] = {}
    while True:
        while not queue.empty():
            rank, reduced = queue.get()
            results[rank] = reduced
        if ranks.join(timeout=0.2):
            break
    while not queue.empty():
        rank, reduced = queue.get()
        results[rank] = reduced
    return results
