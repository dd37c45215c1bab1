"""ShardMembership: one member's place in its job on every shard (join, watch, rejoin, state transfer, leave).

The worker client keeps the channels and the pushes; this keeps who the
member is. It joins the first shard first (an elastic member gets its id and
its run there) and the others with that id and run; says with every Join what
the member holds (``member_role``), so a shard that restarted serves the run
the hosts hold; holds a Watch open on each shard (its end tells the aggregator
at once that this process is gone, and the first shard's carries the job's
membership news); rejoins a shard that restarted or cut the Watch; and moves
the training state between a donor and a joiner (see gradq.client.elastic).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np

from gradq.client import serde
from gradq.client.chunks import shard_for
from gradq.client.elastic import JobWorld, ReceivedState, fetch_state, send_state, world_of
from gradq.client.sending import AggregationError
from gradq.client.serde import Refusal
from gradq.client.shard_channels import ShardChannels
from gradq.proto.v1 import aggregator_pb2 as pb

__all__ = ["JobEndedError", "ShardMembership"]

log = logging.getLogger(__name__)

# The first wait before an elastic member joins again after the shards disagreed on its run (doubled, at
# most 2 s): about the time the job's hosts take to come back to a restarted shard.
_ELASTIC_JOIN_BACKOFF_S = 0.2


class JobEndedError(AggregationError):
    """The run this member comes back to ended: its other hosts finished the job and left (Refusal JOB_ENDED).

    Nothing is left to rejoin or wait for: the member stops, and a new run of the job starts afresh.
    """

    def __init__(self, job_id: str, incarnation: str, cause: AggregationError) -> None:
        super().__init__(
            cause.address,
            cause.code,
            f"job {job_id!r} (incarnation={incarnation[:64]!r}) has finished: its other hosts completed it and "
            f"left while this host was away, so there is no run to rejoin; start a new run of the job to train "
            f"again ({cause.details})",
            cause.refusal,
        )
        self.job_id, self.incarnation = job_id, incarnation


# How often a Watch says this process lives (WatchRequest.heartbeat_ms). The aggregator loses a member silent
# for longer than this and its --keepalive-timeout (1.5 s by default) together; a stopped process sends its
# heartbeat as it resumes, so a stop shorter than the timeout loses nobody. What the heartbeats cost the
# aggregator: bench/watch_cost.py --heartbeat-ms.
HEARTBEAT_S = 1.0


def _heartbeats(request: pb.WatchRequest, ended: threading.Event) -> Iterator[pb.WatchRequest]:
    """The Watch's requests: ``request``, then an empty one every HEARTBEAT_S until the call ends.

    gRPC sends them from a thread of its own; the shard's first connection
    carries them, which no push shares (gradq.client.shard_connections).
    """
    yield request
    heartbeat = pb.WatchRequest()
    while not ended.wait(HEARTBEAT_S):
        yield heartbeat


class ShardMembership:
    """This member of ``job_id`` on each shard ``channels`` holds (see the module docstring).

    Args:
        job_id: the job.
        rank: the member id asked for (ANY_RANK: an elastic member takes the one the first shard gives).
        spec: what every Join says of the job.
        incarnation: this run of the job (an elastic member adopts the live run's).
        timeout_s: deadline of a Join and of each state transfer.
        reconnect_timeout_s: how long a rejoin waits for a shard that went away.
        channels: the shards' channels: Join, Watch (its heartbeats) and Leave go on each shard's own; the
            training state a donor sends and DiLoCo's seeds on its uploads', which would hold the heartbeats back.
        trained: whether a mean has come back to this member (it then holds its run's state).
        rank_changed: told the member id the first shard gave.
    """

    def __init__(
        self,
        job_id: str,
        rank: int,
        spec: serde.JobSpec,
        incarnation: str,
        timeout_s: float,
        reconnect_timeout_s: float,
        channels: ShardChannels,
        trained: Callable[[], bool],
        rank_changed: Callable[[int], None],
    ) -> None:
        self.job_id, self.rank, self.spec = job_id, rank, spec
        self.elastic = spec.elastic
        self.timeout_s, self.reconnect_timeout_s = timeout_s, reconnect_timeout_s
        self.joins = 0  # successful Joins, rejoins included: a DiLoCo host re-seeds a restarted aggregator
        self.catch_up = False  # elastic: joined a job in training; receive the state before pushing
        self.received_state = False  # elastic: took the run's training state (FetchState): it holds the run's
        self.world: JobWorld | None = None  # elastic: the members as the Watch stream last announced them
        self._channels = channels
        self._trained = trained
        self._rank_changed = rank_changed
        # Each shard's run of the job: the first shard's is the member's run; a shard answers with the run it holds.
        self.incarnations = [incarnation]
        self.joined: list[bool] = []  # per shard: joined, so a push may go there without a Join first
        self._watches: list[Any] = []  # per shard: the Watch held open while joined
        self._watched_servers: list[str] = []  # per shard: the server process (JoinResponse.server_id) it watches
        self._watch_lock = threading.Lock()  # two pushes' retries may rejoin one shard at once
        self._asked = (rank, incarnation)  # the id and run the first Join asked for (an elastic start-over's)

    @property
    def addresses(self) -> list[str]:
        """``host:port`` of each shard, in shard order."""
        return self._channels.addresses

    def reset_shards(self) -> None:
        """The channels' shards, in order (again after discovery learned the group): none is joined yet."""
        addresses = self.addresses
        self.incarnations = [self.incarnations[0]] * len(addresses)
        self.joined = [False] * len(addresses)
        self._watches = [None] * len(addresses)
        self._watched_servers = [""] * len(addresses)

    @property
    def incarnation(self) -> str:
        """The run of the job joined (on the first shard; see ``incarnations``)."""
        return self.incarnations[0]

    @incarnation.setter
    def incarnation(self, incarnation: str) -> None:
        self.incarnations = [incarnation] * len(self.incarnations)

    # -- joining --------------------------------------------------------------------------------

    def join(self) -> None:
        """Join every shard, the first first (see ``_join_elastic`` for an elastic member).

        Raises:
            AggregationError: a shard refused the join or could not be reached.
        """
        if not self.elastic:
            for shard in range(len(self.addresses)):
                self.join_shard(shard)
            return
        self._join_elastic()

    def _join_elastic(self) -> None:
        """Join an elastic job on every shard, the first first; start over while a restarted first shard
        runs a run of its own.

        A first shard that restarted and was reached before the job's hosts came back gives this host an id
        in a run of its own, which the other shards refuse (ANOTHER_RUN: that id trains in the job's run
        there). The hosts that hold the job's state take the first shard back (their run replaces one that
        never trained), so this host leaves, waits and joins again from the first shard, as a newcomer,
        until ``timeout_s`` has passed.
        """
        self._asked = (self.rank, self.incarnations[0])
        deadline = time.monotonic() + self.timeout_s
        backoff = _ELASTIC_JOIN_BACKOFF_S
        while True:
            try:
                for shard in range(len(self.addresses)):
                    self.join_shard(shard)
                return
            except AggregationError as error:
                if (
                    error.refusal is not Refusal.ANOTHER_RUN
                    or self.received_state
                    or time.monotonic() + backoff > deadline
                ):
                    raise
                log.warning("joining again from the first shard in %.1f s: %s", backoff, error)
            self._start_over()
            time.sleep(backoff)
            backoff = min(2 * backoff, 2.0)

    def _start_over(self) -> None:
        """Leave every shard and take back the id and run asked for at the first Join: the next is a newcomer's."""
        self.leave()
        self.rank, self.incarnation = self._asked
        self.catch_up = False

    def rejoin_shard(self, shard: int) -> None:
        """Join ``shard`` again (it restarted, or refused a push as not holding this member).

        An elastic member rejoins the first shard first: that shard says who the job's members are, and a
        member it dropped (silent past the keepalive while this shard restarted) is refused there
        (NOT_JOINED, which the member answers by joining as a newcomer) instead of coming back here as a
        member of its own, whose rounds every other host would wait for.
        """
        patience = min(self.timeout_s, self.reconnect_timeout_s)
        if self.elastic and shard > 0:
            self.join_shard(0, patience)
        self.join_shard(shard, patience)

    def member_role(self) -> pb.MemberRole:
        """What this member brings to a Join (a proto MemberRole): the server decides on it after a restart.

        Pending on the first shard: JOINING. Trained in its run (a mean came back, or it received the
        state): RESUMING, so a shard that lost the run takes it back as training and a run formed there
        by hosts without state yields to it. Otherwise STARTING.
        """
        if not self.elastic:
            return pb.MEMBER_ROLE_STARTING
        if self.catch_up:
            return pb.MEMBER_ROLE_JOINING
        if self.received_state or self._trained():
            return pb.MEMBER_ROLE_RESUMING
        return pb.MEMBER_ROLE_STARTING

    def join_shard(self, shard: int, patience: float | None = None) -> None:
        """Join ``shard``. An elastic member joins the first shard first, which gives it its id and its run;
        the other shards follow that id and that run (one run identity across shards), each answering with
        the run it holds."""
        incarnation = self.incarnations[0] if self.elastic else self.incarnations[shard]
        role = self.member_role()
        # A shard that lost the run re-forms it once the members training when this one last heard are back.
        training = len(self.world.members) if role == pb.MEMBER_ROLE_RESUMING and self.world is not None else 0
        request = serde.join_request(self.job_id, self.rank, self.spec, incarnation, role, training)
        timeout = self.timeout_s if patience is None else patience
        try:
            response = self._channels.stubs[shard].Join(
                request, timeout=timeout, wait_for_ready=True, metadata=self._channels.metadata
            )
        except grpc.RpcError as error:
            failure = AggregationError.of_call(self.addresses[shard], error)
            if failure.refusal is Refusal.JOB_ENDED:
                raise JobEndedError(self.job_id, incarnation, failure) from None
            raise failure from None
        if self.elastic and shard == 0:  # the member id and run the aggregator gave this member
            self.rank, self.catch_up = response.rank, response.catch_up
            self._rank_changed(self.rank)
        elif self.elastic and response.rank != self.rank:
            raise AggregationError(
                self.addresses[shard],
                None,
                f"joined as member {response.rank}, not {self.rank} as on {self.addresses[0]}; every shard of an "
                f"elastic job must hold the same members",
            )
        if self.elastic:
            self.incarnations[shard] = response.incarnation
        self.joined[shard] = True
        self.joins += 1
        self._watch(shard, response.server_id)

    def counted_lost(self, refusal: Refusal) -> bool:
        """A refusal saying the aggregator counts this fixed job's rank lost (an elastic member is dropped instead)."""
        return not self.elastic and refusal is Refusal.LOST

    # -- watching -------------------------------------------------------------------------------

    def _watch(self, shard: int, server_id: str) -> None:
        """Hold a Watch open on ``shard`` (the server process ``server_id``): if this process dies, the
        stream's end tells the aggregator at once.

        Never read but on the first shard of an elastic job (its membership news): the call stays open
        until ``leave`` cancels it (after the Leave, so the aggregator does not take it for a loss) or the
        process ends. A call nobody reads never learns that its server went away (gRPC delivers a stream's
        status after its messages), so a Watch opened against another server process (the shard restarted)
        is replaced, never trusted: the new process would otherwise watch nothing of this member, and its
        rounds would wait for a host that died until their deadline.
        """
        with self._watch_lock:
            watching = self._watches[shard]
            if watching is not None and self._watched_servers[shard] != server_id:
                self._watches[shard] = None  # first: its end is not this shard's news
                watching.cancel()
                watching = None
            if watching is not None and not watching.done():
                return
            request = serde.watch_request(self.job_id, self.rank, self.incarnations[shard], int(HEARTBEAT_S * 1000))
            ended = threading.Event()
            call = self._channels.stubs[shard].Watch(_heartbeats(request, ended), metadata=self._channels.metadata)
            self._watches[shard], self._watched_servers[shard] = call, server_id
        call.add_done_callback(lambda done: self._watch_ended(shard, done, ended))
        if self.elastic and shard == 0:  # the first shard's stream carries the job's membership news: read it
            threading.Thread(target=self._read_world, args=(call,), name="gradq-watch", daemon=True).start()

    def _watch_ended(self, shard: int, call: Any, heartbeats: threading.Event) -> None:
        """A Watch that ended other than by ``leave``: the aggregator cut this rank off, went away, or cannot watch it.

        UNAVAILABLE while joined is the aggregator ending the stream, e.g.
        this process's heartbeat was late (it was stopped, or partitioned):
        it counts this rank lost, so a fixed job's rank, alive again, joins
        again (the aggregator then counts it back) and watches anew, on a
        thread of its own. If the aggregator itself went away, that Join fails
        and the pushes' own retries rejoin. An elastic member was dropped
        instead: it must come back as a joiner with the state, which its
        adapter does, never by rejoining its old id here.
        """
        heartbeats.set()  # their generator returns: gRPC's thread sending them ends
        code = call.code()
        cut = code == grpc.StatusCode.UNAVAILABLE and self.joined[shard] and self._watches[shard] is call
        if cut and not self.elastic:
            threading.Thread(target=self._rejoin_after_cut, args=(shard,), name="gradq-rejoin", daemon=True).start()
            return
        if code == grpc.StatusCode.OK and self._watches[shard] is call:
            # The aggregator stopped (it ends every Watch with OK): whatever comes back on that address holds no
            # job of ours, so the next push joins it first, as the same member, instead of being refused.
            self.joined[shard] = False
            return
        # CANCELLED: we left.
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE):
            log.warning(
                "aggregator %s does not watch this rank (%s: %s); losing it is found at the round deadline",
                self.addresses[shard],
                code.name if code is not None else "?",
                call.details(),
            )

    def _rejoin_after_cut(self, shard: int) -> None:
        try:
            self.rejoin_shard(shard)
        except AggregationError as error:
            log.debug("rejoining %s after its Watch ended failed: %s", self.addresses[shard], error)
            return
        log.info("rejoined %s after it cut this rank's Watch (member %d)", self.addresses[shard], self.rank)

    def _read_world(self, call: Any) -> None:
        """Keep ``world`` current from the Watch stream until it ends."""
        try:
            for event in call:
                self.world = world_of(event)
        except grpc.RpcError:
            pass  # the stream ended: ``_watch_ended`` says why when it matters

    # -- the training state ---------------------------------------------------------------------

    def fetch_state(self) -> list[ReceivedState]:
        """A pending elastic member waits (up to ``timeout_s``) for the training state and receives it.

        Returns:
            What each shard sent, in shard order: a donor's state comes whole through the first shard (the
            others send nothing); a DiLoCo job's global state comes from every shard, each its own round keys.

        Each shard admits this member from the step its transfer names. A donor names one step on every
        shard; the aggregator's copy of a DiLoCo job is sent by each shard at its own next outer-round
        boundary, and a boundary crossed on one shard between this member's transfers there and on another
        admits it at two outer rounds. It then leaves (so no round waits for it), joins again as a newcomer
        and waits for the next boundary, until ``timeout_s`` has passed.

        A shard that goes away mid-transfer (it restarted) is answered the same way: this member leaves
        every shard and joins again.

        Raises:
            AggregationError: refused, the sender went away, the deadline passed, or the shards admitted this
                member at different steps (or went away) until then.
        """
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                received = self._fetch_every_shard()
            except AggregationError as error:
                # A shard went away mid-transfer (it restarted): the others' transfers have ended too, so
                # this member leaves them all and joins again, as after a drop.
                if error.code != grpc.StatusCode.UNAVAILABLE or not self.elastic or time.monotonic() > deadline:
                    raise
                log.warning("%s; joining again as a newcomer", error)
                self._start_over()
                self._join_elastic()
                continue
            steps = sorted({state.step for state in received})
            if len(steps) == 1:
                break
            apart = AggregationError(self.addresses[0], None, f"the shards admitted this member at steps {steps}")
            if time.monotonic() > deadline:
                raise apart
            log.warning("%s; joining again as a newcomer", apart.details)
            self._start_over()
            self._join_elastic()
        self.catch_up = False
        self.received_state = True
        return received

    def _fetch_every_shard(self) -> list[ReceivedState]:
        def fetch(shard: int) -> ReceivedState:
            request = serde.state_request(self.job_id, self.rank, self.incarnations[shard])
            return fetch_state(
                self._channels.stubs[shard], self.addresses[shard], request, self.timeout_s, self._channels.metadata
            )

        # Pending on every shard: each admits this member from the step its transfer names. The pool's end
        # waits for every transfer, so a failure is raised only once none is left waiting.
        with concurrent.futures.ThreadPoolExecutor(len(self.addresses), thread_name_prefix="gradq-fetch") as pool:
            transfers = [pool.submit(fetch, shard) for shard in range(len(self.addresses))]
        return [transfer.result() for transfer in transfers]

    def send_state(self, joiner: int, step: int, data: bytes) -> int:
        """Send a waiting joiner the training state taken before ``step``; returns the bytes relayed.

        Raises:
            AggregationError: the joiner is not waiting (or went away), or the aggregator could not be reached.
        """
        # The other shards first, with nothing: each admits the joiner from ``step`` on, before this member
        # pushes any of that step there, so none of those rounds can complete without it (as on the first).
        for shard in range(1, len(self.addresses)):
            header = serde.state_chunk(self.job_id, self.rank, self.incarnations[shard], joiner, step, 0, b"")
            send_state(
                self._channels.upload_stubs[shard],
                self.addresses[shard],
                header,
                b"",
                self.timeout_s,
                self._channels.metadata,
            )
        header = serde.state_chunk(self.job_id, self.rank, self.incarnations[0], joiner, step, 0, b"")
        return send_state(
            self._channels.upload_stubs[0], self.addresses[0], header, data, self.timeout_s, self._channels.metadata
        )

    def shard_of(self, key: int) -> int:
        """The shard that owns round key ``key`` (gradq.client.chunks.shard_for)."""
        return shard_for(key, len(self.addresses))

    def seed_outer(
        self, step: int, key: int, keys: int, parameters: np.ndarray, momentum: np.ndarray | None
    ) -> tuple[bool, int, bytes, bytes]:
        """DiLoCo: seed, or check, the global state of round key ``key`` as it stands before ``step``, on the
        shard that owns the key (each shard holds the global state of its own keys).

        Args:
            step: the outer round the state starts.
            key: the round key; ``keys``: how many of an outer round's keys that shard owns.
            parameters: float32 global parameters of the key.
            momentum: float32 outer momentum, as many (None: zeros).

        Returns:
            (the shard holds exactly these, the outer round its copy starts,
            its parameters and momentum as float32 LE bytes when they differ, else empty).

        Raises:
            AggregationError: refused (names why) or unreachable.
        """
        shard = self.shard_of(key)
        request = serde.outer_seed(
            self.job_id,
            self.rank,
            self.incarnations[shard],
            step,
            key,
            keys,
            np.ascontiguousarray(parameters, dtype="<f4").tobytes(),
            b"" if momentum is None else np.ascontiguousarray(momentum, dtype="<f4").tobytes(),
        )
        try:
            answer = self._channels.upload_stubs[shard].SeedOuter(
                request, timeout=self.timeout_s, metadata=self._channels.metadata
            )
        except grpc.RpcError as error:
            raise AggregationError.of_call(self.addresses[shard], error) from None
        return answer.matched, answer.step, answer.parameters, answer.momentum

    # -- leaving --------------------------------------------------------------------------------

    def leave(self) -> None:
        """Leave every shard joined (best effort) and end the Watch streams, Leave first."""
        for shard, stub in enumerate(self._channels.stubs):
            if self.joined[shard]:
                request = serde.leave_request(self.job_id, self.rank, self.incarnations[shard])
                try:
                    stub.Leave(request, timeout=min(self.timeout_s, 5.0), metadata=self._channels.metadata)
                except grpc.RpcError as error:
                    log.debug("leave from %s failed: %s", self.addresses[shard], error.code())
                self.joined[shard] = False
        for shard, watching in enumerate(self._watches):
            if watching is not None:
                watching.cancel()
                self._watches[shard] = None
