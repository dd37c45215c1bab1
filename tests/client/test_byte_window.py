"""The window in bytes on a simulated path: an injected clock, a bottleneck link and a propagation delay.

A discrete-event model of one shard's path: each push queues for the
bottleneck (``rate`` bytes per second, first come first served), then takes
the round trip's propagation delay before its answer. The window only sees
what a client sees: when a push went out and when its answer came.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import pytest

from gradq.client.window import PathEstimate, ShardWindow, WindowSettings

MIB = 1 << 20
PUSH = MIB  # a 2^21-element chunk at 4 bits


@dataclass
class SimulatedPath:
    """One shard's window sending an endless backlog of ``PUSH``-byte pushes over a bottleneck and a delay."""

    rate: float  # bytes per second at the bottleneck
    rtt: float  # propagation round trip, seconds
    settings_of: dict[str, int] = field(default_factory=dict)
    now: float = 0.0
    link_free: float = 0.0
    peak_bytes: int = 0
    peak_pushes: int = 0
    answered: int = 0
    backlog: bool = True  # keep the backlog full; False: the pushes queued run out

    def __post_init__(self) -> None:
        given = {"max_bytes": 256 * MIB, "max_pushes": 1000, "connection_bytes": 4 * MIB, **self.settings_of}
        settings = WindowSettings(
            max_bytes=given["max_bytes"],
            max_pushes=given["max_pushes"],
            max_connections=given.get("max_connections", 8),
            connection_bytes=given["connection_bytes"],
            path_estimate=lambda: PathEstimate(lambda: self.now),
        )
        self.window: ShardWindow[int] = ShardWindow(1, 2, settings)
        self._events: list[tuple[float, int]] = []
        self._next = 0
        for _ in range(4000):  # the backlog: a DiLoCo round's chunks, queued at once
            self._submit()

    def _submit(self) -> None:
        item, self._next = self._next, self._next + 1
        if self.window.admit(0, item, PUSH):
            self._send(item)

    def _send(self, item: int) -> None:
        self.link_free = max(self.link_free, self.now) + PUSH / self.rate
        heapq.heappush(self._events, (self.link_free + self.rtt, item))
        pushes, in_flight = self.window.in_flight(0)
        self.peak_bytes, self.peak_pushes = max(self.peak_bytes, in_flight), max(self.peak_pushes, pushes)

    def run(self, until: float, failing: bool = False) -> None:
        """Answer pushes until ``until`` seconds (``failing``: as failures); the backlog is kept full."""
        while self._events and self._events[0][0] <= until:
            self.now, item = heapq.heappop(self._events)
            self.answered += 1
            for started in self.window.release(0, item, PUSH, answered=not failing):
                self._send(started)
            if self.backlog:
                self._submit()
        self.now = until

    def reset_peaks(self) -> None:
        self.peak_bytes = self.peak_pushes = 0

    @property
    def bdp(self) -> float:
        return self.rate * self.rtt


def test_in_flight_bytes_grow_to_the_bandwidth_delay_product_of_a_100_ms_path() -> None:
    path = SimulatedPath(rate=125e6, rtt=0.1)  # 1 Gbit/s between regions: 12.5 MB per round trip
    path.run(until=0.2)
    assert path.peak_pushes <= 3, "before any answer the window holds its count, not more"
    path.run(until=3.0)
    assert path.peak_bytes >= path.bdp, f"{path.peak_bytes} bytes in flight at most, the path holds {path.bdp:.0f}"
    assert path.peak_bytes <= 2.5 * path.bdp + PUSH, "the window overshot twice the product"
    # The link, not the window, set the pace from then on: nearly every push the link carried was answered.
    before = path.answered
    path.run(until=5.0)
    delivered = (path.answered - before) * PUSH / 2.0
    assert delivered >= 0.9 * path.rate, f"{delivered / 1e6:.1f} MB/s of a {path.rate / 1e6:.0f} MB/s link"


def test_on_a_lan_the_window_keeps_its_count_of_pushes() -> None:
    path = SimulatedPath(rate=125e6, rtt=0.0002)  # the product is a fraction of one push
    path.run(until=2.0)
    assert path.peak_pushes <= 3
    assert path.window.connections(0) == 1


def test_the_window_never_holds_more_than_its_cap() -> None:
    path = SimulatedPath(rate=1.25e9, rtt=0.1, settings_of={"max_bytes": 16 * MIB})  # 10 Gbit/s: 125 MB per trip
    path.run(until=5.0)
    assert path.peak_bytes <= 16 * MIB
    assert path.peak_bytes >= 16 * MIB - PUSH  # and it does fill it
    assert path.window.window_bytes(0) == 16 * MIB


