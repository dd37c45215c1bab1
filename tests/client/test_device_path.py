"""The device path end to end: DDP on gloo, the hook's torch codec, two real aggregator shards.

``GradqHookState(codec="torch")`` quantizes CPU tensors with the torch twins,
through the same chunking, shards, window and retries as the numpy path; with
the same inputs both must hand DDP the same gradients, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator

import ddp_probe
import numpy as np
import pytest
import torch

from gradq.client import WorkerClient
from gradq.client.ddp import GradqHookState
from gradq.qcore import QuantConfig, Rounding
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.policy import RoundPolicy
from gradq.server.process import free_port

pytestmark = pytest.mark.e2e  # a slow end-to-end run: deselected unless --e2e

WORLD, STEPS, PIECES, NUMEL = 2, 2, 3, 3 * 2500
# 1024-element chunks of 256-element channels: every bucket is cut into 3 rounds, spread over both shards.
CHUNK_ELEMENTS, CHANNEL_SIZE = 1024, 256


@pytest.fixture(scope="module")
def shards() -> Iterator[list[AggregatorServer]]:
    servers = [AggregatorServer(RoundPolicy(round_timeout_s=30.0), ServerOptions("127.0.0.1:0", grace_s=0.5))]
    servers.append(AggregatorServer(RoundPolicy(round_timeout_s=30.0), ServerOptions("127.0.0.1:0", grace_s=0.5)))
    for server in servers:
        server.start()
    yield servers
    for server in servers:
        server.stop()


def reduce_with(
    codec: str, shards: list[AggregatorServer], config: QuantConfig, error_feedback: bool, dtype: str
) -> tuple[list[list[np.ndarray]], dict[int, list[np.ndarray]], list[int]]:
    """(each rank's gradients, what DDP handed each rank, rounds each shard completed) for one codec."""
    rng = np.random.default_rng(11)
    gradients = [[rng.normal(0, 1e-2, NUMEL).astype(np.float32) for _ in range(STEPS)] for _ in range(WORLD)]
    state = GradqHookState(
        [f"127.0.0.1:{server.port}" for server in shards],
        config,
        error_feedback=error_feedback,
        chunk_elements=CHUNK_ELEMENTS,
        codec=codec,
    )
    before = [server.table.counters["rounds_completed"] for server in shards]
    results = ddp_probe.run(
        WORLD, f"tcp://127.0.0.1:{free_port()}", "gradq", gradients, dtype=dtype, state=state, pieces=PIECES
    )
    rounds = [server.table.counters["rounds_completed"] - done for server, done in zip(shards, before, strict=True)]
    return gradients, results, rounds


@pytest.mark.parametrize(
    ("dtype", "error_feedback", "rounding"),
    [
        ("float32", False, Rounding.NEAREST),
        ("float32", True, Rounding.NEAREST),
        ("float16", True, Rounding.NEAREST),
        ("bfloat16", False, Rounding.NEAREST),
        ("float32", True, Rounding.STOCHASTIC),
    ],
    ids=["fp32", "fp32-ef", "fp16-ef", "bf16", "fp32-ef-stochastic"],
)
def test_torch_codec_gives_ddp_the_numpy_paths_gradients_bit_for_bit(
    shards: list[AggregatorServer], dtype: str, error_feedback: bool, rounding: Rounding
) -> None:
    config = QuantConfig(bits=4, channel_size=CHANNEL_SIZE, rounding=rounding, seed=7)
    gradients, host, host_rounds = reduce_with("numpy", shards, config, error_feedback, dtype)
    _, device, device_rounds = reduce_with("torch", shards, config, error_feedback, dtype)
    # Buckets are cut into chunks that alternate between the shards (DDP's first
    # step buckets differently from the rest, so the count is not fixed).
    assert host_rounds == device_rounds and sum(device_rounds) > STEPS * PIECES and min(device_rounds) > 0
    for step in range(STEPS):
        as_sent = [torch.from_numpy(g[step]).to(getattr(torch, dtype)).float().numpy() for g in gradients]
        exact = np.mean(as_sent, axis=0)
        for rank in range(WORLD):
            np.testing.assert_array_equal(device[rank][step], host[rank][step])
            np.testing.assert_array_equal(device[rank][step], device[0][step])
        # 4 bits both ways: within a few grid steps of the exact mean, so neither path is trivially wrong.
        assert np.abs(device[0][step] - exact).max() < 4 * (exact.max() - exact.min()) / 15


def test_a_worker_pushes_tensors_through_the_same_rounds_and_records_their_costs(
    shards: list[AggregatorServer],
) -> None:
    # One rank per job, so the mean is what this rank sent: the tensor push and the
    # numpy push of the same values must come back identical, chunked over both shards.
    addresses = [f"127.0.0.1:{server.port}" for server in shards]
    values = np.random.default_rng(5).normal(size=5000).astype(np.float32)
    config = QuantConfig(bits=4, channel_size=CHANNEL_SIZE)
    means = {}
    for library, bucket in (("numpy", values.copy()), ("torch", torch.from_numpy(values.copy()))):
        with WorkerClient(
            addresses, f"job-{library}", 0, 1, config, error_feedback=True, chunk_elements=CHUNK_ELEMENTS
        ) as client:
            means[library] = client.push_pull_async(0, 3, bucket).result(timeout=30)
            stats = client.stats()
            residuals = client.residuals(library)
        assert stats.pushes == 5 and stats.encode_seconds > 0 and stats.decode_seconds > 0
        assert stats.bytes_received > 0 and stats.compression_ratio > 6
        assert residuals is not None and len(list(residuals.keys())) == 5  # one per chunk
    assert isinstance(means["torch"], torch.Tensor) and means["torch"].dtype == torch.float32
    np.testing.assert_array_equal(means["torch"].numpy(), means["numpy"])
