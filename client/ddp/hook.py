"""The DDP comm hook: `model.register_comm_hook(GradqHookState(...), gradq_hook)`.

The hook quantizes each gradient bucket, starts a PushPull and returns at once;
the gRPC completion callback fills the returned future with the averaged bucket.
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations at
# registration and needs real types, not strings.
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from gradq.client.bit_policy import BIT_POLICIES, DEFAULT_AVERAGE_BITS, Piece, check_average_bits
from gradq.client.chunks import DEFAULT_CHUNK_ELEMENTS, assemble
from gradq.client.ddp.allgather_hooks import allgather_perchannel_hook, allreduce_mean_hook
from gradq.client.ddp.bit_plans import BitPlans
from gradq.client.ddp.checkpoint import checkpoint_of, resume_from
from gradq.client.ddp.elastic import elastic_host, join_elastic_host, serve_joiners, share_objects, start_member
from gradq.client.ddp.env import DEFAULT_CONNECT_TIMEOUT_S, HOST_GROUPINGS, hook_arguments_from_env
from gradq.client.ddp.errors import BackwardFailures
from gradq.client.ddp.host_groups import HostGroup, find_host_group, push_through_host
from gradq.client.ddp.lifecycle import Membership, draw_run_names
from gradq.client.ddp.placement import CODECS, bucket_and_output, on_callers_stream
from gradq.client.ddp.residuals import ParameterResiduals
from gradq.client.elastic import JobWorld
from gradq.client.security import ChannelSecurity
from gradq.client.sending import AggregationError
from gradq.client.stats import ClientStats
from gradq.client.window import check_max_in_flight
from gradq.client.worker import WorkerClient
from gradq.qcore import QuantConfig

__all__ = ["GradqHookState", "gradq_hook", "FALLBACKS"]

log = logging.getLogger(__name__)

# What to do when the aggregator cannot be reached when training starts.
FALLBACKS = ("error", "allreduce", "allgather")

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]

# DDP pushes every rank's buckets in the same order, so the hook may hold pushes back.
DEFAULT_HOOK_IN_FLIGHT = 2

# What a pickled state leaves out: a copy is a configuration and connects as a new incarnation.
_UNPICKLED = frozenset(
    {
        "__weakref__",
        "_client",
        "_closed",
        "_served_step",
        "_shared",
        "_failures",
        "_gather_pool",
        "_host",
        "_membership",
        "_mode",
        "_plans",
        "_residuals",
        "_sender_pool",
        "incarnation",
        "process_group",
    }
)


class GradqHookState:
    """Everything ``gradq_hook`` needs; connects lazily on the first bucket.

    Each connect is a new incarnation of ``job_id`` (rank 0 draws it), so a
    rerun or a torchrun restart with the same id starts the job afresh. The
    state leaves the job on ``close()``, at the end of a ``with`` block, when it
    (or the DDP model holding it) is collected, or when the process exits.

    Args:
        addresses: ``host:port`` of the aggregator shard(s).
        config: how buckets are quantized.
        error_feedback: carry each bucket's quantization error into its next step.
        fallback: if the aggregator is unreachable at the first bucket: "error"
            (raise, naming the address), "allreduce" (plain fp32 allreduce) or
            "allgather" (the serverless per-channel allgather hook). All ranks
            agree on the outcome, so they never mix collectives and RPCs.
        job_id: shared by every rank; None lets rank 0 draw one and broadcast it.
        timeout_s: deadline of each RPC (keep it above the server's round timeout).
        connect_timeout_s: how long the first join waits for the aggregator.
        process_group: the group DDP reduces over (None: the default group).
        security: TLS, mutual TLS and/or bearer token for the aggregator channels.
        chunk_elements: buckets above this travel as several rounds (see WorkerClient).
        max_in_flight: pushes per shard on the wire at once (see
            gradq.client.window): 2 lets one chunk arrive while the previous
            one's mean leaves; None sends a step's chunks all at once.
        codec: where buckets are quantized: "auto" (on their device: the torch
            codec for GPU buckets, numpy for CPU ones), "torch" (on their
            device, CPU included) or "numpy" (copied to the host first).
        host_grouping: "auto" reduces inside each host first where hosts hold
            several ranks (two-level aggregation, see
            gradq.client.ddp.host_groups), hosts found from ``host`` or the
            launcher (torchrun's GROUP_RANK, Lightning's and Ray Train's
            NODE_RANK); "flat" pushes every rank's whole bucket.
        host: this rank's host name, for launchers that set no node rank:
            ranks given the same name reduce together (None: the launcher's).
        elastic_hosts: 0 for a fixed job; N > 0 makes the job elastic (see
            gradq.client.ddp.elastic): each host is one process, or a host's
            ranks under their own launch, with the host's process group; the
            job starts training once N hosts have joined, hosts may then be
            lost (the others go on) and join (they receive the training state
            of the objects given to ``share`` at a step boundary). Call
            ``start()`` before training.
        bit_policy: "uniform" pushes every bucket on ``config``; "adaptive"
            splits each bucket at parameter boundaries and gives 1-D and
            hard-to-quantize parameters more bits, keeping every bucket's
            average at or under ``average_bits`` (see gradq.client.bit_policy).
            Adaptive needs the flat path (hosts of one rank, or ``host_grouping="flat"``).
        average_bits: the adaptive policy's most bits per element on average
            (``config.bits``..8; the uniform policy ignores it).
    """

    __slots__ = (
        "__weakref__",  # Membership leaves the job when the state is collected
        "_client",  # WorkerClient: a live channel, left out of the pickled form
        "_closed",  # close() was called: a later bucket is an error, not a silent rejoin
        "_failures",  # bucket failures held until DDP's backward ends, then raised typed
        "_gather_pool",  # one thread that gathers mean pieces inside the host, in bucket order
        "_host",  # this rank's place among the job's hosts, found at connect (see host_groups)
        "_membership",  # leaves the job once, at close / collection / exit
        "_mode",  # "gradq" or a fallback name, decided on the first bucket
        "_plans",  # each bucket's pieces (round key, elements, grid) under the adaptive bit policy
        "_residuals",  # keeps error feedback on its parameters across bucket rebuilds and checkpoints
        "_sender_pool",  # one thread that encodes and sends buckets off the autograd thread
        "_served_step",  # elastic: the step whose boundary this member last served joiners at
        "_shared",  # elastic: the objects (model, optimizer, ...) whose state a joiner receives
        "addresses",  # aggregator shard addresses, in shard order
        "average_bits",  # the adaptive bit policy's target bits per element
        "bit_policy",  # "uniform" or "adaptive": which bits each piece of a bucket gets
        "chunk_elements",  # largest round a bucket is cut into
        "codec",  # "auto", "torch" or "numpy": which array library quantizes a bucket
        "config",  # the wire grid for pushes
        "connect_timeout_s",  # first join's patience
        "elastic_hosts",  # 0: a fixed job; N: an elastic job that starts with N hosts
        "error_feedback",  # whether residuals are kept
        "fallback",  # behaviour when the aggregator is unreachable at start
        "host",  # explicit host name for launchers that set none (None: from the launcher)
        "host_grouping",  # "auto" (two-level where hosts hold several ranks) or "flat"
        "incarnation",  # this run of the job, drawn by rank 0 at connect (None before)
        "job_id",  # round namespace on the aggregator, same on every rank
        "max_in_flight",  # pushes per shard on the wire at once
        "process_group",  # DDP's group; left out of the pickled form
        "security",  # TLS / token for the channels (plain bytes, so it pickles)
        "step",  # iteration counter: with the bucket index, the round key
        "timeout_s",  # per-RPC deadline
    )

    def __init__(
        self,
        addresses: str | Sequence[str],
        config: QuantConfig | None = None,
        *,
        error_feedback: bool = False,
        fallback: str = "error",
        job_id: str | None = None,
        timeout_s: float = 120.0,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        process_group: dist.ProcessGroup | None = None,
        security: ChannelSecurity | None = None,
        chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
        max_in_flight: int | None = DEFAULT_HOOK_IN_FLIGHT,
        codec: str = "auto",
        host_grouping: str = "auto",
        host: str | None = None,
        elastic_hosts: int = 0,
        bit_policy: str = "uniform",
        average_bits: float = DEFAULT_AVERAGE_BITS,
    ) -> None:
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback={fallback!r} is invalid; expected one of {', '.join(FALLBACKS)}")
        self.addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        if not self.addresses:
            raise ValueError("addresses=[] is invalid; expected at least one 'host:port'")
        self.config = config or QuantConfig()
        if not self.config.scheme.is_quantized:
            raise ValueError(f"config.scheme={self.config.scheme.name.lower()} is not quantized; use plain DDP")
        if not timeout_s > 0 or not connect_timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s}, connect_timeout_s={connect_timeout_s}: expected both > 0")
        self.error_feedback = error_feedback
        self.fallback = fallback
        self.job_id = job_id
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.process_group = process_group
        self.security = security
        self.chunk_elements = chunk_elements
        check_max_in_flight(max_in_flight)
        self.max_in_flight = max_in_flight
        if codec not in CODECS:
            raise ValueError(f"codec={codec!r} is invalid; expected one of {', '.join(CODECS)}")
        self.codec = codec
        if host_grouping not in HOST_GROUPINGS:
            raise ValueError(f"host_grouping={host_grouping!r} is invalid; expected one of {', '.join(HOST_GROUPINGS)}")
        self.host_grouping = host_grouping
        self.host = host
        if isinstance(elastic_hosts, bool) or not isinstance(elastic_hosts, int) or elastic_hosts < 0:
            raise ValueError(f"elastic_hosts={elastic_hosts!r} is invalid; expected 0 (a fixed job) or hosts >= 1")
        if elastic_hosts and job_id is None:
            raise ValueError("elastic_hosts needs job_id: independent hosts find their job by it")
        if elastic_hosts and len(self.addresses) != 1:
            raise ValueError(f"addresses={self.addresses!r}: an elastic job runs on one aggregator shard")
        if elastic_hosts and fallback != "error":
            raise ValueError(f"fallback={fallback!r}: an elastic host cannot fall back (it would train alone)")
        self.elastic_hosts = elastic_hosts
        self._shared: list[Any] = []
        if bit_policy not in BIT_POLICIES:
            raise ValueError(f"bit_policy={bit_policy!r} is invalid; expected one of {', '.join(BIT_POLICIES)}")
        if bit_policy == "adaptive":
            check_average_bits(average_bits, self.config.bits)
        self.bit_policy = bit_policy
        self.average_bits = average_bits
        self.step = 0
        self._reset_connection()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "GradqHookState":
        """A state configured by the GRADQ_* variables `gradq worker` and the Compose workers use.

        Args:
            environ: the variables (None: ``os.environ``); see
                gradq.client.ddp.env.HOOK_ENVIRONMENT for their names.
            overrides: constructor arguments that win over the variables
                (e.g. ``fallback="allreduce"``).

        Returns:
            The configured state (not yet connected).

        Raises:
            ValueError: GRADQ_AGGREGATORS is unset, or a variable holds a bad value.
        """
        return cls(**{**hook_arguments_from_env(environ), **overrides})

    def _reset_connection(self) -> None:
        """The fields a new or unpickled state starts without: nothing is connected yet."""
        self.incarnation: str | None = None
        self._client: WorkerClient | None = None
        self._mode: str | None = None
        self._sender_pool: ThreadPoolExecutor | None = None
        self._gather_pool: ThreadPoolExecutor | None = None
        self._host: HostGroup | None = None
        self._membership: Membership | None = None
        self._failures = BackwardFailures()
        self._residuals = ParameterResiduals()
        self._plans = BitPlans()
        self._closed = False
        self._served_step = -1

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps so that resuming keeps error feedback (``torch.save`` it with the model).

        Returns:
            ``step`` (the next round's step), ``config`` (the push grid as plain
            values), ``error_feedback``, and ``residuals``: each bucket's residual
            pieces as flat float32 CPU tensors, keyed by parameter and element
            range (see gradq.client.ddp.residuals), so a resume puts each back
            on its own parameter, on any device and in any bucket layout.
        """
        return checkpoint_of(self)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume from ``state_dict()``'s output; call it before the first backward.

        Args:
            state_dict: what ``state_dict()`` returned (e.g. after ``torch.load``).

        Raises:
            RuntimeError: the state has connected already (its grid is in use).
            ValueError: a key is missing or holds a bad value.
        """
        resume_from(self, state_dict)

    def _sender(self) -> ThreadPoolExecutor:
        if self._sender_pool is None:
            self._sender_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradq-sender")
        return self._sender_pool

    def _gatherer(self) -> ThreadPoolExecutor:
        if self._gather_pool is None:
            self._gather_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradq-gather")
        return self._gather_pool

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__ if name not in _UNPICKLED}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Fields added since the first release, for states pickled before them.
        defaults = {
            "chunk_elements": DEFAULT_CHUNK_ELEMENTS,
            "max_in_flight": DEFAULT_HOOK_IN_FLIGHT,
            "codec": "auto",
            "host_grouping": "auto",
            "host": None,
            "elastic_hosts": 0,
            "bit_policy": "uniform",
            "average_bits": DEFAULT_AVERAGE_BITS,
        }
        for name, value in {**defaults, **state}.items():
            setattr(self, name, value)
        self._shared = []
        self.process_group = None
        self._reset_connection()

    def share(self, *objects: Any) -> None:
        """Elastic: the objects a joining host receives the state of (the model, the optimizer, a scheduler...).

        Each needs ``state_dict()`` and ``load_state_dict()``; every host shares
        the same kinds in the same order. Call it before ``start()``.

        Raises:
            TypeError: an object lacks state_dict / load_state_dict.
        """
        share_objects(self, objects)

    def start(self) -> int:
        """Join the job now; an elastic newcomer receives the training state before this returns.

        Returns:
            The step to train from: 0 for a host that starts the job, the
            donor's step for one that joins it in training (its model and
            optimizer then hold the training state, bit for bit).

        Raises:
            AggregationError: the aggregator refused or could not be reached,
                or the state transfer failed.
            ValueError: an elastic job with nothing shared.
        """
        return start_member(self)

    def world(self) -> JobWorld | None:
        """Elastic: the job's members and the ranks they stand for, as last announced (None before the first)."""
        return self._client.world if self._client is not None else None

    @property
    def client(self) -> WorkerClient | None:
        """The live WorkerClient (None before the first bucket or under a fallback)."""
        return self._client

    @property
    def host_group(self) -> HostGroup | None:
        """This rank's place among the job's hosts (None before the first bucket)."""
        return self._host

    @property
    def mode(self) -> str | None:
        """ "gradq", or the fallback in use; None before the first bucket."""
        return self._mode

    def stats(self) -> ClientStats | None:
        """The worker client's figures; None if not connected.

        Returns:
            Encode / network / decode time, bytes each way, relative error, and
            the compression ratio against the buckets' own dtype (``dtype``
            names it: a bf16 bucket is compared with 2 bytes per element).
        """
        return self._client.stats() if self._client is not None else None

    def close(self) -> None:
        """Leave the job and close the channels; idempotent. The hook refuses buckets afterwards."""
        self._closed = True
        if self._sender_pool is not None:
            self._sender_pool.shutdown(wait=True)  # pushes already handed over go out before the Leave
            self._sender_pool = None
        if self._gather_pool is not None:
            self._gather_pool.shutdown(wait=True)
            self._gather_pool = None
        if self._membership is not None:
            self._membership.close()
            self._membership = None
        self._client = None

    def __enter__(self) -> "GradqHookState":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _group(self) -> dist.ProcessGroup:
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        assert group is not None, "torch.distributed is not initialized"
        return group

    def _connect(self) -> None:
        """Join on every shard; all ranks then agree on gradq or the fallback."""
        group = self._group()
        self.job_id, self.incarnation = draw_run_names(group, self.job_id)
        # Under two-level aggregation the aggregator's members are hosts, each standing for its ranks.
        if self.elastic_hosts:
            host = self._host = elastic_host(group, self.elastic_hosts, self.timeout_s)
        else:
            host = self._host = find_host_group(group, self.host_grouping, self.host, os.environ, self.timeout_s)
        if self.bit_policy == "adaptive" and not host.flat:
            raise ValueError(
                f"bit_policy='adaptive' with two-level aggregation ({host.describe()}): the adaptive policy "
                "splits whole buckets; pass host_grouping='flat' (GRADQ_HOST_GROUPING=flat) or bit_policy='uniform'"
            )

        def client_for(rank: int, incarnation: str) -> WorkerClient:
            return WorkerClient(
                self.addresses,
                str(self.job_id),
                rank,
                host.hosts,
                self.config,
                elastic=bool(self.elastic_hosts),
                ranks=host.local_size,
                error_feedback=self.error_feedback,
                timeout_s=self.timeout_s,
                security=self.security,
                chunk_elements=self.chunk_elements,
                max_in_flight=self.max_in_flight,
                incarnation=incarnation,
                reconnect_timeout_s=self.connect_timeout_s,
            )

        def join(client: WorkerClient) -> AggregationError | None:
            try:
                client.timeout_s = self.connect_timeout_s
                client.join()
                client.timeout_s = self.timeout_s
            except AggregationError as error:
                client.close()
                return error
            return None

        if self.elastic_hosts:  # the member id comes from the aggregator, through the host's first rank
            client, failure = join_elastic_host(group, host, client_for, join, self.incarnation)
        else:
            client = client_for(host.host, self.incarnation)
            failure = join(client)
        reachable = torch.tensor([1 if client is not None and failure is None else 0], dtype=torch.int32)
        dist.all_reduce(reachable, op=dist.ReduceOp.MIN, group=group)
        if reachable.item() == 1:
            assert client is not None
            self._client, self._mode = client, "gradq"
            self._membership = Membership(self, client)
            if self.elastic_hosts:  # the member id the aggregator assigned, and the run joined
                self._host, self.incarnation = replace(host, host=client.rank), client.incarnation
            return
        if failure is None and client is not None:
            client.close()
        where = str(failure) if failure else "another rank could not reach the aggregator"
        if self.fallback == "error":
            raise AggregationError(
                failure.address if failure else ",".join(self.addresses),
                failure.code if failure else None,
                f"unreachable at start ({where}); choose fallback='allreduce' or 'allgather' to train without it",
            )
        log.warning("aggregator unreachable (%s); falling back to %s", where, self.fallback)
        self._mode = self.fallback


def gradq_hook(state: GradqHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` through the gradq aggregator without blocking backward.

    Args:
        state: the GradqHookState registered with the model.
        bucket: DDP's flattened gradient bucket (fp32, fp16 or bf16; CPU or CUDA).

    Returns:
        A future DDP waits on, completed by the gRPC callback with the mean
        bucket (same shape, dtype and device as ``bucket.buffer()``). A failed
        round makes ``backward()`` raise its AggregationError (see
        gradq.client.ddp.errors).
    """
    if state._closed:
        raise RuntimeError("GradqHookState is closed; register a new state to train through gradq again")
    if state.mode is None and state.elastic_hosts:
        raise RuntimeError(
            "an elastic host joins before training: call state.share(model, optimizer) and state.start()"
        )
    if state.mode is None:
        state._connect()
    sparse = bucket.buffer().layout != torch.strided
    if state.mode != "gradq":
        return _fallback_allreduce(state, bucket) if sparse else _FALLBACK_HOOKS[str(state.mode)](state, bucket)
    step = state.step
    if state.elastic_hosts:
        serve_joiners(state, step)  # at a step boundary, before this step's first push
    if bucket.is_last():
        # DDP launches buckets in index order, so the last one closes the iteration on every rank.
        state.step += 1
    host, client, buffer = state._host, state.client, bucket.buffer()
    assert host is not None and client is not None
    adaptive = state.bit_policy == "adaptive" and not sparse
    plan = state._plans.plan(bucket, state.config, state.average_bits, state._group()) if adaptive else None
    if sparse:
        segments = []
    elif plan is not None:
        segments = [(key, piece.begin, piece.end) for key, piece in plan]
    elif host.flat:
        segments = [(bucket.index(), 0, buffer.numel())]
    else:
        segments = host.segments(bucket.index(), buffer.numel(), state.config.channel_size)
    if state.error_feedback:
        state._residuals.observe(state, bucket, segments)
    if sparse:
        # A sparse gradient (nn.Embedding(sparse=True)) has no dense grid to quantize: its
        # bucket is averaged by the process group, uncompressed, as DDP's default hook does.
        return _fallback_allreduce(state, bucket)
    if host.flat:
        pieces = plan or [(bucket.index(), Piece(0, buffer.numel(), state.config))]
        return state._failures.guard(_push_bucket(state, bucket, step, pieces), buffer)
    reduced = push_through_host(host, client, buffer, step, segments, state.codec, state._sender(), state._gatherer())
    return state._failures.guard(reduced, buffer)


def _push_bucket(
    state: GradqHookState, bucket: dist.GradBucket, step: int, pieces: list[tuple[int, Piece]]
) -> torch.futures.Future[torch.Tensor]:
    client = state.client
    assert client is not None
    buffer = bucket.buffer()
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    # Every bucket takes the same path (chunks, shards, window, retries, stats);
    # the codec decides only where it is quantized and where its mean is decoded.
    # DDP leaves the buffer alone until the future is done, so an fp32 bucket's
    # mean is decoded straight into it, as allreduce would.
    values, out = bucket_and_output(buffer, state.codec)

    def deliver(done: Any) -> None:
        try:
            done.result()  # every piece's mean is in ``out``
        except Exception as error:  # handed to DDP, which raises it in backward
            result.set_exception(error)  # type: ignore[arg-type]  # torch's stub says Tensor
            return
        result.set_result(torch.as_tensor(out).to(buffer.device, buffer.dtype).view_as(buffer))

    # Encoding and building the request move to the state's sender thread, so
    # backward goes on computing earlier buckets' gradients meanwhile (the kernels
    # release the GIL); on a GPU it queues after the work that made the gradients.
    @on_callers_stream(buffer)
    def send() -> None:
        try:
            dtype = str(buffer.dtype).removeprefix("torch.")  # a host copy is float32; stats compare with this
            parts = [
                client.push_pull_async(
                    step,
                    key,
                    values[piece.begin : piece.end],
                    out=out[piece.begin : piece.end],
                    dtype=dtype,
                    config=piece.config,
                )
                for key, piece in pieces
            ]
            assemble(parts, out, (len(out),)).add_done_callback(deliver)
        except Exception as error:  # handed to DDP, which raises it in backward
            result.set_exception(error)  # type: ignore[arg-type]

    state._sender().submit(send)
    return result


def _fallback_allreduce(state: GradqHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return allreduce_mean_hook(state._group(), bucket)


def _fallback_allgather(state: GradqHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return allgather_perchannel_hook(state._group(), bucket, state.config.channel_size, state.config.bits)


_FALLBACK_HOOKS: dict[str, Hook] = {"allreduce": _fallback_allreduce, "allgather": _fallback_allgather}
