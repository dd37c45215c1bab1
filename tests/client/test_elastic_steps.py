"""The elastic loop, ``for step in state.steps(total)``, on a real aggregator: a host dropped and rejoined.

Each host is a thread of this process with a one-rank gloo group of its own
(DDP, or DiLoCo), so the test holds one host at a chosen step while the other
trains on: the order of events is fixed, not left to timing. A host is
dropped the way a silent one is: its Watch stream ends without a Leave.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from waiting import wait_until

from gradq.client.config import GradqConfig
from gradq.client.ddp import GradqHookState, gradq_hook
from gradq.client.diloco import DiLoCo
from gradq.client.worker import WorkerClient
from gradq.qcore import QuantConfig
from gradq.server.app import AggregatorServer

TOTAL = 30  # the job's steps
DROPPED_AT = 5  # the step in which one host is dropped
AHEAD = 12  # the step the other host has reached when the dropped one comes back
WAIT_S = 30.0  # any one condition: generous on 2 busy cores


def batch(step: int) -> torch.Tensor:
    """The same batch on every host: the job's parameters then depend on its steps alone."""
    return torch.from_numpy(np.random.default_rng(step).normal(size=(16, 8)).astype(np.float32))


def drop(client: WorkerClient | None) -> None:
    """End this host's Watch without a Leave: the aggregator takes it for lost and drops it from the job."""
    assert client is not None
    client.membership._watches[0].cancel()


class DDPHost:
    """One elastic DDP host: its own group, model, optimizer and state; ``trained`` lists the steps it was given."""

    def __init__(self, address: str, job_id: str, hosts: int) -> None:
        self.group = dist.new_group([0])
        torch.manual_seed(0)  # every starting host builds the same model
        self.model = DistributedDataParallel(nn.Linear(8, 4), process_group=self.group)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        config = QuantConfig(bits=8)
        self.state = GradqHookState(
            address, config, job_id=job_id, elastic_hosts=hosts, process_group=self.group, timeout_s=WAIT_S
        )
        self.model.register_comm_hook(self.state, gradq_hook)
        self.state.share(self.model, self.optimizer)
        self.trained: list[int] = []

    def train(self, total: int, before: Callable[[int], None] = lambda step: None) -> None:
        """The loop a user writes; ``before(step)`` runs at the top of each step."""
        for step in self.state.steps(total):
            self.trained.append(step)
            before(step)
            self.model(batch(step)).square().mean().backward()
            self.optimizer.step()  # a host found dropped in this step rejoins here
            self.optimizer.zero_grad()

    def at(self, step: int) -> bool:
        return bool(self.trained) and self.trained[-1] >= step

    def joiner_waits(self) -> bool:
        world = self.state.world()
        return world is not None and bool(world.joiners)


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as threads:
        yield threads


def results(*futures: Future[None]) -> None:
    for future in futures:
        future.result(timeout=120)


