"""What a training loop tells its user: one log line per event on the ``gradq`` logger, and a summary at the end.

torchft, Lightning and Accelerate print a line when a job forms, loses or gains
a replica, and what a run cost when it ends; gradq's loops do the same on
Python's ``logging`` (loggers named under ``gradq``): connected (aggregator,
job, grid), hosts lost and joined as a survivor sees them, this host dropped
and rejoined, a fallback taken, and a summary of the whole run (steps, rounds,
bytes sent against the tensors' own dtype, rejoins, failed rounds). The first
rank of each host speaks; the host's other ranks say nothing, as Lightning's
rank-zero logging.

Python shows nothing below WARNING until a program configures logging, so a
plain ``python train.py`` would see none of it. As Lightning does for its own
logger: when the process has configured no logging at all (the root logger has
no handler), the ``gradq`` logger gets one stderr handler at INFO, once. A
program that configures logging keeps its own setup (``logging.getLogger("gradq")
.setLevel(logging.WARNING)`` quiets gradq's lines).

Thread model: a session's counts are written by gRPC's threads (a round's
future completing) and read at the end, under one lock each.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any

from gradq.client.elastic import JobWorld
from gradq.client.stats import ClientStats
from gradq.qcore import codec_for

if TYPE_CHECKING:
    from gradq.client.config import GradqConfig
    from gradq.client.session.host_groups import HostGroup
    from gradq.client.worker import WorkerClient

__all__ = ["LOGGER_NAME", "SessionEvents", "TrainingSummary", "show_gradq_logs"]

LOGGER_NAME = "gradq"  # every module's logger is named under it (gradq.client...), so one switch quiets them all
log = logging.getLogger(__name__)

_SHOWN = threading.Event()  # show_gradq_logs ran once in this process
_SHOW_LOCK = threading.Lock()


def show_gradq_logs() -> None:
    """Give the ``gradq`` logger a stderr handler at INFO, once, if the process configured no logging at all.

    Called when a loop connects: a program that set up logging before (any
    handler on the root logger, a level or handler on ``gradq``) keeps it as it is.
    """
    with _SHOW_LOCK:
        if _SHOWN.is_set():
            return
        _SHOWN.set()
        logger = logging.getLogger(LOGGER_NAME)
        if logging.getLogger().handlers or logger.handlers:
            return
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s gradq %(levelname)s: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
        # The handler is gradq's own: a root handler added later must not print each line twice (as Lightning).
        logger.propagate = False


class SessionEvents:
    """One connected session's events for the user: connected, hosts lost and joined, rounds that failed.

    The session owns it; a TrainingSummary keeps it after the session closes
    (it holds the worker client for its figures, never the session).

    Args:
        job_id: the job the session joined.
        client: the joined worker client (None under a fallback).
        speaks: this rank logs for its host (the host's first rank).
        mode: "gradq", or the fallback the session's ranks took.
    """

    __slots__ = ("_lock", "_members", "client", "failed_rounds", "job_id", "mode", "rejoins", "speaks")

    def __init__(self, job_id: str, client: WorkerClient | None, speaks: bool, mode: str = "gradq") -> None:
        self.job_id, self.client, self.speaks, self.mode = job_id, client, speaks, mode
        self.failed_rounds = 0  # rounds whose future failed (the error itself goes to the loop)
        self.rejoins = 0  # the member's rejoins before and by this session (gradq.client.session.member)
        self._members: frozenset[int] | None = None  # the job's members at the last look
        self._lock = threading.Lock()  # futures fail on gRPC threads

    def connected(self, config: GradqConfig, host: HostGroup) -> None:
        """The session joined the job: where, which job, on which grid."""
        if not self.speaks or self.client is None:
            return
        quant = config.quant
        if config.elastic_hosts:
            place = f"elastic, member {host.host}, starts with {config.elastic_hosts} hosts"
        else:
            place = f"fixed, {host.hosts} member(s)"
        codec = codec_for(quant.scheme)
        if codec.sparse:  # what is kept of each chunk, not bits per element, says what it sends
            grid = f"top {quant.topk} of every {quant.channel_size} entries"
        else:
            grid = f"at {codec.wire_bits(quant)} bits"
        log.info(
            "connected to aggregator %s: job %s (%s), %s %s, error feedback %s",
            ",".join(config.addresses),
            self.job_id,
            place,
            quant.scheme.name.lower(),
            grid,
            "on" if config.error_feedback else "off",
        )

    def round_ended(self, future: Any) -> None:
        """A round's future completed: count it if it failed (a done-callback of ``reduce``'s future)."""
        try:
            future.value()
        except Exception:  # the loop receives the error itself; here it is only counted
            with self._lock:
                self.failed_rounds += 1

    def see_world(self, world: JobWorld | None) -> None:
        """Elastic: say which hosts left or joined the job since the last look (at a step boundary)."""
        if world is None:
            return
        members = frozenset(world.members)
        with self._lock:
            before, self._members = self._members, members
        if before is None or before == members or not self.speaks:
            return
        lost, joined = sorted(before - members), sorted(members - before)
        now = f"{len(members)} host(s) train now: members {sorted(members)}"
        if lost:
            log.info("job %s lost host(s) %s (dropped or left); %s", self.job_id, _ids(lost), now)
        if joined:
            log.info("host(s) %s joined job %s; %s", _ids(joined), self.job_id, now)


class TrainingSummary:
    """An adapter's run in figures, over every session it connected (a rejoin connects another); logged once.

    Logged at the adapter's ``close()``, when the adapter is collected, or at
    interpreter exit, whichever comes first. It never refers to the adapter
    (that would keep it alive): the adapter counts into it.

    Args:
        owner: the adapter whose end ends the run (a GradqHookState, a DiLoCo).
        loop: what trained, for the line ("DDP hook", "DiLoCo").
    """

    __slots__ = ("__weakref__", "_finalizer", "_lock", "_sessions", "late_rounds", "loop", "rejoins", "rounds", "steps")

    def __init__(self, owner: object, loop: str) -> None:
        self.loop = loop
        self.steps = 0  # steps trained in this process (DiLoCo: inner steps)
        self.rounds = 0  # DiLoCo: outer rounds this host took part in
        self.rejoins = 0  # times this host was dropped (silent past the keepalive) and joined again
        self.late_rounds = 0  # semi-synchronous DiLoCo: rounds this host was late for
        self._sessions: list[SessionEvents] = []
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(owner, self._log)

    def attach(self, events: SessionEvents) -> None:
        """A session the adapter connected: its figures count from now on, and its member's rejoins."""
        with self._lock:
            self._sessions.append(events)
            self.rejoins = max(self.rejoins, events.rejoins)

    def close(self) -> None:
        """The run ended: log the summary now (once; later calls do nothing)."""
        self._finalizer()

    def figures(self) -> tuple[ClientStats | None, int]:
        """The worker clients' figures summed over the run's sessions (None without one), and its failed rounds."""
        with self._lock:
            sessions = list(self._sessions)
        stats = [events.client.stats() for events in sessions if events.client is not None]
        return (_sum(stats) if stats else None), sum(events.failed_rounds for events in sessions)

    def line(self) -> str:
        """The summary, one line."""
        with self._lock:
            job = self._sessions[-1].job_id if self._sessions else "?"
            fallbacks = sorted({events.mode for events in self._sessions} - {"gradq"})
        stats, failed = self.figures()
        done = (
            f"{self.rounds} outer rounds, {self.steps} inner steps" if self.loop == "DiLoCo" else f"{self.steps} steps"
        )
        parts = [f"training summary of job {job} ({self.loop}): {done}"]
        if stats is None or not stats.uncompressed_bytes:
            fallback = f" (fallback {', '.join(fallbacks)})" if fallbacks else ""
            parts.append(f"no bytes through gradq{fallback}")
        else:
            dtype = stats.dtype or "float32"
            parts.append(
                f"sent {_size(stats.bytes_sent)} for {_size(stats.uncompressed_bytes)} of {dtype} "
                f"({stats.bytes_sent / stats.uncompressed_bytes:.3f}x of {dtype}, {stats.compression_ratio:.1f}x "
                f"smaller), received {_size(stats.bytes_received)}, {stats.pushes} pushes"
            )
        late = f", late rounds {self.late_rounds}" if self.loop == "DiLoCo" else ""
        skipped = (stats.skipped_rounds, stats.partial_rounds) if stats is not None else (0, 0)
        parts.append(
            f"rejoins {self.rejoins}{late}, failed rounds {failed}, skipped rounds {skipped[0]}, "
            f"partial rounds {skipped[1]}"
        )
        return "; ".join(parts)

    def _log(self) -> None:
        with self._lock:
            speaks = any(events.speaks for events in self._sessions)
        if speaks:
            log.info("%s", self.line())


