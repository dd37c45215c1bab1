"""Throughput of gradq's qcore codec beside memcpy, plain numpy, seed 000's torch loop and torch's native kernels.

Run from the repository root:

    python bench/qcore_kernels.py            # report only, always exits 0
    python bench/qcore_kernels.py --check    # exits 1 when an absolute target is missed

With a C compiler (``$CC``, default ``cc``) it also builds bench/native/round_trip.c,
the same 8-bit per-channel round trip as plain C loops, and times it alternately
with gradq's. The round trip's absolute floor is printed twice: as set, and scaled
by the reference rows measured where it was set (copy, numpy, torch). The targets
are in docs/performance.md; figures: bench/results/qcore-kernels.md.

Every row is GB/s of fp32 input (4 bytes per element / median seconds of one call,
after one warm-up call), on one thread. This is a benchmark, not a test: torch is
allowed here (bench only); qcore itself never imports it.
"""

from __future__ import annotations

import os

# Pin every thread pool to one thread before numpy, numba or torch read these.
for _variable in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_variable] = "1"

import argparse  # noqa: E402
import ctypes  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from gradq.qcore import QuantConfig, Scheme, decode, decode_accumulate, encode  # noqa: E402

CHANNEL_SIZE = 512
QMAX_8BIT = 255
# Seed 000 loops over channels in Python; a tenth of the bucket keeps its row to seconds.
SEED_SLICE_FRACTION = 10
PER_CHANNEL = Scheme.PER_CHANNEL_AFFINE.name.lower()
SEED_KERNEL = "seed 000 torch loop round trip [a]"
# torch warns that its quantized tensors are deprecated; the row stays as the library baseline.
TORCH_DEPRECATION = "torch.quantize_per_tensor, torch.quantize_per_channel"
TARGET_ROUND_TRIP_GBPS = 5.0
TARGET_ACCUMULATE_GBPS = 10.0
# The bucket size of the targets (docs/performance.md), and the reference rows of the machine the 5 GB/s floor was
# set on.
DESIGN_NUMEL = 6_000_000
DESIGN_REFERENCE_GBPS = {
    "memory copy (np.copyto)": 25.0,
    "numpy vectorised round trip": 1.2,
    "torch quantize_per_channel round trip [b]": 0.9,
}
NATIVE_SOURCE = Path(__file__).with_name("native") / "round_trip.c"
NATIVE_KERNEL = "C round trip, same arithmetic, -O3 -march=native [c]"
PAIRED_KERNEL = "gradq round trip, timed alternately with [c]"
# Written between the cold rows' runs: past the last-level cache of the machines measured
# (figures: bench/results/qcore-kernels.md).
EVICTION_BYTES = 512 << 20


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the table."""

    kernel: str  # what was timed
    bits: int | None  # None where bits do not apply (the copy)
    scheme: str  # grid granularity, or "-" for the copy
    numel: int  # elements per timed call (smaller for the seed's loop)
    gbps: float  # fp32 bytes in / median seconds


@dataclass(frozen=True, slots=True)
class Target:
    """A throughput floor the 8-bit per-channel path must reach."""

    name: str
    floor_gbps: float
    measured_gbps: float

    @property
    def passed(self) -> bool:
        """True when the measured throughput meets the floor."""
        return self.measured_gbps >= self.floor_gbps


def median_seconds(call: Callable[[], object], repeats: int, before: Callable[[], object] | None = None) -> float:
    """Median wall time of ``call`` over ``repeats`` runs, after one untimed warm-up run.

    Args:
        call: the work to time; its result is discarded.
        repeats: how many timed runs.
        before: untimed work before each run (e.g. evicting the caches).

    Returns:
        The median, in seconds.
    """
    call()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class CacheEvictor:
    """Evicts the CPU caches by writing a buffer larger than them (untimed, between runs)."""

    def __init__(self, nbytes: int = EVICTION_BYTES) -> None:
        self.buffer = np.zeros(nbytes // 8)

    def __call__(self) -> None:
        self.buffer += 1.0


def measure(
    kernel: str,
    bits: int | None,
    scheme: str,
    x: np.ndarray,
    call: Callable[[], object],
    repeats: int,
    before: Callable[[], object] | None = None,
) -> Row:
    """Time ``call`` and express it as GB/s of ``x``'s fp32 bytes.

    Args:
        kernel: row label.
        bits: bits per element, or None.
        scheme: scheme label.
        x: the float32 input the call consumes (sets the byte count).
        call: the work to time.
        repeats: timed runs.
        before: untimed work before each run.

    Returns:
        The table row.
    """
    seconds = median_seconds(call, repeats, before)
    return Row(kernel, bits, scheme, x.size, x.nbytes / seconds / 1e9)


def gradq_round_trip(x: np.ndarray, config: QuantConfig) -> np.ndarray:
    """``decode(encode(x, config))``: what a receiver gets back, into a fresh array."""
    return decode(encode(x, config))


def gradq_rows(x: np.ndarray, repeats: int) -> list[Row]:
    """Quantize, dequantize, dequantize-accumulate and round trip through gradq's public API.

    Args:
        x: float32 bucket.
        repeats: timed runs per row.

    Returns:
        Four rows for each of 8/4 bits and per-tensor/per-channel affine.
    """
    rows = []
    out = np.empty_like(x)
    accumulator = np.zeros_like(x)
    for scheme in (Scheme.PER_TENSOR_AFFINE, Scheme.PER_CHANNEL_AFFINE):
        for bits in (8, 4):
            config = QuantConfig(scheme=scheme, bits=bits, channel_size=CHANNEL_SIZE)
            quantized = encode(x, config)
            label = scheme.name.lower()
            rows += [
                measure("gradq quantize", bits, label, x, partial(encode, x, config), repeats),
                measure("gradq dequantize", bits, label, x, partial(decode, quantized, out), repeats),
                measure(
                    "gradq dequantize-accumulate",
                    bits,
                    label,
                    x,
                    partial(decode_accumulate, quantized, accumulator),
                    repeats,
                ),
                measure("gradq round trip", bits, label, x, partial(gradq_round_trip, x, config), repeats),
            ]
    return rows


def cold_rows(x: np.ndarray, repeats: int) -> list[Row]:
    """The 8-bit per-channel quantize, dequantize and round trip with the caches evicted before each run.

    The other rows rerun on buffers the previous run left in cache; a round trip
    into a fresh output touches about 54 MB, past what a shared host's cache
    keeps, so it is compared with these.

    Args:
        x: float32 bucket.
        repeats: timed runs per row.

    Returns:
        Three rows, labelled "(cold cache)".
    """
    config = QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=8, channel_size=CHANNEL_SIZE)
    quantized = encode(x, config)
    evict = CacheEvictor()
    fresh = "gradq dequantize, fresh output (cold cache)"
    return [
        measure("gradq quantize (cold cache)", 8, PER_CHANNEL, x, partial(encode, x, config), repeats, evict),
        measure(fresh, 8, PER_CHANNEL, x, partial(decode, quantized), repeats, evict),
        measure(
            "gradq round trip (cold cache)", 8, PER_CHANNEL, x, partial(gradq_round_trip, x, config), repeats, evict
        ),
    ]


class NativeRoundTrip:
    """``bench/native/round_trip.c`` built by the C compiler for this machine and called through ctypes.

    Args:
        library: path of the built shared library.
    """

    def __init__(self, library: Path) -> None:
        self.library = ctypes.CDLL(str(library))
        pointer, length = ctypes.c_void_p, ctypes.c_int64
        self.library.quantize_per_channel.argtypes = [pointer, length, length, pointer, pointer, pointer]
        self.library.dequantize_per_channel.argtypes = [pointer, length, length, pointer, pointer, pointer]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Encode and decode ``x`` into fresh arrays, as ``gradq_round_trip`` does."""
        channels = -(-x.size // CHANNEL_SIZE)
        levels = np.empty(x.size, np.uint8)
        scale = np.empty(channels, np.float32)
        zero_point = np.empty(channels, np.int32)
        self.library.quantize_per_channel(
            x.ctypes.data, x.size, CHANNEL_SIZE, levels.ctypes.data, scale.ctypes.data, zero_point.ctypes.data
        )
        out = np.empty(x.size, np.float32)
        self.library.dequantize_per_channel(
            levels.ctypes.data, x.size, CHANNEL_SIZE, scale.ctypes.data, zero_point.ctypes.data, out.ctypes.data
        )
        return out


def build_native(scratch: Path) -> NativeRoundTrip | str:
    """Compile the C reference with ``$CC`` (default ``cc``); a sentence saying why not when it cannot be built."""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        return f"no C compiler {compiler!r} on PATH (set CC)"
    library = scratch / "round_trip.so"
    command = [compiler, "-O3", "-march=native", "-fno-math-errno", "-shared", "-fPIC", "-o", str(library)]
    built = subprocess.run([*command, str(NATIVE_SOURCE)], capture_output=True, text=True, check=False)
    if built.returncode != 0:
        return f"{' '.join(command)} exited {built.returncode}: {built.stderr.strip()[:300] or 'no message'}"
    return NativeRoundTrip(library)


def native_rows(x: np.ndarray, repeats: int, native: NativeRoundTrip) -> list[Row]:
    """The C reference's round trip and gradq's, timed alternately, after checking that their bytes agree.

    Alternating the two keeps the host's load, which moves both by half here,
    out of their ratio.

    Raises:
        AssertionError: when the C round trip decodes to other values than gradq's.
    """
    config = QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=8, channel_size=CHANNEL_SIZE)
    differing = np.flatnonzero(native(x) != gradq_round_trip(x, config))
    assert differing.size == 0, f"the C reference differs from gradq at {differing.size} elements, first {differing[0]}"
    calls = {NATIVE_KERNEL: partial(native, x), PAIRED_KERNEL: partial(gradq_round_trip, x, config)}
    times: dict[str, list[float]] = {kernel: [] for kernel in calls}
    for _ in range(repeats + 1):  # the first pair warms up
        for kernel, call in calls.items():
            start = time.perf_counter()
            call()
            times[kernel].append(time.perf_counter() - start)
    return [
        Row(kernel, 8, PER_CHANNEL, x.size, x.nbytes / statistics.median(seconds[1:]) / 1e9)
        for kernel, seconds in times.items()
    ]


