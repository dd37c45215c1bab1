"""Seed 000's two allgather hooks, ported from tensorplay to torch, and the hooks the benchmarks wrap them in.

The baseline of bench/ddp_step.py and bench/network.py, which import it as
scripts run from bench/ (Python puts a script's folder on ``sys.path``). Kept
as the seed wrote them: uint8 affine, its own min/max observers with .item()
per channel, Python loops over channels, two all_gathers, nested futures. One
change: gloo's all_gather future holds the output list itself, where NCCL's
holds [output list], so the seed's ``fut.wait()[0]`` reads ``fut.wait()`` here
(indexing gloo's result with [0] is what crashes PyTorch's copy of these hooks
on CPU).
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations at
# registration and needs real types, not strings.
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "SEED_CHANNEL_SIZE",
    "Hook",
    "OrderedBucketsState",
    "no_communication_hook",
    "ordered_buckets_hook",
    "seed_perchannel_hook",
    "seed_pertensor_hook",
]

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]

SEED_QMAX = 255  # seed 000 quantizes to uint8 levels 0..255
SEED_CHANNEL_SIZE = 512  # seed 000's per-channel ``bucket_size``


def _seed_quantize_per_tensor(x: torch.Tensor, scale: float, zero_point: float) -> torch.Tensor:
    y = torch.round(x / scale) + zero_point
    return torch.clamp(y, 0, SEED_QMAX).to(torch.uint8)


def _seed_dequantize_per_tensor(y: torch.Tensor, scale: float, zero_point: float) -> torch.Tensor:
    return scale * (y.to(torch.float32) - zero_point)


def _seed_quantize_per_channel(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    y = torch.zeros(x.shape, device=x.device)
    for i in range(x.size(0)):
        y[i, :] = torch.round(x[i, :] / scale[i]) + zero_point[i]
    return torch.clamp(y, 0, SEED_QMAX).to(torch.uint8)


def _seed_dequantize_per_channel(y: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    levels = y.to(torch.float32)
    x = torch.zeros_like(levels)
    for i in range(x.size(0)):
        x[i, :] = scale[i] * (levels[i, :] - zero_point[i])
    return x


def _seed_qparams(min_val: float, max_val: float) -> tuple[float, int]:
    if max_val == min_val:
        return 1.0, 0
    scale = (max_val - min_val) / float(SEED_QMAX)
    zero_point = round(0 - min_val / scale)  # the seed wraps it in int(); round() of a float already is one
    return scale, max(0, min(SEED_QMAX, zero_point))


def _seed_qparams_per_channel(channels: torch.Tensor) -> torch.Tensor:
    """The seed's per-channel observer: one .item() per channel for min and for max; (2, C) float32."""
    min_vals = [channels[i].min().item() for i in range(channels.size(0))]
    max_vals = [channels[i].max().item() for i in range(channels.size(0))]
    pairs = [_seed_qparams(low, high) for low, high in zip(min_vals, max_vals, strict=True)]
    scales = torch.tensor([scale for scale, _ in pairs], dtype=torch.float32)
    zero_points = torch.tensor([zero_point for _, zero_point in pairs], dtype=torch.int64)
    return torch.stack((scales, zero_points))  # promoted to float32, as in the seed


