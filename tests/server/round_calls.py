"""Drive a RoundTable from a test's threads as the servicer drives it from its event loop: admit, add, watch, answer."""

from __future__ import annotations

import threading

from gradq.qcore import QuantizedArray
from gradq.server.rounds import RoundResult, RoundTable, RoundTicket

__all__ = ["contribute", "push", "wait"]


def push(
    table: RoundTable,
    job_id: str,
    step: int,
    bucket: int,
    rank: int,
    tensor: QuantizedArray,
    non_finite: bool = False,
    incarnation: str = "",
) -> RoundTicket:
    """Add ``rank``'s bucket to round (job, step, bucket) as a PushPull does; returns at once."""
    ticket = table.admit(job_id, step, bucket, rank, tensor, incarnation)
    table.add(ticket, tensor, non_finite)
    return ticket


def wait(table: RoundTable, ticket: RoundTicket, patience: float | None = None) -> RoundResult:
    """Block until the ticket's round finishes (at most until its deadline) and answer, as a waiting PushPull.

    Args:
        table: the ticket's table.
        ticket: from ``push``.
        patience: most seconds to wait; past it the call gives up (CancelledError), as a client's deadline.
    """
    wake = threading.Event()
    timeout = table.watch(ticket, wake)
    gave_up = False
    if timeout is not None:
        try:
            gave_up = patience is not None and patience < timeout
            wake.wait(patience if gave_up else timeout)
        finally:
            table.unwatch(ticket, wake)
    return table.answer(ticket, gave_up)


def contribute(
    table: RoundTable,
    job_id: str,
    step: int,
    bucket: int,
    rank: int,
    tensor: QuantizedArray,
    non_finite: bool = False,
    incarnation: str = "",
) -> RoundResult:
    """``wait(push(...))``: one rank's whole PushPull."""
    return wait(table, push(table, job_id, step, bucket, rank, tensor, non_finite, incarnation))
