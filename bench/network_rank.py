"""What one rank of bench/network.py runs: the hooks measured, the model, the timed steps.

Started by bench/network.py (``--rank-main``) inside the rank's network
namespace. Holds a faithful torch port of seed 000's per-tensor allgather hook,
the catalogue of models and methods, and the timing of each step's buckets.
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations at
# registration and needs real types, not strings.
import dataclasses
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import netns
import torch
import torch.distributed as dist
from cpu_busy import read_cpu_times, read_process_cpu_s
from network_report import Method, MethodResult, gradq_grid
from peer_hooks import PEER_HOOKS, PEER_SINGLE_BUCKET_MB
from seed_hooks import Hook, OrderedBucketsState, no_communication_hook, ordered_buckets_hook, seed_pertensor_hook
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel

from gradq.client.ddp import GradqHookState, gradq_hook

__all__ = [
    "MODELS",
    "METHODS",
    "METHOD_BY_KEY",
    "RankSpec",
    "timed_hook",
    "build_model",
    "measure_method",
    "rank_main",
]

MODELS = {
    "mlp-5.8m": (784, 2048, 2048, 10),  # 5,824,522 parameters
    "mlp-25m": (784, 2176, 2176, 2176, 2176, 2176, 2176, 10),  # 25,415,690 parameters
}
METHODS = (
    Method("compute-only", "compute only (no-communication hook)"),
    Method("allreduce", "gloo allreduce fp32"),
    Method("fp16", "fp16 compress hook"),
    *(Method(peer.key, peer.label) for peer in PEER_HOOKS.values()),
    Method("seed-pertensor", "seed allgather per-tensor 8-bit"),
    Method("gradq8-1", "gradq 8-bit, 1 shard", bits=8, shards=1),
    Method("gradq8-2", "gradq 8-bit, 2 shards", bits=8, shards=2),
    Method("gradq4-1", "gradq 4-bit, 1 shard", bits=4, shards=1),
    Method("gradq4-2", "gradq 4-bit, 2 shards", bits=4, shards=2),
    Method("gradq8-4", "gradq 8-bit, 4 shards", bits=8, shards=4),
    Method("gradq4-4", "gradq 4-bit, 4 shards", bits=4, shards=4),
    Method("gradq2ef-1", "gradq 2-bit + EF, 1 shard", bits=2, error_feedback=True, shards=1),
    Method("gradq2ef-2", "gradq 2-bit + EF, 2 shards", bits=2, error_feedback=True, shards=2),
    Method("gradq4ef-2", "gradq 4-bit + EF, 2 shards", bits=4, error_feedback=True, shards=2),
    Method("gradq1ef-2", "gradq 1-bit + EF, 2 shards", bits=1, error_feedback=True, shards=2),
    Method("gradq1sign-2", "gradq 1-bit sign + EF, 2 shards", 1, True, 2, "per_channel_sign"),
    # Two-level rows: under --hosts HxL the ranks of a host reduce inside it and push 1/L each (host_groups).
    Method("gradq8-2-twolevel", "gradq 8-bit, 2 shards, two-level", bits=8, shards=2, two_level=True),
    Method("gradq4ef-2-twolevel", "gradq 4-bit + EF, 2 shards, two-level", 4, True, 2, two_level=True),
    Method("gradq2ef-2-twolevel", "gradq 2-bit + EF, 2 shards, two-level", 2, True, 2, two_level=True),
    Method(
        "gradq1sign32-2",
        "gradq 1-bit sign + EF, 32-element channels, 2 shards",
        bits=1,
        error_feedback=True,
        shards=2,
        scheme="per_channel_sign",
        channel_size=32,
    ),
)
METHOD_BY_KEY = {method.key: method for method in METHODS}
BATCH_SIZE = 32
CLASSES = 10
DISTINCT_BATCHES = 4  # synthetic, fixed per rank, cycled through
LEARNING_RATE = 0.01
SEED = 0
POWERSGD_START_STEP = 2  # plain allreduce before it, inside the warm-up (>= 2 steps)


# -- timing the buckets of one step ----------------------------------------------------------------


class TimedHookState:
    """State of ``timed_hook``: the hook it wraps and when this step's buckets reached it."""

    __slots__ = (
        "bucket_numels",  # bucket index -> elements (DDP's layout as of the latest step)
        "first_entry",  # perf_counter() at this step's first bucket; None before it
        "hook",  # the measured hook
        "inner",  # the measured hook's state
        "last_entry",  # perf_counter() at this step's last bucket: backward's compute is done
    )

    def __init__(self, hook: Hook, inner: Any) -> None:
        self.hook = hook
        self.inner = inner
        self.bucket_numels: dict[int, int] = {}
        self.first_entry: float | None = None
        self.last_entry: float | None = None

    def reset(self) -> None:
        """Forget the previous step's times."""
        self.first_entry = self.last_entry = None


