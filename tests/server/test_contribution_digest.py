"""The resend digest: cheap on a large push, yet it tells a changed grid or sampled payload from a true resend."""

from __future__ import annotations

import dataclasses

import numpy as np

from gradq.qcore import QuantConfig, QuantizedArray, encode
from gradq.server.step_window import contribution_digest


def _push(numel: int) -> QuantizedArray:
    values = np.random.default_rng(numel).standard_normal(numel).astype(np.float32)
    return encode(values, QuantConfig(bits=4))


def _with_payload_byte_flipped(tensor: QuantizedArray, index: int) -> QuantizedArray:
    payload = tensor.payload.copy()
    payload[index] ^= 0xFF
    return dataclasses.replace(tensor, payload=payload)


def test_a_true_resend_matches_and_a_changed_grid_end_or_flag_does_not() -> None:
    large = _push(1 << 20)  # 512 KiB of payload: sampled in blocks
    digest = contribution_digest(large, False)
    assert contribution_digest(_push(1 << 20), False) == digest
    assert contribution_digest(large, True) != digest
    scale = large.scale.copy()
    scale[-1] *= 2
    assert contribution_digest(dataclasses.replace(large, scale=scale), False) != digest
    for index in (0, 4095, large.payload.nbytes - 1, large.payload.nbytes - 4096):
        assert contribution_digest(_with_payload_byte_flipped(large, index), False) != digest, index


def test_a_small_payload_is_hashed_whole() -> None:
    small = _push(100_000)  # 50 KB: under the 64 KiB sampled, so every byte counts
    digest = contribution_digest(small, False)
    for index in range(0, small.payload.nbytes, 997):
        assert contribution_digest(_with_payload_byte_flipped(small, index), False) != digest, index
