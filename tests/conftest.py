"""Fixtures of every test folder: real aggregators on port 0, raw stubs over real channels, a one-rank gloo group.

Also the default selection: the slow end-to-end tests (marker ``e2e``) run only with ``--e2e`` or a ``-m`` of one's own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc
from gradq.qcore import Scheme
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.policy import RoundPolicy
from gradq.server.process import free_port

StartAggregator = Callable[..., AggregatorServer]
E2E_DESELECTED = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--e2e``: also run the slow end-to-end tests (Ray, torchrun, Compose, the browser, elastic and long runs)."""
    parser.addoption(
        "--e2e",
        action="store_true",
        help="also run the tests marked e2e (slow end-to-end runs; .ci/run passes it); a -m expression of one's own "
        "selects by itself instead",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the e2e tests unless asked for: reported as deselected, so no one reads them as passed or skipped."""
    if config.getoption("--e2e") or config.getoption("markexpr"):
        return
    slow = [item for item in items if item.get_closest_marker("e2e") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("e2e") is None]
    config.stash[E2E_DESELECTED] = len(slow)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Say once, at the end, what the default left out and how to run it."""
    deselected = config.stash.get(E2E_DESELECTED, 0)
    if deselected:
        terminalreporter.write_line(f"{deselected} slow end-to-end tests (marker e2e) deselected; --e2e runs them")


@pytest.fixture
def start_aggregator() -> Iterator[StartAggregator]:
    """Start aggregators with a given policy; all are stopped at teardown."""
    servers: list[AggregatorServer] = []

    def start(policy: RoundPolicy | None = None, **options: object) -> AggregatorServer:
        server = AggregatorServer(
            policy or RoundPolicy(round_timeout_s=5.0),
            ServerOptions(**{"address": "127.0.0.1:0", "grace_s": 1.0, **options}),  # type: ignore[arg-type]
        )
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def stub_for() -> Iterator[Callable[[AggregatorServer], pb_grpc.AggregatorStub]]:
    """A raw Aggregator stub on a real channel to a started server."""
    channels: list[grpc.Channel] = []

    def make(server: AggregatorServer) -> pb_grpc.AggregatorStub:
        channel = grpc.insecure_channel(
            f"127.0.0.1:{server.port}",
            options=[("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)],
        )
        channels.append(channel)
        return pb_grpc.AggregatorStub(channel)

    yield make
    for channel in channels:
        channel.close()


@pytest.fixture
def aggregator() -> Iterator[AggregatorServer]:
    """A real aggregator for one test (round timeout 60 s)."""
    server = AggregatorServer(RoundPolicy(round_timeout_s=60.0), ServerOptions("127.0.0.1:0", grace_s=0.5))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def exact_aggregator() -> Iterator[str]:
    """The address of an aggregator returning float32 means: at world 1 the mean a rank gets is what it sent."""
    policy = RoundPolicy(round_timeout_s=30.0, return_scheme=Scheme.FLOAT32)
    server = AggregatorServer(policy, ServerOptions("127.0.0.1:0", grace_s=0.5))
    server.start()
    yield f"127.0.0.1:{server.port}"
    server.stop()


@pytest.fixture
def group() -> Iterator[None]:
    """torch.distributed initialized as a one-rank gloo group, for DDP in the test process."""
    import torch.distributed as dist  # here: the server and qcore tests never load torch

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A local Ray cluster of 2 CPUs whose workers import tests/client's modules and tests/' helpers; shut down."""
    from dependencies import require_module

    ray = require_module("ray", "ray")
    with pytest.MonkeyPatch.context() as patch:
        # Inherited by the cluster's processes: one thread per worker on 2 shared cores, nothing sent home.
        patch.setenv("OMP_NUM_THREADS", "1")
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        # Ray starts its workers (Ray Train's, the shards' actors) at niceness 15, so beside any other work on the
        # machine (a CI neighbour, a load) they would get a sliver of the cores, and the tests would time Ray's
        # priority instead of gradq; at 0 they share the cores like the test process.
        patch.setenv("RAY_worker_niceness", "0")
        # Ray Train's helpers a test does not need (each an actor polling on the 2 busy cores), and more time for
        # a worker group to start there than the 60 s default.
        patch.setenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
        patch.setenv("RAY_TRAIN_METRICS_ENABLED", "0")
        patch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "300")
        # tests/client's train functions, and tests/ for the helpers they share with the tests (tests/waiting.py).
        tests = Path(__file__).parent
        path = os.pathsep.join([str(tests / "client"), str(tests)])
        ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
        try:
            yield
        finally:
            ray.shutdown()
