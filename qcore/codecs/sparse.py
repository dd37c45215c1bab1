"""Top-k per chunk: the largest entries of each chunk, their indices and a 2-bit code of their magnitude.

A chunk is a run of ``channel_size`` consecutive elements (4096 by default).
Each keeps the ``topk`` (64) entries of largest ``|x|``, ties to the lower
index, zeros never; each kept entry travels as its index in the chunk
(``ceil(log2(chunk))`` bits: 12) and a 2-bit code into a 4-entry lookup of
magnitudes shared by the whole array (``scale``): the sign, and whether
``|x|`` is below or at least the mean ``|x|`` of its sign's kept entries. Each
lookup entry is the exact mean ``|x|`` of the entries it codes, so the code
loses no mass on average. At the defaults an array costs
``(1 + 64 * 14) / 4096 = 0.219`` bits per element: SparseLoCo's chunk and k
(Sarfi et al., 2025), whose wire sends the same 14 bits per entry.

Unsent entries are not lost under error feedback (``ErrorFeedback``): they
wait in the residual until they are among the largest. The aggregator sums
the sparse pushes into its dense float32 sum and returns the mean on this
same scheme, re-sparsified with error feedback of its own
(gradq.server.policy.feeds_back): what every host downloads is one sparse
array, whatever the number of hosts.

The payload, each part starting on a byte:

1. one bit per chunk, LSB first: 1 if the chunk kept ``min(topk, its length)``
   entries (a full chunk);
2. for each chunk that is not full, in order, its count as a little-endian
   uint16 (a chunk with fewer non-zero entries than ``topk``);
3. every kept entry's index in its chunk, ``index_bits`` bits each, LSB first,
   chunk after chunk, increasing within a chunk;
4. every kept entry's code, 2 bits each: ``2 * (x > 0) + (|x| >= that sign's mean)``.

The means are summed exactly (in integers, at 2**-30 of the largest kept
magnitude, as the scaled sign's), so the torch twin reproduces the numpy
lookup bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from gradq.qcore.codecs.base import Codec
from gradq.qcore.packing import channel_count
from gradq.qcore.quantized import LARGEST_QUANTIZABLE, METADATA_BYTES, QuantizedArray, refuse_out_of_range
from gradq.qcore.scheme import QuantConfig, Scheme

__all__ = [
    "CODECS",
    "DEFAULT_CHUNK",
    "DEFAULT_TOPK",
    "LARGEST_CHUNK",
    "SMALLEST_CHUNK",
    "SparseCodec",
    "SparseLayout",
    "index_bits",
    "pack_fixed",
    "unpack_fixed",
]

DEFAULT_CHUNK = 4096
DEFAULT_TOPK = 64
# Counts of partial chunks travel as uint16, and an index of a chunk this long fits 16 bits.
LARGEST_CHUNK = 1 << 16
CODE_BITS = 2
LOOKUP_ENTRIES = 1 << CODE_BITS
# Magnitudes are summed as integers of this many bits below the largest kept magnitude's power of two.
FIXED_POINT_BITS = 30
# A lookup entry no kept value uses (or whose values all floor to 0) holds this: a scale must be > 0.
SMALLEST_MAGNITUDE = float(np.finfo(np.float32).smallest_subnormal)
_NO_ZERO_POINTS = np.empty(0, np.int32)
_NO_ZERO_POINTS.flags.writeable = False
# Rows of chunks selected at once: bounds the temporaries of one encode to about 16 MiB.
_ROWS_PER_BLOCK_ELEMENTS = 1 << 20
# Kept entries read, checked and added at once: bounds a decode's temporaries (a few MiB) whatever
# ``topk`` a push claims, so a push can make the aggregator allocate no more than its dense sum.
_ENTRIES_PER_BLOCK = 1 << 16
# A chunk's bookkeeping (its flag, count and length) must cost less than its elements' float32 sum.
SMALLEST_CHUNK = 64


def index_bits(chunk: int) -> int:
    """Bits of an index into a chunk of ``chunk`` elements: ``ceil(log2(chunk))``, at least 1."""
    return max(1, (chunk - 1).bit_length())


def pack_fixed(values: np.ndarray, width: int) -> np.ndarray:
    """Pack non-negative integers below ``2**width`` (width 1..16) densely, LSB first, into bytes.

    Packed ``_ENTRIES_PER_BLOCK`` values at a time (a multiple of 8, so each block
    ends on a byte): the temporaries stay a few MiB however many values there are.
    """
    parts = []
    for first in range(0, values.size, _ENTRIES_PER_BLOCK):
        block = values[first : first + _ENTRIES_PER_BLOCK].astype(np.uint32)
        bits = np.empty((block.size, width), np.uint8)
        for bit in range(width):
            bits[:, bit] = (block >> bit) & 1
        parts.append(np.packbits(bits.reshape(-1), bitorder="little"))
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def unpack_fixed(data: np.ndarray, width: int, count: int, first: int = 0) -> np.ndarray:
    """Inverse of ``pack_fixed``: values ``first .. first + count`` of the stream, as int64."""
    start_bit = first * width
    low = start_bit // 8
    high = (start_bit + count * width + 7) // 8
    skip = start_bit - 8 * low
    bits = np.unpackbits(data[low:high], bitorder="little")[skip : skip + count * width].reshape(count, width)
    values = np.zeros(count, np.int64)
    for bit in range(width):
        values |= bits[:, bit].astype(np.int64) << bit
    return values


class SparseLayout(NamedTuple):
    """Where each part of a payload lies, and what the counts say (from ``SparseCodec.layout``)."""

    counts: np.ndarray  # int32, entries kept by each chunk
    index_bits: int
    indices: slice  # of the payload
    codes: slice


def _chunk_lengths(numel: int, chunk: int) -> np.ndarray:
    """Each chunk's length: ``chunk``, the last one what is left."""
    lengths = np.full(channel_count(numel, chunk), chunk, np.int32)
    if numel % chunk:
        lengths[-1] = numel % chunk
    return lengths


