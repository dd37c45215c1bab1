"""The job's steps as a training loop's iterator: ``for step in state.steps(total)`` for every adapter.

A host counts the job's steps, not its own iterations. An elastic host that
was dropped (silent past the keepalive) and joined again takes the training
state at the step the others have reached: its step jumps forward. A loop
counting ``range(start, total)`` would go on from where it was and train past
``total``, alone once the others have left; this iterator re-reads the job's
step whenever the adapter says it jumped, so it yields each of the job's
remaining steps once and stops at ``total``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

__all__ = ["check_total", "job_steps"]


def check_total(total: int) -> int:
    """``total`` as the step a loop stops at.

    Args:
        total: the job's steps in all (the step after its last).

    Returns:
        ``total``.

    Raises:
        ValueError: ``total`` is not an integer >= 0.
    """
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"total={total!r} is invalid; expected an integer >= 0 (the step the job ends at)")
    return total


def job_steps(first: int, total: int, job_step: Callable[[], int], jumps: Callable[[], int]) -> Iterator[int]:
    """Yield the job's steps from ``first`` up to ``total`` (excluded), following the adapter's jumps.

    Each iteration is one step; the next is the one after, unless ``jumps()``
    changed during the iteration (the host joined again, or caught up after a
    late round): the step it trained was dropped with it, and the next is the
    job's step it received, ``job_step()``. So a jump forward skips nothing the
    job still has to take and never goes past ``total``; a ``first`` at or past
    ``total`` yields nothing.

    Args:
        first: the job's step this host trains next, once it has joined.
        total: the step the job ends at.
        job_step: the job's step the adapter holds now (read only after a jump).
        jumps: a counter the adapter moves whenever its step jumped.

    Yields:
        The job's step each iteration trains.
    """
    step = first
    while step < total:
        before = jumps()
        yield step
        step = job_step() if jumps() != before else step + 1
