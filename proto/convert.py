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
from gradq.qcore import QuantizedArray, Scheme, codec_for
from gradq.qcore.codecs import registered_schemes

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
        topk=q.topk,
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


def tensor_from_proto(
    message: pb.QuantizedTensor, field: str = "tensor", payload: memoryview | bytes | None = None
) -> QuantizedArray:
    """Check a wire tensor field by field and view it as a QuantizedArray (no payload copy).

    The scheme's codec checks everything it defines (bits, channel size, sizes,
    qparams, payload values); this module checks the scheme and the dtype tag.

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
        codec = codec_for(Scheme(message.scheme))
    except ValueError:
        names = ", ".join(f"{s.value} ({s.name})" for s in sorted(registered_schemes()))
        raise ValueError(f"{field}.scheme={message.scheme} is not a known scheme; expected one of {names}") from None
    # Each access to a bytes field copies it out of the message: read each once.
    tensor = codec.from_wire(
        field,
        message.bits,
        message.numel,
        message.channel_size,
        message.scale,
        message.zero_point,
        message.payload if payload is None else payload,
        message.dtype,
        message.topk,
    )
    if message.dtype not in ALLOWED_DTYPES:
        raise ValueError(f"{field}.dtype={message.dtype!r} is not supported; expected one of {sorted(ALLOWED_DTYPES)}")
    return tensor
