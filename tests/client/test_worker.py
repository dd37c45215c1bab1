"""WorkerClient against real aggregators: means, sharding, retries across a restart, errors."""

from __future__ import annotations

import concurrent.futures
import itertools
import re
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradq.client import AggregationError, JobSpec, WorkerClient, shard_for
from gradq.client.chunks import (
    MIN_SHARD_SPLIT,
    SLOW_LINK_CHUNK_BYTES,
    assemble,
    chunk_bounds,
    chunk_key,
    slow_link_chunk_elements,
)
from gradq.qcore import QuantConfig, Scheme, encode
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.policy import RoundPolicy

Start = Callable[..., AggregatorServer]


@pytest.fixture
def start() -> Iterator[Start]:
    servers: list[AggregatorServer] = []

    def make(policy: RoundPolicy | None = None, address: str = "127.0.0.1:0") -> AggregatorServer:
        server = AggregatorServer(policy or RoundPolicy(round_timeout_s=10.0), ServerOptions(address, grace_s=0.5))
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


def run_ranks(world: int, work: Callable[[int], None]) -> None:
    errors: list[BaseException] = []

    def guarded(rank: int) -> None:
        try:
            work(rank)
        except BaseException as error:  # re-raised below in the test thread
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]


def test_mean_is_within_the_analytic_error_bound(start: Start) -> None:
    server = start()
    config = QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=8, channel_size=128)
    world = 3
    rng = np.random.default_rng(7)
    inputs = [rng.normal(scale=0.01, size=(37, 101)).astype(np.float32) for _ in range(world)]
    results: dict[int, np.ndarray] = {}

    def work(rank: int) -> None:
        with WorkerClient(f"127.0.0.1:{server.port}", "job", rank, world, config) as client:
            results[rank] = client.push_pull(0, 0, inputs[rank])

    run_ranks(world, work)
    exact = np.mean(inputs, axis=0, dtype=np.float64).astype(np.float32).reshape(-1)
    # Each push errs by <= half its channel's step; the mean of those by <= their mean;
    # the mean is re-quantized on the same grid, adding <= half of its own step.
    push_steps = np.mean([np.repeat(encode(x, config).scale, 128)[: x.size] for x in inputs], axis=0)
    return_step = np.repeat(encode(exact, config).scale, 128)[: exact.size]
    bound = 0.5 * push_steps + 0.5 * return_step * 1.01 + 1e-7
    for rank in range(world):
        assert results[rank].shape == (37, 101)
        assert (np.abs(results[rank].reshape(-1) - exact) <= bound).all()
        np.testing.assert_array_equal(results[rank], results[0])


def test_integer_gradients_average_exactly_and_async_variant_completes(start: Start) -> None:
    server = start(RoundPolicy(round_timeout_s=10.0))
    config = QuantConfig(scheme=Scheme.FLOAT32)
    results: dict[int, list[np.ndarray]] = {}

    def work(rank: int) -> None:
        with WorkerClient([f"127.0.0.1:{server.port}"], "ints", rank, 4, config) as client:
            futures = [
                client.push_pull_async(step, 0, np.arange(64, dtype=np.float32) * (rank + step)) for step in (0,)
            ]
            results[rank] = [future.result(timeout=30) for future in futures]
            results[rank].append(client.push_pull(1, 0, np.arange(64, dtype=np.float32) * (rank + 1)))

    run_ranks(4, work)
    for rank in range(4):
        np.testing.assert_array_equal(results[rank][0], np.arange(64, dtype=np.float32) * 1.5)
        np.testing.assert_array_equal(results[rank][1], np.arange(64, dtype=np.float32) * 2.5)


