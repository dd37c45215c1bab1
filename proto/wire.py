"""Protobuf wire format around one bulk bytes field, without copying the bulk through protobuf.

A PushPull message is a few dozen bytes of fields plus megabytes of packed
levels in ``QuantizedTensor.payload``. Letting protobuf build or parse it
copies that payload four to six times (Python bytes -> message arena ->
serialized bytes, and back), which profiling of the aggregator showed as a
fifth of its CPU. Here the small fields go through protobuf as usual and the
payload is spliced in, or sliced out, by hand:

- ``join_bulk`` emits ``outer | nested-tag | len | nested | bulk-tag | len | bulk``:
  valid protobuf (fields may come in any order), one copy of the bulk.
- ``split_bulk`` finds the bulk field of a received message and returns the
  message without it (small, for protobuf to parse) plus a zero-copy view of
  the bulk. Anything it does not expect (a repeated nested field, groups,
  truncation) returns None, and the caller lets protobuf parse the whole
  message, so odd but valid encodings keep protobuf's semantics and invalid
  ones get protobuf's error.
"""

from __future__ import annotations

__all__ = ["join_bulk", "scalar_fields", "split_bulk"]

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5
# protobuf refuses tags and lengths longer than 5 bytes (and above these values);
# the fast path must refuse them too, or it would accept what protobuf rejects.
_MAX_TAG_OR_LENGTH_BYTES = 5
_MAX_TAG = (1 << 32) - 1
_MAX_LENGTH = (1 << 31) - 1


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _length_prefix(field: int, length: int) -> bytes:
    return _varint(field << 3 | _LENGTH_DELIMITED) + _varint(length)


def join_bulk(outer: bytes, nested_field: int, nested: bytes, bulk_field: int, bulk: memoryview) -> bytes:
    """Serialize a message whose field ``nested_field`` holds ``nested`` plus a bytes field ``bulk_field``.

    Args:
        outer: the outer message serialized without its nested field.
        nested_field: field number of the nested message in the outer one.
        nested: the nested message serialized without its bulk field.
        bulk_field: field number of the bytes field inside the nested message.
        bulk: the bytes field's contents (copied once, into the result).
    """
    bulk_prefix = _length_prefix(bulk_field, bulk.nbytes)
    nested_prefix = _length_prefix(nested_field, len(nested) + len(bulk_prefix) + bulk.nbytes)
    return b"".join((outer, nested_prefix, nested, bulk_prefix, bulk))


def _read_varint(data: memoryview, position: int, end: int, max_bytes: int = 10) -> tuple[int, int]:
    """(value, position after it); raises IndexError past ``end`` or after ``max_bytes`` bytes."""
    value = shift = 0
    while True:
        if position >= end or shift >= 7 * max_bytes:
            raise IndexError("truncated or over-long varint")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7


def _fields(data: memoryview, begin: int, end: int) -> list[tuple[int, int, int, int]]:
    """(key, start of the tag, start of the value, end of the value) for each field; key = number << 3 | type."""
    fields = []
    position = begin
    while position < end:
        start = position
        key, position = _read_varint(data, position, end, _MAX_TAG_OR_LENGTH_BYTES)
        if key > _MAX_TAG:
            raise IndexError(f"tag {key}")
        wire_type = key & 7
        if wire_type == _VARINT:
            _, position = _read_varint(data, position, end)
            value_start = start
        elif wire_type == _LENGTH_DELIMITED:
            length, position = _read_varint(data, position, end, _MAX_TAG_OR_LENGTH_BYTES)
            if length > _MAX_LENGTH:
                raise IndexError(f"length {length}")
            value_start = position
            position += length
        elif wire_type in (_FIXED64, _FIXED32):
            value_start = position
            position += 8 if wire_type == _FIXED64 else 4
        else:  # groups: not in gradq's messages; protobuf handles them
            raise IndexError(f"wire type {wire_type}")
        if position > end:
            raise IndexError("field runs past the end")
        fields.append((key, start, value_start, position))
    return fields


def scalar_fields(data: bytes, numbers: frozenset[int]) -> dict[int, int | bytes]:
    """The top-level fields ``numbers`` of a serialized message: varints as ints, length-delimited ones as bytes.

    Reads past every other field (a bulk one too) without copying it. A field
    that occurs more than once keeps its last value, as protobuf's scalar
    fields do; an absent one is absent from the result.

    Raises:
        IndexError: the bytes are malformed.
    """
    view = memoryview(data)
    found: dict[int, int | bytes] = {}
    for key, start, value_start, end in _fields(view, 0, len(data)):
        number, wire_type = key >> 3, key & 7
        if number not in numbers:
            continue
        if wire_type == _VARINT:
            found[number] = _varint_after_tag(view, start, end)
        elif wire_type == _LENGTH_DELIMITED:
            found[number] = bytes(view[value_start:end])
        else:
            raise IndexError(f"field {number} has wire type {wire_type}")
    return found


def _varint_after_tag(data: memoryview, start: int, end: int) -> int:
    """The value of the varint field whose tag begins at ``start``."""
    _, position = _read_varint(data, start, end, _MAX_TAG_OR_LENGTH_BYTES)
    return _read_varint(data, position, end)[0]


def split_bulk(data: bytes, nested_field: int, bulk_field: int) -> tuple[bytes, memoryview] | None:
    """Cut the bulk field out of a serialized message.

    Returns:
        (the message with an empty bulk field, a read-only view of the bulk in
        ``data``), or None when the message has no nested field, repeats it or
        its bulk field, or is malformed: parse it whole with protobuf then.
    """
    view = memoryview(data)
    nested_key, bulk_key = nested_field << 3 | _LENGTH_DELIMITED, bulk_field << 3 | _LENGTH_DELIMITED
    try:
        outer = _fields(view, 0, len(data))
        nested = [field for field in outer if field[0] >> 3 == nested_field]
        if len(nested) != 1 or nested[0][0] != nested_key:
            return None
        _, nested_start, nested_begin, nested_end = nested[0]
        bulks = [field for field in _fields(view, nested_begin, nested_end) if field[0] >> 3 == bulk_field]
        if len(bulks) != 1 or bulks[0][0] != bulk_key:
            return None
    except IndexError:
        return None
    _, bulk_start, bulk_begin, bulk_end = bulks[0]
    rest = view[nested_begin:bulk_start].nbytes + view[bulk_end:nested_end].nbytes
    stripped = b"".join(
        (
            view[:nested_start],
            _length_prefix(nested_field, rest),
            view[nested_begin:bulk_start],
            view[bulk_end:nested_end],
            view[nested_end:],
        )
    )
    return stripped, view[bulk_begin:bulk_end]
