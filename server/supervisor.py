"""`gradq serve --shards N`: run N shard processes and keep them up until SIGTERM, or until all of them are done.

Each shard is a whole `gradq serve` child on its own port (the parent's
flags, then its port, metrics port and group), so nothing in a shard knows
it was started here. The parent:

- restarts a shard that dies (a crash, an OOM kill, SIGKILL) on the same port
  and logs it; its rounds in flight fail or are retried by the workers as
  after any aggregator restart, and the next round rejoins it;
- on SIGTERM or SIGINT sends every shard SIGTERM (each stops gracefully within
  its --grace) and exits 0;
- leaves a shard that exits 0 by itself (--exit-after-jobs) stopped, and
  exits 0 once every shard has;
- stops them all and exits with the shard's status when one cannot start
  at all (its own message says why, e.g. its port is in use), or 1 when one
  keeps failing to start again.

The children run in a session of their own (a terminal's Ctrl-C reaches the
parent, which stops them in order) and, on Linux, get SIGTERM if the parent
itself is killed, so none outlives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from gradq.server.shard_plan import ShardPlan

__all__ = ["ShardSupervisor"]

log = logging.getLogger(__name__)

# How often the parent looks at its children (a dead shard is restarted within this).
_POLL_S = 0.05
# How long a shard may take from its start to serving before it counts as failed to start.
_START_TIMEOUT_S = 60.0
# Failed starts in a row after which the parent gives up on a shard (and stops the others).
_MAX_FAILED_STARTS = 5
# Pause before the k-th restart in a row that failed to serve: 0.5 s doubling, at most this.
_MAX_BACKOFF_S = 5.0
# Beyond a shard's --grace, how long the parent waits at a stop before it kills what is left.
_STOP_SLACK_S = 5.0
_PR_SET_PDEATHSIG = 1


@dataclass
class _Shard:
    """One shard's child process and what the parent knows of it."""

    index: int
    port: int
    command: list[str]
    port_file: Path
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    serving: bool = False
    done: bool = False  # exited 0 by itself: not restarted
    failed_starts: int = 0
    restarts: int = 0
    retry_at: float = 0.0
    ever_served: bool = False  # served at least once: a later death is restarted, not fatal


