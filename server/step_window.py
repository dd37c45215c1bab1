"""Which pushes a job accepts: steps inside its window, each bucket's one grid, and resends that match what was counted.

The step window of a job (one incarnation) is
``[newest completed - retain_steps, anchor + max_steps_ahead]``, where the
anchor is the newest completed step, or before any round completes the step
of the job's first round (so a job may resume from a checkpoint at any step).
Only completed rounds move it: a failed or aborted round never makes a later
step stale. A round already retained for (step, bucket) answers whatever its step.
"""

from __future__ import annotations

import zlib

from gradq.qcore import QuantizedArray
from gradq.qcore.codecs import codec_for
from gradq.server.budget import MemoryBudget
from gradq.server.errors import FailedPreconditionError
from gradq.server.job import Job

__all__ = ["GRID_ENTRY_BYTES", "check_step", "check_grid", "contribution_digest", "describe_grid"]

# What remembering one bucket's grid holds: its dict slot, key and (scheme, bits, channel size, topk)
# tuple, about 200 bytes by sys.getsizeof. Charged to the job's memory budget, so a client that
# invents bucket keys is refused like one that opens too many rounds, instead of growing the map.
GRID_ENTRY_BYTES = 256

# The payload bytes hashed per contribution: at most this many blocks of this size, evenly
# spaced. The digest must cost little beside decoding: crc32 runs at ~1.4 GB/s here, and
# hashing contiguous blocks needs no strided copy (the digest of a 512 KiB push: 0.16 -> 0.09 ms).
_DIGEST_BLOCKS = 16
_DIGEST_BLOCK_BYTES = 4096


def check_step(job: Job, step: int, retain_steps: int, max_steps_ahead: int) -> None:
    """Refuse a new round's step outside the job's window; the job is unchanged either way.

    Raises:
        FailedPreconditionError: naming the step and both bounds.
    """
    completed = job.newest_completed_step
    anchor = completed if completed >= 0 else job.first_step
    if anchor < 0:
        return  # the job's first round: any step may start it
    oldest = max(0, completed - retain_steps) if completed >= 0 else 0
    newest = anchor + max_steps_ahead
    if step < oldest:
        raise FailedPreconditionError(
            f"step={step} is stale: {job.describe()} has completed rounds up to step {completed}; "
            f"expected step in [{oldest}, {newest}] (a new incarnation starts the job fresh)"
        )
    if step > newest:
        raise FailedPreconditionError(
            f"step={step} is too far ahead: {job.describe()} is at step {anchor}; expected step in "
            f"[{oldest}, {newest}] (--max-steps-ahead={max_steps_ahead})"
        )


def describe_grid(grid: tuple[object, ...]) -> str:
    """``scheme=..., bits=..., channel_size=...`` (and ``topk=...`` for a sparse grid) for messages."""
    scheme, bits, channel_size, topk = grid
    return (
        f"scheme={scheme}, bits={bits}"
        + (f", channel_size={channel_size}" if channel_size else "")
        + (f", topk={topk}" if topk else "")
    )


def check_grid(job: Job, bucket: int, tensor: QuantizedArray, budget: MemoryBudget) -> None:
    """Fix a bucket's grid on its first push; refuse a push of it on another. Caller holds the job table's lock.

    The grid is per (job, bucket), not per job, so a bit policy may give some
    buckets more bits than others (gradq.client.bit_policy); the contributions
    of one round still all share its grid, since they share its bucket. Per-tensor
    schemes have no channel size of their own (it is the bucket's numel), so
    their codec leaves it out of the grid.

    Raises:
        FailedPreconditionError: naming the bucket and both grids.
        ResourceExhaustedError: the job's memory budget cannot hold one more bucket's grid.
    """
    grid = (
        tensor.scheme.name,
        tensor.bits,
        codec_for(tensor.scheme).grid_channel_size(tensor.channel_size),
        tensor.topk,
    )
    fixed = job.grids.get(bucket)
    if fixed is None:
        budget.charge(GRID_ENTRY_BYTES, f"the grid of bucket {bucket} of {job.describe()}", job.memory)
        job.grids[bucket] = grid
    elif grid != fixed:
        raise FailedPreconditionError(
            f"tensor grid ({describe_grid(grid)}) does not match the grid of bucket {bucket} of {job.describe()} "
            f"({describe_grid(fixed)}), fixed by its first push; every rank must quantize a bucket alike"
        )


def contribution_digest(tensor: QuantizedArray, non_finite: bool, weight: int = 0) -> int:
    """A digest of what a rank pushed, to tell a true resend from a different bucket.

    Covers the push's weight, the whole grid (scale and zero point per channel), the payload's
    size and up to 64 KiB of it in evenly spaced blocks: a full hash would cost
    more than decoding. Any change of a channel's range changes its scale, so a
    different gradient slips through only if it keeps every channel's range
    and differs only in unsampled bytes.

    Returns:
        A 32-bit digest.
    """
    payload = tensor.payload.reshape(-1).data.cast("B")
    digest = zlib.crc32(tensor.scale.tobytes())
    digest = zlib.crc32(tensor.zero_point.tobytes(), digest)
    digest = zlib.crc32(
        payload.nbytes.to_bytes(8, "little") + bytes([non_finite]) + weight.to_bytes(8, "little"), digest
    )
    if payload.nbytes <= _DIGEST_BLOCKS * _DIGEST_BLOCK_BYTES:
        return zlib.crc32(payload, digest)
    last_start = payload.nbytes - _DIGEST_BLOCK_BYTES
    for block in range(_DIGEST_BLOCKS):  # from the payload's first byte to its last
        start = block * last_start // (_DIGEST_BLOCKS - 1)
        digest = zlib.crc32(payload[start : start + _DIGEST_BLOCK_BYTES], digest)
    return digest
