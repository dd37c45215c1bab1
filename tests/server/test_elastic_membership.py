"""Elastic membership across restarts and mis-built hosts, on real aggregators and real channels.

The races of issue 41 are made deterministic here by ordering the events by
hand: a shard restarts between steps, a standby joins before the survivors
come back, a host built with another model joins first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
from conftest import StartAggregator
from waiting import wait_until

from gradq.client import AggregationError, JobSpec, WorkerClient
from gradq.client.elastic import ANY_RANK, JobWorld
from gradq.qcore import QuantConfig, Scheme
from gradq.server.app import AggregatorServer
from gradq.server.policy import RoundPolicy

EXACT = QuantConfig(scheme=Scheme.FLOAT32)
RIGHT = "0.fc.weight float32[64, 32]\n0.fc.bias float32[64]"
ODD = "0.fc.weight float32[32, 32]\n0.fc.bias float32[32]"

Host = Callable[..., WorkerClient]


class Shards:
    """Real aggregators on real ports, each restartable on its own port."""

    def __init__(self, start: StartAggregator, count: int) -> None:
        self._start = start
        self.servers = [start(RoundPolicy(round_timeout_s=20.0)) for _ in range(count)]

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{server.port}" for server in self.servers]

    def restart(self, shard: int) -> AggregatorServer:
        """Stop ``shard`` and start an empty aggregator on its port: it knows no job."""
        old = self.servers[shard]
        old.stop()
        self.servers[shard] = self._start(RoundPolicy(round_timeout_s=20.0), address=f"127.0.0.1:{old.port}")
        return self.servers[shard]


@pytest.fixture
def hosts() -> Iterator[Callable[[list[str], str], WorkerClient]]:
    """Elastic members of job 'ef' (2 starting hosts unless ``world_size`` says); closed at teardown."""
    clients: list[WorkerClient] = []

    def make(addresses: list[str], incarnation: str, timeout_s: float = 20, **spec: object) -> WorkerClient:
        client = WorkerClient(
            addresses,
            "ef",
            ANY_RANK,
            JobSpec(**{"world_size": 2, **spec}, elastic=True),  # type: ignore[arg-type]
            EXACT,
            timeout_s=timeout_s,
            incarnation=incarnation,
            retry_backoff_s=0.1,
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def push_all(step: int, clients: list[WorkerClient], values: list[float]) -> list[np.ndarray]:
    """Every client pushes buckets 0 and 1 (one on each of two shards) of its value at ``step``.

    Returns:
        Each client's two means side by side, in order.
    """

    def push(client: WorkerClient, value: float) -> np.ndarray:
        futures = [client.push_pull_async(step, bucket, np.full(4, value, np.float32)) for bucket in (0, 1)]
        return np.concatenate([future.result(timeout=30) for future in futures])

    with ThreadPoolExecutor(len(clients)) as pool:
        futures = [pool.submit(push, client, value) for client, value in zip(clients, values, strict=True)]
        return [future.result(timeout=40) for future in futures]


def wait_for_world(client: WorkerClient, done: Callable[[JobWorld], bool]) -> None:
    wait_until(
        lambda: client.membership.world is not None and done(client.membership.world),
        "the Watch stream to announce it",
        10.0,
    )


@pytest.mark.parametrize(
    ("shards", "restarted"), [(1, 0), (2, 0), (2, 1)], ids=["one-aggregator", "shard-0", "shard-1"]
)
def test_a_joiner_that_reaches_a_restarted_shard_first_does_not_take_the_job(
    start_aggregator: StartAggregator,
    hosts: Callable[..., WorkerClient],
    caplog: pytest.LogCaptureFixture,
    shards: int,
    restarted: int,
) -> None:
    group = Shards(start_aggregator, shards)
    first, second = hosts(group.addresses, "run-a"), hosts(group.addresses, "run-b")
    first.join()
    second.join()
    assert push_all(0, [first, second], [1.0, 3.0]) == [pytest.approx(np.full(8, 2.0))] * 2
    if shards == 2:  # the buckets went to both shards: each holds rounds of the job
        assert all(server.table.counters["contributions"] > 0 for server in group.servers)

    group.restart(restarted)
    standby = hosts(group.addresses, "run-c")
    joined: Future[None] = Future()
    # The standby dials first; it may have to wait for the survivors to take a restarted first shard back.
    threading.Thread(target=lambda: _settle(joined, standby.join), daemon=True).start()
    if restarted != 0:
        joined.result(timeout=20)  # pending on the live first shard, pending on the restarted one too
        assert standby.membership.catch_up and standby.membership.incarnation == first.membership.incarnation
    else:  # the standby's Join made a run of its own on the empty first shard (the other shard refuses it)
        wait_until(
            lambda: (
                group.servers[0].table.jobs.find("ef", "run-c") is not None
                or any("joining again from the first shard" in record.getMessage() for record in caplog.records)
            ),
            "the standby's run of its own on the restarted first shard",
        )

    # The survivors' next step reaches the restarted shard after the standby: their run is the job's.
    assert push_all(1, [first, second], [5.0, 7.0]) == [pytest.approx(np.full(8, 6.0))] * 2
    joined.result(timeout=20)
    if not standby.membership.catch_up:
        # One aggregator: nothing else told the standby that the run it started there was not the job's. The
        # survivors' run replaced it; its next call says so, and it joins again as a newcomer (as the DDP hook
        # and DiLoCo do on that refusal).
        assert shards == 1
        with pytest.raises(AggregationError) as error:
            standby.push_pull(1, 0, np.ones(4, np.float32))
        assert error.value.refusal == "ANOTHER_RUN"
        standby.close()
        standby = hosts(group.addresses, "run-c")
        standby.join()
    assert standby.membership.catch_up, "the standby is a newcomer: it waits for the state"
    assert standby.membership.incarnation == first.membership.incarnation == second.membership.incarnation
    assert standby.membership.rank not in (first.membership.rank, second.membership.rank)

    received: Future[object] = Future()
    threading.Thread(target=lambda: _settle(received, standby.membership.fetch_state), daemon=True).start()
    wait_for_world(first, lambda world: standby.membership.rank in world.joiners)
    world = first.membership.world
    donor = first if world is not None and world.donor == first.membership.rank else second
    donor.membership.send_state(standby.membership.rank, 2, b"the training state")
    assert received.result(timeout=20)[0].data == b"the training state"  # type: ignore[index]

    means = push_all(2, [first, second, standby], [1.0, 2.0, 6.0])
    assert all(mean == pytest.approx(np.full(8, 3.0)) for mean in means)  # all three, every shard


def test_a_standby_refused_by_a_restarted_first_shards_run_rejoins_as_a_newcomer(
    start_aggregator: StartAggregator, hosts: Callable[..., WorkerClient]
) -> None:
    """The other order: the survivors take the restarted first shard back before the standby's retry."""
    group = Shards(start_aggregator, 2)
    first, second = hosts(group.addresses, "run-a"), hosts(group.addresses, "run-b")
    first.join()
    second.join()
    push_all(0, [first, second], [1.0, 3.0])
    group.restart(0)
    assert push_all(1, [first, second], [5.0, 7.0]) == [pytest.approx(np.full(8, 6.0))] * 2
    standby = hosts(group.addresses, "run-c")
    standby.join()
    joined = standby.membership
    assert (joined.catch_up, joined.incarnation, joined.rank) == (True, first.membership.incarnation, 2)


