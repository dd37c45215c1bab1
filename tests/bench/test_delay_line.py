"""bench/delay_line.py: the delay queue under a fake clock, and a real link between two namespaces.

The real test needs root and /dev/net/tun: it skips without them here and fails under CI (CI=true), which runs
as root.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str) -> ModuleType:
    """A bench module by file (bench/ is no package); delay_line imports nothing else from bench/."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


delay_line = _load("delay_line")


class FakeClock:
    """Seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_frame_is_held_for_the_delay_then_released() -> None:
    clock = FakeClock()
    queue = delay_line.DelayQueue(0.025, clock)
    assert queue.wait_s() is None
    queue.push(b"frame")
    assert queue.wait_s() == pytest.approx(0.025)
    clock.now += 0.024
    assert queue.pop_due() == []
    assert queue.wait_s() == pytest.approx(0.001)
    clock.now += 0.001
    assert queue.pop_due() == [b"frame"]
    assert queue.wait_s() is None and len(queue) == 0


def test_a_round_trip_through_two_queues_takes_twice_the_delay() -> None:
    clock = FakeClock()
    there, back = delay_line.DelayQueue(0.02, clock), delay_line.DelayQueue(0.02, clock)
    sent_at = clock.now
    there.push(b"ping")
    answered = None
    while answered is None:  # the process's loop: sleep until the next frame is due, release it, answer it
        waits = [wait for wait in (there.wait_s(), back.wait_s()) if wait is not None]
        clock.now += min(waits)
        for frame in there.pop_due():
            back.push(frame.replace(b"ping", b"pong"))
        for frame in back.pop_due():
            answered = frame
    assert answered == b"pong"
    assert clock.now - sent_at == pytest.approx(0.04)


def test_every_byte_arrives_in_order_whatever_the_timing() -> None:
    clock = FakeClock()
    queue = delay_line.DelayQueue(0.01, clock)
    generator = random.Random(7)
    frames = [generator.randbytes(generator.randint(1, 16000)) for _ in range(2000)]
    delivered: list[bytes] = []
    for frame in frames:
        queue.push(frame)
        clock.now += generator.choice((0.0, 0.0001, 0.003, 0.02))  # bursts, gaps, pauses longer than the delay
        delivered += queue.pop_due()
    clock.now += 0.01
    delivered += queue.pop_due()
    assert delivered == frames
    assert queue.bytes_in == queue.bytes_out == sum(map(len, frames))
    assert queue.dropped == 0


def test_a_full_queue_drops_and_counts_instead_of_growing() -> None:
    queue = delay_line.DelayQueue(1.0, FakeClock(), limit_bytes=10)
    assert queue.push(b"123456") and not queue.push(b"12345") and queue.push(b"1234")
    assert (queue.dropped, queue.queued_bytes) == (1, 10)


@pytest.mark.parametrize(
    ("delay_s", "limit", "message"),
    [(-0.001, 1, "delay_s=-0.001 is invalid"), (float("nan"), 1, "delay_s=nan is invalid"), (0.0, 0, "limit_bytes=0")],
)
def test_bad_settings_are_refused_by_name(delay_s: float, limit: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        delay_line.DelayQueue(delay_s, FakeClock(), limit_bytes=limit)


def test_a_bad_end_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="end='gq0' is invalid; expected NAMESPACE:DEVICE"):
        delay_line.parse_end("gq0")


# -- a real link between two namespaces ---------------------------------------------------------------

ONE_WAY_S = 0.02
NAMESPACES = (f"gradq-dlt{os.getpid()}-a", f"gradq-dlt{os.getpid()}-b")
ADDRESSES = ("10.78.0.1", "10.78.0.2")


def _require_root_and_tun() -> None:
    missing = [
        what for what, ok in (("root", os.geteuid() == 0), ("/dev/net/tun", Path("/dev/net/tun").exists())) if not ok
    ]
    if not missing:
        return
    message = f"the real delay line needs {' and '.join(missing)}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"under CI=true: {message}")
    pytest.skip(message)


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True)


@pytest.fixture
def linked_namespaces() -> Iterator[None]:
    """Two namespaces joined by a delay line of ONE_WAY_S each way; everything is deleted afterwards."""
    _require_root_and_tun()
    line = None
    try:
        for namespace in NAMESPACES:
            _ip("netns", "add", namespace)
        line = delay_line.start_delay_line((NAMESPACES[0], "dl0"), (NAMESPACES[1], "dl0"), ONE_WAY_S)
        for namespace, address in zip(NAMESPACES, ADDRESSES, strict=True):
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "dl0")
            _ip("-n", namespace, "link", "set", "dl0", "mtu", str(delay_line.DEFAULT_MTU), "up")
        yield
    finally:
        if line is not None:
            line.stop()
        for namespace in NAMESPACES:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
    assert line is not None and line.process.poll() is not None  # the process is gone, and its devices with it


def test_a_real_link_delays_each_way_and_delivers_every_byte(linked_namespaces: None) -> None:
    with delay_line.in_namespace(NAMESPACES[1]):
        server = socket.create_server((ADDRESSES[1], 0))
    with delay_line.in_namespace(NAMESPACES[0]):
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    payload = random.Random(3).randbytes(4 << 20)
    received = hashlib.sha256()
    with server, client:
        client.settimeout(10.0)
        client.connect(server.getsockname())
        peer, _ = server.accept()
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with peer:
            round_trips = []
            for _ in range(5):
                started = time.perf_counter()
                client.sendall(b"?")
                assert peer.recv(1) == b"?"
                peer.sendall(b"!")
                assert client.recv(1) == b"!"
                round_trips.append(time.perf_counter() - started)
            # ARP and the first echo may add a little; the best of five is the line's own round trip.
            assert 2 * ONE_WAY_S <= min(round_trips) <= 2 * ONE_WAY_S * 1.05 + 0.002

            def drain() -> None:
                while data := peer.recv(1 << 20):
                    received.update(data)

            reader = threading.Thread(target=drain)
            reader.start()
            client.sendall(payload)
            client.shutdown(socket.SHUT_WR)
            reader.join(timeout=15.0)
            assert not reader.is_alive()
    assert received.digest() == hashlib.sha256(payload).digest()
