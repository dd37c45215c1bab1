"""A Watch's heartbeat: a member that promises one and falls silent is lost, naming why; a bad promise is refused.

A real server on a real port; the silent member is a raw stream whose
heartbeats the test stops without closing it, as a stopped process or a
partition would. The other member is a real WorkerClient, heartbeats and all.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
import numpy as np
import pytest
from waiting import wait_until

from gradq.client import AggregationError, WorkerClient
from gradq.client import serde as client_serde
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc
from gradq.qcore import QuantConfig
from gradq.server.app import AggregatorServer
from gradq.server.limits import ServiceLimits
from gradq.server.liveness import HEARTBEAT_MS, HEARTBEAT_RATE_FACTOR, Heartbeats, Liveness
from gradq.server.policy import RoundPolicy
from gradq.server.rounds import RoundTable

StartAggregator = Callable[..., AggregatorServer]
StubFor = Callable[[AggregatorServer], pb_grpc.AggregatorStub]


class Beats:
    """A Watch's requests: the first, then one every ``every_s`` while ``beating`` is set, never half-closed
    until ``release``."""

    def __init__(self, request: pb.WatchRequest, every_s: float) -> None:
        self.request, self.every_s = request, every_s
        self.beating, self.release = threading.Event(), threading.Event()
        self.beating.set()
        self.sent = 0

    def __iter__(self) -> Iterator[pb.WatchRequest]:
        yield self.request
        while not self.release.wait(self.every_s):
            if self.beating.is_set():
                self.sent += 1
                yield pb.WatchRequest()


def test_a_member_whose_heartbeat_stops_is_lost_naming_why_while_one_that_beats_trains_on(
    start_aggregator: StartAggregator, stub_for: StubFor
) -> None:
    server = start_aggregator(RoundPolicy(round_timeout_s=30.0), keepalive_timeout_s=1.0)
    stub = stub_for(server)
    stub.Join(client_serde.join_request("beats", 1, 2), timeout=5)
    beats = Beats(client_serde.watch_request("beats", 1, heartbeat_ms=100), 0.1)
    watch = stub.Watch(iter(beats))
    worker = WorkerClient(f"127.0.0.1:{server.port}", "beats", 0, 2, QuantConfig(bits=8))
    try:
        next(watch)  # the first event: the aggregator holds the stream
        worker.join()  # and the worker's Watch, beating every second
        # Heartbeats for 2.5 s, more than twice the 1.1 s of silence the aggregator allows: nobody is lost.
        wait_until(lambda: beats.sent >= 25, "25 heartbeats sent", 30)
        assert not watch.done() and server.servicer.liveness.open_watches == 2
        # The heartbeats stop; the stream stays open, as a stopped process's would.
        beats.beating.clear()
        wait_until(watch.done, "the silent member's Watch ended", 30)
        assert watch.code() == grpc.StatusCode.UNAVAILABLE
        assert "promised a heartbeat every 100 ms" in (watch.details() or "")
        assert "--keepalive-timeout=1" in (watch.details() or ""), watch.details()
        # The member that beats trains on and hears why the other is gone.
        with pytest.raises(AggregationError, match=r"rank 1 was lost \(it promised a heartbeat every 100 ms"):
            worker.push_pull(0, 0, np.ones(8, np.float32))
        assert server.servicer.liveness.open_watches == 1  # the worker's, still beating
    finally:
        beats.release.set()
        watch.cancel()
        worker.close()


@pytest.mark.parametrize("heartbeat_ms", [1, 49, 10_001])
def test_a_heartbeat_promise_outside_its_range_is_refused_by_name_and_watches_nothing(
    start_aggregator: StartAggregator, stub_for: StubFor, heartbeat_ms: int
) -> None:
    server = start_aggregator()
    stub = stub_for(server)
    stub.Join(client_serde.join_request("promises", 0, 1), timeout=5)
    with pytest.raises(grpc.RpcError) as refused:
        next(stub.Watch(iter([client_serde.watch_request("promises", 0, heartbeat_ms=heartbeat_ms)]), timeout=5))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"WatchRequest.heartbeat_ms={heartbeat_ms} is invalid; expected 0 (no heartbeat) or 50..10000" in (
        refused.value.details() or ""
    )
    assert server.servicer.liveness.open_watches == 0
    # The rank is still joined and can watch with a good promise.
    watch = stub.Watch(iter([client_serde.watch_request("promises", 0)]))
    next(watch)
    assert server.servicer.liveness.open_watches == 1
    watch.cancel()


def test_a_watch_stream_that_sends_no_request_is_refused(start_aggregator: StartAggregator, stub_for: StubFor) -> None:
    server = start_aggregator()
    with pytest.raises(grpc.RpcError) as refused:
        next(stub_for(server).Watch(iter([]), timeout=5))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sent no WatchRequest" in (refused.value.details() or "")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Message:
    def take(self) -> bytes:
        return b""


def test_a_heartbeat_turns_late_only_past_its_limit_and_each_message_resets_it() -> None:
    clock = Clock()

    async def scenario() -> list[tuple[bool, bool]]:
        heartbeats = Heartbeats(3600.0, clock)  # the test checks by hand: the periodic check never runs
        wake = asyncio.Event()
        beat = heartbeats.add(1.0, 2.0, wake)
        seen = []
        clock.now += 2.0  # at the limit: not late
        heartbeats.check()
        seen.append((beat.late, wake.is_set()))

        async def one_message() -> AsyncIterator[Message]:
            yield Message()

        await beat.listen(one_message())  # heard now: the silence starts again
        clock.now += 1.5
        heartbeats.check()
        seen.append((beat.late, wake.is_set()))
        clock.now += 0.6  # 2.1 s since it was heard
        heartbeats.check()
        seen.append((beat.late, wake.is_set()))
        heartbeats.discard(beat)
        heartbeats.stop()
        return seen

    assert asyncio.run(scenario()) == [(False, False), (False, False), (True, True)]


def test_the_silence_allowed_is_the_promised_period_and_the_timeout() -> None:
    table = RoundTable(RoundPolicy())
    liveness = Liveness(table, ServiceLimits(), late_after_s=1.5)
    assert liveness.silence_limit(0) is None
    assert liveness.silence_limit(1000) == pytest.approx(2.5)
    assert liveness.silence_limit(HEARTBEAT_MS[0]) == pytest.approx(1.55)


def test_heartbeats_up_to_four_times_the_promised_rate_and_a_stalls_backlog_pass_but_a_flood_is_cut() -> None:
    clock = Clock()

    async def messages(times: list[float]) -> AsyncIterator[Message]:
        for at in times:
            clock.now = at
            yield Message()

    async def heard(times: list[float], period_s: float = 1.0, limit_s: float = 2.5) -> tuple[int, bool, str]:
        heartbeats = Heartbeats(3600.0, clock)
        beat = heartbeats.add(period_s, limit_s, asyncio.Event())
        await beat.listen(messages(times))
        heartbeats.stop()
        broken = beat.broken(int(period_s * 1000), limit_s - period_s)
        return beat.heard, beat.flooding, str(broken or "")

    start = clock.now
    # An hour at four times the promised rate: never a flood.
    steady = [start + i / HEARTBEAT_RATE_FACTOR for i in range(1, 4 * 3600)]
    assert asyncio.run(heard(steady)) == (len(steady), False, "")
    # A stall up to the silence limit queues heartbeats that arrive in one burst: they pass.
    clock.now = start
    assert asyncio.run(heard([start + 2.5] * 5))[1] is False
    # At the smallest promise (50 ms) with a long --keepalive-timeout (10 s), the backlog is 200: it passes too.
    clock.now = start
    assert asyncio.run(heard([start + 10.0] * 200, period_s=0.05, limit_s=10.05))[1] is False
    # As fast as a client can send: cut once the burst is spent, and the message names the promise it broke.
    clock.now = start
    count, flooding, why = asyncio.run(heard([start + i * 1e-4 for i in range(1000)]))
    assert flooding and count < 20, count
    assert f"more than {HEARTBEAT_RATE_FACTOR} times as often as the one every 1000 ms it promised" in why
    assert "WatchRequest.heartbeat_ms" in why and "a flood" in why


def test_a_member_flooding_its_watch_with_heartbeats_is_cut_by_name_and_the_others_hear_why(
    start_aggregator: StartAggregator, stub_for: StubFor
) -> None:
    server = start_aggregator(RoundPolicy(round_timeout_s=30.0))
    stub = stub_for(server)
    stub.Join(client_serde.join_request("flood", 1, 2), timeout=5)
    flood = Beats(client_serde.watch_request("flood", 1, heartbeat_ms=1000), 0.0)  # no pause between beats
    watch = stub.Watch(iter(flood))
    worker = WorkerClient(f"127.0.0.1:{server.port}", "flood", 0, 2, QuantConfig(bits=8))
    try:
        next(watch)
        worker.join()
        wait_until(watch.done, "the flooding member's Watch ended", 30)
        assert watch.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, watch.details()
        assert "rank 1: it sent" in (watch.details() or "") and "a flood" in (watch.details() or "")
        # It was cut once its burst was spent: after a handful of messages, not the thousands it would send.
        sent = re.search(r"it sent (\d+) heartbeats", watch.details() or "")
        assert sent is not None and int(sent.group(1)) <= 4 * HEARTBEAT_RATE_FACTOR, watch.details()
        # The member that keeps its promise is told why the other is gone, as for any lost rank.
        with pytest.raises(AggregationError, match=r"rank 1 was lost \(it sent \d+ heartbeats .* a flood"):
            worker.push_pull(0, 0, np.ones(8, np.float32))
        wait_until(lambda: server.servicer.liveness.open_watches == 1, "only the worker's Watch is open", 30)
    finally:
        flood.release.set()
        watch.cancel()
        worker.close()