def numpy_round_trip_per_channel(x: np.ndarray) -> np.ndarray:
    """Plain vectorised numpy 8-bit per-channel affine round trip (seed 000's formula, no loop).

    Args:
        x: flat float32 array.

    Returns:
        The dequantized float32 values, ``x.size`` of them.
    """
    padded = np.zeros(-(-x.size // CHANNEL_SIZE) * CHANNEL_SIZE, np.float32)
    padded[: x.size] = x
    channels = padded.reshape(-1, CHANNEL_SIZE)
    # Qparams in float64, as the seed derives them from Python floats; only the
    # scale travels as float32. Same levels as the seed, bit for bit.
    low = channels.min(axis=1, keepdims=True).astype(np.float64)
    high = channels.max(axis=1, keepdims=True).astype(np.float64)
    constant = high == low
    scale64 = np.where(constant, 1.0, (high - low) / QMAX_8BIT)
    zero_point = np.where(constant, 0.0, np.clip(np.rint(-low / scale64), 0, QMAX_8BIT)).astype(np.float32)
    scale = scale64.astype(np.float32)
    levels = np.clip(np.rint(channels / scale) + zero_point, 0, QMAX_8BIT).astype(np.uint8)
    return (scale * (levels.astype(np.float32) - zero_point)).reshape(-1)[: x.size]


class _SeedPerChannelMinMaxObserver:
    """Seed 000's ``_PerChannelMinMaxObserver``, kept as written (one ``.item()`` per channel)."""

    def __init__(self) -> None:
        self.min_vals: list[float] = []
        self.max_vals: list[float] = []

    def __call__(self, tensor: torch.Tensor) -> _SeedPerChannelMinMaxObserver:
        self.min_vals = [tensor[i].min().item() for i in range(tensor.size(0))]
        self.max_vals = [tensor[i].max().item() for i in range(tensor.size(0))]
        return self

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        qmin, qmax = 0, QMAX_8BIT
        scales, zero_points = [], []
        for mn, mx in zip(self.min_vals, self.max_vals, strict=True):
            if mx == mn:
                scales.append(1.0)
                zero_points.append(qmin)
            else:
                s = (mx - mn) / float(qmax - qmin)
                zero_points.append(max(qmin, min(qmax, round(qmin - mn / s))))
                scales.append(s)
        return torch.tensor(scales, dtype=torch.float32), torch.tensor(zero_points, dtype=torch.int64)


def _seed_quantize_per_channel_backend(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    y = torch.zeros(x.shape, device=x.device)
    for i in range(x.size(0)):
        y[i, :] = torch.round(x[i, :] / scale[i]) + zero_point[i]
    return torch.clamp(y, 0, QMAX_8BIT).to(torch.uint8)


def _seed_dequantize_per_channel_backend(
    y: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor
) -> torch.Tensor:
    y = y.to(torch.float32).to(y.device)
    x = torch.zeros_like(y)
    for i in range(x.size(0)):
        x[i, :] = scale[i] * (y[i, :] - zero_point[i])
    return x


def seed_round_trip_per_channel(tensor: torch.Tensor) -> torch.Tensor:
    """Seed 000's per-channel hook minus the collectives: pad, observe, quantize, dequantize, unpad.

    Args:
        tensor: flat float32 tensor.

    Returns:
        The dequantized tensor, ``tensor.numel()`` elements.
    """
    channels = torch.nn.functional.pad(
        tensor, pad=(0, CHANNEL_SIZE - len(tensor) % CHANNEL_SIZE), mode="constant", value=0
    ).view(-1, CHANNEL_SIZE)
    scale, zero_point = _SeedPerChannelMinMaxObserver()(channels).calculate_qparams()
    levels = _seed_quantize_per_channel_backend(channels, scale, zero_point)
    return _seed_dequantize_per_channel_backend(levels, scale, zero_point).reshape(-1)[: tensor.size(0)]


def torch_native_round_trip_per_channel(tensor: torch.Tensor) -> torch.Tensor:
    """``torch.quantize_per_channel`` (quint8, axis 0) + ``.dequantize()``, qparams from vectorised min/max.

    Args:
        tensor: flat float32 tensor.

    Returns:
        The dequantized tensor, ``tensor.numel()`` elements.
    """
    padding = -len(tensor) % CHANNEL_SIZE
    channels = torch.nn.functional.pad(tensor, pad=(0, padding)).view(-1, CHANNEL_SIZE)
    low, high = torch.aminmax(channels, dim=1)
    constant = high == low
    scale = torch.where(constant, 1.0, (high - low).double() / QMAX_8BIT)
    zero_point = torch.where(constant, 0, torch.round(-low / scale).clamp(0, QMAX_8BIT)).long()
    quantized = torch.quantize_per_channel(channels, scale, zero_point, axis=0, dtype=torch.quint8)
    return quantized.dequantize().reshape(-1)[: len(tensor)]


def reference_rows(x: np.ndarray, repeats: int) -> list[Row]:
    """Memory copy, plain numpy, seed 000's loop (on a slice) and torch's native per-channel kernels.

    Args:
        x: float32 bucket.
        repeats: timed runs per row.

    Returns:
        The reference rows, copy first.
    """
    copy_target = np.empty_like(x)
    tensor = torch.from_numpy(x)
    seed_slice = x[: max(x.size // SEED_SLICE_FRACTION, 1)]
    seed_tensor = torch.from_numpy(seed_slice)
    return [
        measure("memory copy (np.copyto)", None, "-", x, lambda: np.copyto(copy_target, x), repeats),
        measure("numpy vectorised round trip", 8, PER_CHANNEL, x, lambda: numpy_round_trip_per_channel(x), repeats),
        measure(
            SEED_KERNEL,
            8,
            PER_CHANNEL,
            seed_slice,
            lambda: seed_round_trip_per_channel(seed_tensor),
            repeats,
        ),
        measure(
            "torch quantize_per_channel round trip [b]",
            8,
            PER_CHANNEL,
            x,
            lambda: torch_native_round_trip_per_channel(tensor),
            repeats,
        ),
    ]


def format_table(rows: Sequence[Row], copy_gbps: float) -> str:
    """Render the rows as a markdown table with each row's ratio to the copy.

    Args:
        rows: measured rows.
        copy_gbps: the copy row's throughput.

    Returns:
        The table, one line per row.
    """
    lines = ["| kernel | bits | scheme | elements | GB/s | x copy |", "|---|---:|---|---:|---:|---:|"]
    for row in rows:
        bits = "-" if row.bits is None else str(row.bits)
        lines.append(
            f"| {row.kernel} | {bits} | {row.scheme} | {row.numel:,} | {row.gbps:.2f} | {row.gbps / copy_gbps:.3f} |"
        )
    return "\n".join(lines)


def format_split(rows: Sequence[Row]) -> str:
    """Where the 8-bit per-channel round trip's time goes: its two kernels, cached and cold."""

    def ms(kernel: str) -> float:
        row = find_row(rows, kernel, 8, PER_CHANNEL)
        return 4e-6 * row.numel / row.gbps

    warm = ms("gradq quantize") + ms("gradq dequantize")
    cold = ms("gradq quantize (cold cache)") + ms("gradq dequantize, fresh output (cold cache)")
    return (
        f"8-bit per-channel round trip: {ms('gradq round trip'):.2f} ms per call; quantize + dequantize "
        f"{warm:.2f} ms with their buffers in cache, {cold:.2f} ms with the caches evicted (round trip from cold: "
        f"{ms('gradq round trip (cold cache)'):.2f} ms)."
    )


def ratio(rows: Sequence[Row], kernel: str, reference: str) -> float:
    """GB/s of the 8-bit per-channel ``kernel`` row over the ``reference`` row's."""
    return find_row(rows, kernel, 8, PER_CHANNEL).gbps / find_row(rows, reference, 8, PER_CHANNEL).gbps


def find_row(rows: Sequence[Row], kernel: str, bits: int, scheme: str) -> Row:
    """The row with the given labels.

    Raises:
        LookupError: naming the labels when no row has them.
    """
    for row in rows:
        if (row.kernel, row.bits, row.scheme) == (kernel, bits, scheme):
            return row
    raise LookupError(f"no row kernel={kernel!r}, bits={bits}, scheme={scheme!r}; expected one measured above")


def targets_for(rows: Sequence[Row]) -> list[Target]:
    """The throughput floors, each paired with its measured figure.

    Args:
        rows: measured rows.

    Returns:
        One Target per floor.
    """
    round_trip = find_row(rows, "gradq round trip", 8, PER_CHANNEL)
    accumulate = find_row(rows, "gradq dequantize-accumulate", 8, PER_CHANNEL)
    return [
        Target("8-bit per-channel round trip", TARGET_ROUND_TRIP_GBPS, round_trip.gbps),
        Target("8-bit per-channel dequantize-accumulate", TARGET_ACCUMULATE_GBPS, accumulate.gbps),
    ]


def scaled_targets_for(rows: Sequence[Row]) -> list[Target]:
    """The round trip's floor carried to this machine by each reference row of the machine it was set on.

    The 5 GB/s floor was set where a copy ran at 25 GB/s, numpy at 1.2 and torch
    at 0.9; each row measured here scales the floor by the same factor.
    """
    round_trip = find_row(rows, "gradq round trip", 8, PER_CHANNEL)
    targets = []
    for kernel, design_gbps in DESIGN_REFERENCE_GBPS.items():
        here = next(row for row in rows if row.kernel == kernel)
        targets.append(
            Target(
                f"round trip vs {kernel} ({here.gbps:.2f} GB/s here, {design_gbps:g} where the floor was set)",
                TARGET_ROUND_TRIP_GBPS * here.gbps / design_gbps,
                round_trip.gbps,
            )
        )
    return targets


def format_targets(targets: Sequence[Target], title: str = "## targets") -> str:
    """Render the targets as a list with PASS/FAIL and the measured figure."""
    lines = [title, ""]
    for target in targets:
        verdict = "PASS" if target.passed else "FAIL"
        lines.append(
            f"- {verdict}: {target.name} {target.measured_gbps:.2f} GB/s (target >= {target.floor_gbps:.3g} GB/s)"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=DESIGN_NUMEL, help="elements in the bucket (default 6,000,000)")
    parser.add_argument("--repeats", type=int, default=15, help="timed runs per row, after one warm-up (default 15)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    if args.numel < CHANNEL_SIZE:
        parser.error(f"--numel={args.numel} is too small; expected >= {CHANNEL_SIZE}")
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats} is invalid; expected >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print the report, and return the exit code.

    Args:
        argv: command-line arguments; None reads ``sys.argv``.

    Returns:
        0, or 1 with ``--check`` when a target is missed.
    """
    args = parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=TORCH_DEPRECATION, category=UserWarning)
    x = np.random.default_rng(0).normal(0, 1e-3, args.numel).astype(np.float32)
    with tempfile.TemporaryDirectory() as scratch:
        native = build_native(Path(scratch))
        rows = reference_rows(x, args.repeats) + gradq_rows(x, args.repeats) + cold_rows(x, args.repeats)
        if isinstance(native, NativeRoundTrip):
            rows += native_rows(x, args.repeats, native)
    seed_numel = find_row(rows, SEED_KERNEL, 8, PER_CHANNEL).numel
    print(
        f"# qcore kernels: {args.numel:,} float32 elements, channel {CHANNEL_SIZE}, 1 thread, "
        f"median of {args.repeats} after a warm-up\n"
    )
    print(format_table(rows, copy_gbps=rows[0].gbps))
    print(
        f"\nGB/s = fp32 bytes in (4 x elements) / median seconds per call, for every row (decode rows too).\n"
        f"[a] seed 000's hook as written (pad, per-channel observer, quantize and dequantize backends, each a "
        f"Python loop over channels; collectives left out), timed on the first {seed_numel:,} elements only "
        f"because it is slow; its GB/s is for that slice.\n"
        f"[b] torch {torch.__version__} warns that its quantized tensors are deprecated; the warning is silenced.\n"
        "Decode rows read 1 byte (8-bit) per element where the copy reads 4, so they can beat 1.0 x copy.\n"
    )
    if isinstance(native, NativeRoundTrip):
        speed = ratio(rows, PAIRED_KERNEL, NATIVE_KERNEL)
        print(
            "[c] bench/native/round_trip.c: gradq's arithmetic as plain C loops, compiled for this machine; its bytes"
            f" equal gradq's (checked). Timed alternately, gradq's round trip runs at {speed:.2f} x its speed.\n"
        )
    else:
        print(f"[c] the C reference row was skipped: {native}.\n")
    print(format_split(rows) + "\n")
    targets = targets_for(rows)
    print(format_targets(targets))
    print()
    title = "## the round trip's floor scaled by the reference rows of the machine it was set on"
    if args.numel == DESIGN_NUMEL:
        print(format_targets(scaled_targets_for(rows), title))
    else:
        print(
            f"{title}\n\nNot scaled: the reference rows are for {DESIGN_NUMEL:,} elements, not --numel={args.numel:,}."
        )
    return 1 if args.check and not all(target.passed for target in targets) else 0


if __name__ == "__main__":
    sys.exit(main())
