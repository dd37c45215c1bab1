"""The hook's lifecycle in real DDP (world size 1, gloo) against a real aggregator: typed errors, leaving, closing."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable

import grpc
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from waiting import wait_until

from gradq.client.ddp import GradqHookState, gradq_hook
from gradq.client.sending import AggregationError
from gradq.qcore import QuantConfig
from gradq.server.app import AggregatorServer
from gradq.server.policy import RoundPolicy
from gradq.server.process import free_port

# The model's one bucket holds 8 * 4 + 4 = 36 elements.
BUCKET_ELEMENTS = 36
StartAggregator = Callable[..., AggregatorServer]  # the start_aggregator fixture (tests/conftest.py)


def joined(server: AggregatorServer) -> dict[str, list[int]]:
    """Job id -> its joined ranks, as the aggregator's table holds them now."""
    with server.table.jobs.lock:
        return {job.job_id: sorted(job.joined) for job in server.table.jobs.all()}


@pytest.fixture
def aggregator(start_aggregator: StartAggregator) -> AggregatorServer:
    return start_aggregator(RoundPolicy(round_timeout_s=30.0), grace_s=0.5)


def ddp_model() -> DistributedDataParallel:
    torch.manual_seed(0)
    return DistributedDataParallel(nn.Linear(8, 4))


def step(model: DistributedDataParallel) -> None:
    model.zero_grad()
    model(torch.ones(2, 8)).sum().backward()


def test_a_refused_round_raises_its_aggregation_error_from_backward(
    group: None, start_aggregator: StartAggregator
) -> None:
    server = start_aggregator(RoundPolicy(max_bucket_elements=BUCKET_ELEMENTS - 1), grace_s=0.5)
    model = ddp_model()
    address = f"127.0.0.1:{server.port}"
    model.register_comm_hook(GradqHookState(address, QuantConfig(bits=8)), gradq_hook)
    for _ in range(2):  # DDP finished its pass: the next backward fails the same way, not on DDP's state
        with pytest.raises(AggregationError) as raised:
            step(model)
        assert type(raised.value) is AggregationError
        assert raised.value.address == address and raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert str(raised.value).startswith(
            f"aggregator {address}: INVALID_ARGUMENT: tensor.numel={BUCKET_ELEMENTS} is too large"
        )


def test_an_unreachable_aggregator_raises_aggregation_error_from_backward(group: None) -> None:
    address = f"127.0.0.1:{free_port()}"
    model = ddp_model()
    model.register_comm_hook(GradqHookState(address, connect_timeout_s=0.5), gradq_hook)
    with pytest.raises(AggregationError, match=f"^aggregator {address}: .*unreachable at start") as raised:
        step(model)
    assert raised.value.address == address and raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_the_context_manager_leaves_and_close_is_idempotent(aggregator: AggregatorServer, group: None) -> None:
    model = ddp_model()
    with GradqHookState(f"127.0.0.1:{aggregator.port}", job_id="ctx") as state:
        model.register_comm_hook(state, gradq_hook)
        step(model)
        assert joined(aggregator) == {"ctx": [0]}
    assert joined(aggregator) == {}
    state.close()
    with pytest.raises(RuntimeError, match="GradqHookState is closed"):
        step(model)


def test_a_collected_state_leaves_its_job(aggregator: AggregatorServer, group: None) -> None:
    model = ddp_model()
    model.register_comm_hook(GradqHookState(f"127.0.0.1:{aggregator.port}", job_id="collected"), gradq_hook)
    step(model)
    assert joined(aggregator) == {"collected": [0]}
    del model
    # The thread that read the last answer may still be running DDP's callbacks for a moment, holding the
    # state: collect until the membership is left (a state held for good fails here).
    wait_until(lambda: gc.collect() >= 0 and joined(aggregator) == {}, "the collected state's job left", 10)


def test_every_connect_is_a_new_incarnation_of_the_job(aggregator: AggregatorServer, group: None) -> None:
    incarnations = []
    for _ in range(2):
        model = ddp_model()
        with GradqHookState(f"127.0.0.1:{aggregator.port}", job_id="rerun") as state:
            model.register_comm_hook(state, gradq_hook)
            step(model)
            step(model)
            assert state.step == 2 and state.client is not None
            incarnations.append(state.client.membership.incarnation)
    assert all(len(name) == 32 for name in incarnations) and incarnations[0] != incarnations[1]


EXITING_SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from torch import nn
    from gradq.client.ddp import GradqHookState, gradq_hook

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 4))
    state = GradqHookState.from_env()
    model.register_comm_hook(state, gradq_hook)
    model(torch.ones(2, 8)).sum().backward()
    print("joined", state.job_id, flush=True)
    """
)


def test_a_process_that_exits_without_closing_leaves_its_job(aggregator: AggregatorServer) -> None:
    env = {**os.environ, "GRADQ_AGGREGATORS": f"127.0.0.1:{aggregator.port}", "GRADQ_JOB_ID": "exiting"}
    done = subprocess.run(  # an exit that hangs fails at the timeout
        [sys.executable, "-c", EXITING_SCRIPT.format(port=free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    # The last line: torch 2.8's gloo prints "[Gloo] Rank 0 is connected to 0 peer ranks..." to stdout first.
    assert done.stdout.splitlines()[-1].split() == ["joined", "exiting"]
    assert joined(aggregator) == {}