def timed_hook(state: TimedHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Record when ``bucket`` became ready, then run the wrapped hook on it.

    Args:
        state: the wrapped hook, its state and this step's timestamps.
        bucket: DDP's gradient bucket.

    Returns:
        The wrapped hook's future for ``bucket``.
    """
    now = time.perf_counter()
    if state.first_entry is None:
        state.first_entry = now
    if bucket.is_last():
        state.last_entry = now
    state.bucket_numels[bucket.index()] = bucket.buffer().numel()
    return state.hook(state.inner, bucket)


# -- one rank --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What every rank of one scenario runs; travels as JSON on the command line."""

    rank: int
    world_size: int
    host: int  # index of the emulated host (namespace) this rank runs in
    rendezvous: str  # host:port of rank 0's TCPStore
    layers: tuple[int, ...]
    methods: tuple[str, ...]
    aggregators: tuple[str, ...]  # host:port of each shard
    aggregator_pids: tuple[int, ...]  # the shards' processes, whose CPU time rank 0 reads
    warmup: int
    steps: int
    job_prefix: str  # gradq job ids are <prefix>-<method>
    chunk_elements: int | None  # gradq's largest round; None: the library's slow-link round for the row's grid
    output: str  # where this rank writes its MethodResult list


def build_model(layers: Sequence[int]) -> nn.Module:
    """An MLP with ReLU between the ``layers`` widths; same weights on every rank.

    Args:
        layers: widths from the input to the logits, e.g. (784, 2048, 2048, 10).

    Returns:
        The model, seeded with SEED.
    """
    torch.manual_seed(SEED)
    modules: list[nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(layers):
        modules += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*modules[:-1])


def _batches(rank: int, inputs: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(SEED + rank)
    return [
        (
            torch.randn(BATCH_SIZE, inputs, generator=generator),
            torch.randint(0, CLASSES, (BATCH_SIZE,), generator=generator),
        )
        for _ in range(DISTINCT_BATCHES)
    ]


def _hook_for(method: Method, spec: RankSpec) -> tuple[Hook, Any, GradqHookState | None]:
    """(hook, its state, the gradq state to close afterwards) for a method that communicates through a hook."""
    if method.bits is not None:
        config, chunk_elements = gradq_grid(method, spec.chunk_elements)
        addresses = list(spec.aggregators[: method.shards])
        state = GradqHookState(
            addresses,
            config,
            error_feedback=method.error_feedback,
            job_id=f"{spec.job_prefix}-{method.key}",
            connect_timeout_s=60.0,
            chunk_elements=chunk_elements,
            # Other gradq rows stay flat even where a host holds several ranks: today's path, for comparison.
            host_grouping="auto" if method.two_level else "flat",
            host=f"w{spec.host}" if method.two_level else None,
        )
        return gradq_hook, state, state
    if method.key == "seed-pertensor":
        return ordered_buckets_hook, OrderedBucketsState(seed_pertensor_hook), None
    if method.key == "fp16":
        return fp16_compress_hook, None, None  # process group None: the default group
    if method.key in PEER_HOOKS:
        peer = PEER_HOOKS[method.key]
        return peer.hook, peer.make_state(POWERSGD_START_STEP), None
    raise ValueError(f"method={method.key!r} has no hook; expected one of {', '.join(METHOD_BY_KEY)}")


def _train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[float, float]:
    """One step; returns (start, end of backward) in perf_counter() seconds."""
    inputs, labels = batch
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(inputs), labels).backward()
    backward_done = time.perf_counter()
    optimizer.step()
    return started, backward_done


def measure_method(
    spec: RankSpec, method: Method, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> MethodResult:
    """Warm up, then time ``spec.steps`` steps of ``method`` and count this rank's host's wire bytes.

    Args:
        spec: the scenario as this rank sees it (steps, model, aggregators).
        method: what to measure; a fresh DDP model is built for it.
        batches: this rank's synthetic batches, cycled through.

    Returns:
        This rank's step times, bucket timings, its host link's wire bytes per step (shared by the
        host's ranks), bucket sizes, and the machine's and the aggregator shards' CPU time.
    """
    single_bucket = method.key in PEER_HOOKS and PEER_HOOKS[method.key].single_bucket
    model = DistributedDataParallel(
        build_model(spec.layers), bucket_cap_mb=PEER_SINGLE_BUCKET_MB if single_bucket else None
    )
    timer: TimedHookState | None = None
    gradq_state: GradqHookState | None = None
    if method.key == "compute-only":  # nothing to time: the hook returns at once
        model.register_comm_hook(None, no_communication_hook)
    elif method.key != "allreduce":  # plain DDP: its built-in allreduce, no hook
        hook, inner, gradq_state = _hook_for(method, spec)
        timer = TimedHookState(hook, inner)
        model.register_comm_hook(timer, timed_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    try:
        for step in range(spec.warmup):
            _train_step(model, optimizer, batches[step % len(batches)])
        dist.barrier()
        tx_before, rx_before = netns.read_counters(netns.HOST_DEVICE)
        cpu_before = read_cpu_times()
        aggregator_cpu_before = read_process_cpu_s(spec.aggregator_pids)
        own_cpu_before = time.process_time()
        step_s, window_s, tail_s = [], [], []
        for step in range(spec.steps):
            if timer is not None:
                timer.reset()
            started, backward_done = _train_step(model, optimizer, batches[step % len(batches)])
            step_s.append(time.perf_counter() - started)
            if timer is not None and timer.first_entry is not None and timer.last_entry is not None:
                window_s.append(backward_done - timer.first_entry)
                tail_s.append(backward_done - timer.last_entry)
        cpu = read_cpu_times() - cpu_before
        aggregator_cpu_s = read_process_cpu_s(spec.aggregator_pids) - aggregator_cpu_before
        rank_cpu_s = time.process_time() - own_cpu_before
        dist.barrier()  # every peer has received what this rank sent: the counters are complete
        tx_after, rx_after = netns.read_counters(netns.HOST_DEVICE)
    finally:
        if gradq_state is not None:
            gradq_state.close()
    return MethodResult(
        key=method.key,
        step_s=step_s,
        window_s=window_s,
        tail_s=tail_s,
        tx_per_step=(tx_after - tx_before) / spec.steps,
        rx_per_step=(rx_after - rx_before) / spec.steps,
        bucket_numels=[timer.bucket_numels[index] for index in sorted(timer.bucket_numels)] if timer else [],
        numel=sum(parameter.numel() for parameter in model.parameters()),
        cpu_busy_s=cpu.busy_s,
        cpu_total_s=cpu.total_s,
        aggregator_cpu_s=aggregator_cpu_s,
        rank_cpu_s=rank_cpu_s,
    )


def rank_main(spec: RankSpec) -> None:
    """Join the gloo group over this namespace's link, measure every method, write the results.

    Args:
        spec: this rank's part of the scenario; results go to ``spec.output`` as JSON.
    """
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{spec.rendezvous}",
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(minutes=15),
    )
    try:
        batches = _batches(spec.rank, spec.layers[0])
        results = [measure_method(spec, METHOD_BY_KEY[key], batches) for key in spec.methods]
        Path(spec.output).write_text(json.dumps([dataclasses.asdict(result) for result in results]))
    finally:
        dist.destroy_process_group()
