"""What a codec is: the one place a wire scheme's encoding, decoding, sizes and checks live."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any, NamedTuple, Protocol

import numpy as np

from gradq.qcore.packing import packed_size
from gradq.qcore.quantized import METADATA_BYTES, QuantizedArray
from gradq.qcore.scheme import DEFAULT_CHANNEL_SIZE, LOW_BIT_CHANNEL_SIZE, LOW_BITS, QuantConfig, Rounding, Scheme

__all__ = ["Codec", "DeviceEncoding", "TorchTwin", "noise_key"]


def noise_key(config: QuantConfig, rng: np.random.Generator | None) -> int:
    """The key of the stochastic-rounding noise for one encode; -1 for nearest rounding.

    Both array libraries draw it here, from the same generator, so a torch encode
    and a numpy encode of the same values with the same generator agree byte for byte.
    """
    if config.rounding is not Rounding.STOCHASTIC:
        return -1
    generator = rng if rng is not None else np.random.default_rng(config.seed)
    return int(generator.integers(0, 2**62))


class DeviceEncoding(NamedTuple):
    """A codec's output while it is still on a torch device (tensors typed ``Any``: qcore imports no torch)."""

    bits: int
    channel_size: int
    scale: Any  # float32, one per channel
    zero_point: Any  # int32, one per channel (empty for a scheme without zero points)
    payload: Any  # uint8, ceil(numel * bits / 8) (the sparse scheme's: its own layout)
    topk: int = 0  # the sparse scheme's entries per chunk


class TorchTwin(Protocol):
    """A codec's arithmetic in torch ops, byte-identical to the numpy codec, on any device."""

    def encode(self, flat: Any, config: QuantConfig, rng: np.random.Generator | None) -> DeviceEncoding:
        """Encode a flat float32 tensor on its device.

        Raises:
            ValueError: for a value the numpy codec refuses, with its message.
        """

    def decode(self, encoding: DeviceEncoding, numel: int, out: Any) -> None:
        """Write the decoded values into ``out``, a flat float32 tensor of ``numel`` elements."""


