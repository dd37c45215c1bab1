"""gradq_hook and the allgather hooks inside real DDP processes on gloo, against exact references."""

from __future__ import annotations

import pickle
from collections.abc import Callable

import ddp_probe
import numpy as np
import pytest
import seed_reference
import torch

from gradq.client.chunks import DEFAULT_CHUNK_ELEMENTS
from gradq.client.ddp import GradqHookState
from gradq.qcore import QuantConfig, Scheme
from gradq.server.app import AggregatorServer
from gradq.server.policy import RoundPolicy
from gradq.server.process import free_port


@pytest.fixture
def aggregator(start_aggregator: Callable[..., AggregatorServer]) -> AggregatorServer:
    return start_aggregator(RoundPolicy(round_timeout_s=30.0), grace_s=0.5)


def straddling(rng: np.random.Generator, numel: int, channel: int) -> np.ndarray:
    """Gradient-like values where every channel holds both signs (the seed clips otherwise)."""
    values = rng.normal(0, 1e-2, numel).astype(np.float32)
    values[::channel] = -np.abs(values[::channel]) - 1e-3
    values[1::channel] = np.abs(values[1::channel]) + 1e-3
    return values


def seed_roundtrip(hook: str, values: np.ndarray) -> np.ndarray:
    """What one rank's bucket becomes after the seed's quantize/dequantize."""
    if hook == "allgather_pertensor":
        return seed_reference.dequantize_encoding(seed_reference.quantize_per_tensor(values), values.size)
    encoding = seed_reference.quantize_per_channel(values)
    return seed_reference.dequantize_encoding(encoding, seed_reference.SEED_CHANNEL_SIZE)[: values.size]


@pytest.mark.parametrize("hook", ["allgather_pertensor", "allgather_perchannel"])
def test_allgather_hooks_match_the_seed_on_the_same_inputs(hook: str) -> None:
    rng = np.random.default_rng(5)
    numel, world = 1500, 2
    gradients = [[straddling(rng, numel, 512)] for _ in range(world)]
    results = ddp_probe.run(world, f"tcp://127.0.0.1:{free_port()}", hook, gradients)
    expected = np.mean([seed_roundtrip(hook, gradients[rank][0]) for rank in range(world)], axis=0, dtype=np.float32)
    for rank in range(world):
        np.testing.assert_allclose(results[rank][0], expected, rtol=0, atol=1e-7)


@pytest.mark.parametrize("hook", ["allgather_pertensor", "allgather_perchannel"])
def test_allgather_hooks_with_several_buckets_in_flight(hook: str) -> None:
    # Four buckets per step: every rank must issue the collectives in the same order,
    # or gloo mixes buckets up (wrong sizes abort, equal sizes average the wrong data).
    rng = np.random.default_rng(9)
    pieces, numel, world = 4, 4 * 700, 2
    gradients = [[straddling(rng, numel, 700) for _ in range(3)] for _ in range(world)]
    results = ddp_probe.run(world, f"tcp://127.0.0.1:{free_port()}", hook, gradients, pieces=pieces)
    for step in range(3):
        exact = np.mean([gradients[rank][step] for rank in range(world)], axis=0)
        # Each rank's bucket errs by at most half a step: (max - min) / 255 / 2 of the widest bucket.
        spread = max(float(np.ptp(gradients[rank][step])) for rank in range(world))
        for rank in range(world):
            np.testing.assert_array_equal(results[rank][step], results[0][step])
            assert np.abs(results[rank][step] - exact).max() <= spread / 255 / 2 + 1e-7


@pytest.mark.parametrize("world", [2, 3])
def test_gradq_hook_averages_integer_gradients_exactly_over_steps(aggregator: AggregatorServer, world: int) -> None:
    # Each channel spans 255 integers with both ends present: the 8-bit grid holds every value exactly.
    rng = np.random.default_rng(world)

    def bucket() -> np.ndarray:
        values = rng.integers(-128, 128, 1024).astype(np.float32)
        values[::512], values[1::512] = -128, 127
        return values

    gradients = [[bucket() for _ in range(3)] for _ in range(world)]
    state = GradqHookState(f"127.0.0.1:{aggregator.port}", QuantConfig(bits=8, channel_size=512))
    results = ddp_probe.run(world, f"tcp://127.0.0.1:{free_port()}", "gradq", gradients, state=state)
    for step in range(3):
        exact = np.mean([gradients[rank][step] for rank in range(world)], axis=0)
        for rank in range(world):
            # The mean goes back on a grid too: within half of its step (range / 255).
            np.testing.assert_allclose(results[rank][step], exact, atol=255 / 255 / 2 + 1e-6)
            np.testing.assert_array_equal(results[rank][step], results[0][step])
    assert aggregator.table.counters["rounds_completed"] == 3
    assert aggregator.table.counters["contributions"] == 3 * world


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_buckets_come_back_in_their_dtype(aggregator: AggregatorServer, dtype: str) -> None:
    rng = np.random.default_rng(1)
    gradients = [[rng.normal(0, 1, 600).astype(np.float32)] for _ in range(2)]
    state = GradqHookState(f"127.0.0.1:{aggregator.port}", QuantConfig(bits=8))
    results = ddp_probe.run(2, f"tcp://127.0.0.1:{free_port()}", "gradq", gradients, dtype=dtype, state=state)
    as_sent = [torch.from_numpy(g[0]).to(getattr(torch, dtype)).float().numpy() for g in gradients]
    exact = np.mean(as_sent, axis=0)
    tolerance = 2 * (exact.max() - exact.min()) / 255 + 1e-2 * np.abs(exact).max()
    np.testing.assert_allclose(results[0][0], exact, atol=tolerance)


def test_state_pickles_without_channels_or_groups() -> None:
    state = GradqHookState(["a:1", "b:2"], QuantConfig(bits=4), error_feedback=True, fallback="allreduce")
    restored = pickle.loads(pickle.dumps(state))
    assert restored.addresses == ["a:1", "b:2"] and restored.config == state.config
    assert restored.error_feedback and restored.fallback == "allreduce"
    assert restored.client is None and restored.mode is None and restored.process_group is None
    assert restored.max_in_flight == 2 and restored.chunk_elements == state.chunk_elements


def test_a_state_pickled_before_newer_fields_restores_their_defaults() -> None:
    # What the first release pickled: the constructor's arguments as slots, and the step.
    old = {
        "addresses": ["a:1"],
        "config": QuantConfig(bits=8),
        "error_feedback": True,
        "fallback": "error",
        "job_id": None,
        "timeout_s": 60.0,
        "connect_timeout_s": 10.0,
        "security": None,
        "step": 7,
    }
    restored = GradqHookState.__new__(GradqHookState)
    restored.__setstate__(old)
    assert restored.chunk_elements == DEFAULT_CHUNK_ELEMENTS and restored.max_in_flight == 2
    assert restored.step == 7 and restored.timeout_s == 60.0 and restored.error_feedback
    assert restored.config == QuantConfig(bits=8) and restored.addresses == ["a:1"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fallback": "retry"}, "fallback='retry' is invalid"),
        ({"addresses": []}, r"addresses=\[\] is invalid"),
        ({"config": QuantConfig(scheme=Scheme.FLOAT16)}, "config.scheme=float16 is not quantized"),
    ],
)
def test_state_rejects_bad_combinations(kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"addresses": "a:1"}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        GradqHookState(**arguments)  # type: ignore[arg-type]
