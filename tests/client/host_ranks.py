"""Spawned ranks on emulated hosts for the two-level tests: each rank is told its host as torchrun would tell it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from gradq.client.ddp import GradqHookState, gradq_hook
from gradq.qcore import QuantConfig


@dataclass
class RankRun:
    """What one rank did: the reduced gradient of each step and what its state ended with."""

    rank: int
    reduced: list[np.ndarray]
    host: tuple[int, int, int, int, int]  # (host, hosts, local_rank, local_size, pieces)
    bytes_sent: int
    residuals: dict[str, np.ndarray] = field(default_factory=dict)
    step: int = 0
    bits: tuple[int, ...] = ()  # the distinct bits of the adaptive policy's plans (() under the uniform one)


@dataclass(frozen=True)
class HostJob:
    """One job of ``len(hosts)`` ranks; ``hosts[r]`` is rank r's host (torchrun's GROUP_RANK)."""

    hosts: tuple[int, ...]
    aggregator: str
    job_id: str
    init_method: str
    config: QuantConfig
    error_feedback: bool = False
    host_grouping: str = "auto"
    pieces: int = 1  # parameters of the probe, each in its own bucket when > 1
    checkpoints: tuple[dict[str, object], ...] | None = None  # per rank, from a previous job's RankRun
    bit_policy: str = "uniform"
    average_bits: float = 2.5


def run_rank(rank: int, job: HostJob, gradients: list[list[np.ndarray]], queue: mp.SimpleQueue) -> None:
    """One rank: set the launcher's variables, train the probe on ``gradients[rank]``, report a RankRun."""
    import ddp_probe  # on sys.path in the spawned child as in the test process

    host = job.hosts[rank]
    local = [other for other, its_host in enumerate(job.hosts) if its_host == host]
    os.environ.update(GROUP_RANK=str(host), LOCAL_RANK=str(local.index(rank)), LOCAL_WORLD_SIZE=str(len(local)))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=job.init_method, rank=rank, world_size=len(job.hosts))
    try:
        probe = ddp_probe.Probe(gradients[0][0].size, torch.float32, job.pieces)
        model = DistributedDataParallel(probe, bucket_cap_mb=1e-6 if job.pieces > 1 else 25)
        state = GradqHookState(
            job.aggregator,
            job.config,
            error_feedback=job.error_feedback,
            job_id=job.job_id,
            host_grouping=job.host_grouping,
        )
        if job.checkpoints is not None:
            checkpoint = dict(job.checkpoints[rank])
            checkpoint["residuals"] = {
                name: torch.from_numpy(values)
                for name, values in checkpoint["residuals"].items()  # type: ignore[attr-defined]
            }
            state.load_state_dict(checkpoint)
        model.register_comm_hook(state, gradq_hook)
        reduced = []
        for step_gradient in gradients[rank]:
            model.zero_grad()
            model(torch.from_numpy(step_gradient)).backward()
            reduced.append(torch.cat([p.grad for p in probe.pieces if p.grad is not None]).numpy().copy())
        group = state.host_group
        assert group is not None
        saved = state.state_dict()
        stats = state.stats()
        queue.put(
            RankRun(
                rank,
                reduced,
                (group.host, group.hosts, group.local_rank, group.local_size, group.pieces),
                stats.bytes_sent if stats is not None else 0,
                {name: values.numpy() for name, values in saved["residuals"].items()},
                saved["step"],
            )
        )
        state.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # see ddp_probe.reduced_gradients


def run(job: HostJob, gradients: list[list[np.ndarray]]) -> list[RankRun]:
    """Spawn the job's ranks; their runs in rank order."""
    queue: mp.SimpleQueue = mp.get_context("spawn").SimpleQueue()
    ranks = mp.spawn(run_rank, args=(job, gradients, queue), nprocs=len(job.hosts), join=False)
    runs: dict[int, RankRun] = {}
    while True:
        while not queue.empty():
            done = queue.get()
            runs[done.rank] = done
        if ranks.join(timeout=0.2):
            break
    while not queue.empty():
        done = queue.get()
        runs[done.rank] = done
    return [runs[rank] for rank in sorted(runs)]


def checkpoints_of(runs: list[RankRun], config: QuantConfig) -> tuple[dict[str, object], ...]:
    """Each rank's state_dict() as the next job loads it."""
    grid = {
        "scheme": config.scheme.name.lower(),
        "bits": config.bits,
        "channel_size": config.channel_size,
        "rounding": config.rounding.name.lower(),
        "seed": config.seed,
    }
    return tuple({"step": run.step, "config": grid, "error_feedback": True, "residuals": run.residuals} for run in runs)


def train_with_ddp_options(
    rank: int, job: HostJob, batches: tuple[int, ...], static_graph: bool, queue: mp.SimpleQueue
) -> None:
    """A small MLP through the hook with DDP's options: ``Join`` for uneven ``batches``, else ``static_graph``.

    Under Join, every other batch accumulates locally (``no_sync``); the rank
    with fewer batches shadows the others' reductions once it runs out.
    """
    import contextlib

    from torch import nn
    from torch.distributed.algorithms.join import Join

    host = job.hosts[rank]
    os.environ.update(GROUP_RANK=str(host))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=job.init_method, rank=rank, world_size=len(job.hosts))
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(
            nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 2)), static_graph=static_graph
        )
        state = GradqHookState(
            job.aggregator,
            job.config,
            error_feedback=job.error_feedback,
            job_id=job.job_id,
            bit_policy=job.bit_policy,
            average_bits=job.average_bits,
        )
        model.register_comm_hook(state, gradq_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(rank)
        uneven = len(set(batches)) > 1
        with Join([model]) if uneven else contextlib.nullcontext():
            for batch in range(batches[rank]):
                inputs = torch.randn(4, 8, generator=generator)
                if uneven and batch % 2 == 0:
                    with model.no_sync():
                        model(inputs).square().sum().backward()
                    continue
                model(inputs).square().sum().backward()
                optimizer.step()
                optimizer.zero_grad()
        parameters = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()
        group = state.host_group
        assert group is not None
        queue.put(
            RankRun(
                rank,
                [parameters],
                (group.host, group.hosts, group.local_rank, group.local_size, group.pieces),
                0,
                {},
                state.step,
                planned_bits(state),
            )
        )
        state.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # see ddp_probe.reduced_gradients


def planned_bits(state: GradqHookState) -> tuple[int, ...]:
    """The distinct bits the adaptive policy gave this rank's bucket pieces."""
    session = state.session
    assert session is not None
    return tuple(sorted({piece.config.bits for _, pieces in session.plans._plans.values() for _, piece in pieces}))


def run_with_ddp_options(job: HostJob, batches: tuple[int, ...], static_graph: bool = False) -> list[RankRun]:
    """Spawn ``train_with_ddp_options`` on the job's ranks; their runs in rank order."""
    queue: mp.SimpleQueue = mp.get_context("spawn").SimpleQueue()
    ranks = mp.spawn(
        train_with_ddp_options, args=(job, batches, static_graph, queue), nprocs=len(job.hosts), join=False
    )
    ranks.join(timeout=120)
    runs = []
    while not queue.empty():
        runs.append(queue.get())
    return sorted(runs, key=lambda run: run.rank)
