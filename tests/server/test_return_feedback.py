"""The mean a low-bit job gets back is unbiased over many steps: the aggregator carries its re-encoding error.

Issue 26: with 2-bit + EF pushes, the mean of the ranks' grids lands on half
steps of the return grid, and rounding it to nearest the same way every step,
with nothing carrying the error, moved every parameter the same way (see
bench/low_bit_bias.py). Server error feedback, on by default, removes it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from gradq.client import WorkerClient
from gradq.qcore import QuantConfig, Scheme
from gradq.server.app import AggregatorServer
from gradq.server.policy import PushedGrid, RoundPolicy, feeds_back

NUMEL = 128 * 32  # 32 channels of the 2-bit default
STEPS = 100
WORLD = 2


def _accumulated_error(server: AggregatorServer, job: str) -> tuple[float, float]:
    """(||sum(delivered - mean)|| / ||sum(mean)||, sum(delivered - mean) / sum|sum(mean)|) over STEPS rounds."""
    rng = np.random.default_rng(1)
    persistent = (rng.standard_normal(NUMEL) * 0.2).astype(np.float32)  # what every step's gradients share
    gradients = [
        [persistent + rng.standard_normal(NUMEL).astype(np.float32) for _ in range(WORLD)] for _ in range(STEPS)
    ]
    delivered = np.zeros((WORLD, STEPS, NUMEL), np.float32)
    errors: list[BaseException] = []

    def rank(rank_id: int) -> None:
        address = f"127.0.0.1:{server.port}"
        try:
            with WorkerClient(address, job, rank_id, WORLD, QuantConfig(bits=2), error_feedback=True) as client:
                for step in range(STEPS):
                    delivered[rank_id, step] = client.push_pull(step, 0, gradients[step][rank_id])
        except BaseException as error:  # reported by the test thread
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert np.array_equal(delivered[0], delivered[1])  # every rank applies the same mean
    exact = np.mean(gradients, axis=1, dtype=np.float64).sum(axis=0)
    error = delivered[0].astype(np.float64).sum(axis=0) - exact
    return float(np.linalg.norm(error) / np.linalg.norm(exact)), float(error.sum() / np.abs(exact).sum())


def test_the_default_returns_a_low_bit_mean_without_drift(start_aggregator: Callable[..., AggregatorServer]) -> None:
    drift, signed = _accumulated_error(start_aggregator(RoundPolicy(round_timeout_s=30.0)), "unbiased")
    # Measured 0.030 and +0.0005: only what the residuals hold at the end is missing.
    assert drift < 0.08 and abs(signed) < 0.005


def test_without_server_error_feedback_the_return_leg_drifts(
    start_aggregator: Callable[..., AggregatorServer],
) -> None:
    # The old default, kept as an option: this is what the test above guards against (measured 0.26 and -0.033).
    policy = RoundPolicy(round_timeout_s=30.0, server_error_feedback=False)
    drift, signed = _accumulated_error(start_aggregator(policy), "biased")
    assert drift > 0.15 and signed < -0.01


def test_by_default_the_aggregator_feeds_back_uniform_grids_of_at_most_four_bits_only() -> None:
    def pushed(scheme: Scheme, bits: int) -> PushedGrid:
        return PushedGrid(scheme, bits, 128, 1024, "float32")

    auto, on, off = RoundPolicy(), RoundPolicy(server_error_feedback=True), RoundPolicy(server_error_feedback=False)
    for bits in (1, 2, 4):
        assert feeds_back(auto, pushed(Scheme.PER_CHANNEL_AFFINE, bits))
    assert feeds_back(auto, pushed(Scheme.PER_TENSOR_SYMMETRIC, 2))
    assert not feeds_back(auto, pushed(Scheme.PER_CHANNEL_AFFINE, 8))  # a step of 1/255: no fp32 residual
    assert not feeds_back(auto, pushed(Scheme.PER_CHANNEL_SIGN, 1))
    assert feeds_back(on, pushed(Scheme.PER_CHANNEL_SIGN, 1)) and feeds_back(on, pushed(Scheme.PER_CHANNEL_AFFINE, 8))
    assert not feeds_back(off, pushed(Scheme.PER_CHANNEL_AFFINE, 2))
    # A float return keeps what a residual would carry: none is held, whatever the policy.
    assert not feeds_back(on, pushed(Scheme.FLOAT32, 8))
    assert not feeds_back(RoundPolicy(return_scheme=Scheme.FLOAT16), pushed(Scheme.PER_CHANNEL_AFFINE, 2))
