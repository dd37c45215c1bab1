"""Fixtures of the client tests: real aggregators on port 0 and a one-rank gloo process group."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from gradq.qcore import Scheme
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.policy import RoundPolicy
from gradq.server.process import free_port


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
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
