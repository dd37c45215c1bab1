"""How a bucket becomes rounds: chunk bounds, round keys, the shard of each round, the reassembled future.

Every rank must cut a bucket the same way and send each piece to the same
shard, so these rules are plain functions of the bucket's size and index.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
from typing import Any

from gradq.qcore import QuantConfig, channel_count, codec_for

__all__ = [
    "CHUNK_KEY_STRIDE",
    "DEFAULT_CHUNK_ELEMENTS",
    "MIN_SHARD_SPLIT",
    "SLOW_LINK_CHUNK_BYTES",
    "assemble",
    "chunk_bounds",
    "chunk_key",
    "shard_for",
    "slow_link_chunk_elements",
]

# Largest round a bucket is cut into, by default. Every round costs gRPC's
# per-call CPU at both ends (bench/push_overhead.py), which sets the pace
# where the link is fast: on loopback the 8-bit step was fastest at 2^21
# (bench/ddp_step.py, bench/results/ddp-step.md).
DEFAULT_CHUNK_ELEMENTS = 1 << 21

# Where links, not CPU, set the pace (about 1 Gbit/s or slower), a round of
# this many payload bytes: a shard gets several chunks per step, so with the
# DDP hook's two pushes in flight one chunk arrives while the last one's mean
# leaves. At world 4 with 2 shards, 8-bit (2^19 elements): 208 -> 180 ms at
# 1 Gbit/s, 1550 -> 1237 ms at 100 Mbit/s; on loopback 50 -> 58..62 ms
# (bench/network.py, bench/ddp_step.py). Counted in bytes, not elements: at
# fewer bits the same elements take less wire time but the same per-round CPU,
# and 2^19-element rounds made the CPU-bound 1 Gbit/s step slower (world 4,
# 2 shards: 4-bit + EF 154.3 -> 132.1 ms at 2^20, 1-bit sign 122.4 -> 110.4
# at 2^22, 2-bit + EF 124.2 -> 119.1 at 2^21).
SLOW_LINK_CHUNK_BYTES = 1 << 19

# Smallest chunk cut only to spread a bucket over the shards: below this a
# round's fixed cost (the CPU of a call at both ends, bench/push_overhead.py)
# outweighs what balancing the links saves.
MIN_SHARD_SPLIT = 1 << 16

# A bucket's chunk i travels as round key bucket + i * CHUNK_KEY_STRIDE (chunk 0 keeps the bucket's own key).
CHUNK_KEY_STRIDE = 1 << 32


def slow_link_chunk_elements(config: QuantConfig) -> int:
    """The ``chunk_elements`` for links of about 1 Gbit/s or slower: rounds of ``SLOW_LINK_CHUNK_BYTES`` of payload.

    Args:
        config: the push grid; its codec's bits per element set the count.

    Returns:
        2^19 elements at 8 bits, 2^20 at 4, 2^21 at 2, 2^22 at 1.
    """
    return SLOW_LINK_CHUNK_BYTES * 8 // codec_for(config.scheme).wire_bits(config)


def chunk_key(bucket: int, chunk: int) -> int:
    """The round key of a bucket's chunk."""
    return bucket + chunk * CHUNK_KEY_STRIDE


def shard_for(key: int, shards: int) -> int:
    """The shard that owns a round key: the same in every process, spread round-robin.

    Bucket b's chunk i goes to shard (b + i) % shards. ``chunk_bounds`` cuts
    every large bucket into equal chunks, a multiple of ``shards`` of them, so
    each shard gets the same share of it; small buckets take turns by index.
    A random hash could pile two large buckets on one shard.
    """
    bucket, chunk = key % CHUNK_KEY_STRIDE, key // CHUNK_KEY_STRIDE
    return (bucket + chunk) % shards


def chunk_bounds(numel: int, chunk_elements: int, channel_size: int, shards: int = 1) -> list[tuple[int, int]]:
    """Fewest chunks of at most ``chunk_elements``, equal up to whole channels (no small tail round).

    With several shards, a bucket of at least ``shards * MIN_SHARD_SPLIT``
    elements is cut into a multiple of ``shards`` chunks, so ``shard_for``
    gives every shard an equal share of it. Otherwise the shard with one chunk
    more sets the step's pace: a bucket whole on one of 2 shards, or 2 chunks
    on 4 shards. ``chunk_elements`` must be a whole number of channels
    (WorkerClient rounds it up); 0 never splits.
    """
    if chunk_elements <= 0:
        return [(0, numel)]
    count = -(-numel // chunk_elements)
    balanced = -(-count // shards) * shards
    if numel >= balanced * MIN_SHARD_SPLIT:
        count = balanced
    channels = channel_count(numel, channel_size)
    count = min(count, channels)
    if count <= 1:
        return [(0, numel)]
    # Whole channels, spread so chunk sizes differ by at most one channel: exactly
    # ``count`` chunks, each at most chunk_elements (it is whole channels too).
    edges = [min(channels * index // count * channel_size, numel) for index in range(count + 1)]
    return list(itertools.pairwise(edges))


def assemble(
    parts: list[concurrent.futures.Future[Any]], out: Any, shape: tuple[int, ...]
) -> concurrent.futures.Future[Any]:
    """One future for a bucket's chunks, which decode into their slices of ``out``: ``out``, or the first failure.

    It completes only once every chunk has settled, failed or not, so no
    chunk's mean is written into ``out`` after the caller got its answer.
    """
    result: concurrent.futures.Future[Any] = concurrent.futures.Future()
    remaining = [len(parts)]
    errors: list[BaseException] = []
    lock = threading.Lock()

    def landed(done: concurrent.futures.Future[Any]) -> None:
        error = done.exception()
        with lock:
            if error is not None:
                errors.append(error)
            remaining[0] -= 1
            if remaining[0] > 0:
                return
        if errors:
            result.set_exception(errors[0])
        else:
            result.set_result(out.reshape(shape))

    for part in parts:
        part.add_done_callback(landed)
    return result