def test_the_window_shrinks_back_when_the_round_trip_rises_and_when_the_link_slows() -> None:
    path = SimulatedPath(rate=125e6, rtt=0.1)
    path.run(until=5.0)
    grown = path.window.window_bytes(0)
    assert grown >= 1.8 * path.bdp
    # A queue builds elsewhere on the path: round trips four times as long at the same rate.
    path.rtt = 0.4
    path.run(until=6.5)
    assert path.window.path(0).queueing
    assert path.window.window_bytes(0) <= 0.6 * grown, "the window did not give up its second product"
    # The link slows to a tenth: once the fast samples age out the window follows the slow link.
    path.rtt, path.rate = 0.1, 12.5e6
    path.run(until=10.0)
    path.reset_peaks()
    path.run(until=30.0)
    # The shortest round trip now holds a push's own 84 ms on the slow link.
    holds = path.rate * (path.rtt + PUSH / path.rate)
    assert path.peak_bytes <= 2 * holds + PUSH, f"{path.peak_bytes} in flight on a path that holds {holds:.0f}"


def test_a_round_after_an_idle_minute_starts_at_the_window_the_last_one_ended_with() -> None:
    path = SimulatedPath(rate=125e6, rtt=0.1)
    path.run(until=5.0)
    grown = path.window.window_bytes(0)
    path.backlog = False
    path.window.drain(0)  # the round's last pushes: nothing waits behind the ones on the wire
    path.run(until=10.0)
    assert path.window.in_flight(0) == (0, 0)
    path.now = 70.0  # a minute of compute
    path.backlog = True
    path.reset_peaks()
    for _ in range(100):  # the next round's chunks, queued at once
        path._submit()
    assert path.window.window_bytes(0) == grown
    assert path.peak_bytes >= 0.9 * grown, "the round after the idle minute restarted from the count"
    path.run(until=71.0)
    assert path.window.window_bytes(0) >= 0.9 * grown  # the fresh shortest round trip is the path's


def test_a_queue_seen_at_the_end_of_a_round_does_not_halve_the_next_round_after_an_idle_spell() -> None:
    path = SimulatedPath(rate=125e6, rtt=0.1)
    path.run(until=5.0)
    grown = path.window.window_bytes(0)
    # The round's last answers all come late (they waited for the other hosts' pushes): read as a queue.
    path.rtt = 0.4
    path.run(until=5.6)
    assert path.window.path(0).queueing
    path.backlog = False
    path.window.drain(0)
    path.run(until=10.0)
    assert path.window.in_flight(0) == (0, 0)
    path.now, path.rtt, path.backlog = 70.0, 0.1, True  # a minute of compute; nothing was on the path
    path._submit()
    assert not path.window.path(0).queueing, "an empty path still counted as queueing"
    assert path.window.window_bytes(0) >= 0.9 * grown


def test_a_failure_drops_the_window_to_its_count_and_it_grows_again() -> None:
    path = SimulatedPath(rate=125e6, rtt=0.1)
    path.run(until=3.0)
    assert path.window.window_bytes(0) > 0
    path.run(until=3.3, failing=True)
    assert path.window.window_bytes(0) == 0
    path.run(until=8.0)
    assert path.window.window_bytes(0) >= path.bdp


def test_connections_follow_the_window_one_send_buffer_each_up_to_the_most() -> None:
    slow = SimulatedPath(rate=125e6, rtt=0.1)
    slow.run(until=5.0)
    # About twice 12.5 MB in flight over 4 MiB send buffers: several connections, not the most.
    assert 4 <= slow.window.connections(0) <= 7
    fast = SimulatedPath(rate=1.25e9, rtt=0.1, settings_of={"max_connections": 8})
    fast.run(until=5.0)
    assert fast.window.connections(0) == 8


def test_without_sizing_to_the_path_the_window_is_its_count() -> None:
    path = SimulatedPath(rate=125e6, rtt=0.1, settings_of={})
    path.window = ShardWindow(1, 2, WindowSettings(sized_to_path=False, path_estimate=lambda: PathEstimate(lambda: 0)))
    for item in range(10):
        path.window.admit(0, item, PUSH)
    assert path.window.in_flight(0) == (2, 2 * PUSH)


def test_the_estimate_forgets_old_samples_and_takes_no_round_trip_from_a_retry() -> None:
    clock = [0.0]
    estimate = PathEstimate(lambda: clock[0])
    sent = estimate.sent()
    clock[0] = 0.1
    estimate.answered(sent, MIB)
    assert estimate.min_rtt == pytest.approx(0.1) and estimate.rate == pytest.approx(MIB / 0.1)
    sent = estimate.sent()
    clock[0] = 0.2
    estimate.answered(sent, MIB, measured=False)  # answered after a retry: counted, not a sample
    assert estimate.min_rtt == pytest.approx(0.1) and estimate.delivered == 2 * MIB
    clock[0] = 30.0  # the samples are old, yet the last of each is kept until a new one comes
    assert estimate.min_rtt == pytest.approx(0.1)
    sent = estimate.sent()
    clock[0] = 30.3
    estimate.answered(sent, MIB)
    assert estimate.min_rtt == pytest.approx(0.3)


@pytest.mark.parametrize(
    ("name", "value"), [("max_bytes", 0), ("max_pushes", -1), ("max_connections", 1.5), ("connection_bytes", 0)]
)
def test_bad_settings_are_refused_naming_the_field(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"{name}={value!r} is invalid; expected"):
        WindowSettings(**{name: value})  # type: ignore[arg-type]
