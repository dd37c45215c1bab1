"""GradqSession: one training loop's connection to a gradq job, whatever loop drives it.

A session is made by connecting a GradqConfig over a process group. It owns
what stays between calls: the worker client, the membership (fixed or
elastic), this rank's host group, the error-feedback residuals, the adaptive
bit plans, the backward failures and the two threads that push and gather.
Its one call, ``reduce``, averages a flat tensor under a key for a step and
returns a future of the mean; the path it takes (flat, through the host, or
the fallback the ranks agreed on) is the session's business, not the loop's.
The adapters (the DDP comm hook, and the next loops) stay thin on top of it.

Threads: ``reduce`` runs on the caller's thread (autograd's, for DDP) and only
hands work on: the sender thread encodes and pushes in call order, the gather
thread collects a host's mean pieces in call order, and gRPC's threads
complete the futures.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from gradq.client.bit_policy import Piece
from gradq.client.config import GradqConfig
from gradq.client.elastic import JobWorld
from gradq.client.serde import JobSpec
from gradq.client.session.bit_plans import BitPlans
from gradq.client.session.connecting import (
    JoinOutcome,
    agree_on_join,
    check_fallback,
    join_host,
    loop_group,
    loop_part,
    place_member,
)
from gradq.client.session.failures import BackwardFailures
from gradq.client.session.host_groups import HostGroup, push_segments
from gradq.client.session.lifecycle import Membership, draw_run_names
from gradq.client.session.member import Member
from gradq.client.session.residuals import ParameterResiduals
from gradq.client.session.training_log import SessionEvents, show_gradq_logs
from gradq.client.stats import ClientStats
from gradq.client.worker import WorkerClient

__all__ = ["GradqSession"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectTerms:
    """What ``GradqSession.connect`` was given besides the configuration (its docstring says what each is)."""

    group: dist.ProcessGroup | None
    host: HostGroup | None = None
    job: JobSpec = field(default_factory=JobSpec)  # the loop's part of the job's spec; the placement is connect's
    on_drop: Callable[[BaseException], bool] | None = None


class GradqSession:
    """A connected training loop (see the module docstring); make one with ``GradqSession.connect``."""

    __slots__ = (
        "__weakref__",  # Membership leaves the job when the session is collected
        "_closed",  # close() was called: a later reduce is an error, not a silent rejoin
        "_gather_pool",  # one thread that gathers mean pieces inside the host, in call order
        "_membership",  # leaves the job once, at close / collection / exit
        "_sender_pool",  # one thread that encodes and sends off the caller's thread
        "_terms",  # what connect() was given besides the configuration: a rejoin connects on the same terms
        "client",  # the joined WorkerClient (None under a fallback)
        "config",  # the frozen configuration this session was connected with
        "events",  # what the user is told: connected, hosts lost and joined, failed rounds (training_log)
        "failures",  # failures held until the backward pass ends, then raised typed
        "group",  # the process group the loop reduces over
        "host",  # this rank's place among the job's hosts
        "incarnation",  # this run of the job (the live run's, for an elastic joiner)
        "job_id",  # the job every rank joined
        "member",  # this host's membership of the job: joins, drops, the state to take and to give
        "mode",  # "gradq", or the fallback the ranks agreed on
        "plans",  # each tensor's pieces under the adaptive bit policy
        "residuals",  # keeps error feedback on its parameters across layouts and checkpoints
    )

    def __init__(
        self,
        config: GradqConfig,
        group: dist.ProcessGroup | None,
        job_id: str,
        incarnation: str,
        host: HostGroup,
        client: WorkerClient | None,
        mode: str,
        terms: ConnectTerms | None = None,
    ) -> None:
        self.config, self.group, self.job_id, self.incarnation = config, group, job_id, incarnation
        self.host, self.client, self.mode = host, client, mode
        self._terms = terms or ConnectTerms(group)
        self.failures = BackwardFailures(self._terms.on_drop)
        self.residuals = ParameterResiduals(client, config.codec)
        self.plans = BitPlans()
        self.member: Member[GradqSession] = Member(self, client.membership if client is not None else None)
        self.events = SessionEvents(job_id, client, group is None or dist.get_rank(group) == 0, mode)
        self._closed = False
        self._sender_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._gather_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._membership = Membership(self, client) if client is not None else None

    @classmethod
    def connect(
        cls,
        config: GradqConfig,
        group: dist.ProcessGroup | None = None,
        host: HostGroup | None = None,
        job: JobSpec | None = None,
        on_drop: Callable[[BaseException], bool] | None = None,
    ) -> GradqSession:
        """Join the job on every shard; all ranks of ``group`` then agree on gradq or the fallback.

        Collective over ``group`` (None: the default group, or this process
        alone when torch.distributed is not initialized: a one-process host
        needs no process group). Every connect is a
        new incarnation of the job (rank 0 draws it), so a rerun or a torchrun
        restart with the same job id starts the job afresh.

        ``host`` is this rank's member, when the adapter placed it itself (FSDP:
        the host's ranks push their own shards as one member, no local
        collective); None finds the hosts from the launcher (DDP).
        ``job`` is the loop's part of what every Join says of the job (a
        gradq.client.JobSpec; its fields say what each asks of the aggregator,
        which refuses a Join that disagrees with the job's, naming both values).
        Where the member sits (``world_size``, ``ranks``, ``elastic``,
        ``job_ranks``, ``max_members``) connect sets from ``config`` and the
        host placement. None: nothing of the loop's said.
        ``on_drop``: says whether a bucket failure of a backward pass is the
        adapter's to handle (an elastic host dropped from the job rejoins after
        its optimizer's step, ``member.rejoin``) instead of being raised.

        Raises:
            AggregationError: the aggregator refused a Join (a configuration to
                fix: the message names both sides' values), or it could not be
                reached and ``config.fallback`` is "error" (or there is nothing
                to fall back over); the message says what to check.
            RuntimeError: a launcher started several ranks, but torch.distributed is not initialized.
            ValueError: ``job`` sets a field of the placement, which connect sets itself.
        """
        show_gradq_logs()
        terms = ConnectTerms(group, host, loop_part(job), on_drop)
        group = loop_group(group)
        job_id, incarnation = draw_run_names(group, config.job_id)
        host, spec = place_member(config, group, host, terms.job)

        def client_for(rank: int, run: str) -> WorkerClient:
            return WorkerClient(
                list(config.addresses),
                job_id,
                rank,
                spec,
                config.quant,
                error_feedback=config.error_feedback,
                timeout_s=config.timeout_s,
                security=config.security,
                chunk_elements=config.chunk_elements,
                max_in_flight=config.max_in_flight,
                incarnation=run,
                reconnect_timeout_s=config.connect_timeout_s,
            )

        client, failure = join_host(group, host, client_for, config, incarnation)
        outcome = agree_on_join(group, failure)
        if outcome == JoinOutcome.JOINED and client is not None:
            if config.elastic_hosts:  # the member id the aggregator assigned, and the run joined
                host, incarnation = replace(host, host=client.membership.rank), client.membership.incarnation
            session = cls(config, group, job_id, incarnation, host, client, "gradq", terms)
            session.events.connected(config, host)
            return session
        if client is not None:
            client.close()
        check_fallback(outcome, failure, config, group)
        where = str(failure) if failure else "another rank could not reach the aggregator"
        log.warning(
            "aggregator unreachable (%s); falling back to %s: training goes on without gradq", where, config.fallback
        )
        return cls(config, group, job_id, incarnation, host, None, config.fallback, terms)

    def reconnect(self) -> GradqSession:
        """Close this session and join the job again on the same terms: a new Join, as a newcomer.

        What ``member.rejoin`` does for a host the aggregator dropped; collective over the group, as ``connect``.

        Raises:
            AggregationError: as ``connect``.
        """
        self.close()
        terms = self._terms
        return type(self).connect(self.config, terms.group, terms.host, terms.job, terms.on_drop)

    def reduce(
        self,
        values: torch.Tensor,
        step: int,
        key: int,
        parameters: Sequence[torch.Tensor] | None = None,
        weight: int = 0,
    ) -> torch.futures.Future[torch.Tensor]:
        """Average ``values`` over the job's ranks for round ``(step, key)``; returns at once.

        Args:
            values: a flat tensor (any float dtype, any device), the same key and
                size on every rank at this step. The caller leaves it alone until
                the future is done: an fp32 tensor's mean may be written into it.
            step: the training step; with ``key``, the round.
            key: names this tensor within the step, the same on every rank and
                below 2**32 / (the most ranks a host holds).
            parameters: the parameters ``values`` lays end to end, if it does:
                error feedback then follows them when the caller's layout
                changes, and the adaptive bit policy splits at their bounds.
            weight: in a session connected ``weighted``, what this host trained on
                for ``values`` (tokens, samples), the same on every rank of the
                host, >= 1: the mean is then weighted by it. 0 otherwise.

        Returns:
            A future of the mean, shaped and typed like ``values``, on its device;
            it fails with an AggregationError naming the round and the reason.
        """
        if self._closed:
            raise RuntimeError("the gradq session is closed; connect a new one to train through gradq again")
        if self.mode != "gradq":
            raise RuntimeError(f"the gradq session is in fallback mode {self.mode!r}; the adapter reduces natively")
        config, host, client = self.config, self.host, self.client
        assert client is not None
        client.check_weight(weight)
        flat = values.detach().reshape(-1)
        params = list(parameters) if parameters is not None else []
        pieces: list[tuple[int, Piece]]
        if config.bit_policy == "adaptive" and params:
            pieces = self.plans.plan(key, params, flat, config.quant, config.average_bits, self.group)
        else:
            pieces = [(key, Piece(0, flat.numel(), config.quant))]
        segments, grids = host.segments(pieces)
        if config.error_feedback:
            self.residuals.observe(key, params, flat.numel(), flat.device, [(k, b, e) for k, b, e in segments])
        reduced = push_segments(
            host, client, values, step, segments, grids, config.codec, self._sender(), self._gatherer(), weight
        )
        reduced.add_done_callback(self.events.round_ended)
        return reduced

    def round_keys(self, key: int, numel: int) -> list[tuple[int, int, int]]:
        """Every round a tensor of ``numel`` reduced under ``key`` travels as, across the host: (round key, begin, end).

        Ascending round keys; the ranks of a host between them push them all
        (``reduce`` pushes this rank's); on a host of shards, this rank's own
        tensor's rounds only (each rank's differ). The uniform grid's layout: an adaptive
        bit policy plans its pieces anew each step, so it has no fixed one.
        """
        assert self.client is not None, "a session in fallback pushes no rounds"
        # A rank that pushes every piece (or, on a host of shards, this rank's own tensors).
        whole = self.host if self.host.sharded else replace(self.host, local_rank=0, local_size=1)
        segments, _ = whole.segments([(key, Piece(0, numel, self.config.quant))])
        rounds = [
            (chunk, begin + chunk_begin, begin + chunk_end)
            for piece_key, begin, end in segments
            for chunk, chunk_begin, chunk_end in self.client.round_keys(piece_key, end - begin)
        ]
        return sorted(rounds)

    def end_step(self) -> None:
        """The caller has reduced every tensor of this step (DDP: after its last bucket)."""
        self.residuals.end_step()
        self.events.see_world(self.world())
        # The step's freed buffers stay in the heap for the next step's: a malloc_trim here cost about 8 ms of
        # CPU per rank and step (the trim, and the page faults of taking the pages back) and did not lower the
        # peak (bench/results/worker-memory.md).

    def world(self) -> JobWorld | None:
        """Elastic: the job's members and the ranks they stand for, as last announced (None before the first)."""
        return self.member.world()

    def stats(self) -> ClientStats | None:
        """The worker client's figures; None under a fallback."""
        return self.client.stats() if self.client is not None else None

    def held_bytes(self) -> dict[str, int]:
        """What this session holds between and during calls, in bytes, by buffer.

        Returns:
            ``residuals``: the error-feedback residuals (one float32 per element
            pushed, on the tensors' devices); ``requests``: the encoded pushes
            not yet answered (kept for a resend); both 0 under a fallback.
        """
        client = self.client
        if client is None:
            return {"residuals": 0, "requests": 0}
        residuals = 0
        for library in client.array_libraries():
            store = client.residuals(library)
            if store is None:  # error feedback is off
                continue
            keys = store.keys()  # a ResidualStore, not a dict
            for key in keys:
                held = store.residual(key)
                residuals += held.numel() * held.element_size() if isinstance(held, torch.Tensor) else held.nbytes
        return {"residuals": residuals, "requests": client.requests_in_flight_bytes()}

    def close(self) -> None:
        """Leave the job and close the channels; idempotent. ``reduce`` refuses afterwards."""
        self._closed = True
        for pool in (self._sender_pool, self._gather_pool):
            if pool is not None:
                pool.shutdown(wait=True)  # pushes already handed over go out before the Leave
        self._sender_pool = self._gather_pool = None
        if self._membership is not None:
            self._membership.close()
            self._membership = None

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def _sender(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._sender_pool is None:
            self._sender_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradq-sender")
        return self._sender_pool

    def _gatherer(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._gather_pool is None:
            self._gather_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradq-gather")
        return self._gather_pool