def test_buckets_route_to_shards_deterministically(start: Start) -> None:
    shards = [start(), start()]
    addresses = [f"127.0.0.1:{s.port}" for s in shards]
    assert [shard_for(b, 2) for b in range(6)] == [0, 1, 0, 1, 0, 1]

    def work(rank: int) -> None:
        with WorkerClient(addresses, "sharded", rank, 2, QuantConfig(bits=4)) as client:
            for bucket in range(5):
                client.push_pull(0, bucket, np.full(100, float(bucket + rank), np.float32))

    run_ranks(2, work)
    assert shards[0].table.counters["rounds_completed"] == 3  # buckets 0, 2, 4
    assert shards[1].table.counters["rounds_completed"] == 2  # buckets 1, 3


def test_client_retries_across_an_aggregator_restart(start: Start) -> None:
    first = start()
    address = f"127.0.0.1:{first.port}"
    client = WorkerClient(address, "restart", 0, 1, QuantConfig(scheme=Scheme.FLOAT32), retry_backoff_s=0.2)
    client.join()
    np.testing.assert_array_equal(client.push_pull(0, 0, np.ones(4, np.float32)), np.ones(4, np.float32))
    first.stop()
    restarted: list[AggregatorServer] = []
    timer = threading.Timer(0.5, lambda: restarted.append(start(address=address)))
    timer.start()
    result = client.push_pull(1, 0, np.full(4, 2.0, np.float32))  # UNAVAILABLE -> rejoin -> resend
    timer.join()
    np.testing.assert_array_equal(result, np.full(4, 2.0, np.float32))
    assert restarted[0].table.counters["contributions"] == 1
    client.close()


def test_unreachable_aggregator_error_names_the_address() -> None:
    client = WorkerClient("127.0.0.1:1", "nowhere", 0, 1, timeout_s=0.5, max_retries=0)
    started = time.monotonic()
    with pytest.raises(AggregationError, match=r"aggregator 127\.0\.0\.1:1: (DEADLINE_EXCEEDED|UNAVAILABLE)"):
        client.push_pull(0, 0, np.ones(3, np.float32))
    assert time.monotonic() - started < 5
    client.close()


def test_round_failure_reaches_the_caller_with_missing_ranks(start: Start) -> None:
    server = start(RoundPolicy(round_timeout_s=0.5))
    with (
        WorkerClient(f"127.0.0.1:{server.port}", "lonely", 0, 2) as client,
        pytest.raises(AggregationError, match=r"ABORTED: .*ranks \[1\] missing"),
    ):
        client.push_pull(0, 0, np.ones(3, np.float32))


def test_client_error_feedback_keeps_long_run_mean_unbiased(start: Start) -> None:
    server = start(RoundPolicy(round_timeout_s=10.0, return_scheme=Scheme.FLOAT32))
    x = np.linspace(-1, 1, 257, dtype=np.float32) ** 3
    config = QuantConfig(scheme=Scheme.PER_TENSOR_AFFINE, bits=2)
    drift = {}
    for feedback in (False, True):
        with WorkerClient(f"127.0.0.1:{server.port}", f"ef-{feedback}", 0, 1, config, error_feedback=feedback) as c:
            total = sum(c.push_pull(step, 0, x) for step in range(30))
        drift[feedback] = float(np.abs(total / 30 - x).max())
    assert drift[True] < 0.05 < drift[False]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"addresses": []}, r"addresses=\[\] is invalid"),
        ({"rank": 3}, "rank=3 is out of range; expected 0..1"),
        ({"job": 0}, "world_size=0 is invalid; expected an integer >= 1"),
        ({"timeout_s": 0}, "timeout_s=0 is invalid"),
        ({"chunk_elements": -1}, r"chunk_elements=-1 is invalid; expected an integer >= 0"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"addresses": "127.0.0.1:1", "job_id": "j", "rank": 0, "job": 2}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        WorkerClient(**arguments)  # type: ignore[arg-type]