def _seed_gather_list(tensor: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    return [torch.zeros_like(tensor) for _ in range(world_size)]


def seed_pertensor_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Seed 000's ``quantization_pertensor_hook``: uint8 per-tensor affine over two all_gathers.

    Args:
        process_group: group to average over (None: the default group).
        bucket: DDP's gradient bucket.

    Returns:
        Future of the mean bucket.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    tensor = bucket.buffer()
    scale, zero_point = _seed_qparams(tensor.min().item(), tensor.max().item())
    s_and_z = torch.tensor([scale, zero_point], dtype=torch.float32)
    all_ranks_s_and_z = _seed_gather_list(s_and_z, world_size)
    fut = dist.all_gather(all_ranks_s_and_z, s_and_z, group=group, async_op=True).get_future()

    def quantize_and_allgather(fut: torch.futures.Future[list[torch.Tensor]]) -> list[torch.Tensor]:
        gathered = fut.wait()
        quantized = _seed_quantize_per_tensor(tensor, gathered[rank][0].item(), gathered[rank][1].item())
        out = _seed_gather_list(quantized, world_size)
        return dist.all_gather(out, quantized, group=group, async_op=True).get_future().wait()

    def dequantize_and_aggregate(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        all_ranks_quantized = fut.wait()
        aggregated = torch.zeros(all_ranks_quantized[0].shape, device=tensor.device, dtype=torch.float32)
        for r, quantized in enumerate(all_ranks_quantized):
            aggregated += _seed_dequantize_per_tensor(
                quantized, all_ranks_s_and_z[r][0].item(), all_ranks_s_and_z[r][1].item()
            )
        return aggregated / world_size

    return fut.then(quantize_and_allgather).then(dequantize_and_aggregate)


def seed_perchannel_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Seed 000's ``quantization_perchannel_hook``: uint8 affine per 512-element channel, Python loops.

    Args:
        process_group: group to average over (None: the default group).
        bucket: DDP's gradient bucket.

    Returns:
        Future of the mean bucket.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    tensor = bucket.buffer()
    # As in the seed: a whole channel of padding when the length is already a multiple.
    padding = SEED_CHANNEL_SIZE - len(tensor) % SEED_CHANNEL_SIZE
    tensor_in_channels = nn.functional.pad(tensor, (0, padding), value=0.0).view(-1, SEED_CHANNEL_SIZE)
    s_and_z = _seed_qparams_per_channel(tensor_in_channels)
    all_ranks_s_and_z = _seed_gather_list(s_and_z, world_size)
    fut = dist.all_gather(all_ranks_s_and_z, s_and_z, group=group, async_op=True).get_future()

    def quantize_and_allgather(fut: torch.futures.Future[list[torch.Tensor]]) -> list[torch.Tensor]:
        gathered = fut.wait()
        quantized = _seed_quantize_per_channel(tensor_in_channels, gathered[rank][0, :], gathered[rank][1, :])
        out = _seed_gather_list(quantized, world_size)
        return dist.all_gather(out, quantized, group=group, async_op=True).get_future().wait()

    def dequantize_and_aggregate(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        all_ranks_quantized = fut.wait()
        aggregated = torch.zeros(all_ranks_quantized[0].shape, device=tensor.device, dtype=torch.float32)
        for r, quantized in enumerate(all_ranks_quantized):
            aggregated += _seed_dequantize_per_channel(quantized, all_ranks_s_and_z[r][0], all_ranks_s_and_z[r][1])
        return aggregated.reshape(-1)[: tensor.size(0)] / world_size

    return fut.then(quantize_and_allgather).then(dequantize_and_aggregate)


class OrderedBucketsState:
    """State of ``ordered_buckets_hook``: the allgather hook measured, the chain in flight, bucket sizes."""

    __slots__ = (
        "bucket_numels",  # bucket index -> elements, as of the latest step (DDP's rebuilt layout)
        "hook",  # the allgather hook measured, called with state None (the default group)
        "in_flight",  # the previous bucket's future this step; None before the first bucket
    )

    def __init__(self, hook: Hook) -> None:
        self.hook = hook
        self.bucket_numels: dict[int, int] = {}
        self.in_flight: torch.futures.Future[torch.Tensor] | None = None


def ordered_buckets_hook(state: OrderedBucketsState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Run ``state.hook`` on ``bucket`` once the previous bucket's future is done; record the bucket's size.

    The allgather hooks issue their second all_gather from inside gloo's
    completion callback. With two buckets in flight the ranks then issue
    collectives in different orders (gloo aborts: "Received data size doesn't
    match expected size", or ``gloo::EnforceNotMet`` at world 4) or block both
    of gloo's worker threads (deadlock). One chain at a time keeps every rank's
    order the same, at the price of overlap: the hook blocks backward meanwhile.

    Args:
        state: the wrapped hook, the bucket in flight and the sizes seen.
        bucket: DDP's gradient bucket.

    Returns:
        The wrapped hook's future for ``bucket``.
    """
    if state.in_flight is not None:
        state.in_flight.wait()
    state.bucket_numels[bucket.index()] = bucket.buffer().numel()
    future = state.hook(None, bucket)
    state.in_flight = None if bucket.is_last() else future
    return future


def no_communication_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Hand DDP its own bucket back at once: the step without any communication."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future