def test_a_standbys_run_replaced_between_the_survivors_returns_never_makes_it_a_member(
    start_aggregator: StartAggregator, hosts: Callable[..., WorkerClient], caplog: pytest.LogCaptureFixture
) -> None:
    """One restarted aggregator, the order CI once drew: the standby starts a run of its own there, one
    survivor takes the shard back, and the standby's next push comes before the other survivor's.

    The standby holds none of the job's state: it must never train as a member (neither under the id its own
    run gave it, which a survivor owns, nor under a fresh one while the run re-forms), and the survivors'
    round must average the survivors alone.
    """
    group = Shards(start_aggregator, 1)
    first, second = hosts(group.addresses, "run-a"), hosts(group.addresses, "run-b")
    first.join()
    second.join()
    assert push_all(0, [first, second], [1.0, 3.0]) == [pytest.approx(np.full(8, 2.0))] * 2
    server = group.restart(0)
    standby = hosts(group.addresses, "run-c")
    standby.join()  # the empty shard: a run of its own, in which it starts
    assert not standby.membership.catch_up and standby.membership.incarnation == "run-c"
    taken_id = standby.membership.rank
    survivor = next(host for host in (first, second) if host.membership.rank != taken_id)
    other = first if survivor is second else second

    survivor_push: Future[list[np.ndarray]] = Future()
    threading.Thread(target=lambda: _settle(survivor_push, lambda: push_all(1, [survivor], [5.0])), daemon=True).start()
    wait_until(
        lambda: (job := server.table.jobs.find("ef", first.membership.incarnation)) is not None and job.members.resumed,
        "the survivor to take the restarted shard back",
        10.0,
    )
    with pytest.raises(AggregationError) as error:  # its run was replaced; its id is the other survivor's
        standby.push_pull(1, 0, np.full(4, 100.0, np.float32))
    assert error.value.refusal == "ANOTHER_RUN"
    standby.close()

    newcomer = hosts(group.addresses, "run-d", timeout_s=20)
    joined: Future[None] = Future()
    threading.Thread(target=lambda: _settle(joined, newcomer.join), daemon=True).start()
    wait_until(
        lambda: any("joining again" in r.getMessage() and "re-forming" in r.getMessage() for r in caplog.records),
        "the newcomer's Join refused while the run re-forms",
    )
    assert not joined.done(), "a newcomer waits while the run re-forms: no id it could draw is known to be free"
    assert push_all(1, [other], [7.0]) == [pytest.approx(np.full(8, 6.0))]  # the survivors alone
    assert survivor_push.result(timeout=10) == [pytest.approx(np.full(8, 6.0))]
    joined.result(timeout=20)
    assert newcomer.membership.catch_up and newcomer.membership.incarnation == first.membership.incarnation
    assert newcomer.membership.rank not in (first.membership.rank, second.membership.rank)