def _sum(stats: list[ClientStats]) -> ClientStats:
    """One ClientStats for several clients' (a rejoin's new client counts from zero): totals summed."""
    pushes = sum(one.pushes for one in stats)
    dtypes = sorted({part for one in stats for part in one.dtype.split("+") if part})
    return ClientStats(
        pushes=pushes,
        encode_seconds=sum(one.encode_seconds for one in stats),
        network_seconds=sum(one.network_seconds for one in stats),
        decode_seconds=sum(one.decode_seconds for one in stats),
        bytes_sent=sum(one.bytes_sent for one in stats),
        bytes_received=sum(one.bytes_received for one in stats),
        uncompressed_bytes=sum(one.uncompressed_bytes for one in stats),
        dtype="+".join(dtypes),
        relative_error=sum(one.relative_error * one.pushes for one in stats) / max(pushes, 1),
        skipped_rounds=sum(one.skipped_rounds for one in stats),
        partial_rounds=sum(one.partial_rounds for one in stats),
    )


def _size(count: int) -> str:
    """Bytes as a person reads them: 812 B, 35.2 kB, 1.25 MB, 3.10 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.{2 if scale > 1e3 else 1}f} {unit}"
    return f"{count} B"


def _ids(members: list[int]) -> str:
    return ", ".join(str(member) for member in members)
