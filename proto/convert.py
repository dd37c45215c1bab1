"""QuantizedTensor (protobuf) <-> QuantizedArray (qcore), validating untrusted input.

Both the aggregator and the worker client go through here, so a malformed
tensor is rejected with the same message whichever side receives it.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
from google.protobuf.message import Message

from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.proto.wire import join_bulk, split_bulk
from gradq.qcore import QuantizedArray, Scheme

__all__ = [
    "ALLOWED_DTYPES",
    "DTYPE_BYTES",
    "parse_with_tensor",
    "serialize_with_tensor",
    "tensor_from_proto",
    "tensor_header",
    "tensor_to_proto",
]

M = TypeVar("M", bound=Message)

_PAYLOAD_FIELD = pb.QuantizedTensor.DESCRIPTOR.fields_by_name["payload"].number

# Element types a sender may declare (the receiver casts the mean back to it),
# with their size: what a bucket would weigh uncompressed, for the statistics.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
ALLOWED_DTYPES = frozenset(DTYPE_BYTES)

_FLOAT_BITS = {Scheme.FLOAT32: 32, Scheme.FLOAT16: 16}


def tensor_header(q: QuantizedArray) -> pb.QuantizedTensor:
    """A QuantizedArray's wire message without its payload (grid, qparams, dtype)."""
    return pb.QuantizedTensor(
        scheme=pb.Scheme.Value(f"SCHEME_{q.scheme.name}"),
        bits=q.bits,
        numel=q.numel,
        channel_size=q.channel_size,
        scale=q.scale.astype("<f4", copy=False).tobytes(),
        zero_point=q.zero_point.astype("<i4", copy=False).tobytes(),
        dtype=q.dtype,
    )


def tensor_to_proto(q: QuantizedArray) -> pb.QuantizedTensor:
    """Wrap a QuantizedArray in its wire message (one copy of each array)."""
    message = tensor_header(q)
    message.payload = q.payload.tobytes()
    return message


def serialize_with_tensor(outer: Message, field: str, q: QuantizedArray) -> bytes:
    """Serialize ``outer`` with ``q`` in its QuantizedTensor field ``field``, copying the payload once.

    The bytes are a valid encoding of the message: protobuf in any language reads them.

    Raises:
        ValueError: ``outer`` already has ``field`` set (the two would be merged).
    """
    if outer.HasField(field):
        raise ValueError(f"{field} is already set on the {outer.DESCRIPTOR.name}; pass the message without it")
    number = outer.DESCRIPTOR.fields_by_name[field].number
    header = tensor_header(q).SerializeToString()
    payload = np.ascontiguousarray(q.payload).reshape(-1).data
    return join_bulk(outer.SerializeToString(), number, header, _PAYLOAD_FIELD, payload)


def parse_with_tensor(data: bytes, message_type: type[M], field: str) -> tuple[M, memoryview | bytes]:
    """Parse ``data`` as ``message_type``, returning its tensor field's payload apart, uncopied.

    Returns:
        (the message, with ``field``'s payload empty when it was sliced out;
        the payload: a view into ``data``, or the parsed field's bytes when
        the message was parsed whole).

    Raises:
        google.protobuf.message.DecodeError: ``data`` is not a ``message_type``.
    """
    split = split_bulk(data, message_type.DESCRIPTOR.fields_by_name[field].number, _PAYLOAD_FIELD)
    if split is None:  # an encoding the fast path does not take: protobuf parses it all
        message = message_type.FromString(data)
        return message, getattr(message, field).payload
    stripped, payload = split
    return message_type.FromString(stripped), payload


