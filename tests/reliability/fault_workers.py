"""Worker processes for the fault tests: real WorkerClients pushing integer gradients step by step."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from types import FrameType

import numpy as np
from waiting import wait_until

from gradq.client import AggregationError, WorkerClient
from gradq.qcore import QuantConfig, Scheme

NUMEL = 64


def gradient(rank: int, step: int) -> np.ndarray:
    """Integer-valued, so every mean of them is exact on the FLOAT32 wire."""
    return (np.arange(NUMEL, dtype=np.float32) + 1) * (rank + 1) * (step + 1)


def exact_mean(world: int, step: int) -> np.ndarray:
    total = np.sum([gradient(rank, step) for rank in range(world)], axis=0, dtype=np.float64)
    return np.asarray(total / world, dtype=np.float32)


def run_worker(
    address: str,
    job: str,
    rank: int,
    world: int,
    steps: int,
    hang_at: int,
    pause_s: float,
    events: mp.Queue,
    stop_at: int = -1,
    keep_going: bool = False,
) -> None:
    """Push ``steps`` steps; report each outcome as (rank, step, ok, detail, seconds).

    At ``hang_at`` the worker hangs for good; at ``stop_at`` it reports
    "stopping" and pushes only after a SIGCONT (the test SIGSTOPs it meanwhile). With ``keep_going`` a failed step
    is reported and the worker goes on to the next, as a training loop that
    skips a failed step would.
    """
    config = QuantConfig(scheme=Scheme.FLOAT32)
    with WorkerClient(address, job, rank, world, config, timeout_s=60, retry_backoff_s=0.1, max_retries=8) as client:
        for step in range(steps):
            if step == hang_at:
                events.put((rank, step, True, "hanging", 0.0))
                threading.Event().wait()  # hangs for good, connections open, until the test kills it
            if step == stop_at:
                continued = threading.Event()
                signal.signal(signal.SIGCONT, _setter(continued))
                events.put((rank, step, True, "stopping", 0.0))  # the test SIGSTOPs us, then SIGCONTs
                # Woken now and then: SIGCONT may land on a gRPC thread, and only the main thread runs its handler.
                while not continued.wait(0.01):
                    pass
            started = time.monotonic()
            try:
                mean = client.push_pull(step, 0, gradient(rank, step))
            except AggregationError as error:
                events.put((rank, step, False, str(error), time.monotonic() - started))
                if keep_going:
                    continue
                return
            exact = bool(np.array_equal(mean, exact_mean(world, step)))
            events.put((rank, step, exact, "exact" if exact else f"inexact: {mean[:4]}", time.monotonic() - started))
            time.sleep(pause_s)  # the step's compute, simulated: the behaviour, not a wait for something


def _setter(event: threading.Event) -> Callable[[int, FrameType | None], None]:
    """A signal handler that sets ``event``."""

    def handle(_signum: int, _frame: FrameType | None) -> None:
        event.set()

    return handle


# One worker's outcome: (rank, step, exact, detail, seconds).
Event = tuple[int, int, bool, str, float]


class Outcomes:
    """One queue per worker: a worker killed while holding its queue's lock blocks no one else."""

    def __init__(self, queues: list[mp.Queue]) -> None:
        self.queues = queues

    def take(self) -> Event | None:
        """The next outcome from any worker, or None while none has come (it never blocks)."""
        for source in self.queues:
            with contextlib.suppress(queue.Empty):
                return source.get_nowait()  # type: ignore[no-any-return]
        return None


def start_workers(
    address: str,
    job: str,
    world: int,
    steps: int,
    hang: dict[int, int] | None = None,
    pause_s: float = 0.0,
    stop: dict[int, int] | None = None,
    keep_going: bool = False,
) -> tuple[Sequence[BaseProcess], Outcomes]:
    """Start ``world`` worker processes; ``hang`` and ``stop`` map a rank to the step it hangs or stops at."""
    context = mp.get_context("spawn")
    queues: list[mp.Queue] = [context.Queue() for _ in range(world)]
    processes = [
        context.Process(
            target=run_worker,
            args=(address, job, rank, world, steps, (hang or {}).get(rank, -1), pause_s, queues[rank]),
            kwargs={"stop_at": (stop or {}).get(rank, -1), "keep_going": keep_going},
            daemon=True,
        )
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    return processes, Outcomes(queues)


def collect(events: Outcomes, count: int, timeout_s: float) -> list[Event]:
    """The next ``count`` outcomes from any worker; fails the test naming what came if they take longer."""
    found: list[Event] = []

    def enough() -> bool:
        while len(found) < count and (event := events.take()) is not None:
            found.append(event)
        return len(found) >= count

    wait_until(enough, f"{count} outcomes", timeout_s, detail=lambda: f"got {found}")
    return found


def gather(
    events: Outcomes, outcomes: dict[tuple[int, int], Event], done: Callable[[], bool], what: str, timeout_s: float
) -> None:
    """Record every outcome in ``outcomes`` by (rank, step) as it comes, until ``done()`` holds.

    Raises:
        AssertionError: ``done()`` did not hold within ``timeout_s``; the message names ``what`` and the outcomes.
    """

    def recorded() -> bool:
        while (event := events.take()) is not None:
            outcomes[event[:2]] = event
        return done()

    wait_until(recorded, what, timeout_s, detail=lambda: f"outcomes by (rank, step): {sorted(outcomes)}")