def test_a_dropped_ddp_host_goes_on_from_the_jobs_step_and_stops_at_its_end(
    group: None, aggregator: AggregatorServer, pool: ThreadPoolExecutor
) -> None:
    address = f"127.0.0.1:{aggregator.port}"
    survivor, dropped = DDPHost(address, "steps-ddp", 2), DDPHost(address, "steps-ddp", 2)

    def wait_for_a_joiner(step: int) -> None:
        if step == AHEAD:  # it serves the joiner at its next step boundary, this step's first bucket
            wait_until(survivor.joiner_waits, "the dropped host to join again", WAIT_S)

    def fall_silent(step: int) -> None:
        if step == DROPPED_AT:  # dropped, and held while the survivor trains on alone
            drop(dropped.state.client)
            wait_until(lambda: survivor.at(AHEAD), f"the survivor at step {AHEAD}", WAIT_S)

    try:
        results(pool.submit(survivor.train, TOTAL, wait_for_a_joiner), pool.submit(dropped.train, TOTAL, fall_silent))
    finally:
        for host in (survivor, dropped):
            host.state.close()

    assert survivor.trained == list(range(TOTAL))
    # Step 5 was dropped with it; it took the state at step 12 and trained the job's steps from there, to its end.
    # A counted range(start(), TOTAL) would have gone on with 6, 7, ... and trained 6 steps past the job's end.
    assert dropped.trained == [*range(DROPPED_AT + 1), *range(AHEAD, TOTAL)]
    assert dropped.state.rejoins == 1
    assert dropped.state.step == survivor.state.step == TOTAL
    for mine, theirs in zip(dropped.model.parameters(), survivor.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_a_joiner_that_arrives_at_or_past_the_end_trains_no_step(
    group: None, aggregator: AggregatorServer, pool: ThreadPoolExecutor
) -> None:
    address = f"127.0.0.1:{aggregator.port}"
    host, late = DDPHost(address, "steps-late", 1), DDPHost(address, "steps-late", 1)

    def wait_for_a_joiner(step: int) -> None:
        if step == AHEAD:
            wait_until(host.joiner_waits, "the late host to join", WAIT_S)

    def join_late() -> None:
        wait_until(lambda: host.at(AHEAD), f"the host at step {AHEAD}", WAIT_S)
        try:
            late.train(AHEAD - 2)  # the job is at step 12 when it joins: nothing left of its 10 steps
        finally:
            late.state.close()  # its Leave: the step it was admitted at goes on without it

    try:
        results(pool.submit(host.train, TOTAL, wait_for_a_joiner), pool.submit(join_late))
    finally:
        host.state.close()

    assert late.trained == []
    assert late.state.step == AHEAD  # it joined (and received the state) before it found nothing left
    assert host.trained == list(range(TOTAL))


def test_a_fixed_jobs_steps_count_on_from_the_states_step(group: None, exact_aggregator: str) -> None:
    model = DistributedDataParallel(nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradqHookState(exact_aggregator, job_id="steps-fixed") as state:
        model.register_comm_hook(state, gradq_hook)
        with pytest.raises(ValueError, match=r"total=-1 is invalid; expected an integer >= 0"):
            state.steps(-1)
        trained = []
        for steps in (3, 5, 2):  # a second loop goes on from the first's end; one already past its total is empty
            for step in state.steps(steps):
                trained.append(step)
                model(batch(step)).sum().backward()
                optimizer.step()
        assert trained == [0, 1, 2, 3, 4]
        assert state.step == 5


def test_a_dropped_diloco_host_goes_on_from_the_jobs_round_and_stops_at_its_end(
    group: None, aggregator: AggregatorServer, pool: ThreadPoolExecutor
) -> None:
    sync_every, rounds = 4, 10
    total = sync_every * rounds
    config = GradqConfig.of(f"127.0.0.1:{aggregator.port}", job_id="steps-diloco", elastic_hosts=2, timeout_s=WAIT_S)
    trained: dict[str, list[int]] = {"survivor": [], "dropped": []}
    hosts: dict[str, DiLoCo] = {}
    # Made here: new_group is collective over the default group and must be called in one order.
    groups = {name: dist.new_group([0]) for name in trained}

    def train(name: str, before: Callable[[DiLoCo, int], None]) -> None:
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        with DiLoCo(config, model, inner, sync_every=sync_every, process_group=groups[name]) as diloco:
            hosts[name] = diloco
            for step in diloco.steps(total):
                trained[name].append(step)
                before(diloco, step)
                model(batch(step)).square().mean().backward()
                inner.step()  # every 4th ends an outer round; a host dropped rejoins in it
                inner.zero_grad()

    ahead = 6 * sync_every  # round 6's first step: the survivor ends that round with the joiner waiting

    def wait_for_a_joiner(diloco: DiLoCo, step: int) -> None:
        if step == ahead:
            wait_until(lambda: bool((world := diloco.world()) and world.joiners), "the dropped host", WAIT_S)

    def fall_silent(diloco: DiLoCo, step: int) -> None:
        if step == 9:  # in round 2; its push at step 11 is refused, and it joins again
            drop(diloco.session.client if diloco.session is not None else None)
            wait_until(lambda: bool(trained["survivor"]) and trained["survivor"][-1] >= ahead, "the survivor", WAIT_S)

    results(pool.submit(train, "survivor", wait_for_a_joiner), pool.submit(train, "dropped", fall_silent))

    assert trained["survivor"] == list(range(total))
    # Its steps of round 2 were dropped with it; it took the global state after round 6 and went on from round 7.
    assert trained["dropped"] == [*range(3 * sync_every), *range(7 * sync_every, total)]
    survivor, dropped = hosts["survivor"], hosts["dropped"]
    assert dropped.rejoins == 1
    assert dropped.outer_round == survivor.outer_round == rounds
    for mine, theirs in zip(dropped.global_parameters, survivor.global_parameters, strict=True):
        assert torch.equal(mine, theirs)