def test_large_buckets_travel_as_chunks_spread_over_the_shards(start: Start) -> None:
    shards = [start(), start()]
    addresses = [f"127.0.0.1:{s.port}" for s in shards]
    config = QuantConfig(scheme=Scheme.FLOAT32, channel_size=512)
    results: dict[int, np.ndarray] = {}

    def work(rank: int) -> None:
        with WorkerClient(addresses, "chunks", rank, 2, config, chunk_elements=1000) as client:
            assert client.chunk_elements == 1024  # rounded up to whole channels
            results[rank] = client.push_pull(0, 1, np.arange(5000, dtype=np.float32).reshape(50, 100) * (rank + 1))

    run_ranks(2, work)
    for rank in (0, 1):
        np.testing.assert_array_equal(results[rank], np.arange(5000, dtype=np.float32).reshape(50, 100) * 1.5)
    # Bucket 1's chunks 0..4 go to shards (1 + i) % 2: 1, 0, 1, 0, 1.
    assert [s.table.counters["rounds_completed"] for s in shards] == [2, 3]


def test_slow_link_rounds_carry_the_same_payload_bytes_at_every_width() -> None:
    for config in (QuantConfig(bits=8), QuantConfig(bits=4), QuantConfig(bits=2), QuantConfig(bits=1)):
        assert slow_link_chunk_elements(config) * config.bits // 8 == SLOW_LINK_CHUNK_BYTES
    assert slow_link_chunk_elements(QuantConfig(bits=8)) == 1 << 19
    # The scaled sign sends 1 bit whatever config.bits says.
    assert slow_link_chunk_elements(QuantConfig(Scheme.PER_CHANNEL_SIGN, bits=8)) == 1 << 22


def test_chunks_are_equal_shares_of_whole_channels() -> None:
    # Three rounds; 10 channels of 512 (the last one partial) split 3 / 3 / 4.
    assert chunk_bounds(5000, 2048, 512) == [(0, 1536), (1536, 3072), (3072, 5000)]
    assert chunk_bounds(6000, 2048, 8) == [(0, 2000), (2000, 4000), (4000, 6000)]  # no small tail round
    assert chunk_bounds(100, 0, 8) == [(0, 100)] == chunk_bounds(100, 100, 8)


