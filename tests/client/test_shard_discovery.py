"""A worker given one shard's address learns the others (gradq.client.discovery): against `gradq serve --shards 2`
it trains rounds on both shards, a WorkerClient's and a GradqSession's alike; a server without the Shards RPC is one
shard, and a group that is malformed or lacks the dialed shard is refused by name."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import threading
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import numpy as np
import psutil
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from gradq.client.discovery import discover_shards, resolve_group
from gradq.client.elastic import ANY_RANK
from gradq.client.sending import AggregationError
from gradq.client.serde import JobSpec
from gradq.client.worker import WorkerClient
from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc
from gradq.qcore import QuantConfig
from gradq.server.app import AggregatorServer
from gradq.server.process import free_port, spawn_shards

ELEMENTS = 4096  # two chunks of 2048: one per shard
CHUNK = 2048


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def sharded() -> Iterator[tuple[list[int], int]]:
    """`gradq serve --shards 2` (fp32 means), metrics on two consecutive ports: (shard ports, first metrics port)."""
    metrics = free_port()
    while metrics >= 65535 or listening(metrics + 1):
        metrics = free_port()
    flags = ("--return-scheme", "fp32", "--round-timeout", "30", "--grace", "1", "--metrics-port", str(metrics))
    process, ports = spawn_shards(2, *flags, stderr=subprocess.DEVNULL)
    yield ports, metrics
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)


def contributions(metrics_port: int, job: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.search(rf'^gradq_contributions_total\{{job="{job}"\}} (\S+)$', text, re.MULTILINE)
    return float(found[1]) if found else 0.0


@pytest.mark.parametrize("elastic", [False, True], ids=["fixed", "elastic"])
def test_a_worker_given_one_address_learns_both_shards_and_trains_rounds_on_each(
    sharded: tuple[list[int], int], elastic: bool
) -> None:
    ports, metrics = sharded
    job = "learned-elastic" if elastic else "learned"
    both = [f"127.0.0.1:{port}" for port in ports]
    rng = np.random.default_rng(0)
    steps = 3
    values = rng.normal(size=(2, steps, ELEMENTS)).astype(np.float32)
    means: dict[int, list[np.ndarray]] = {}
    addresses: dict[int, list[str]] = {}

    def rank(r: int) -> None:
        # Rank 1 is given the second shard's address: each learns the same group, in shard order.
        member = ANY_RANK if elastic else r  # an elastic member takes the id the first shard gives
        spec = JobSpec(world_size=2, elastic=elastic)
        with WorkerClient(both[r], job, member, spec, QuantConfig(bits=8), chunk_elements=CHUNK) as client:
            addresses[r] = list(client.addresses)
            means[r] = [client.push_pull(step, 0, values[r, step]) for step in range(steps)]

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert addresses == {0: both, 1: both}
    for step in range(steps):
        expected = values[:, step].mean(axis=0)
        for r in (0, 1):  # 8-bit pushes, fp32 means: within a step of each channel's grid
            assert np.abs(means[r][step] - expected).max() < 0.05
    # Each shard averaged one chunk of every step, from both ranks.
    assert [contributions(metrics + shard, job) for shard in (0, 1)] == [2 * steps, 2 * steps]


def test_a_session_configured_with_one_address_reduces_over_both_shards(
    sharded: tuple[list[int], int], group: None
) -> None:
    import torch

    from gradq.client.config import GradqConfig
    from gradq.client.session import GradqSession

    ports, metrics = sharded
    one = f"127.0.0.1:{ports[0]}"
    config = GradqConfig((one,), QuantConfig(bits=8), job_id="session-learned", chunk_elements=CHUNK)
    session = GradqSession.connect(config)
    try:
        assert session.client is not None
        assert session.client.addresses == [f"127.0.0.1:{port}" for port in ports]
        values = torch.linspace(-1.0, 1.0, ELEMENTS)
        mean = session.reduce(values.clone(), 0, 0).wait()
        session.end_step()
    finally:
        session.close()
    assert torch.allclose(mean, values, atol=2 / 255)  # one rank: the mean is what it sent
    assert [contributions(metrics + shard, "session-learned") for shard in (0, 1)] == [1.0, 1.0]


@pytest.mark.parametrize(
    ("dialed", "advertised", "group"),
    [
        ("gpu-box:50051", [], ["gpu-box:50051"]),
        ("gpu-box:50051", [":50051", ":50052"], ["gpu-box:50051", "gpu-box:50052"]),
        ("gpu-box:50052", ["0.0.0.0:50051", "[::]:50052"], ["gpu-box:50051", "gpu-box:50052"]),
        ("agg:50051", ["agg:50051", "agg-2:50051"], ["agg:50051", "agg-2:50051"]),
        ("[::1]:7000", [":7000", ":7001"], ["[::1]:7000", "[::1]:7001"]),
    ],
)
def test_the_group_fills_in_the_host_dialed(dialed: str, advertised: list[str], group: list[str]) -> None:
    assert resolve_group(dialed, advertised) == group


@pytest.mark.parametrize(
    ("dialed", "advertised", "message"),
    [
        ("h:1", [":1", "h"], "the shard reports its group as ':1,h', and 'h' is not 'host:port'"),
        ("h:1", [":1", ":70000"], "':70000' is not 'host:port'; expected host:port entries in shard order"),
        ("h:1", [":1", "h:1"], "the shard reports its group as ':1,h:1', which names an address twice (h:1,h:1)"),
        (
            "h:1",
            [":2", ":3"],
            "the shard reports a group that does not contain it: h:2,h:3 (as advertised: ':2,:3'); expected h:1 among "
            "them: set the shards' --advertise-host to the host workers dial",
        ),
        ("unix:/tmp/s", [":1"], "but 'unix:/tmp/s' is not 'host:port'; dial host:port, or list every shard"),
    ],
)
def test_a_malformed_group_is_refused_naming_it(dialed: str, advertised: list[str], message: str) -> None:
    with pytest.raises(AggregationError) as refused:
        resolve_group(dialed, advertised)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert message in str(refused.value)


def test_a_shard_reporting_a_group_without_it_fails_the_join(
    start_aggregator: Callable[..., AggregatorServer],
) -> None:
    server = start_aggregator(shard_group=("127.0.0.1:1", "127.0.0.1:2"))
    client = WorkerClient(f"127.0.0.1:{server.port}", "j", 0, 1, timeout_s=5)
    try:
        with pytest.raises(AggregationError) as refused:
            client.join()
    finally:
        client.close()
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    advertised = "127.0.0.1:1,127.0.0.1:2"
    expected = f"does not contain it: {advertised} (as advertised: {advertised!r}); expected 127.0.0.1:{server.port}"
    assert expected in str(refused.value)


def test_a_server_without_the_shards_rpc_is_one_shard() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # health only: every Aggregator method unknown
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            group = discover_shards(pb_grpc.AggregatorStub(channel), f"127.0.0.1:{port}", 5.0, None)
    finally:
        server.stop(None)
    assert group == [f"127.0.0.1:{port}"]


def test_a_shard_alone_keeps_the_one_address(
    start_aggregator: Callable[..., AggregatorServer],
) -> None:
    alone = start_aggregator()
    with WorkerClient(f"127.0.0.1:{alone.port}", "alone", 0, 1, timeout_s=5) as client:
        assert client.addresses == [f"127.0.0.1:{alone.port}"]


def test_training_goes_on_through_a_shard_the_parent_restarted() -> None:
    flags = ("--return-scheme", "fp32", "--round-timeout", "30", "--grace", "1")
    process, ports = spawn_shards(2, *flags, stderr=subprocess.DEVNULL)
    try:
        values = np.linspace(-1.0, 1.0, ELEMENTS, dtype=np.float32)
        with WorkerClient(
            f"127.0.0.1:{ports[0]}", "through", 0, 1, QuantConfig(bits=8), chunk_elements=CHUNK
        ) as client:
            for step in range(2):
                assert np.abs(client.push_pull(step, 0, values) - values).max() < 0.01
            (victim,) = [
                child
                for child in psutil.Process(process.pid).children()
                if child.cmdline()[child.cmdline().index("--shard-ports") + 1] == str(ports[1])
            ]
            victim.kill()  # SIGKILL: the parent restarts it on its port
            victim.wait(timeout=10)
            for step in range(2, 4):  # pushes to it retry and rejoin the restarted shard
                assert np.abs(client.push_pull(step, 0, values) - values).max() < 0.01
            assert client.addresses == [f"127.0.0.1:{port}" for port in ports]
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
