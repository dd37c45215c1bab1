"""DiLoCo's global state on the aggregator, served: members seed it, joiners receive it with no donor.

``seed`` runs a SeedOuter (in the pool: it copies or compares a round key's
arrays) and charges what a new key holds to the job's memory budget.
``OuterJoiners`` sends the joiners of a DiLoCo job the state at an outer-round
boundary: the round closing that made the state whole (gradq.server.outer_state)
calls ``boundary`` under its lock, and the transfer runs on the event loop,
through the same relays a donor member would fill (gradq.server.state_relay).
The joiners are admitted there, before any round of the new outer round can
open (the members have not received the last mean yet), so those rounds wait
for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from gradq.proto.transport import MAX_STATE_CHUNK_BYTES
from gradq.server.errors import FailedPreconditionError, RoundError
from gradq.server.job import Job
from gradq.server.membership import ANY_RANK
from gradq.server.outer_state import Seeded
from gradq.server.rounds import RoundTable
from gradq.server.serde import Seed
from gradq.server.state_relay import Relay, StateHeader, StateRelays

__all__ = ["AGGREGATOR_SENDER", "OuterJoiners", "seed"]

log = logging.getLogger(__name__)

# The sender a joiner's state chunks name when the aggregator itself sends them.
AGGREGATOR_SENDER = ANY_RANK


def seed(table: RoundTable, request: Seed) -> Seeded:
    """Seed, or compare, one round key of a member's DiLoCo job (see gradq.server.outer_state).

    Raises:
        FailedPreconditionError: not a member training in this run, a job without an outer step, or a key
            whose size differs from the one its first seed or push fixed.
        InvalidArgumentError: the key, keys or sizes are out of range, or a value is NaN or Inf.
        ResourceExhaustedError: the job's or the aggregator's memory budget cannot hold a new key.
    """
    with table.jobs.lock:
        job = table.jobs.member(request.job_id, request.rank, request.incarnation, table.now())
    outer = job.outer
    if outer is None:
        raise FailedPreconditionError(
            f"{job.describe()} has no outer step on the aggregator; its hosts joined without outer_step "
            f"(DiLoCo with outer_step='hosts' averages only)"
        )
    # Charged before the copy is made: a seed the budget cannot hold is refused and holds nothing.
    new = outer.charge_for_seed(request.key, request.parameters)
    what = f"the global state of key {request.key} of {job.describe()}"
    table.budget.charge(new, what, job.memory)
    try:
        seeded = outer.seed(
            request.key, request.keys, request.step, request.parameters, request.momentum, job.describe()
        )
    except BaseException:
        table.budget.adjust(new, 0, job.memory)
        raise
    table.budget.adjust(new, seeded.new_bytes, job.memory)
    if seeded.moved:
        # The job's outer round is this seed's now (a host at a later round holds more training): rounds in
        # flight of earlier ones are behind, and their hosts take this state at the next boundary.
        table.late_hosts.leave_behind(job, request.step, {}, f"member {request.rank} seeded outer round {request.step}")
    if seeded.whole:  # joiners waiting (a host behind, or after a restart) need not wait for a round to close
        table.outer_boundary(job, request.step)
    if seeded.new_bytes:
        log.info(
            "%s seeded key %d before outer round %d (member %d)",
            job.describe(),
            request.key,
            request.step,
            request.rank,
        )
    elif not seeded.matched:
        log.warning(
            "member %d of %s holds other global parameters for key %d (outer round %d) than the aggregator "
            "(outer round %d); %s",
            request.rank,
            job.describe(),
            request.key,
            request.step,
            seeded.step,
            "it takes the aggregator's"
            if seeded.step == request.step
            else "the job is past it: its next push is refused (BEHIND) and it takes the job's state",
        )
    return seeded


class OuterJoiners:
    """Sends DiLoCo joiners the global state from the aggregator's copy, at outer-round boundaries.

    Args:
        table: the jobs and the memory budget.
        relays: the joiners waiting, one relay each (they live on the server's event loop).
    """

    def __init__(self, table: RoundTable, relays: StateRelays) -> None:
        self._table = table
        self._relays = relays
        self._transfers: set[asyncio.Task[None]] = set()

    def boundary(self, job: Job, step: int, loop: asyncio.AbstractEventLoop) -> None:
        """Called from any thread, under a round's lock: the state is whole before outer round ``step``."""
        with contextlib.suppress(RuntimeError):  # a closed loop: the server has stopped
            loop.call_soon_threadsafe(self._serve, job, step)

    def _serve(self, job: Job, step: int) -> None:
        outer = job.outer
        if outer is None or not self._relays.waiting(job):
            return
        data = outer.snapshot(step)
        if data is None:  # a later round has moved it on already: the next boundary serves them
            return
        header = StateHeader(AGGREGATOR_SENDER, step, len(data))
        try:
            claimed = self._relays.claim_by_aggregator(job, step, header)
        except RoundError as error:
            log.warning("%s: the joiners waiting cannot enter at outer round %d: %s", job.describe(), step, error)
            return
        if not claimed:
            return
        what = f"the global state sent to {len(claimed)} joiners of {job.describe()}"
        try:
            self._table.budget.charge(len(data), what, job.memory)
        except RoundError as error:
            for relay in claimed:
                relay.fail(error)
            return
        task = asyncio.get_running_loop().create_task(self._send(job, claimed, data))
        self._transfers.add(task)
        task.add_done_callback(self._transfers.discard)

    async def _send(self, job: Job, claimed: list[Relay], data: bytearray) -> None:
        """Stream the one copy of the state to every joiner claimed, chunk by chunk, then free it."""
        try:
            await asyncio.gather(*(_stream(relay, data) for relay in claimed))
        finally:
            self._table.budget.adjust(len(data), 0, job.memory)


async def _stream(relay: Relay, data: bytearray) -> None:
    view = memoryview(data)
    try:
        for begin in range(0, len(data), MAX_STATE_CHUNK_BYTES):
            await relay.put(bytes(view[begin : begin + MAX_STATE_CHUNK_BYTES]))
        await relay.end()
    except RoundError as error:  # the joiner went away: the others still get theirs
        log.info("the global state did not reach member %d: %s", relay.joiner, error)
        relay.fail(error)