def _expected_channels(scheme: Scheme, numel: int, channel_size: int) -> int:
    if not scheme.is_quantized:
        return 0
    if not scheme.is_per_channel:
        return 1
    return -(-numel // channel_size)


def tensor_from_proto(
    message: pb.QuantizedTensor, field: str = "tensor", payload: memoryview | bytes | None = None
) -> QuantizedArray:
    """Check a wire tensor field by field and view it as a QuantizedArray (no payload copy).

    Args:
        message: the received QuantizedTensor.
        field: the message's name in its parent, used in error messages.
        payload: the payload when it was parsed apart (``parse_with_tensor``);
            None reads ``message.payload``.

    Returns:
        The QuantizedArray; its arrays are read-only views of the message bytes.

    Raises:
        ValueError: naming the offending field, its value and what was expected.
    """
    try:
        scheme = Scheme(message.scheme)
    except ValueError:
        names = ", ".join(f"{s.value} ({s.name})" for s in Scheme)
        raise ValueError(f"{field}.scheme={message.scheme} is not a known scheme; expected one of {names}") from None
    bits, numel, channel_size = message.bits, message.numel, message.channel_size
    if scheme.is_quantized:
        lowest = 2 if scheme.is_symmetric else 1
        if not lowest <= bits <= 8:
            raise ValueError(f"{field}.bits={bits} is invalid for {scheme.name}; expected {lowest}..8")
    elif bits != _FLOAT_BITS[scheme]:
        raise ValueError(f"{field}.bits={bits} is invalid for {scheme.name}; expected {_FLOAT_BITS[scheme]}")
    if scheme.is_per_channel:
        if channel_size < 1:
            raise ValueError(f"{field}.channel_size={channel_size} is invalid; expected >= 1 for {scheme.name}")
    elif channel_size != max(numel, 1) and channel_size != numel:
        raise ValueError(f"{field}.channel_size={channel_size} is invalid; expected numel={numel} for {scheme.name}")
    # Each access to a bytes field copies it out of the message: read each once.
    scale_bytes, zero_point_bytes = message.scale, message.zero_point
    if payload is None:
        payload = message.payload
    payload_bytes = (numel * bits + 7) // 8
    if len(payload) != payload_bytes:
        raise ValueError(
            f"{field}.payload has {len(payload)} bytes; expected ceil(numel * bits / 8) = "
            f"{payload_bytes} for numel={numel}, bits={bits}"
        )
    channels = _expected_channels(scheme, numel, channel_size)
    for name, raw in (("scale", scale_bytes), ("zero_point", zero_point_bytes)):
        if len(raw) != 4 * channels:
            raise ValueError(
                f"{field}.{name} has {len(raw)} bytes; expected {4 * channels} (4 per channel, {channels} channels)"
            )
    scale = np.frombuffer(scale_bytes, "<f4")
    zero_point = np.frombuffer(zero_point_bytes, "<i4")
    bad_scale = ~(np.isfinite(scale) & (scale > 0))
    if bad_scale.any():
        index = int(np.flatnonzero(bad_scale)[0])
        raise ValueError(f"{field}.scale[{index}]={float(scale[index])} is invalid; expected a finite number > 0")
    if scheme.is_quantized:
        qmax = (1 << bits) - 1
        off_grid = (zero_point < 0) | (zero_point > qmax)
        if scheme.is_symmetric:
            off_grid = zero_point != (qmax + 1) // 2
        if off_grid.any():
            index = int(np.flatnonzero(off_grid)[0])
            expected = f"{(qmax + 1) // 2} (symmetric mid-point)" if scheme.is_symmetric else f"0..{qmax}"
            value = int(zero_point[index])
            raise ValueError(f"{field}.zero_point[{index}]={value} is off the grid; expected {expected}")
    if not scheme.is_quantized:
        values = np.frombuffer(payload, np.float16 if scheme is Scheme.FLOAT16 else np.float32)
        if not np.isfinite(values).all():
            index = int(np.flatnonzero(~np.isfinite(values))[0])
            raise ValueError(f"{field}.payload[{index}]={float(values[index])} is not finite; expected finite values")
    if message.dtype not in ALLOWED_DTYPES:
        raise ValueError(f"{field}.dtype={message.dtype!r} is not supported; expected one of {sorted(ALLOWED_DTYPES)}")
    return QuantizedArray(
        scheme=scheme,
        bits=bits,
        numel=numel,
        channel_size=channel_size,
        scale=scale,
        zero_point=zero_point,
        payload=np.frombuffer(payload, np.uint8),
        dtype=message.dtype,
    )
