"""A propagation delay between two network namespaces, built from TAP devices (this kernel has no netem).

One process per link: it owns a TAP device in each of two namespaces and copies
every frame read from one to the other after a fixed one-way delay, in order,
per direction (one reader and one timed writer thread per direction). The
timing is ``DelayQueue``, a small pure class driven by an injected clock so it
can be tested without root. A rate limit is tc's tbf on the TAP devices
themselves (their egress is what the process reads), as bench/netns.py does
for veths. Frames are large (MTU 16000 by default) to keep the packet rate, and
so this process's CPU, low.

The process is started by ``start_delay_line`` (which waits for both devices to
exist) and is ended by ``DelayLineProcess.stop``; its devices vanish with it.
Needs root (``/dev/net/tun`` and ``setns``).

Run by hand::

    python bench/delay_line.py --left NS_A:DEV_A --right NS_B:DEV_B --delay-ms 25
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import fcntl
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "DEFAULT_MTU",
    "DelayLineProcess",
    "DelayQueue",
    "in_namespace",
    "start_delay_line",
]

DEFAULT_MTU = 16000  # large frames keep the packet rate (and this process's CPU) low
QUEUE_LIMIT_BYTES = 256 << 20  # tail drop beyond this: only an unshaped link at a long delay gets near it
READY_TIMEOUT_S = 10.0
_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_NETNS_DIR = Path("/var/run/netns")
_READ_SIZE = 1 << 16  # more than any frame at an MTU up to 65535
_READY = "ready"


class DelayQueue:
    """Frames released in arrival order once ``delay_s`` has passed since each was pushed.

    Thread-safe for one pusher and one popper (a deque's append and popleft are atomic):
    the reader pushes, the writer pops.

    Args:
        delay_s: one-way delay, >= 0.
        clock: seconds on a monotonic clock (``time.monotonic`` in the process, a fake in tests).
        limit_bytes: frames pushed while this much is queued are dropped (and counted), as a full queue would.
    """

    def __init__(
        self, delay_s: float, clock: Callable[[], float] = time.monotonic, limit_bytes: int = QUEUE_LIMIT_BYTES
    ) -> None:
        if not delay_s >= 0.0:
            raise ValueError(f"delay_s={delay_s!r} is invalid; expected a delay >= 0 seconds")
        if limit_bytes < 1:
            raise ValueError(f"limit_bytes={limit_bytes!r} is invalid; expected >= 1")
        self.delay_s = delay_s
        self._clock = clock
        self._limit_bytes = limit_bytes
        self._frames: collections.deque[tuple[float, bytes]] = collections.deque()
        self.bytes_in = 0  # written by the pusher only
        self.bytes_out = 0  # written by the popper only
        self.dropped = 0  # frames refused at the limit, or that the far device refused

    def __len__(self) -> int:
        return len(self._frames)

    @property
    def queued_bytes(self) -> int:
        """Bytes pushed and not yet popped (dropped frames excluded)."""
        return self.bytes_in - self.bytes_out

    def push(self, frame: bytes) -> bool:
        """Queue ``frame`` to be due ``delay_s`` from now; False (and counted) when the queue is full."""
        if self.queued_bytes + len(frame) > self._limit_bytes:
            self.dropped += 1
            return False
        # bytes_in first: the popper may subtract this frame's size as soon as it is in the deque.
        self.bytes_in += len(frame)
        self._frames.append((self._clock() + self.delay_s, frame))
        return True

    def wait_s(self) -> float | None:
        """Seconds until the oldest frame is due (0 when it is already due); None when nothing is queued."""
        if not self._frames:
            return None
        return max(0.0, self._frames[0][0] - self._clock())

    def pop_due(self) -> list[bytes]:
        """Every frame due now, oldest first (possibly none)."""
        now = self._clock()
        due = []
        while self._frames and self._frames[0][0] <= now:
            frame = self._frames.popleft()[1]
            self.bytes_out += len(frame)
            due.append(frame)
        return due


# -- namespaces and TAP devices (root only) ---------------------------------------------------------


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"setns failed: {os.strerror(error)}")


@contextmanager
def in_namespace(namespace: str) -> Iterator[None]:
    """Run the body with the calling thread in network namespace ``namespace`` (from ``ip netns add``).

    Sockets and devices created inside stay in that namespace after the thread returns to its own.

    Raises:
        FileNotFoundError: no namespace of that name exists.
    """
    path = _NETNS_DIR / namespace
    if not path.exists():
        raise FileNotFoundError(f"namespace={namespace!r} does not exist; expected one listed by `ip netns list`")
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(path, os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(target)
        os.close(own)


def _open_tap(namespace: str, device: str) -> int:
    """A file descriptor of a new TAP device ``device`` in ``namespace`` (frames without a packet-info header)."""
    if not 0 < len(device.encode()) < 16:
        raise ValueError(f"device={device!r} is invalid; expected a Linux interface name of 1-15 bytes")
    with in_namespace(namespace):
        fd = os.open("/dev/net/tun", os.O_RDWR)
        try:
            fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", device.encode(), _IFF_TAP | _IFF_NO_PI))
        except BaseException:
            os.close(fd)
            raise
    return fd


def parse_end(text: str) -> tuple[str, str]:
    """(namespace, device) of ``NAMESPACE:DEVICE``.

    Raises:
        ValueError: ``text`` is not ``NAMESPACE:DEVICE`` with both parts non-empty.
    """
    namespace, _, device = text.partition(":")
    if not namespace or not device:
        raise ValueError(f"end={text!r} is invalid; expected NAMESPACE:DEVICE such as 'gradq-w0:gq0'")
    return namespace, device


# -- the process ------------------------------------------------------------------------------------


def _read_into(source: int, queue: DelayQueue, wake: threading.Event, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            frame = os.read(source, _READ_SIZE)
        except OSError:
            if stop.is_set():
                return
            raise
        queue.push(frame)
        wake.set()


def _write_from(target: int, queue: DelayQueue, wake: threading.Event, stop: threading.Event) -> None:
    while not stop.is_set():
        wake.clear()  # before looking: a frame pushed after this sets it again, so the wait cannot miss it
        wait_s = queue.wait_s()
        if wait_s is None:
            wake.wait(0.5)
        elif wait_s > 0.0:
            time.sleep(wait_s)  # a frame pushed meanwhile is due later still: nothing to wake for
        for frame in queue.pop_due():
            try:
                os.write(target, frame)
            except OSError:  # the device went down (or is full): the frame is lost, as on a wire
                queue.dropped += 1


def run_link(left: tuple[str, str], right: tuple[str, str], delay_s: float) -> None:
    """Open both TAP devices, say ``ready`` on stdout, then carry frames both ways until SIGTERM."""
    # A parent killed outright (SIGKILL) cannot stop its links: the kernel does, the moment it dies.
    if ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError("prctl(PR_SET_PDEATHSIG) failed")
    fds = [_open_tap(*left), _open_tap(*right)]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    threads = []
    for source, target in ((fds[0], fds[1]), (fds[1], fds[0])):
        queue, wake = DelayQueue(delay_s), threading.Event()
        threads.append(threading.Thread(target=_read_into, args=(source, queue, wake, stop), daemon=True))
        threads.append(threading.Thread(target=_write_from, args=(target, queue, wake, stop), daemon=True))
    sys.setswitchinterval(0.0005)  # a writer due now should not wait 5 ms for a reader to yield the GIL
    for thread in threads:
        thread.start()
    print(_READY, flush=True)
    while not stop.is_set():
        # The main thread only waits for SIGTERM; a dead copier thread ends the process (and the devices).
        select.select([], [], [], 0.5)
        if not all(thread.is_alive() for thread in threads):
            raise RuntimeError("a copier thread died; the link is broken")
    # The descriptors close with the process; closing them under a blocked read would race it.


class DelayLineProcess:
    """A running delay-line process; ``stop()`` (idempotent) ends it, which deletes its devices."""

    def __init__(self, process: subprocess.Popen[str], left: tuple[str, str], right: tuple[str, str]) -> None:
        self.process = process
        self.left = left
        self.right = right

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=3.0)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def start_delay_line(left: tuple[str, str], right: tuple[str, str], delay_s: float) -> DelayLineProcess:
    """Start the process joining ``left`` and ``right`` ((namespace, device) each); returns once both devices exist.

    The devices are created down and without addresses: the caller sets MTU, addresses and state with ``ip``.

    Raises:
        ValueError: ``delay_s`` is negative.
        RuntimeError: the process did not report ready within READY_TIMEOUT_S; it has been stopped.
    """
    if not delay_s >= 0.0:
        raise ValueError(f"delay_s={delay_s!r} is invalid; expected a one-way delay >= 0 seconds")
    argv = [sys.executable, str(Path(__file__).resolve()), "--left", ":".join(left), "--right", ":".join(right)]
    argv += ["--delay-ms", repr(delay_s * 1e3)]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = DelayLineProcess(process, left, right)
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], READY_TIMEOUT_S)
    if not ready or process.stdout.readline().strip() != _READY:
        line.stop()
        error = process.stderr.read() if process.stderr is not None else ""
        raise RuntimeError(f"the delay line {left} <-> {right} did not start within {READY_TIMEOUT_S:.0f} s: {error}")
    return line


def main(argv: Sequence[str] | None = None) -> int:
    """The delay-line process: ``--left NS:DEV --right NS:DEV --delay-ms MS``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--left", type=parse_end, required=True, help="NAMESPACE:DEVICE of one end")
    parser.add_argument("--right", type=parse_end, required=True, help="NAMESPACE:DEVICE of the other end")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay in each direction")
    args = parser.parse_args(argv)
    if not args.delay_ms >= 0.0:
        parser.error(f"--delay-ms={args.delay_ms!r} is invalid; expected >= 0")
    run_link(args.left, args.right, args.delay_ms / 1e3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
