"""The quantization scheme: which grid a bucket is put on, and how it is rounded."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Scheme", "Rounding", "QuantConfig", "DEFAULT_CHANNEL_SIZE", "LOW_BIT_CHANNEL_SIZE"]

# Seed 000 quantizes per channel in runs of 512 consecutive elements.
DEFAULT_CHANNEL_SIZE = 512
# At 1 and 2 bits a channel's few levels span its largest value, so a smaller
# channel keeps small gradients off the zero level: on the transformer of
# bench/convergence.py (AdamW), 2-bit + EF went from +1.38% to +0.48% of fp32's
# held-out loss, for 0.375 more bits per element of qparams.
LOW_BIT_CHANNEL_SIZE = 128
LOW_BITS = 2  # wire bits at or under which LOW_BIT_CHANNEL_SIZE is the default


class Scheme(enum.IntEnum):
    """How an array travels. Values mirror ``gradq.v1.Scheme`` (parity-tested)."""

    FLOAT32 = 1
    FLOAT16 = 2
    PER_TENSOR_AFFINE = 3
    PER_TENSOR_SYMMETRIC = 4
    PER_CHANNEL_AFFINE = 5
    PER_CHANNEL_SYMMETRIC = 6
    PER_CHANNEL_SIGN = 7
    SPARSE_TOPK = 8

    @property
    def is_quantized(self) -> bool:
        """True for the integer-grid schemes, False for the float pass-through ones (the codec says)."""
        from gradq.qcore.codecs import codec_for  # the registry imports this module

        return codec_for(self).quantized

    @classmethod
    def parse(cls, value: Scheme | str | int) -> Scheme:
        """Turn a name such as ``"per_channel_affine"`` (or a value) into a Scheme.

        Raises:
            ValueError: naming the value and the accepted names.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls[value.strip().upper().replace("-", "_")]
            except KeyError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool) and value in cls._value2member_map_:
            return cls(value)
        names = ", ".join(s.name.lower() for s in cls)
        raise ValueError(f"scheme={value!r} is not a scheme; expected one of: {names}")


class Rounding(enum.IntEnum):
    """How a value between two grid levels picks one."""

    NEAREST = 1  # deterministic, error <= half a step
    STOCHASTIC = 2  # unbiased (QSGD-style), error < one step

    @classmethod
    def parse(cls, value: Rounding | str | int) -> Rounding:
        """Turn ``"nearest"`` / ``"stochastic"`` (or a value) into a Rounding.

        Raises:
            ValueError: naming the value and the accepted names.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.strip().upper() in cls.__members__:
            return cls[value.strip().upper()]
        if isinstance(value, int) and not isinstance(value, bool) and value in cls._value2member_map_:
            return cls(value)
        raise ValueError(f"rounding={value!r} is not a rounding mode; expected 'nearest' or 'stochastic'")


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """What a sender puts on the wire.

    Args:
        scheme: grid granularity and symmetry (or a float pass-through);
            a ``Scheme`` or its lower-case name.
        bits: levels per element are ``2**bits``; 1..8 (symmetric needs >= 2).
            Ignored by the float schemes.
        channel_size: elements per channel for the per-channel schemes: a
            channel is a run of consecutive elements of the flat array. 0
            (the default) picks ``DEFAULT_CHANNEL_SIZE`` (512), or
            ``LOW_BIT_CHANNEL_SIZE`` (128) at 1 and 2 bits; ``sparse_topk``'s
            chunk of 4096.
        rounding: ``"nearest"`` or ``"stochastic"``.
        seed: seeds the stochastic-rounding generator; None draws fresh entropy.
        topk: for ``sparse_topk``, the most entries each chunk (``channel_size``
            elements) keeps; 0 (the default) picks 64, or the chunk when shorter.
            Must be 0 for every other scheme.
    """

    scheme: Scheme = Scheme.PER_CHANNEL_AFFINE
    bits: int = 8
    channel_size: int = 0
    rounding: Rounding = Rounding.NEAREST
    seed: int | None = None
    topk: int = 0

    def __post_init__(self) -> None:
        # Accept names so configs can come straight from flags and env vars.
        object.__setattr__(self, "scheme", Scheme.parse(self.scheme))
        object.__setattr__(self, "rounding", Rounding.parse(self.rounding))
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 8:
            raise ValueError(f"bits={self.bits!r} is out of range; expected an integer in 1..8")
        if isinstance(self.channel_size, bool) or not isinstance(self.channel_size, int) or self.channel_size < 0:
            raise ValueError(f"channel_size={self.channel_size!r} is invalid; expected an integer >= 1 (0: default)")
        from gradq.qcore.codecs import codec_for  # the registry imports this module

        codec = codec_for(self.scheme)
        if self.channel_size == 0:
            object.__setattr__(self, "channel_size", codec.default_channel_size(self))
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed={self.seed!r} is invalid; expected None or an integer >= 0")
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 0:
            raise ValueError(f"topk={self.topk!r} is invalid; expected an integer >= 0 (0: the scheme's default)")
        if self.topk and not codec.sparse:
            raise ValueError(f"topk={self.topk} is only for scheme=sparse_topk; expected 0 for scheme={codec.name}")
        if self.topk == 0:
            object.__setattr__(self, "topk", codec.default_topk(self))
        codec.check_config(self)

    @property
    def qmax(self) -> int:
        """Largest level of the grid (the smallest is 0)."""
        return (1 << self.bits) - 1
