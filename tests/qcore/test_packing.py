"""pack_bits / unpack_bits: dense LSB-first layout, exact sizes, and rejected inputs."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from gradq.qcore import pack_bits, packed_size, unpack_bits


def pack_reference(levels: list[int], bits: int) -> bytes:
    """Level i at bits [i*bits, (i+1)*bits) of one little-endian integer, zero-padded to whole bytes."""
    stream = sum(level << (i * bits) for i, level in enumerate(levels))
    return stream.to_bytes(-(-len(levels) * bits // 8), "little")


@st.composite
def levels_and_bits(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    """A bit width 1..8 and levels that fit it, at any length (odd ones included)."""
    bits = draw(st.integers(1, 8))
    length = draw(st.integers(0, 200))
    levels = draw(arrays(np.uint8, length, elements=st.integers(0, (1 << bits) - 1)))
    return levels, bits


@settings(max_examples=200, deadline=None)
@given(case=levels_and_bits())
def test_round_trip_size_and_layout(case: tuple[np.ndarray, int]) -> None:
    levels, bits = case

    packed = pack_bits(levels, bits)

    assert packed.dtype == np.uint8
    assert packed.size == packed_size(levels.size, bits) == -(-levels.size * bits // 8)
    assert packed.tobytes() == pack_reference(levels.tolist(), bits)
    np.testing.assert_array_equal(unpack_bits(packed, bits, levels.size), levels)
    np.testing.assert_array_equal(unpack_bits(packed.tobytes(), bits, levels.size), levels)


@pytest.mark.parametrize(
    ("levels", "bits", "expected"),
    [
        # 1 | 2<<3 | 7<<6 = 0b1_1101_0001: 209 = 0b11010001, then the spilled top bit of 7.
        ([1, 2, 7], 3, [209, 1]),
        # A whole group of eight: 0o76543210 = 0xFAC688, little-endian.
        ([0, 1, 2, 3, 4, 5, 6, 7], 3, [0x88, 0xC6, 0xFA]),
        ([1, 0, 1, 1, 0, 0, 0, 0, 1], 1, [0b00001101, 0b1]),
        # 31 | 1<<5 = 63; 2<<10 puts 0b10 at bits 2-3 of the second byte.
        ([31, 1, 2], 5, [63, 8]),
        ([200, 3], 8, [200, 3]),
    ],
)
def test_hand_computed_layout(levels: list[int], bits: int, expected: list[int]) -> None:
    packed = pack_bits(np.array(levels), bits)

    assert packed.tolist() == expected
    assert unpack_bits(packed, bits, len(levels)).tolist() == levels


@pytest.mark.parametrize(("levels", "bits", "bad"), [([0, 8], 3, "levels[1]=8"), ([1, -1], 2, "levels[1]=-1")])
def test_pack_rejects_levels_that_do_not_fit(levels: list[int], bits: int, bad: str) -> None:
    with pytest.raises(ValueError, match=re.escape(bad)) as raised:
        pack_bits(np.array(levels), bits)

    assert f"{bits} bits" in str(raised.value)
    assert f"0..{(1 << bits) - 1}" in str(raised.value)


@pytest.mark.parametrize(("size", "bits", "numel", "expected"), [(3, 3, 9, 4), (5, 3, 9, 4), (0, 1, 1, 1)])
def test_unpack_rejects_a_buffer_of_the_wrong_length(size: int, bits: int, numel: int, expected: int) -> None:
    with pytest.raises(ValueError) as raised:
        unpack_bits(np.zeros(size, np.uint8), bits, numel)

    message = str(raised.value)
    assert f"buffer has {size} bytes" in message
    assert f"= {expected}" in message
    assert f"numel={numel}, bits={bits}" in message


@pytest.mark.parametrize("bits", [0, 9, True])
def test_bits_out_of_range_are_rejected(bits: int) -> None:
    with pytest.raises(ValueError, match=re.escape(f"bits={bits!r}")):
        pack_bits(np.zeros(4, np.uint8), bits)
    with pytest.raises(ValueError, match=re.escape(f"bits={bits!r}")):
        unpack_bits(np.zeros(4, np.uint8), bits, 4)
