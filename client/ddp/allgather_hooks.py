"""Serverless comm hooks with seed 000's semantics, on qcore's vectorised grid.

Two all_gathers per bucket (qparams, then payloads); every rank dequantizes every
other rank's payload and averages. They are the benchmark baseline gradq is
measured against and its fallback when no aggregator can be reached.
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations at
# registration and needs real types, not strings.
import numpy as np
import torch
import torch.distributed as dist

from gradq.qcore import DEFAULT_CHANNEL_SIZE, QuantConfig, QuantizedArray, Scheme, decode_accumulate, encode

__all__ = ["allgather_pertensor_hook", "allgather_perchannel_hook", "allreduce_mean_hook"]


def allgather_pertensor_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket, bits: int = 8
) -> torch.futures.Future[torch.Tensor]:
    """Per-tensor affine ``bits``-bit quantization over two all_gathers (seed 000's per-tensor hook).

    Args:
        process_group: group to average over (None: the default group).
        bucket: DDP's gradient bucket.
        bits: bits per element.

    Returns:
        Future of the mean bucket, shaped and typed like ``bucket.buffer()``.
    """
    config = QuantConfig(scheme=Scheme.PER_TENSOR_AFFINE, bits=bits)
    return _allgather_mean(process_group, bucket, config)


def allgather_perchannel_hook(
    process_group: dist.ProcessGroup | None,
    bucket: dist.GradBucket,
    channel_size: int = DEFAULT_CHANNEL_SIZE,
    bits: int = 8,
) -> torch.futures.Future[torch.Tensor]:
    """Per-channel affine quantization over two all_gathers (seed 000's per-channel hook, vectorised).

    Args:
        process_group: group to average over (None: the default group).
        bucket: DDP's gradient bucket.
        channel_size: elements per channel (the seed's ``bucket_size``).
        bits: bits per element.

    Returns:
        Future of the mean bucket, shaped and typed like ``bucket.buffer()``.
    """
    config = QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=bits, channel_size=channel_size)
    return _allgather_mean(process_group, bucket, config)


def allreduce_mean_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Plain fp32 allreduce of the bucket, divided by the world size (DDP's default)."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer().div_(dist.get_world_size(group))
    future = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return future.then(lambda done: done.value()[0])


def _allgather_mean(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket, config: QuantConfig
) -> torch.futures.Future[torch.Tensor]:
    group = process_group if process_group is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)
    buffer = bucket.buffer()
    mine = encode(buffer.detach().float().cpu().numpy(), config)
    qparams = torch.from_numpy(np.concatenate([mine.scale.view(np.uint8), mine.zero_point.view(np.uint8)]))
    payload = torch.from_numpy(mine.payload)
    gathered_qparams = [torch.empty_like(qparams) for _ in range(world_size)]
    gathered_payloads = [torch.empty_like(payload) for _ in range(world_size)]
    # Both collectives start here, in the hook, so every rank issues them in DDP's
    # bucket order. Starting the second from the first's callback (as the seed does)
    # lets two buckets' collectives interleave differently on different ranks.
    both = torch.futures.collect_all(
        [
            dist.all_gather(gathered_qparams, qparams, group=group, async_op=True).get_future(),
            dist.all_gather(gathered_payloads, payload, group=group, async_op=True).get_future(),
        ]
    )

    def average(_: torch.futures.Future[list[torch.futures.Future[list[torch.Tensor]]]]) -> torch.Tensor:
        total = np.zeros(mine.numel, np.float32)
        channels = mine.num_channels
        for rank_qparams, rank_payload in zip(gathered_qparams, gathered_payloads, strict=True):
            raw = rank_qparams.numpy()
            theirs = QuantizedArray(
                mine.scheme,
                mine.bits,
                mine.numel,
                mine.channel_size,
                raw[: 4 * channels].view(np.float32),
                raw[4 * channels :].view(np.int32),
                rank_payload.numpy(),
            )
            decode_accumulate(theirs, total)
        total /= np.float32(world_size)
        return torch.from_numpy(total).to(buffer.device, buffer.dtype).view_as(buffer)

    return both.then(average)