class ShardSupervisor:
    """Start the shards of ``plan``, keep them up, stop them (see the module docstring).

    Args:
        plan: each shard's ports and the group they report.
        argv: the parent's own `gradq serve` arguments, given to every shard
            before its own (later flags win, so each shard's port, metrics port
            and group override the parent's).
        port_file: where to write the shards' ports, one a line, once all serve (None: nowhere).
        grace_s: the shards' --grace, which bounds how long a stop waits for them.
    """

    def __init__(self, plan: ShardPlan, argv: Sequence[str], port_file: Path | None, grace_s: float) -> None:
        self.plan = plan
        self.port_file = port_file
        self.grace_s = grace_s
        self._stop = threading.Event()
        self._signal: str | None = None
        self._files = tempfile.TemporaryDirectory(prefix="gradq-shards-")
        group = ",".join(plan.group)
        self.shards = []
        for index, (port, metrics_port) in enumerate(zip(plan.ports, plan.metrics_ports, strict=True)):
            port_path = Path(self._files.name) / f"shard-{index}.port"
            own = ["--shards", "1", "--shard-ports", str(port), "--shard-group", group, "--port-file", str(port_path)]
            if metrics_port is not None:
                own += ["--metrics-port", str(metrics_port)]
            command = [sys.executable, "-m", "gradq.server", *argv, *own]
            self.shards.append(_Shard(index, port, command, port_path))

    def stop_on_signals(self) -> None:
        """Stop every shard on SIGTERM or SIGINT (call from the main thread)."""

        def handle(signum: int, _frame: FrameType | None) -> None:
            self._signal = signal.Signals(signum).name
            self._stop.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, handle)

    def run(self) -> int:
        """Start the shards and supervise them until a stop; returns the exit status for the parent."""
        try:
            return self._run()
        finally:
            self._stop_all()
            self._files.cleanup()

    def _run(self) -> int:
        count = len(self.shards)
        log.info(
            "starting %d shards on ports %s (group %s)",
            count,
            ",".join(map(str, self.plan.ports)),
            ",".join(self.plan.group),
        )
        for shard in self.shards:
            self._start(shard)
        announced = False
        while not self._stop.wait(_POLL_S):
            now = time.monotonic()
            for shard in self.shards:
                status = self._look_at(shard, now)
                if status is not None:
                    return status
            if not announced and all(shard.ever_served for shard in self.shards):
                announced = True
                if self.port_file is not None:
                    self.port_file.write_text("".join(f"{shard.port}\n" for shard in self.shards))
                log.info("all %d shards serving on ports %s", count, ",".join(map(str, self.plan.ports)))
            if all(shard.done for shard in self.shards):
                log.info("every shard exited by itself (status 0); stopping")
                return 0
        log.info("received %s: stopping %d shards", self._signal or "a stop", count)
        return 0

    def _look_at(self, shard: _Shard, now: float) -> int | None:
        """Advance one shard: serving, exited, due for a restart; an exit status when the parent must stop."""
        if shard.done:
            return None
        process = shard.process
        if process is None:  # waiting out a restart's pause
            if now >= shard.retry_at:
                self._start(shard)
            return None
        code = process.poll()
        if code is None:
            if not shard.serving and shard.port_file.exists() and shard.port_file.read_text().strip():
                shard.serving = shard.ever_served = True
                shard.failed_starts = 0
                if shard.restarts:
                    log.info("shard %d serving again on port %d (restart %d)", shard.index, shard.port, shard.restarts)
            elif not shard.serving and now - shard.started_at > _START_TIMEOUT_S:
                log.error("shard %d did not serve within %.0f s; killing it", shard.index, _START_TIMEOUT_S)
                process.kill()
            return None
        shard.process = None
        if code == 0:
            shard.done = True
            log.info("shard %d (port %d) exited by itself (status 0)", shard.index, shard.port)
            return None
        if not shard.ever_served:
            log.error(
                "shard %d (port %d) could not start (%s); stopping the other shards",
                shard.index,
                shard.port,
                _described(code),
            )
            return code if code > 0 else 1
        if not shard.serving:
            shard.failed_starts += 1
            if shard.failed_starts >= _MAX_FAILED_STARTS:
                log.error(
                    "shard %d (port %d) failed to start again %d times in a row (%s); stopping the other shards",
                    shard.index,
                    shard.port,
                    shard.failed_starts,
                    _described(code),
                )
                return 1
        pause = 0.0 if shard.failed_starts == 0 else min(0.5 * 2 ** (shard.failed_starts - 1), _MAX_BACKOFF_S)
        log.warning(
            "shard %d (port %d) died (%s); restarting it on port %d%s",
            shard.index,
            shard.port,
            _described(code),
            shard.port,
            f" in {pause:g} s" if pause else "",
        )
        shard.restarts += 1
        shard.retry_at = now + pause
        return None

    def _start(self, shard: _Shard) -> None:
        shard.port_file.unlink(missing_ok=True)
        shard.serving = False
        shard.started_at = time.monotonic()
        shard.process = subprocess.Popen(shard.command, start_new_session=True, preexec_fn=_die_with_parent)

    def _stop_all(self) -> None:
        """SIGTERM to every live shard; whatever is left after its grace is killed."""
        live = [shard.process for shard in self.shards if shard.process is not None and shard.process.poll() is None]
        for process in live:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s + _STOP_SLACK_S
        for process in live:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("shard process %d did not stop within %.0f s; killing it", process.pid, self.grace_s)
                process.kill()
                process.wait()


def _described(code: int) -> str:
    """A child's exit, in words: "exit status 2" or "killed by SIGKILL"."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
