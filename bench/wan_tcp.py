"""Raw TCP between two emulated hosts: round trips, steady throughput of N streams, a fresh transfer of N bytes.

Both ends live in this one process: each socket is created inside its host's
namespace (delay_line.in_namespace) and stays there, so no helper process runs
in the namespaces. Needs root. Used by bench/wan.py for the validation report
and beside every gradq row.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from dataclasses import dataclass

from delay_line import in_namespace

__all__ = ["Endpoints", "median_ms", "round_trips", "throughput", "transfer_seconds"]

_BLOCK = 1 << 20
_CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Who sends to whom: the client's namespace, the server's namespace and address, a free port there."""

    client_namespace: str
    server_namespace: str
    server_address: str
    port: int


def _listen(ends: Endpoints, backlog: int) -> socket.socket:
    with in_namespace(ends.server_namespace):
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((ends.server_address, ends.port))
    server.listen(backlog)
    return server


def _connect(ends: Endpoints) -> socket.socket:
    with in_namespace(ends.client_namespace):
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.settimeout(_CONNECT_TIMEOUT_S)
    client.connect((ends.server_address, ends.port))
    client.settimeout(None)
    return client


def round_trips(ends: Endpoints, count: int = 20) -> list[float]:
    """Seconds of ``count`` one-byte TCP echoes on one connection (Nagle off), after one untimed echo."""
    server = _listen(ends, 1)
    client = _connect(ends)
    peer, _ = server.accept()
    server.close()

    def echo() -> None:
        while data := peer.recv(1):
            peer.sendall(data)

    echoer = threading.Thread(target=echo, daemon=True)
    echoer.start()
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    try:
        for index in range(count + 1):
            started = time.perf_counter()
            client.sendall(b"x")
            if client.recv(1) != b"x":
                raise RuntimeError("the echo came back wrong")
            if index:
                times.append(time.perf_counter() - started)
    finally:
        client.close()
        echoer.join(timeout=5.0)
        peer.close()
    return times


class _Sink:
    """Accepts ``streams`` connections and counts what arrives on all of them."""

    def __init__(self, server: socket.socket, streams: int) -> None:
        self.received = 0
        self._lock = threading.Lock()
        self._server = server
        self._threads = [threading.Thread(target=self._accept_one, daemon=True) for _ in range(streams)]
        for thread in self._threads:
            thread.start()

    def _accept_one(self) -> None:
        peer, _ = self._server.accept()
        buffer = bytearray(_BLOCK)
        with peer:
            while count := peer.recv_into(buffer):
                with self._lock:
                    self.received += count

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


def throughput(ends: Endpoints, streams: int, seconds: float) -> tuple[float, float]:
    """(steady, overall) bytes per second of ``streams`` connections sending for ``seconds``.

    Steady counts the second half of the run only (after slow start); overall counts from the first connect.
    Both are measured at the receiver.
    """
    server = _listen(ends, streams)
    sink = _Sink(server, streams)
    started = time.monotonic()
    clients = [_connect(ends) for _ in range(streams)]
    stop = threading.Event()

    def send(client: socket.socket) -> None:
        block = b"\0" * _BLOCK
        try:
            while not stop.is_set():
                client.sendall(block)
        finally:
            client.close()

    senders = [threading.Thread(target=send, args=(client,), daemon=True) for client in clients]
    for sender in senders:
        sender.start()
    time.sleep(seconds / 2)  # the run's length, not a synchronisation: the receiver counts whatever arrived
    middle, at_middle = time.monotonic(), sink.received
    time.sleep(seconds / 2)
    ended, at_end = time.monotonic(), sink.received
    stop.set()
    for sender in senders:
        sender.join(timeout=10.0)
    sink.join(10.0)
    server.close()
    return (at_end - at_middle) / (ended - middle), at_end / (ended - started)


def transfer_seconds(ends: Endpoints, streams: int, total_bytes: int) -> float:
    """Seconds from the first connect until ``total_bytes`` (split evenly over ``streams`` new connections) arrived."""
    server = _listen(ends, streams)
    sink = _Sink(server, streams)
    share = -(-total_bytes // streams)
    started = time.monotonic()
    clients = [_connect(ends) for _ in range(streams)]

    def send(client: socket.socket) -> None:
        view = memoryview(b"\0" * share)
        with client:
            client.sendall(view)

    senders = [threading.Thread(target=send, args=(client,), daemon=True) for client in clients]
    for sender in senders:
        sender.start()
    sink.join(120.0)  # every stream ends when its sender closes: joined means all arrived
    ended = time.monotonic()
    server.close()
    if sink.received != share * streams:
        raise RuntimeError(f"received {sink.received} bytes of {share * streams}")
    return ended - started


def median_ms(times: list[float]) -> float:
    """Median of ``times`` (seconds) in milliseconds."""
    return statistics.median(times) * 1e3
