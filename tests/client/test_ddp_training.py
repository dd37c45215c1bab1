"""Real DDP training on scikit-learn digits through a real aggregator: ranks agree, accuracy holds, fallbacks work."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch.multiprocessing as mp

from gradq.client.apps.demo import free_port, run_job
from gradq.client.apps.training import TrainResult, TrainSpec
from gradq.client.config import GradqConfig
from gradq.qcore import QuantConfig
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.policy import RoundPolicy

pytestmark = pytest.mark.e2e  # a slow end-to-end run: deselected unless --e2e

EPOCHS = 20


@pytest.fixture(scope="module")
def aggregator() -> Iterator[str]:
    server = AggregatorServer(RoundPolicy(round_timeout_s=60.0), ServerOptions("127.0.0.1:0", grace_s=0.5))
    server.start()
    yield f"127.0.0.1:{server.port}"
    server.stop()


def train(
    world: int, aggregator: str | None, bits: int = 8, error_feedback: bool = False, **extra: Any
) -> list[TrainResult]:
    gradq = (
        GradqConfig.of(aggregator, QuantConfig(bits=bits), error_feedback=error_feedback, **extra)
        if aggregator
        else None
    )
    return run_job(
        TrainSpec(world_size=world, init_method=f"tcp://127.0.0.1:{free_port()}", gradq=gradq, epochs=EPOCHS)
    )


@pytest.fixture(scope="module")
def fp32_baseline() -> list[TrainResult]:
    return train(2, None)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_stay_identical_and_loss_falls(aggregator: str, world: int) -> None:
    results = train(world, aggregator, bits=8)
    for result in results:
        assert result.mode == "gradq"
        np.testing.assert_array_equal(result.parameters, results[0].parameters)
        assert result.last_loss < 0.25 * result.first_loss
    assert results[0].bytes_sent <= 0.26 * results[0].fp32_bytes


def test_8_bit_parameters_stay_close_to_fp32_allreduce(aggregator: str, fp32_baseline: list[TrainResult]) -> None:
    gradq = train(2, aggregator, bits=8)[0].parameters
    reference = fp32_baseline[0].parameters
    assert np.linalg.norm(gradq - reference) < 0.1 * np.linalg.norm(reference)


@pytest.mark.parametrize(
    ("bits", "error_feedback", "allowed_drop"),
    [(8, False, 0.5), (4, True, 1.0), (2, True, 1.0)],
    ids=["8-bit", "4-bit+EF", "2-bit+EF"],
)
def test_accuracy_within_bound_of_fp32_allreduce(
    aggregator: str, fp32_baseline: list[TrainResult], bits: int, error_feedback: bool, allowed_drop: float
) -> None:
    result = train(2, aggregator, bits=bits, error_feedback=error_feedback)[0]
    assert fp32_baseline[0].accuracy > 95.0
    assert result.accuracy >= fp32_baseline[0].accuracy - allowed_drop, (result.accuracy, fp32_baseline[0].accuracy)


@pytest.mark.parametrize("fallback", ["allreduce", "allgather"])
def test_unreachable_aggregator_falls_back_and_trains(fallback: str) -> None:
    results = train(2, f"127.0.0.1:{free_port()}", fallback=fallback, connect_timeout_s=1.0)
    for result in results:
        assert result.mode == fallback and result.bytes_sent == 0
        assert result.accuracy > 90.0
    np.testing.assert_array_equal(results[1].parameters, results[0].parameters)


def test_unreachable_aggregator_with_error_policy_names_the_address() -> None:
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(mp.ProcessRaisedException, match=rf"aggregator {address}: .*unreachable at start"):
        train(2, address, fallback="error", connect_timeout_s=1.0)
