"""Member: this host's membership of an elastic job, the one place a training loop asks about it.

The session owns it. It says whether the host joined as a newcomer (and must
take the state first), takes the state (from a donor host, or the
aggregator's copy of a DiLoCo job's global state), serves joiners at a step
boundary, checks and seeds the aggregator's copy, tells a refusal that means
"dropped from the job" from any other, and answers a drop with ``rejoin``:
the session joins again on the same terms (a new Join, as a newcomer) and
the member counts it. The DDP hook, FSDP2, DiLoCo and a loop of the user's
own call these and never reach past the session to its worker client.

Collective methods run over the session's group: a host of several ranks
joins, fetches and sends through its first rank, and the others take what it got.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, Self, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from gradq.client.elastic import JobWorld
from gradq.client.sending import AggregationError
from gradq.client.serde import Refusal
from gradq.client.session.elastic import training_state

if TYPE_CHECKING:
    from gradq.client.config import GradqConfig
    from gradq.client.membership import ShardMembership
    from gradq.client.session.host_groups import HostGroup
    from gradq.client.session.training_log import SessionEvents

__all__ = ["ElasticMember", "Member", "SessionView", "dropped_from_job"]

log = logging.getLogger(__name__)

# The refusals that say the aggregator no longer counts this host a member training: it is not one (dropped
# while silent), it waits for the state, or the job's run there is another (a restarted shard resumed by the
# hosts that hold the job). Each is answered the same way: a Join as a newcomer, which takes the state.
_DROPPED_REFUSALS = frozenset({Refusal.NOT_JOINED, Refusal.PENDING, Refusal.ANOTHER_RUN})


def dropped_from_job(error: BaseException) -> bool:
    """A refusal saying the aggregator no longer counts this host a member (dropped while it was silent).

    Its way back is a Join as a newcomer, which takes the state (never its own model, which is stale).
    Decided on the refusal's reason, never its message.
    """
    return isinstance(error, AggregationError) and error.refusal in _DROPPED_REFUSALS


class SessionView(Protocol):
    """What a member reads of the session that owns it (gradq.client.session.session.GradqSession).

    Named here, not imported, so the session imports its member and never the reverse.
    """

    @property
    def config(self) -> GradqConfig: ...
    @property
    def events(self) -> SessionEvents: ...
    @property
    def group(self) -> dist.ProcessGroup | None: ...
    @property
    def host(self) -> HostGroup: ...
    @property
    def job_id(self) -> str: ...
    def reconnect(self) -> Self: ...


S = TypeVar("S", bound=SessionView)


class Member(Generic[S]):
    """This host's place in its job, as the session's training loops see it (see the module docstring).

    Args:
        session: the connected session that owns this member.
        membership: the joined worker client's membership of the job (None under a fallback: no member).
    """

    __slots__ = ("_session", "membership", "served_step")

    def __init__(self, session: S, membership: ShardMembership | None) -> None:
        self._session = session
        # Who this host is on each shard: read here, not through the worker client, which keeps only the pushes.
        self.membership = membership
        self.served_step = -1  # the step whose boundary this member last served joiners at

    @property
    def rejoins(self) -> int:
        """Times this host was dropped (silent past the keepalive) and joined again, over the sessions of its run."""
        return self._session.events.rejoins

    def rejoin(self, error: AggregationError) -> S:
        """This host was dropped (``dropped_from_job(error)``): close the session and join again as a newcomer.

        The new session joins on the same terms (gradq.client.session.session.ConnectTerms) and counts one
        more rejoin. The caller then takes the state before it trains on (``receive``, or a DiLoCo job's
        global state): its own steps of the round it missed are dropped with it. Collective over the group.

        Returns:
            The new session; this one is closed.

        Raises:
            AggregationError: the new Join was refused or found no aggregator.
        """
        session = self._session
        log.warning(
            "this host was dropped from job %s (%s); rejoining as a joiner, it takes the training state",
            session.job_id,
            error.details,
        )
        rejoined = session.reconnect()
        rejoined.events.rejoins = self.rejoins + 1
        return rejoined

    @property
    def rank(self) -> int | None:
        """The member id the aggregator gave this host (None under a fallback)."""
        membership = self.membership
        return membership.rank if membership is not None else None

    @property
    def joining(self) -> bool:
        """Joined a job in training: it must take the state before its first push."""
        return self.membership is not None and self.membership.catch_up

    @property
    def joins(self) -> int:
        """Successful Joins so far, rejoins of a restarted aggregator included (a DiLoCo host re-seeds then)."""
        return self.membership.joins if self.membership is not None else 0

    def world(self) -> JobWorld | None:
        """The job's members training and the ranks they stand for, as last announced (None before the first)."""
        return self.membership.world if self.membership is not None else None

    # -- taking the state ---------------------------------------------------------------------------

    def fetch(self) -> tuple[int, list[bytes], int]:
        """A newcomer waits for the state and receives it: (the step it trains from, each shard's bytes, the sender).

        A donor's state comes whole through the first shard (the others send
        nothing); a DiLoCo job's global state from every shard, each its own
        round keys. Collective over the host's ranks: its first rank fetches,
        the others receive what it got. Whoever sends (a donor host, or the
        aggregator's copy of a DiLoCo job) is the aggregator's choice.

        Raises:
            AggregationError: refused, the sender went away, or the deadline passed (on every rank).
        """
        session, membership = self._session, self.membership
        host = session.host
        assert membership is not None, "a fallback session has no membership"
        received: list[Any] = [None]
        if host.local_rank == 0:
            try:
                states = membership.fetch_state()
                received[0] = (states[0].step, [state.data for state in states], states[0].sender)
            except AggregationError as error:  # the host's other ranks must not wait for it forever
                received[0] = (error.address, error.details)
                if host.local_size == 1:
                    raise
        if host.local_size > 1 and session.group is not None:
            dist.broadcast_object_list(received, src=dist.get_global_rank(session.group, 0), group=session.group)
            membership.catch_up = False
        if len(received[0]) == 2:
            address, details = received[0]
            raise AggregationError(address, None, f"the host's first rank could not receive the state: {details}")
        step, data, sender = received[0]
        return int(step), data, int(sender)

    @property
    def shards(self) -> int:
        """The aggregator shards the job's rounds are spread over."""
        return len(self.membership.addresses) if self.membership is not None else 0

    def shard_of(self, key: int) -> int:
        """The shard that owns round key ``key``."""
        assert self.membership is not None, "a fallback session has no membership"
        return self.membership.shard_of(key)

    def receive(self, shared: Sequence[Any], step: int) -> int:
        """A newcomer receives a live host's state and loads it into ``shared``; returns the step to train from.

        A member that joined a job not yet training (or a fixed job) returns ``step`` as it is.
        Collective over the host's ranks.

        Raises:
            AggregationError: the transfer failed.
            ValueError: the sender shared other objects than this host.
        """
        if not self.joining:
            return step
        step, shards, sender = self.fetch()
        data = b"".join(shards)  # a donor's state comes whole through the first shard
        # weights_only: the bytes come from another host through the aggregator, so no pickled code runs.
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        objects = payload["objects"]
        if len(objects) != len(shared):
            raise ValueError(
                f"member {sender} shared {len(objects)} objects, this host {len(shared)}; "
                f"every host must share the same objects in the same order"
            )
        for item, saved in zip(shared, objects, strict=True):
            item.load_state_dict(saved)
        log.info(
            "joined %s as member %s at step %d: %d bytes of state from member %d",
            self._session.job_id,
            self.rank,
            step,
            len(data),
            sender,
        )
        return step

    # -- giving the state -----------------------------------------------------------------------------

    def serve_joiners(self, shared: Sequence[Any], step: int) -> None:
        """At the first call of ``step``: if the aggregator asks this member, send the waiting joiners the state.

        A failed transfer is logged, not raised: the joiner's loss is handled by the
        aggregator like any other, and this host trains on.
        """
        if step == self.served_step:
            return
        self.served_step = step
        membership, host = self.membership, self._session.host
        world = membership.world if membership is not None else None
        if membership is None or world is None or not world.joiners or world.donor != membership.rank:
            return
        if host.local_rank != 0:
            return  # the host's first rank sends, before its first collective of the step: the others wait in it
        data = training_state(shared, step)
        for joiner in world.joiners:
            try:
                relayed = membership.send_state(joiner, step, data)
            except AggregationError as error:
                log.warning("could not send member %d the training state: %s", joiner, error)
                continue
            log.info("sent member %d the training state before step %d (%d bytes)", joiner, step, relayed)

    # -- the aggregator's copy (DiLoCo) ------------------------------------------------------------------

    def seed_outer(
        self, step: int, key: int, keys: int, parameters: np.ndarray, momentum: np.ndarray | None
    ) -> tuple[bool, int, bytes, bytes]:
        """Seed, or check, the aggregator's global state of round key ``key`` before outer round ``step``.

        See ``ShardMembership.seed_outer``: (matched, the copy's outer round, its parameters and momentum when
        they differ).

        Raises:
            AggregationError: refused (names why) or unreachable.
        """
        assert self.membership is not None, "a fallback session has no membership"
        return self.membership.seed_outer(step, key, keys, parameters, momentum)

    def address(self) -> str:
        """The first shard's address, for messages."""
        membership = self.membership
        return membership.addresses[0] if membership is not None else ",".join(self._session.config.addresses)


ElasticMember = Member  # the name it had before it answered drops; kept for code that imports it
