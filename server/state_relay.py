"""Elastic catch-up: the training state a live member sends a joiner, relayed through the aggregator chunk by chunk.

A newcomer to an elastic job in training is pending (see gradq.server.membership). It waits
in FetchState; the Watch streams then name it and a donor (the lowest member
training). At its next step boundary the donor sends the state with PutState,
whose first chunk admits the joiner into the members from that step on: the
rounds of that step, which cannot have completed (the donor has not pushed to
them yet), now wait for it too. The aggregator holds at most
``RELAY_QUEUE_CHUNKS`` chunks of one transfer at a time (the donor's stream is
held back while the joiner reads), charged to the job's memory budget while
the joiner waits.

Everything here runs on the server's event loop: the relays are asyncio
queues, and only the job table's lock is taken, briefly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from gradq.proto.transport import MAX_STATE_CHUNK_BYTES
from gradq.server.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
from gradq.server.job import Job
from gradq.server.rounds import RoundTable

__all__ = ["MAX_STATE_CHUNK_BYTES", "RELAY_QUEUE_CHUNKS", "Relay", "StateHeader", "StateRelays"]

log = logging.getLogger(__name__)

RELAY_QUEUE_CHUNKS = 4
# What one waiting joiner may hold: the queue full plus the chunk being handed over.
RELAY_BYTES = (RELAY_QUEUE_CHUNKS + 1) * MAX_STATE_CHUNK_BYTES


@dataclass(frozen=True, slots=True)
class StateHeader:
    """What the first chunk of a transfer says: who sends, the step it was taken before, its size."""

    sender: int
    step: int
    total_bytes: int


@dataclass(eq=False)
class Relay:
    """One joiner waiting for the state, and the transfer to it once a donor has claimed it."""

    job: Job
    joiner: int
    header: StateHeader | None = None  # set when a donor claims the relay
    relayed: int = 0
    closed: bool = False  # the joiner stopped waiting: a donor's next chunk is refused
    broken: bool = False  # the transfer failed; the joiner has its error
    queue: asyncio.Queue[bytes | Exception | None] = field(default_factory=lambda: asyncio.Queue(RELAY_QUEUE_CHUNKS))

    async def put(self, data: bytes) -> None:
        """Hand one chunk on, waiting while the joiner is ``RELAY_QUEUE_CHUNKS`` chunks behind.

        Raises:
            InvalidArgumentError: the chunk is too large or goes past the announced size.
            UnavailableError: the joiner stopped waiting.
        """
        assert self.header is not None, "claim the relay first"
        if len(data) > MAX_STATE_CHUNK_BYTES:
            raise InvalidArgumentError(
                f"data of {len(data)} bytes is too large; expected state chunks of at most {MAX_STATE_CHUNK_BYTES}"
            )
        if self.relayed + len(data) > self.header.total_bytes:
            raise InvalidArgumentError(
                f"the state runs past its total_bytes={self.header.total_bytes}; expected exactly that many bytes"
            )
        if self.closed:
            raise UnavailableError(f"member {self.joiner} stopped waiting for the state (its process went away)")
        await self.queue.put(data)
        self.relayed += len(data)

    async def end(self) -> None:
        """The donor sent its last chunk: the joiner gets the end once it has read the rest.

        Raises:
            InvalidArgumentError: fewer bytes came than announced (the joiner gets the error too).
        """
        assert self.header is not None
        if self.relayed != self.header.total_bytes:
            # Whether the sender went away or closed its stream early, the joiner's transfer broke.
            sent = f"{self.relayed} of its total_bytes={self.header.total_bytes}"
            self.fail(UnavailableError(f"member {self.header.sender} stopped sending the state at {sent}"))
            raise InvalidArgumentError(f"the state ended at {sent}")
        if not self.closed:
            await self.queue.put(None)

    def fail(self, error: Exception) -> None:
        """The transfer broke: the joiner gets ``error`` next, instead of chunks that can no longer add up.

        Only the first failure counts: it says best what broke.
        """
        if self.broken:
            return
        self.broken = True
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(error)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The joiner's side: every chunk, in order, until the transfer ends.

        Raises:
            The transfer's error, when it broke (the donor went away or sent a bad stream).
        """
        while True:
            item = await self.queue.get()
            if item is None:
                return
            if isinstance(item, Exception):
                raise item
            yield item


