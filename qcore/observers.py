"""Observers: gather min/max statistics, then turn them into (scale, zero_point).

The contract is torch's (seed 004): ``observe(x)`` any number of times, then
``calculate_qparams()``. Every observer shares one formula (``calculate_qparams``
below); they differ only in how they gather the range.
"""

from __future__ import annotations

import numpy as np

from gradq.qcore.codecs import codec_for
from gradq.qcore.codecs.uniform import UniformCodec
from gradq.qcore.packing import channel_count
from gradq.qcore.quantized import LARGEST_QUANTIZABLE, refuse_out_of_range
from gradq.qcore.scheme import DEFAULT_CHANNEL_SIZE, QuantConfig, Scheme

__all__ = [
    "calculate_qparams",
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "PerChannelMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver",
    "PercentileObserver",
    "observer_for",
]


def calculate_qparams(
    min_vals: np.ndarray, max_vals: np.ndarray, bits: int = 8, symmetric: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Turn per-channel ranges into qparams on the ``bits``-bit grid.

    Args:
        min_vals: float array of channel minima.
        max_vals: float array of channel maxima, same length.
        bits: 1..8 (symmetric needs >= 2).
        symmetric: centre the grid on zero.

    Returns:
        (scale float32, zero_point int32), one pair per channel. The range is
        widened to include 0, so 0.0 is exactly representable.
    """
    _check_grid(bits, symmetric)
    lows = np.asarray(min_vals, np.float32).reshape(-1)
    highs = np.asarray(max_vals, np.float32).reshape(-1)
    if lows.shape != highs.shape:
        raise ValueError(f"min_vals has {lows.size} entries, max_vals {highs.size}; expected the same count")
    for name, values in (("min_vals", lows), ("max_vals", highs)):
        # Past 2**126 the grid's step overflows float32 (as encode refuses such values).
        out_of_range = ~(np.abs(values) < LARGEST_QUANTIZABLE)
        if out_of_range.any():
            index = int(np.flatnonzero(out_of_range)[0])
            raise ValueError(
                f"{name}[{index}]={float(values[index])} is out of range; expected finite values with |v| < 2**126"
            )
    if (lows > highs).any():
        bad = int(np.flatnonzero(lows > highs)[0])
        raise ValueError(f"min_vals[{bad}]={lows[bad]} > max_vals[{bad}]={highs[bad]}; expected min <= max")
    from gradq.qcore import _kernels  # numba loads on first use

    scales = np.empty(lows.size, np.float32)
    zero_points = np.empty(lows.size, np.int32)
    _kernels.qparams_from_ranges(lows, highs, (1 << bits) - 1, symmetric, scales, zero_points)
    return scales, zero_points


def _check_grid(bits: int, symmetric: bool) -> None:
    # QuantConfig owns the rules (and the messages) for valid grids.
    QuantConfig(bits=bits, scheme=Scheme.PER_TENSOR_SYMMETRIC if symmetric else Scheme.PER_TENSOR_AFFINE)


def _nonempty_flat(x: np.ndarray) -> np.ndarray:
    flat = np.ascontiguousarray(np.asarray(x).reshape(-1), dtype=np.float32)
    if flat.size == 0:
        raise ValueError("observe() got an empty array; expected at least one element")
    return flat


def _refuse_out_of_range(values: np.ndarray, offset: int = 0) -> None:
    # The range encode accepts: NaN, Inf and |x| >= 2**126 would make qparams that overflow.
    refuse_out_of_range(values, LARGEST_QUANTIZABLE, "finite values with |x| < 2**126", offset, "observed")


class _RangeObserver:
    """Holds the running range; subclasses decide how a new batch updates it."""

    def __init__(self, bits: int = 8, symmetric: bool = False) -> None:
        _check_grid(bits, symmetric)
        self.bits = bits
        self.symmetric = symmetric
        self.min_val: np.ndarray | None = None
        self.max_val: np.ndarray | None = None

    def _batch_range(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        _refuse_out_of_range(flat)
        return np.array([flat.min()], np.float32), np.array([flat.max()], np.float32)

    def _merge(self, low: np.ndarray, high: np.ndarray) -> None:
        self.min_val, self.max_val = low, high

    def observe(self, x: np.ndarray) -> None:
        """Fold the range of ``x`` (flattened) into the running statistics.

        Raises:
            ValueError: if ``x`` is empty or holds NaN, Inf or ``|x| >= 2**126``
                (naming the first such index).
        """
        self._merge(*self._batch_range(_nonempty_flat(x)))

    def calculate_qparams(self) -> tuple[np.ndarray, np.ndarray]:
        """(scale float32, zero_point int32), one per channel.

        Raises:
            RuntimeError: if nothing has been observed yet.
        """
        if self.min_val is None or self.max_val is None:
            raise RuntimeError(f"{type(self).__name__}.calculate_qparams() called before observe(); observe data first")
        return calculate_qparams(self.min_val, self.max_val, self.bits, self.symmetric)


class MinMaxObserver(_RangeObserver):
    """Running min and max over everything observed, one range for the whole tensor."""

    def _merge(self, low: np.ndarray, high: np.ndarray) -> None:
        if self.min_val is None or self.max_val is None:
            self.min_val, self.max_val = low, high
        else:
            self.min_val = np.minimum(self.min_val, low)
            self.max_val = np.maximum(self.max_val, high)


class _MovingAverageMixin(_RangeObserver):
    averaging_constant: float

    def _merge(self, low: np.ndarray, high: np.ndarray) -> None:
        if self.min_val is None or self.max_val is None:
            self.min_val, self.max_val = low, high
            return
        if low.size != self.min_val.size:
            raise ValueError(
                f"observed {low.size} channels after {self.min_val.size}; "
                "expected the same channel count on every observe()"
            )
        c = np.float32(self.averaging_constant)
        self.min_val = self.min_val + c * (low - self.min_val)
        self.max_val = self.max_val + c * (high - self.max_val)


def _check_averaging_constant(value: float) -> float:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"averaging_constant={value!r} is out of range; expected 0 < c <= 1")
    return float(value)


class MovingAverageMinMaxObserver(_MovingAverageMixin):
    """Exponential moving average of each batch's min and max (one range)."""

    def __init__(self, averaging_constant: float = 0.01, bits: int = 8, symmetric: bool = False) -> None:
        super().__init__(bits, symmetric)
        self.averaging_constant = _check_averaging_constant(averaging_constant)


class _PerChannelRange(_RangeObserver):
    def __init__(self, channel_size: int = DEFAULT_CHANNEL_SIZE, bits: int = 8, symmetric: bool = False) -> None:
        super().__init__(bits, symmetric)
        QuantConfig(channel_size=channel_size)
        self.channel_size = channel_size

    def _batch_range(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        from gradq.qcore import _kernels  # numba loads on first use

        num_channels = channel_count(flat.size, self.channel_size)
        lows = np.empty(num_channels, np.float32)
        highs = np.empty(num_channels, np.float32)
        # The kernel stops at the first channel out of range, leaving the rest unset.
        bad = _kernels.ranges_per_channel(flat, self.channel_size, lows, highs)
        if bad >= 0:
            start = bad * self.channel_size
            _refuse_out_of_range(flat[start : start + self.channel_size], start)
        return lows, highs


class PerChannelMinMaxObserver(_PerChannelRange, MinMaxObserver):
    """Running min and max per channel of ``channel_size`` consecutive elements."""

    def _merge(self, low: np.ndarray, high: np.ndarray) -> None:
        if self.min_val is not None and low.size != self.min_val.size:
            raise ValueError(
                f"observed {low.size} channels after {self.min_val.size}; "
                "expected the same channel count on every observe()"
            )
        MinMaxObserver._merge(self, low, high)


class MovingAveragePerChannelMinMaxObserver(_PerChannelRange, _MovingAverageMixin):
    """Exponential moving average of each channel's min and max."""

    def __init__(
        self,
        averaging_constant: float = 0.01,
        channel_size: int = DEFAULT_CHANNEL_SIZE,
        bits: int = 8,
        symmetric: bool = False,
    ) -> None:
        super().__init__(channel_size, bits, symmetric)
        self.averaging_constant = _check_averaging_constant(averaging_constant)


class PercentileObserver(MinMaxObserver):
    """Clips outliers: the range runs from the (100-p)th to the p-th percentile.

    Values outside the range saturate at the grid's ends; the step gets finer
    for everything else, which pays off for heavy-tailed gradients.
    """

    def __init__(self, percentile: float = 99.99, bits: int = 8, symmetric: bool = False) -> None:
        super().__init__(bits, symmetric)
        if not 50.0 < percentile <= 100.0:
            raise ValueError(f"percentile={percentile!r} is out of range; expected 50 < p <= 100")
        self.percentile = float(percentile)

    def _batch_range(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        _refuse_out_of_range(flat)
        low, high = np.percentile(flat, [100.0 - self.percentile, self.percentile])
        return np.array([low], np.float32), np.array([high], np.float32)


def observer_for(config: QuantConfig) -> MinMaxObserver:
    """A MinMax observer (per tensor or per channel) matching ``config``'s grid.

    Raises:
        ValueError: ``config``'s scheme is not an integer grid (nothing to observe for).
    """
    codec = codec_for(config.scheme)
    if not isinstance(codec, UniformCodec):
        raise ValueError(f"scheme={codec.name} has no grid to observe; expected an integer-grid scheme")
    if codec.per_channel:
        return PerChannelMinMaxObserver(config.channel_size, config.bits, codec.symmetric)
    return MinMaxObserver(config.bits, codec.symmetric)