@settings(max_examples=300, deadline=None)
@given(
    numel=st.integers(0, 1 << 23),
    channels_per_chunk=st.integers(1, 1 << 12),
    channel_size=st.sampled_from([1, 8, 512, 4096]),
    shards=st.integers(1, 5),
)
def test_chunk_bounds_cover_the_bucket_in_whole_channels_and_balance_the_shards(
    numel: int, channels_per_chunk: int, channel_size: int, shards: int
) -> None:
    chunk_elements = channels_per_chunk * channel_size
    bounds = chunk_bounds(numel, chunk_elements, channel_size, shards)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(end == begin for (_, end), (begin, _) in itertools.pairwise(bounds))  # contiguous, in order
    assert all(begin % channel_size == 0 for begin, _ in bounds)
    if len(bounds) > 1:
        assert all(end - begin <= chunk_elements for begin, end in bounds)
        full = [end - begin for begin, end in bounds[:-1]]  # the last may end in a partial channel
        assert max(full) - min(full) <= channel_size  # equal up to one channel
    rounds = -(-numel // chunk_elements)
    if shards > 1 and numel > 0 and numel >= -(-rounds // shards) * shards * MIN_SHARD_SPLIT:
        assert len(bounds) % shards == 0, (len(bounds), shards)  # every shard an equal number of chunks


def test_large_buckets_are_cut_into_equal_shares_for_every_shard() -> None:
    # One chunk's worth on 2 shards: halves. Two chunks' worth on 4 shards: quarters (by whole channels).
    assert chunk_bounds(1_600_000, 1 << 21, 512, shards=2) == [(0, 799_744), (799_744, 1_600_000)]
    assert len(chunk_bounds(4_200_000, 1 << 21, 512, shards=4)) == 4
    # Below shards x MIN_SHARD_SPLIT elements a round's fixed cost outweighs the balance: not cut.
    assert chunk_bounds(2 * MIN_SHARD_SPLIT - 1, 1 << 21, 1, shards=2) == [(0, 2 * MIN_SHARD_SPLIT - 1)]
    assert chunk_bounds(1_600_000, 0, 512, shards=2) == [(0, 1_600_000)]  # 0 still never splits
    # The 5.8M-parameter MLP's two DDP buckets: every shard count gets an equal share.
    for shards in (2, 3, 4):
        loads = [0] * shards
        for bucket, numel in enumerate([4_216_842, 1_607_680]):
            for index, (begin, end) in enumerate(chunk_bounds(numel, 1 << 21, 512, shards)):
                loads[shard_for(chunk_key(bucket, index), shards)] += end - begin
        assert max(loads) / sum(loads) < 1 / shards + 0.001, (shards, loads)


def test_a_bucket_under_one_chunk_still_spreads_over_two_shards(start: Start) -> None:
    shards = [start(), start()]
    addresses = [f"127.0.0.1:{s.port}" for s in shards]
    numel = 2 * MIN_SHARD_SPLIT
    results: dict[int, np.ndarray] = {}

    def work(rank: int) -> None:
        with WorkerClient(addresses, "spread", rank, 2, QuantConfig(scheme=Scheme.FLOAT32)) as client:
            results[rank] = client.push_pull(0, 0, np.arange(numel, dtype=np.float32) * (rank + 1))

    run_ranks(2, work)
    assert [s.table.counters["rounds_completed"] for s in shards] == [1, 1]
    for rank in (0, 1):
        np.testing.assert_array_equal(results[rank], np.arange(numel, dtype=np.float32) * 1.5)


def test_mean_is_decoded_into_the_given_buffer_across_chunks(start: Start) -> None:
    server = start()
    config = QuantConfig(scheme=Scheme.FLOAT32, channel_size=256)
    buffers = {rank: np.full(3000, float(rank + 1), np.float32) for rank in (0, 1)}
    results: dict[int, np.ndarray] = {}

    def work(rank: int) -> None:
        with WorkerClient(f"127.0.0.1:{server.port}", "into", rank, 2, config, chunk_elements=1024) as client:
            # The bucket is also the output, as in the DDP hook: three chunk rounds land in place.
            results[rank] = client.push_pull_async(0, 0, buffers[rank], out=buffers[rank]).result(timeout=30)

    run_ranks(2, work)
    for rank in (0, 1):
        assert np.shares_memory(results[rank], buffers[rank])
        np.testing.assert_array_equal(buffers[rank], np.full(3000, 1.5, np.float32))
    assert server.table.counters["rounds_completed"] == 3


@pytest.mark.parametrize(
    "out",
    [
        np.zeros(8, np.float64),
        np.zeros(7, np.float32),
        np.zeros((8, 2), np.float32)[:, 0],
        np.frombuffer(bytes(32), np.float32),  # read-only
    ],
    ids=["float64", "7-elements", "strided", "read-only"],
)
def test_a_wrong_output_buffer_is_refused_before_anything_is_sent(start: Start, out: np.ndarray) -> None:
    server = start()
    with WorkerClient(f"127.0.0.1:{server.port}", "bad-out", 0, 1) as client:
        with pytest.raises(ValueError, match="expected a writeable contiguous float32 array of 8 elements"):
            client.push_pull_async(0, 0, np.ones(8, np.float32), out=out)
        assert client.stats().pushes == 0


def test_a_failed_bucket_answers_only_once_every_chunk_has_landed() -> None:
    # A chunk still in flight writes its mean into ``out`` when it lands; the
    # caller must not get the bucket's error (and reuse ``out``) before that.
    parts: list[concurrent.futures.Future[np.ndarray]] = [concurrent.futures.Future() for _ in range(2)]
    out = np.zeros(4, np.float32)
    bucket = assemble(parts, out, (4,))
    parts[0].set_exception(AggregationError("a:1", None, "round failed"))
    assert not bucket.done()
    parts[1].set_result(out[2:])
    with pytest.raises(AggregationError, match="round failed"):
        bucket.result(timeout=1)


def test_members_standing_for_several_ranks_weight_the_mean_by_ranks(start: Start) -> None:
    """Two-level aggregation's wire: a host pushes the sum of its ranks and joins standing for them."""
    server = start(RoundPolicy(round_timeout_s=10.0))
    config = QuantConfig(scheme=Scheme.FLOAT32)
    host_ranks = {0: 3, 1: 1}  # uneven hosts: 3 ranks here, 1 there
    host_sums = {0: np.full(64, 3.0 * 2.0, np.float32), 1: np.full(64, 6.0, np.float32)}  # ranks 2,2,2 and 6
    means: dict[int, np.ndarray] = {}

    def work(host: int) -> None:
        with WorkerClient(
            [f"127.0.0.1:{server.port}"], "hosts", host, JobSpec(world_size=2, ranks=host_ranks[host]), config
        ) as client:
            means[host] = client.push_pull(0, 0, host_sums[host])

    run_ranks(2, work)
    for host in (0, 1):
        np.testing.assert_array_equal(means[host], np.full(64, (6.0 + 6.0) / 4, np.float32))  # mean over 4 ranks
    metrics = server.table.counters
    assert metrics["contributions"] == 2


def test_a_member_must_always_stand_for_the_same_ranks(start: Start) -> None:
    server = start(RoundPolicy(round_timeout_s=10.0))
    address = f"127.0.0.1:{server.port}"
    with WorkerClient([address], "weights", 0, JobSpec(world_size=2, ranks=2)) as client:
        client.join()
        with pytest.raises(AggregationError, match=r"FAILED_PRECONDITION: ranks=3 does not match .*for 2 ranks"):
            WorkerClient([address], "weights", 0, JobSpec(world_size=2, ranks=3)).join()
        with pytest.raises(AggregationError, match=r"INVALID_ARGUMENT: ranks=5000 is invalid; expected 1\.\.1024"):
            WorkerClient([address], "weights", 1, JobSpec(world_size=2, ranks=5000)).join()
    with pytest.raises(ValueError, match="ranks=0 is invalid; expected an integer >= 1"):
        WorkerClient([address], "weights", 0, JobSpec(world_size=2, ranks=0))


def test_an_aggregator_gone_for_good_is_reported_unreachable_long_before_the_rpc_deadline(start: Start) -> None:
    server = start()
    address = f"127.0.0.1:{server.port}"
    client = WorkerClient(address, "gone", 0, 1, timeout_s=120.0, reconnect_timeout_s=2.0)
    client.join()
    client.push_pull(0, 0, np.ones(4, np.float32))
    server.stop()
    started = time.monotonic()
    with pytest.raises(AggregationError, match=r"UNAVAILABLE|DEADLINE_EXCEEDED") as caught:
        client.push_pull(1, 0, np.ones(4, np.float32))
    waited = time.monotonic() - started
    # The rejoin's patience (2 s) plus a backoff, not the 120 s deadline; the margin is for a loaded machine.
    assert waited < 20.0, waited
    assert caught.value.address == address
    assert re.search(r"unreachable: tried for \d+\.\d s \(2 attempts", caught.value.details), caught.value.details
    client.close()


def test_the_join_goes_out_while_the_kernels_load(start: Start, monkeypatch: pytest.MonkeyPatch) -> None:
    # A cold process loads the kernels for about 2 s; an elastic joiner's wait for the state starts at its Join.
    import gradq.client.worker as worker

    loading, release = threading.Event(), threading.Event()
    real = worker._load_kernels

    def slow_load(config: QuantConfig) -> None:
        loading.set()
        release.wait(timeout=30)
        real(config)

    monkeypatch.setattr(worker, "_load_kernels", slow_load)
    server = start()
    client = WorkerClient(f"127.0.0.1:{server.port}", "cold", 0, 1, QuantConfig(bits=4), timeout_s=10)
    try:
        client.join()  # returns with the kernels still loading
        assert loading.is_set() and not release.is_set()
        assert server.table.active_jobs() == {"cold": [0]}
        release.set()
        mean = client.push_pull(0, 0, np.ones(64, np.float32))
        assert np.allclose(mean, 1.0)
    finally:
        release.set()
        client.close()