class Codec(ABC):
    """One wire scheme: encode, decode (or accumulate), wire size, untrusted-header checks, the mean's grid.

    Args:
        scheme: the wire enum value this codec answers for.
        twin_module: module holding the torch twin (its ``twin(codec)``), imported on first use.
    """

    quantized: bool  # levels on an integer grid (False: a float pass-through)
    zero_points = True  # each channel sends an int32 zero point beside its scale (a sign has none)
    sparse = False  # sends some entries of each chunk (QuantConfig.topk), not every element

    def __init__(self, scheme: Scheme, twin_module: str) -> None:
        self.scheme = scheme
        self._twin_module = twin_module
        self._twin: TorchTwin | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.scheme.name})"

    @property
    def name(self) -> str:
        """The scheme's lower-case name, as flags and messages spell it."""
        return self.scheme.name.lower()

    # -- sizes ---------------------------------------------------------------------------------

    def default_channel_size(self, config: QuantConfig) -> int:
        """The channel size of a config that names none: smaller at low bits (see ``LOW_BIT_CHANNEL_SIZE``)."""
        return LOW_BIT_CHANNEL_SIZE if self.wire_bits(config) <= LOW_BITS else DEFAULT_CHANNEL_SIZE

    def default_topk(self, config: QuantConfig) -> int:
        """The ``topk`` of a config that names none: 0, unless the scheme is sparse."""
        return 0

    @abstractmethod
    def wire_bits(self, config: QuantConfig) -> int:
        """Bits per element in the payload for ``config``."""

    @abstractmethod
    def wire_channel_size(self, numel: int, channel_size: int) -> int:
        """The ``channel_size`` an encoding of ``numel`` elements carries on the wire."""

    @abstractmethod
    def num_channels(self, numel: int, channel_size: int) -> int:
        """Channels (scales, and zero points where the scheme has them) an encoding of ``numel`` elements carries."""

    def wire_size(self, numel: int, config: QuantConfig) -> int:
        """Bytes an encoding of ``numel`` elements occupies on the wire, metadata included.

        Args:
            numel: element count, >= 0.
            config: the grid.

        Returns:
            Payload, plus 4 bytes of scale (and 4 of zero point, where the
            scheme has them) per channel, plus ``METADATA_BYTES``.
        """
        if numel < 0:
            raise ValueError(f"numel={numel} is negative; expected >= 0")
        channels = self.num_channels(numel, self.wire_channel_size(numel, config.channel_size))
        return METADATA_BYTES + packed_size(numel, self.wire_bits(config)) + self._qparam_bytes(channels)

    def _qparam_bytes(self, channels: int) -> int:
        return (8 if self.zero_points else 4) * channels

    # -- numpy arithmetic ------------------------------------------------------------------------

    @abstractmethod
    def check_config(self, config: QuantConfig) -> None:
        """Refuse a config this scheme cannot carry (QuantConfig calls it).

        Raises:
            ValueError: naming the field, its value and what was expected.
        """

    @abstractmethod
    def encode(
        self,
        flat: np.ndarray,
        config: QuantConfig,
        rng: np.random.Generator | None,
        qparams: tuple[np.ndarray, np.ndarray] | None,
        dtype: str,
    ) -> QuantizedArray:
        """Encode a contiguous flat float32 array (see ``gradq.qcore.encode``)."""

    def encode_compensated(
        self,
        flat: np.ndarray,
        residual: np.ndarray,
        config: QuantConfig,
        rng: np.random.Generator | None,
        dtype: str,
    ) -> QuantizedArray:
        """Error feedback's step: encode ``flat + residual`` and leave what it lost in ``residual``.

        Codecs with a fused kernel override this; the result is the same bytes
        and the same residual as this composition of encode and decode.

        Args:
            flat: contiguous flat float32 values to send.
            residual: contiguous float32 array of ``flat.size``: the error carried
                in, overwritten with the error carried out.
            config, rng, dtype: as for ``encode``.

        Raises:
            ValueError: the compensated values hold NaN/Inf or ``|x| >= 2**126``;
                ``residual`` is then partly overwritten (the caller drops it).
        """
        compensated = flat + residual
        encoded = self.encode(compensated, config, rng, None, dtype)
        self.dequantize(encoded, residual, accumulate=False, divisor=1)
        np.subtract(compensated, residual, out=residual)
        return encoded

    @abstractmethod
    def dequantize(self, q: QuantizedArray, out: np.ndarray, accumulate: bool, divisor: int) -> None:
        """``out (+)= decode(q)``, then ``/ divisor`` when accumulating; ``out`` is checked by the caller."""

    def squared_error(self, q: QuantizedArray, reference: np.ndarray) -> tuple[float, float]:
        """(||decode(q) - reference||^2, ||reference||^2); ``reference`` is checked by the caller.

        This one decodes into an array of its own; a codec may compute both in one pass instead.
        """
        difference = np.empty(q.numel, np.float32)
        self.dequantize(q, difference, accumulate=False, divisor=1)
        difference -= reference
        return float(np.dot(difference, difference)), float(np.dot(reference, reference))

    @abstractmethod
    def mean_config(self, bits: int, channel_size: int, topk: int = 0) -> QuantConfig:
        """The grid the aggregator returns the mean on when the pushers used this scheme (and this ``topk``)."""

    def grid_channel_size(self, channel_size: int) -> int:
        """The channel size that is part of a push's grid: 0 for schemes without channels of their own.

        Every push of one job must agree on (scheme, bits, this); a per-tensor
        push's ``channel_size`` is just its element count, so it is left out.
        """
        return 0

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
        """Check a received encoding field by field and view it as a QuantizedArray (no payload copy).

        Args:
            field: the tensor's name in its message, for error messages.
            bits, numel, channel_size: the header as received.
            scale, zero_point: little-endian float32 / int32 bytes.
            payload: the packed levels.
            dtype: the sender's element type (checked by the caller).
            topk: the sparse scheme's entries per chunk; must be 0 here.

        Returns:
            The QuantizedArray; its arrays are read-only views of the given bytes.

        Raises:
            ValueError: naming the offending field, its value and what was expected.
        """
        self._check_header(field, bits, numel, channel_size)
        if topk:
            raise ValueError(f"{field}.topk={topk} is invalid for {self.scheme.name}; expected 0 (only sparse schemes)")
        expected_payload = packed_size(numel, bits)
        if len(payload) != expected_payload:
            raise ValueError(
                f"{field}.payload has {len(payload)} bytes; expected ceil(numel * bits / 8) = "
                f"{expected_payload} for numel={numel}, bits={bits}"
            )
        channels = self.num_channels(numel, channel_size)
        if len(scale) != 4 * channels:
            raise ValueError(
                f"{field}.scale has {len(scale)} bytes; expected {4 * channels} (4 per channel, {channels} channels)"
            )
        expected_zero_points = 4 * channels if self.zero_points else 0
        if len(zero_point) != expected_zero_points:
            per = "4 per channel" if self.zero_points else f"{self.scheme.name} sends no zero points"
            raise ValueError(
                f"{field}.zero_point has {len(zero_point)} bytes; expected {expected_zero_points} "
                f"({per}, {channels} channels)"
            )
        scales = np.frombuffer(scale, "<f4")
        # Two reductions and no temporaries on the aggregator's path (a NaN fails both comparisons);
        # the elementwise test only runs to name the first bad scale.
        if scales.size and not (scales.min() > 0 and scales.max() < np.inf):
            index = int(np.flatnonzero(~(np.isfinite(scales) & (scales > 0)))[0])
            raise ValueError(f"{field}.scale[{index}]={float(scales[index])} is invalid; expected a finite number > 0")
        zero_points = np.frombuffer(zero_point, "<i4")
        levels = np.frombuffer(payload, np.uint8)
        self._check_values(field, bits, zero_points, levels)
        return QuantizedArray(self.scheme, bits, numel, channel_size, scales, zero_points, levels, dtype)

    @abstractmethod
    def _check_header(self, field: str, bits: int, numel: int, channel_size: int) -> None:
        """Refuse bits or a channel size this scheme does not produce."""

    @abstractmethod
    def _check_values(self, field: str, bits: int, zero_point: np.ndarray, payload: np.ndarray) -> None:
        """Refuse qparams off the grid, or payload values the receiver must not decode."""

    def _check_whole_tensor(self, field: str, numel: int, channel_size: int) -> None:
        # Per-tensor grids write max(numel, 1), float pass-throughs numel: both mean one whole tensor.
        if channel_size != max(numel, 1) and channel_size != numel:
            raise ValueError(
                f"{field}.channel_size={channel_size} is invalid; expected numel={numel} for {self.scheme.name}"
            )

    # -- torch ---------------------------------------------------------------------------------------

    def torch(self) -> TorchTwin:
        """The torch twin (imports torch on the first call)."""
        if self._twin is None:
            self._twin = importlib.import_module(self._twin_module).twin(self)
        return self._twin
