"""A session's run on the aggregator: named at connect, left at close, exit or garbage collection.

torchrun reruns and restarts scripts with the same job id, and scripts rarely
call ``close()``. So every connect is a new *incarnation* of the job (a uuid
rank 0 draws and broadcasts; the aggregator starts the job afresh on a new one),
and the Leave happens by itself: when the session is closed, when it (or the DDP
model and hook state holding it) is collected, or when the interpreter exits.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import uuid
import weakref

import torch.distributed as dist

from gradq.client.worker import WorkerClient

__all__ = ["EXIT_LEAVE_TIMEOUT_S", "Membership", "draw_run_names"]

log = logging.getLogger(__name__)

# Leave's deadline per shard at interpreter exit: a live aggregator answers in
# milliseconds, and a dead one must not hold the process up for long.
EXIT_LEAVE_TIMEOUT_S = 2.0


def draw_run_names(group: dist.ProcessGroup | None, job_id: str | None) -> tuple[str, str]:
    """(job id, incarnation) for this run, the same on every rank of ``group``.

    Args:
        group: the process group the loop reduces over (a collective: every rank calls this);
            None: this process alone, which draws them itself.
        job_id: the configured job id; None lets rank 0 draw one.

    Returns:
        Rank 0's ``job_id`` (or ``"ddp-<uuid>"`` it drew) and a fresh uuid that
        names this run of the job: a rerun or an elastic restart gets another.

    A rank configured with another job id than rank 0's takes rank 0's (and
    logs a warning), so all of them join one job.
    """
    if group is None:
        return job_id or f"ddp-{uuid.uuid4().hex}", uuid.uuid4().hex
    drawn = [(job_id or f"ddp-{uuid.uuid4().hex}", uuid.uuid4().hex) if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(drawn, src=dist.get_global_rank(group, 0), group=group)
    assert drawn[0] is not None, "broadcast_object_list filled the list"
    shared_job_id, incarnation = (str(name) for name in drawn[0])
    if job_id is not None and job_id != shared_job_id:
        # Raising here would leave the other ranks waiting in the next collective.
        log.warning("job_id=%r differs from rank 0's %r; using rank 0's on every rank", job_id, shared_job_id)
    return shared_job_id, incarnation


class Membership:
    """Leaves the job once: on ``close()``, when ``owner`` is collected, or at interpreter exit.

    Args:
        owner: the object whose lifetime bounds the membership (the session).
        client: the joined client; it must not refer back to ``owner``, or
            ``owner`` would never be collected.
    """

    __slots__ = ("_finalizer",)

    def __init__(self, owner: object, client: WorkerClient) -> None:
        # atexit=False: _leave_all below runs them at exit, with a short deadline.
        self._finalizer = weakref.finalize(owner, _leave, client, os.getpid())
        self._finalizer.atexit = False
        with _LIVE_LOCK:
            _LIVE[:] = [finalizer for finalizer in _LIVE if finalizer.alive]
            _LIVE.append(self._finalizer)

    def close(self) -> None:
        """Leave now (idempotent: later calls do nothing)."""
        self._finalizer()


_LIVE: list[weakref.finalize] = []  # memberships maybe not yet left (pruned as new ones come)
_LIVE_LOCK = threading.Lock()


def _leave(client: WorkerClient, pid: int) -> None:
    if os.getpid() != pid:  # a forked child must not end its parent's membership
        return
    try:
        client.close()
    except Exception as error:  # best effort: the aggregator expires idle jobs anyway
        log.debug("leaving job %r failed: %s", client.job_id, error)


def _leave_all() -> None:
    # Registered at import, so it runs after atexit handlers registered later
    # (atexit is LIFO) and before the interpreter tears modules down, while gRPC
    # still works. The sender threads have been joined already (threading's
    # shutdown runs before atexit), so no push is started behind the Leave.
    with _LIVE_LOCK:
        finalizers = list(_LIVE)
    for finalizer in finalizers:
        alive = finalizer.peek()  # (owner, func, args, kwargs), None once left
        if alive is not None:
            client = alive[2][0]
            client.membership.timeout_s = min(client.membership.timeout_s, EXIT_LEAVE_TIMEOUT_S)
            finalizer()


atexit.register(_leave_all)