@pytest.mark.parametrize(
    ("shards", "restarted"), [(1, 0), (2, 0), (2, 1)], ids=["one-aggregator", "shard-0", "shard-1"]
)
def test_a_restarted_shard_re_forms_the_run_with_the_members_training_not_the_ones_it_started_with(
    start_aggregator: StartAggregator, hosts: Callable[..., WorkerClient], shards: int, restarted: int
) -> None:
    """Three hosts start; one is lost; then a shard restarts: the two left must not wait for the third there."""
    group = Shards(start_aggregator, shards)
    first, second, third = (hosts(group.addresses, f"run-{n}", world_size=3) for n in "abc")
    for host in (first, second, third):
        host.join()
    assert push_all(0, [first, second, third], [1.0, 2.0, 6.0]) == [pytest.approx(np.full(8, 3.0))] * 3
    for watch in third.membership._watches:  # its Watch streams end with no Leave, as when its process dies
        watch.cancel()
    wait_for_world(first, lambda world: world.members == (first.membership.rank, second.membership.rank))
    assert push_all(1, [first, second], [1.0, 3.0]) == [pytest.approx(np.full(8, 2.0))] * 2
    group.restart(restarted)
    started = time.monotonic()
    assert push_all(2, [first, second], [5.0, 7.0]) == [pytest.approx(np.full(8, 6.0))] * 2
    assert time.monotonic() - started < 10  # not the restarted shard's 20 s round deadline


def test_a_member_the_first_shard_dropped_never_comes_back_to_a_restarted_shard(
    start_aggregator: StartAggregator, hosts: Callable[..., WorkerClient]
) -> None:
    """The first shard drops a host while shard 1 restarts: shard 1 must not take it back as a member."""
    group = Shards(start_aggregator, 2)
    first, second, silent = (hosts(group.addresses, f"run-{n}", world_size=3) for n in "abc")
    for host in (first, second, silent):
        host.join()
    assert push_all(0, [first, second, silent], [1.0, 2.0, 6.0]) == [pytest.approx(np.full(8, 3.0))] * 3
    silent.membership._watches[0].cancel()  # the first shard sees it go: dropped there alone
    wait_for_world(first, lambda world: world.members == (first.membership.rank, second.membership.rank))
    group.restart(1)
    pushes = [silent.push_pull_async(1, bucket, np.full(4, 100.0, np.float32)) for bucket in (0, 1)]
    for push in pushes:  # refused on both shards: the restarted one asked the first, which dropped it
        with pytest.raises(AggregationError) as error:
            push.result(timeout=20)
        assert error.value.refusal == "NOT_JOINED"
    assert push_all(1, [first, second], [1.0, 3.0]) == [pytest.approx(np.full(8, 2.0))] * 2  # without its 100s
    with group.servers[1].table.jobs.lock:
        (job,) = group.servers[1].table.jobs.all()
        assert silent.membership.rank not in job.members.joined


