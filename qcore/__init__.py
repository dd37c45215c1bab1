"""gradq's quantization core: grids, observers, fused codecs and bit packing (numpy only)."""

from gradq.qcore.codec import (
    METADATA_BYTES,
    QuantizedArray,
    decode,
    decode_accumulate,
    decode_times,
    encode,
    fake_quantize,
    relative_error,
    wire_size,
)
from gradq.qcore.codecs import Codec, codec_for
from gradq.qcore.error_feedback import ErrorFeedback
from gradq.qcore.observers import (
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PercentileObserver,
    PerChannelMinMaxObserver,
    calculate_qparams,
    observer_for,
)
from gradq.qcore.packing import channel_count, pack_bits, packed_size, unpack_bits
from gradq.qcore.scheme import DEFAULT_CHANNEL_SIZE, LOW_BIT_CHANNEL_SIZE, QuantConfig, Rounding, Scheme

__all__ = [
    "DEFAULT_CHANNEL_SIZE",
    "LOW_BIT_CHANNEL_SIZE",
    "Codec",
    "METADATA_BYTES",
    "ErrorFeedback",
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver",
    "PerChannelMinMaxObserver",
    "PercentileObserver",
    "QuantConfig",
    "QuantizedArray",
    "Rounding",
    "Scheme",
    "calculate_qparams",
    "channel_count",
    "codec_for",
    "decode",
    "decode_accumulate",
    "decode_times",
    "encode",
    "fake_quantize",
    "observer_for",
    "pack_bits",
    "packed_size",
    "relative_error",
    "unpack_bits",
    "wire_size",
]