def _full_counts(numel: int, chunk: int, topk: int) -> np.ndarray:
    """The entries a full chunk keeps: ``min(topk, its length)``."""
    return np.minimum(_chunk_lengths(numel, chunk), topk)


def _parts_sizes(chunks: int, partial: int, kept: int, width: int) -> tuple[int, int, int, int]:
    """Bytes of the four parts: full flags, partial counts, indices, codes."""
    return (chunks + 7) // 8, 2 * partial, (kept * width + 7) // 8, (kept * CODE_BITS + 7) // 8


def exact_mean_magnitudes(magnitudes: np.ndarray, per_unit: float) -> float:
    """The exact mean of ``magnitudes`` (float32) at ``1 / per_unit`` resolution, as a float32 value > 0.

    Each magnitude is floored to a count of units and the counts are summed as
    integers, so the order of the sum does not matter (the torch twin's sum is this one).
    """
    if magnitudes.size == 0:
        return SMALLEST_MAGNITUDE
    count = int(np.floor(magnitudes.astype(np.float64) * per_unit).astype(np.int64).sum())
    return max(float(np.float32(float(count) / per_unit / magnitudes.size)), SMALLEST_MAGNITUDE)


def lookup_of(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 4-entry magnitude lookup of the kept ``values`` (float32, non-zero) and each value's code."""
    magnitudes = np.abs(values)
    lookup = np.full(LOOKUP_ENTRIES, SMALLEST_MAGNITUDE, np.float32)
    codes = np.zeros(values.size, np.uint8)
    if values.size == 0:
        return lookup, codes
    _, exponent = math.frexp(float(magnitudes.max()))
    per_unit = math.ldexp(1.0, FIXED_POINT_BITS - exponent)  # a power of two: the products are exact
    positive = values > 0
    for sign in (0, 1):
        mine = positive == bool(sign)
        threshold = np.float32(exact_mean_magnitudes(magnitudes[mine], per_unit))
        high = magnitudes >= threshold
        for level in (0, 1):
            chosen = mine & (high == bool(level))
            lookup[2 * sign + level] = exact_mean_magnitudes(magnitudes[chosen], per_unit)
        codes[mine] = (2 * sign + high[mine]).astype(np.uint8)
    return lookup, codes


def _select(rows: np.ndarray, keep: int) -> np.ndarray:
    """Mask of the ``keep`` largest ``|x|`` of each row (ties to the lower index), zeros never kept."""
    length = rows.shape[1]
    magnitudes = np.abs(rows)
    if keep >= length:
        return magnitudes > 0
    threshold = np.partition(magnitudes, length - keep, axis=1)[:, length - keep][:, None]
    mask = magnitudes > threshold
    ties = magnitudes == threshold
    need = keep - mask.sum(axis=1)
    # Only rows with more ties at the threshold than places left choose among them (rare outside zeros).
    crowded = np.flatnonzero((ties.sum(axis=1) > need) & (threshold[:, 0] > 0))
    mask |= ties & (threshold > 0)
    for row in crowded:
        tied = np.flatnonzero(ties[row])
        mask[row, tied[need[row] :]] = False
    return mask


class SparseCodec(Codec):
    """The ``topk`` largest entries of each chunk, their indices and 2-bit magnitude codes (``config.bits`` ignored)."""

    quantized = True
    zero_points = False
    sparse = True

    def __init__(self, scheme: Scheme) -> None:
        super().__init__(scheme, "gradq.qcore.codecs.sparse_torch")

    def wire_bits(self, config: QuantConfig) -> int:
        """Always 2: the bits of a kept entry's code."""
        return CODE_BITS

    def default_channel_size(self, config: QuantConfig) -> int:
        """``DEFAULT_CHUNK``."""
        return DEFAULT_CHUNK

    def default_topk(self, config: QuantConfig) -> int:
        """``DEFAULT_TOPK``, or the whole chunk when it is shorter."""
        return min(DEFAULT_TOPK, config.channel_size)

    def wire_channel_size(self, numel: int, channel_size: int) -> int:
        """The config's chunk."""
        return channel_size

    def num_channels(self, numel: int, channel_size: int) -> int:
        """The lookup's 4 entries, whatever the size."""
        return LOOKUP_ENTRIES

    def grid_channel_size(self, channel_size: int) -> int:
        """Its chunk."""
        return channel_size

    def check_config(self, config: QuantConfig) -> None:
        """A chunk of ``SMALLEST_CHUNK`` to ``LARGEST_CHUNK`` elements and ``1 <= topk <= chunk``."""
        if not SMALLEST_CHUNK <= config.channel_size <= LARGEST_CHUNK:
            raise ValueError(
                f"channel_size={config.channel_size} is invalid for scheme={self.name}; expected a chunk of "
                f"{SMALLEST_CHUNK}..{LARGEST_CHUNK} elements"
            )
        if not 1 <= config.topk <= config.channel_size:
            raise ValueError(
                f"topk={config.topk} is invalid for scheme={self.name}; expected 1..channel_size={config.channel_size}"
            )

    def mean_config(self, bits: int, channel_size: int, topk: int = 0) -> QuantConfig:
        """The same chunks and ``topk``: the mean re-sparsified (the aggregator feeds its error back)."""
        return QuantConfig(self.scheme, CODE_BITS, channel_size, topk=topk)

    def wire_size(self, numel: int, config: QuantConfig) -> int:
        """Bytes of an encoding whose every chunk is full: exact unless a chunk holds fewer non-zeros than ``topk``.

        A chunk that keeps fewer entries costs 2 bytes for its count and saves
        14 bits per entry it does not keep; below about 10 missing entries the
        encoding is up to 2 bytes larger than this.
        """
        if numel < 0:
            raise ValueError(f"numel={numel} is negative; expected >= 0")
        chunk = config.channel_size
        kept = int(_full_counts(numel, chunk, config.topk).sum())
        parts = _parts_sizes(channel_count(numel, chunk), 0, kept, index_bits(chunk))
        return METADATA_BYTES + 4 * LOOKUP_ENTRIES + sum(parts)

    # -- numpy arithmetic ------------------------------------------------------------------------

    def encode(
        self,
        flat: np.ndarray,
        config: QuantConfig,
        rng: np.random.Generator | None,
        qparams: tuple[np.ndarray, np.ndarray] | None,
        dtype: str,
    ) -> QuantizedArray:
        """Keep each chunk's largest entries; code their magnitudes on the array's lookup."""
        if qparams is not None:
            raise ValueError(f"qparams are not used by scheme={self.name}; its lookup is the kept entries' means")
        refuse_out_of_range(flat, LARGEST_QUANTIZABLE, "finite values with |x| < 2**126")
        chunk, topk, numel = config.channel_size, config.topk, flat.size
        counts = np.zeros(channel_count(numel, chunk), np.int64)
        positions: list[np.ndarray] = []
        whole = numel // chunk
        rows_per_block = max(1, _ROWS_PER_BLOCK_ELEMENTS // chunk)
        for first in range(0, whole, rows_per_block):
            last = min(first + rows_per_block, whole)
            mask = _select(flat[first * chunk : last * chunk].reshape(last - first, chunk), topk)
            counts[first:last] = mask.sum(axis=1)
            positions.append(np.flatnonzero(mask) + first * chunk)
        if numel % chunk:
            mask = _select(flat[whole * chunk :].reshape(1, -1), topk)
            counts[-1] = mask.sum()
            positions.append(np.flatnonzero(mask) + whole * chunk)
        kept = np.concatenate(positions) if positions else np.zeros(0, np.int64)
        lookup, codes = lookup_of(flat[kept])
        payload = self.payload_of(numel, chunk, topk, counts, kept % chunk, codes)
        return QuantizedArray(self.scheme, CODE_BITS, numel, chunk, lookup, _NO_ZERO_POINTS, payload, dtype, topk)

    def encode_compensated(
        self,
        flat: np.ndarray,
        residual: np.ndarray,
        config: QuantConfig,
        rng: np.random.Generator | None,
        dtype: str,
    ) -> QuantizedArray:
        """Error feedback's step with a sparse decode: only the kept entries leave the residual.

        The same bytes and residual as the generic composition, without its dense
        decode and subtraction (on the aggregator, re-sparsifying a mean: most of its CPU).
        """
        np.add(flat, residual, out=residual)
        encoded = self.encode(residual, config, rng, None, dtype)
        for positions, values in self.entry_blocks(encoded):
            residual[positions] -= values
        return encoded

    @staticmethod
    def payload_of(
        numel: int, chunk: int, topk: int, counts: np.ndarray, indices: np.ndarray, codes: np.ndarray
    ) -> np.ndarray:
        """The payload of kept entries: ``counts`` per chunk, their ``indices`` in their chunk and ``codes``."""
        full = counts == _full_counts(numel, chunk, topk)
        parts = [
            np.packbits(full.astype(np.uint8), bitorder="little"),
            counts[~full].astype("<u2").view(np.uint8),
            pack_fixed(indices, index_bits(chunk)),
            pack_fixed(codes, CODE_BITS),
        ]
        return np.concatenate(parts)

    def layout(self, field: str, numel: int, chunk: int, topk: int, payload: np.ndarray) -> SparseLayout:
        """Read the counts and the parts' places out of a payload, checking its size.

        Raises:
            ValueError: a count at or above its chunk's full count, or a payload of another size than the counts say.
        """
        chunks = channel_count(numel, chunk)
        flags_bytes = (chunks + 7) // 8
        if payload.size < flags_bytes:
            raise ValueError(f"{field}.payload has {payload.size} bytes; expected at least {flags_bytes} of flags")
        full = np.unpackbits(payload[:flags_bytes], count=chunks, bitorder="little").astype(bool)
        counts = _full_counts(numel, chunk, topk)
        partial = int(chunks - full.sum())
        counts_end = flags_bytes + 2 * partial
        if payload.size < counts_end:
            raise ValueError(
                f"{field}.payload has {payload.size} bytes; expected at least {counts_end} "
                f"({partial} chunks flagged partial carry 2 bytes of count each)"
            )
        if partial:
            said = payload[flags_bytes:counts_end].view("<u2").astype(np.int64)
            limits = counts[~full]
            over = np.flatnonzero(said >= limits)
            if over.size:
                index = int(np.flatnonzero(~full)[over[0]])
                raise ValueError(
                    f"{field}: chunk {index}'s count is {int(said[over[0]])}; expected below "
                    f"{int(limits[over[0]])} (min(topk={topk}, its length)) for a chunk flagged partial"
                )
            counts = counts.copy()
            counts[~full] = said
        width = index_bits(chunk)
        kept = int(counts.sum())
        _, _, index_bytes, code_bytes = _parts_sizes(chunks, partial, kept, width)
        expected = counts_end + index_bytes + code_bytes
        if payload.size != expected:
            raise ValueError(
                f"{field}.payload has {payload.size} bytes; expected {expected} for {kept} kept entries in "
                f"{chunks} chunks ({width}-bit indices, {CODE_BITS}-bit codes)"
            )
        return SparseLayout(
            counts, width, slice(counts_end, counts_end + index_bytes), slice(counts_end + index_bytes, expected)
        )

    def entry_blocks(self, q: QuantizedArray, field: str = "tensor") -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(positions in the array, decoded float32 values) of the kept entries, a block of chunks at a time.

        Each block holds whole chunks and at most ``_ENTRIES_PER_BLOCK`` entries
        (or one chunk), so reading a push costs a few MiB whatever it claims.
        Positions increase within and across blocks.

        Raises:
            ValueError: the payload's layout is off, or an index is out of its chunk or not increasing.
        """
        layout = self.layout(field, q.numel, q.channel_size, q.topk, q.payload)
        indices_bytes, codes_bytes = q.payload[layout.indices], q.payload[layout.codes]
        lengths = _chunk_lengths(q.numel, q.channel_size)
        ends = np.cumsum(layout.counts)  # entries up to the end of each chunk
        chunk, entry, chunks = 0, 0, layout.counts.size
        while chunk < chunks:
            stop = max(chunk + 1, int(np.searchsorted(ends, entry + _ENTRIES_PER_BLOCK, side="right")))
            count = int(ends[stop - 1]) - entry
            indices = unpack_fixed(indices_bytes, layout.index_bits, count, entry)
            codes = unpack_fixed(codes_bytes, CODE_BITS, count, entry)
            chunk_of = np.repeat(np.arange(chunk, stop, dtype=np.int64), layout.counts[chunk:stop])
            outside = np.flatnonzero(indices >= lengths[chunk_of])
            if outside.size:
                at = int(outside[0])
                raise ValueError(
                    f"{field}: entry {entry + at}'s index {int(indices[at])} is outside chunk {int(chunk_of[at])} of "
                    f"{int(lengths[chunk_of[at]])} elements"
                )
            positions = chunk_of * q.channel_size + indices
            unordered = np.flatnonzero(np.diff(positions) <= 0)  # across chunks they increase by construction
            if unordered.size:
                at = int(unordered[0]) + 1
                raise ValueError(
                    f"{field}: entry {entry + at}'s index {int(indices[at])} in chunk {int(chunk_of[at])} does not "
                    f"follow the one before it; expected indices increasing within a chunk, none repeated"
                )
            magnitudes = q.scale[codes]
            yield positions, np.where(codes >= 2, magnitudes, -magnitudes).astype(np.float32, copy=False)
            chunk, entry = stop, entry + count

    def entries(self, q: QuantizedArray, field: str = "tensor") -> tuple[np.ndarray, np.ndarray]:
        """Every kept entry's position and decoded value (``entry_blocks`` joined), positions increasing."""
        blocks = list(self.entry_blocks(q, field))
        if not blocks:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        return np.concatenate([p for p, _ in blocks]), np.concatenate([v for _, v in blocks])

    def dequantize(self, q: QuantizedArray, out: np.ndarray, accumulate: bool, divisor: int) -> None:
        """``out (+)= decode(q)``: only the kept entries are touched, a block at a time, then ``/ divisor``."""
        if not accumulate:
            out[:] = 0
        for positions, values in self.entry_blocks(q):
            out[positions] += values  # positions are distinct: one add each
        if accumulate and divisor != 1:
            np.divide(out, np.float32(divisor), out=out)

    # -- untrusted input ---------------------------------------------------------------------------

    def from_wire(
        self,
        field: str,
        bits: int,
        numel: int,
        channel_size: int,
        scale: bytes,
        zero_point: bytes,
        payload: memoryview | bytes,
        dtype: str,
        topk: int = 0,
    ) -> QuantizedArray:
        """Check the header, the lookup and the whole payload (counts, sizes, indices) before anything is decoded."""
        self._check_header(field, bits, numel, channel_size)
        if not 1 <= topk <= channel_size:
            raise ValueError(f"{field}.topk={topk} is invalid for {self.scheme.name}; expected 1..{channel_size}")
        if len(scale) != 4 * LOOKUP_ENTRIES:
            expected = 4 * LOOKUP_ENTRIES
            raise ValueError(f"{field}.scale has {len(scale)} bytes; expected {expected} (a 4-entry lookup)")
        if zero_point:
            raise ValueError(f"{field}.zero_point has {len(zero_point)} bytes; expected 0 (the scheme has none)")
        lookup = np.frombuffer(scale, "<f4")
        if not (lookup.min() > 0 and lookup.max() < np.inf):
            index = int(np.flatnonzero(~(np.isfinite(lookup) & (lookup > 0)))[0])
            raise ValueError(f"{field}.scale[{index}]={float(lookup[index])} is invalid; expected a finite number > 0")
        levels = np.frombuffer(payload, np.uint8)
        q = QuantizedArray(self.scheme, bits, numel, channel_size, lookup, _NO_ZERO_POINTS, levels, dtype, topk)
        for _ in self.entry_blocks(q, field):  # every index checked here, not in the middle of a sum
            pass
        return q

    def _check_header(self, field: str, bits: int, numel: int, channel_size: int) -> None:
        if bits != CODE_BITS:
            raise ValueError(f"{field}.bits={bits} is invalid for {self.scheme.name}; expected {CODE_BITS}")
        if not SMALLEST_CHUNK <= channel_size <= LARGEST_CHUNK:
            raise ValueError(
                f"{field}.channel_size={channel_size} is invalid; expected {SMALLEST_CHUNK}..{LARGEST_CHUNK} "
                f"for {self.scheme.name}"
            )

    def _check_values(self, field: str, bits: int, zero_point: np.ndarray, payload: np.ndarray) -> None:
        """Unused: ``from_wire`` checks the payload itself."""


CODECS = (SparseCodec(Scheme.SPARSE_TOPK),)