@pytest.mark.parametrize("shards", [1, 2], ids=["one-shard", "two-shards"])
def test_the_start_quorums_model_is_the_jobs_not_the_first_hosts(
    start_aggregator: StartAggregator, hosts: Callable[..., WorkerClient], shards: int
) -> None:
    group = Shards(start_aggregator, shards)
    odd = hosts(group.addresses, "run-odd", world_size=3, model_signature=ODD)
    right = [hosts(group.addresses, f"run-{n}", world_size=3, model_signature=RIGHT) for n in range(3)]
    odd.join()  # first: nobody disagrees yet
    odd_push: Future[object] = Future()
    threading.Thread(
        target=lambda: _settle(odd_push, lambda: odd.push_pull(0, 0, np.ones(4, np.float32))), daemon=True
    ).start()
    first_join: Future[None] = Future()
    threading.Thread(target=lambda: _settle(first_join, right[0].join), daemon=True).start()

    def candidates() -> int:
        with group.servers[0].table.jobs.lock:
            job = group.servers[0].table.jobs.find("ef", "run-odd")
            return 0 if job is None else len(job.members.models)

    wait_until(lambda: candidates() == 2, "the second model's Join on the first shard")
    assert not first_join.done(), "a Join that meets a disagreement waits for the start quorum"
    right[1].join()  # two of the three agree: theirs is the job's model
    first_join.result(timeout=10)
    with pytest.raises(AggregationError, match=r"model differs .* at tensor 0: this host has '0.fc.weight") as error:
        odd_push.result(timeout=10)
    assert error.value.refusal == "MODEL_MISMATCH"
    with pytest.raises(AggregationError) as error:  # and every later call of the odd host
        odd.push_pull(1, 0, np.ones(4, np.float32))
    assert error.value.refusal == "MODEL_MISMATCH"
    # The refused starter is a lost host: the job formed with the two that agree, and they train.
    means = push_all(0, right[:2], [1.0, 5.0])
    assert all(mean == pytest.approx(np.full(8, 3.0)) for mean in means)
    right[2].join()  # the third right host comes to a job in training: a newcomer, which takes the state first
    assert right[2].membership.catch_up
    latecomer = hosts(group.addresses, "run-late", world_size=3, model_signature=ODD)
    with pytest.raises(AggregationError, match="model differs") as error:
        latecomer.join()
    assert error.value.refusal == "MODEL_MISMATCH"


def test_a_disagreement_no_majority_settles_is_refused_at_the_joins_deadline(
    start_aggregator: StartAggregator, hosts: Callable[..., WorkerClient]
) -> None:
    group = Shards(start_aggregator, 1)
    odd = hosts(group.addresses, "run-odd", model_signature=ODD)
    odd.join()
    right = hosts(group.addresses, "run-right", model_signature=RIGHT, timeout_s=2)
    started = time.monotonic()
    with pytest.raises(AggregationError, match="disagree on the model and no majority of the 2") as error:
        right.join()
    assert error.value.refusal == "MODEL_MISMATCH"
    assert time.monotonic() - started < 5
    agreeing = hosts(group.addresses, "run-same", model_signature=ODD)
    agreeing.join()  # the refused Join left nothing behind: the job forms over the two that agree
    assert push_all(0, [odd, agreeing], [1.0, 3.0]) == [pytest.approx(np.full(8, 2.0))] * 2


def _settle(future: Future, action: Callable[[], object]) -> None:  # type: ignore[type-arg]
    try:
        future.set_result(action())
    except Exception as error:  # handed to the test through the future
        future.set_exception(error)