class StateRelays:
    """The joiners of every elastic job waiting for the state, and the transfers to them.

    Args:
        table: the jobs (membership and the memory budget).
        changed: told when a joiner starts waiting or is admitted (the Watch streams announce it).
    """

    def __init__(self, table: RoundTable, changed: Callable[[Job, str], None]) -> None:
        self._table = table
        self._changed = changed
        self._relays: dict[tuple[Job, int], Relay] = {}

    def fail_unserved(self, job: Job) -> None:
        """No member of ``job`` trains any more: fail the joiners still waiting (none can send them the state)."""
        with self._table.jobs.lock:
            nobody = job.members.formed and not job.members.joined
        if nobody:
            error = FailedPreconditionError(f"every training member of {job.describe()} is gone; restart the job")
            for (owner, _), relay in list(self._relays.items()):
                if owner is job and relay.header is None:
                    relay.fail(error)

    def waiting(self, job: Job) -> list[int]:
        """The members of ``job`` waiting for the state that no donor has claimed yet, ascending."""
        return sorted(j for (owner, j), relay in self._relays.items() if owner is job and relay.header is None)

    def open(self, job_id: str, rank: int, incarnation: str) -> Relay:
        """A pending member starts waiting for the state.

        A member waiting already replaces its earlier relay: that call fails (FAILED_PRECONDITION), this one waits.

        Raises:
            FailedPreconditionError: not a pending member of this run, or no member
                trains (nobody holds the state).
            ResourceExhaustedError: the job's or the aggregator's memory budget is used up.
        """
        jobs = self._table.jobs
        with jobs.lock:
            job = jobs.member(job_id, rank, incarnation, self._table.now(), pending_ok=True)
            if not job.members.is_pending(rank):
                raise FailedPreconditionError(
                    f"member {rank} of {job.describe()} trains already; only a pending elastic member fetches the state"
                )
            # A run not (re)formed here yet waits for its members: a shard that restarted is rejoined by them
            # after a newcomer pending on the first shard may have reached it.
            if job.members.formed and not job.members.joined:
                raise FailedPreconditionError(
                    f"no member of {job.describe()} is training, so none holds the state; restart the job"
                )
            stale = self._relays.get((job, rank))
            if stale is not None:
                # The member's earlier FetchState, which it gave up on (its deadline passed, or the transfer broke
                # and it joined again) before this server saw that call end: the newest call is the one it reads.
                self.close(stale)
                again = f"member {rank} of {job.describe()} asked for the state again; its newer call replaces this"
                stale.fail(FailedPreconditionError(again))
            what = f"the state relay to member {rank} of {job.describe()}"
            self._table.budget.charge(RELAY_BYTES, what, job.memory)
            relay = self._relays[(job, rank)] = Relay(job, rank)
        log.info("member %d of %s waits for the training state", rank, job.describe())
        self._changed(job, "waiting")
        return relay

    def close(self, relay: Relay) -> None:
        """The joiner's FetchState ended (done, failed or cancelled) or a newer one replaced it: stop relaying to
        it (a donor's next chunk is refused) and, once, release its charge."""
        relay.closed = True
        key = (relay.job, relay.joiner)
        if self._relays.get(key) is relay:  # not the newer relay that replaced it
            del self._relays[key]
            self._table.budget.adjust(RELAY_BYTES, 0, relay.job.memory)

    def claim_by_aggregator(self, job: Job, step: int, header: StateHeader) -> list[Relay]:
        """The aggregator itself sends ``job``'s waiting joiners the state (DiLoCo's global state, see
        gradq.server.outer_service): they are admitted from outer round ``step`` on.

        Returns:
            The relays claimed; none when a round of ``step`` or later has opened (too late for this
            boundary: the joiners wait for the next) or the run was retired.
        """
        jobs = self._table.jobs
        with jobs.lock:
            if job.retired or any(rnd_step >= step for rnd_step, _ in job.rounds):
                return []
            claimed = [relay for (owner, _), relay in self._relays.items() if owner is job and relay.header is None]
            for relay in claimed:
                job.members.admit(relay.joiner, header.sender, job.describe)
                relay.header = header
            members = len(job.members.joined)
        for relay in claimed:
            log.info(
                "member %d admitted to %s at outer round %d (%d members): %d bytes of global state from the aggregator",
                relay.joiner,
                job.describe(),
                step,
                members,
                header.total_bytes,
            )
        if claimed:
            self._changed(job, "admitted")
        return claimed

    def claim(self, job_id: str, rank: int, incarnation: str, joiner: int, header: StateHeader) -> Relay:
        """A training member starts sending ``joiner`` the state: the joiner trains from ``header.step`` on.

        Raises:
            FailedPreconditionError: the sender is not training in this run, or
                ``joiner`` is not waiting (or another member is sending it the state).
        """
        jobs = self._table.jobs
        with jobs.lock:
            job = jobs.member(job_id, rank, incarnation, self._table.now())
            relay = self._relays.get((job, joiner))
            if relay is None:
                raise FailedPreconditionError(f"member {joiner} of {job.describe()} is not waiting for the state")
            if relay.header is not None:
                raise FailedPreconditionError(
                    f"member {relay.header.sender} is sending member {joiner} of {job.describe()} the state already"
                )
            job.members.admit(joiner, rank, job.describe)
            relay.header = header
            members = len(job.members.joined)
        log.info(
            "member %d admitted to %s at step %d (%d members): %d bytes of state from member %d",
            joiner,
            job.describe(),
            header.step,
            members,
            header.total_bytes,
            rank,
        )
        self._changed(job, "admitted")
        return relay
