"""WorkerClient: push a quantized bucket to its aggregator shard and pull back the mean."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import grpc
import numpy as np

from gradq.client import serde
from gradq.client.array_codecs import ArrayCodecs
from gradq.client.chunks import (
    DEFAULT_CHUNK_ELEMENTS,
    assemble,
    chunk_bounds,
    chunk_key,
    shard_for,
)
from gradq.client.contact import check_resolvable, explain_no_answer
from gradq.client.discovery import discover_shards
from gradq.client.elastic import ANY_RANK
from gradq.client.membership import ShardMembership
from gradq.client.security import ChannelSecurity
from gradq.client.sending import AggregationError, PendingPush, ShardSender
from gradq.client.shard_channels import ShardChannels
from gradq.client.shard_connections import ShardConnections
from gradq.client.stats import ClientStats, StatsRecorder
from gradq.client.window import ShardWindow, WindowSettings
from gradq.proto.transport import DEFAULT_MAX_MESSAGE_BYTES, MAX_PUSH_WEIGHT, keep_large_buffers
from gradq.qcore import QuantConfig, QuantizedArray, channel_count, decode, encode
from gradq.qcore.arrays import ResidualStore

__all__ = [
    "ANY_RANK",
    "DEFAULT_CHUNK_ELEMENTS",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "AggregationError",
    "WorkerClient",
    "shard_for",
]

log = logging.getLogger(__name__)


class WorkerClient:
    """One rank's connection to a job on one or more aggregator shards: its channels and its pushes.

    Who the member is on each shard (join, watch, rejoin, leave, state
    transfer) is ``membership``'s (gradq.client.membership): its id, run,
    news and state transfer are read there (``client.membership.rank``), in
    one place, never through forwarders here.

    Args:
        addresses: ``host:port`` of each shard (a single string for one).
        job_id: names the job; every rank of it uses the same id.
        rank: this worker's member id, 0..world_size-1 (its rank, or its host's under two-level aggregation);
            in an elastic job it may be ``ANY_RANK`` (the aggregator assigns a free member id at ``join``).
        job: what every Join says of the job (a serde.JobSpec; its fields say what each is), checked by
            the aggregator against the job's; a bare int is a world size, one rank per member and nothing
            else said. An elastic member (``JobSpec.elastic``) adopts a live run's incarnation and reads the
            Watch stream's membership news into ``membership.world`` (see gradq.client.elastic); it talks
            to one shard only.
        config: how buckets are quantized on the way out.
        error_feedback: keep a residual per bucket so quantization error is
            carried into the next step instead of lost (in the bucket's own
            array library: a tensor's residual stays on its device).
        timeout_s: deadline of each RPC; keep it above the aggregator's round
            timeout so its "missing ranks" answer arrives first.
        max_retries: retries of a call that failed with UNAVAILABLE; each
            retry rejoins and resends the same (step, bucket, rank), which the
            aggregator never counts twice.
        retry_backoff_s: first retry delay, doubled on each retry.
        max_message_bytes: gRPC send/receive limit.
        security: TLS / mutual TLS / bearer token; None talks plaintext.
        log_every_s: log a one-line ``stats()`` summary at most this often (None: never).
        chunk_elements: buckets above this many elements travel as several
            rounds (rounded up to whole channels); 0 never splits.
        max_in_flight: pushes per shard on the wire at once however short the
            path, the rest waiting in order; more go while their bytes fit twice
            the path's bandwidth-delay product (see gradq.client.window). None
            sends every push at once.
            Set it only when every rank pushes in the same order, as DDP does.
        incarnation: names this run of the job, the same on every rank (e.g. a
            uuid rank 0 draws and broadcasts); a rerun or restart with the same
            ``job_id`` passes a new one. "" gives none.
        reconnect_timeout_s: how long a retry's rejoin waits for a shard that
            went away (``join`` waits ``membership.timeout_s``): a dead aggregator is
            reported unreachable after about this long plus the first backoff.
        push_stream: send each shard's pushes as the messages of one
            PushPullStream call (gRPC's per-call work saved at both ends); False
            makes one unary PushPull call per push. An aggregator without
            PushPullStream gets unary calls either way.
    """

    def __init__(
        self,
        addresses: str | Sequence[str],
        job_id: str,
        rank: int,
        job: serde.JobSpec | int,
        config: QuantConfig | None = None,
        *,
        error_feedback: bool = False,
        timeout_s: float = 120.0,
        max_retries: int = 5,
        retry_backoff_s: float = 0.2,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        security: ChannelSecurity | None = None,
        log_every_s: float | None = None,
        chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
        max_in_flight: int | None = None,
        incarnation: str = "",
        reconnect_timeout_s: float = 10.0,
        push_stream: bool = True,
        window: WindowSettings | None = None,
    ) -> None:
        addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        if not addresses or not all(isinstance(a, str) and a for a in addresses):
            raise ValueError(f"addresses={addresses!r} is invalid; expected one or more 'host:port' strings")
        # What every Join says of the job, one value (its fields are checked as it is made).
        self.spec = job if isinstance(job, serde.JobSpec) else serde.JobSpec(world_size=job)
        if not self.spec.elastic and not 0 <= rank < self.spec.world_size:
            raise ValueError(f"rank={rank} is out of range; expected 0..{self.spec.world_size - 1}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} is invalid; expected > 0")
        if isinstance(chunk_elements, bool) or not isinstance(chunk_elements, int) or chunk_elements < 0:
            raise ValueError(f"chunk_elements={chunk_elements!r} is invalid; expected an integer >= 0 (0 never splits)")
        if not reconnect_timeout_s > 0:
            raise ValueError(f"reconnect_timeout_s={reconnect_timeout_s} is invalid; expected > 0")
        if max_retries < 0:
            raise ValueError(f"max_retries={max_retries} is invalid; expected >= 0")
        self.job_id = job_id
        self.reconnect_timeout_s = reconnect_timeout_s
        self.config = config or QuantConfig()
        channel = self.config.channel_size
        self.chunk_elements = channel_count(chunk_elements, channel) * channel if chunk_elements > 0 else 0
        self._codecs = ArrayCodecs(self.config, error_feedback)
        self._seed_rng(rank)
        keep_large_buffers()  # halves gRPC's CPU per multi-megabyte call; see gradq.proto.transport
        self.window_settings = window or WindowSettings()
        self._channels = ShardChannels(security or ChannelSecurity(), max_message_bytes, timeout_s, push_stream)
        self._stats = StatsRecorder(log_every_s)
        # Who this member is on each shard (joins, watches, rejoins, state transfer); the aggregator checks
        # the spec every Join carries against the job's.
        self.membership = ShardMembership(
            job_id,
            rank,
            self.spec,
            incarnation,
            timeout_s,
            reconnect_timeout_s,
            self._channels,
            trained=lambda: self._stats.snapshot().bytes_received > 0,
            rank_changed=self._seed_rng,
        )
        self._sending = (max_retries, retry_backoff_s, max_in_flight)
        # One address may be one shard of a group: ``join`` asks it for the others first.
        self._discover = len(addresses) == 1
        self._open_shards(addresses)

    @property
    def addresses(self) -> list[str]:
        """``host:port`` of each shard, in shard order (the group's, once ``join`` has discovered it)."""
        return self._channels.addresses

    @property
    def security(self) -> ChannelSecurity:
        """TLS / mutual TLS / bearer token of every channel."""
        return self._channels.security

    def _open_shards(self, addresses: list[str]) -> None:
        """Channels, stubs and the sender for ``addresses``, in shard order (a shard's channel already open is kept)."""
        self._channels.open(addresses)
        self.membership.reset_shards()
        max_retries, retry_backoff_s, max_in_flight = self._sending
        window: ShardWindow[PendingPush] = ShardWindow(len(self.addresses), max_in_flight, self.window_settings)
        transports = [
            ShardConnections(
                functools.partial(self._channels.open_connection, address), functools.partial(window.connections, shard)
            )
            for shard, address in enumerate(self.addresses)
        ]
        self._sender = ShardSender(
            self.addresses,
            transports,
            self._channels.unary_pushes(),
            max_retries,
            retry_backoff_s,
            window,
            self._stats,
            self.membership.rejoin_shard,
            self.membership.counted_lost,
        )

    # -- membership ----------------------------------------------------------------------------

    def join(self) -> None:
        """Join the job on every shard, waiting up to ``membership.timeout_s`` for each to come up.

        Given one address, first ask that shard for its group
        (gradq.client.discovery): the client then talks to every shard of it,
        in the group's order, and ``addresses`` lists them.

        Raises:
            AggregationError: a shard refused the join or could not be reached (at
                the first join an UnreachableError, saying what its address answered),
                or the one shard's group is malformed or does not contain it.
        """
        first = not any(self.membership.joined)
        if first:  # a name that does not resolve fails now, not at the connect deadline (gradq.client.contact)
            check_resolvable(self.addresses)
        try:
            if self._discover and first:
                group = discover_shards(
                    self._channels.stubs[0], self.addresses[0], self.membership.timeout_s, self._channels.metadata
                )
                self._discover = False
                if group != self.addresses:
                    self._sender.close()  # replaced by the group's; nothing was pushed through it yet
                    self._open_shards(group)
            # Load the compiled kernels (seconds from numba's cache on a cold process) beside the Join,
            # not before it: an elastic joiner's wait for the state begins at the Join, and a push
            # that needs a kernel still loading waits in numba's compile lock, not in a race.
            threading.Thread(target=_load_kernels, args=(self.config,), name="gradq-kernels", daemon=True).start()
            self.membership.join()
        except AggregationError as error:  # a first contact that got no answer says what the address answered
            raise (explain_no_answer(error, self.security, self.membership.timeout_s) if first else error) from None

    def _seed_rng(self, rank: int) -> None:
        # Per-rank stream so stochastic rounding is independent across ranks.
        self._rng = np.random.default_rng(None if self.config.seed is None else [self.config.seed, rank])

    def close(self) -> None:
        """Fail the pushes still waiting for the window, leave every shard joined (best effort), close."""
        for pending in self._sender.window.close():
            self._sender.fail(pending, grpc.StatusCode.CANCELLED, "the client closed before the push was sent")
        self.membership.leave()
        self._sender.close()
        self._channels.close()

    def __enter__(self) -> WorkerClient:
        self.join()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- push / pull ---------------------------------------------------------------------------

    def push_pull(self, step: int, bucket: int, array: Any, *, weight: int = 0) -> Any:
        """Contribute ``array`` to round (step, bucket) and return the mean over all ranks.

        Args:
            step: training step; every rank uses the same numbering.
            bucket: bucket index within the step; picks the shard.
            array: this rank's values: any float array, or a torch tensor on any
                device (quantized there; only packed bytes cross to the host).
            weight: in a job ``spec.weighted``, what this push stands for (the tokens or
                samples this member trained on since it last pushed the key), >= 1;
                the mean is then sum(weight * array) / sum(weight). 0 otherwise.

        Returns:
            float32 array (or tensor, on ``array``'s device) of ``array``'s shape holding the decoded mean.

        Raises:
            AggregationError: the round failed (e.g. ranks missing at its
                deadline) or the aggregator could not be reached.
        """
        return self.push_pull_async(step, bucket, array, weight=weight).result()

    def push_pull_async(
        self,
        step: int,
        bucket: int,
        array: Any,
        out: Any | None = None,
        *,
        dtype: str | None = None,
        config: QuantConfig | None = None,
        weight: int = 0,
    ) -> concurrent.futures.Future[Any]:
        """Like ``push_pull`` but returns at once; the answers, as they arrive, fill the future.

        Quantization happens on the calling thread before this returns, so the
        caller may reuse ``array`` immediately. A bucket larger than
        ``chunk_elements`` travels as several rounds, one per chunk, spread over
        the shards: one chunk's mean comes back while the next is pushed.

        Args:
            out: a contiguous float32 array (a tensor, for a tensor ``array``) of
                ``array``'s element count to decode the mean into (``array``
                itself is fine); None allocates one.
            dtype: the element type ``array`` stands for, when it is a float32
                copy of something narrower (the DDP hook's host copy of a bf16
                bucket): recorded on the wire and compared against in
                ``stats()``. None: ``array``'s own.
            config: the grid of this bucket (None: the client's ``config``). The
                aggregator fixes a bucket's grid at its first push, so pass the
                same one at every step (gradq.client.bit_policy chooses them).
            weight: see ``push_pull``.
        """
        self.check_weight(weight)
        arrays = self._codecs.of(array)
        flat = arrays.flatten(array)
        shape = tuple(np.shape(array))
        numel = len(flat)
        out = arrays.output(out, numel, flat)
        rounds = self.round_keys(bucket, numel)
        keys, pieces = [key for key, _, _ in rounds], [(begin, end) for _, begin, end in rounds]
        started = time.perf_counter()
        try:
            tensors = [
                arrays.encode(key, flat[begin:end], self._rng, config)
                for key, (begin, end) in zip(keys, pieces, strict=True)
            ]
            if dtype is not None:
                tensors = [dataclasses.replace(tensor, dtype=dtype) for tensor in tensors]
        except ValueError as error:
            # NaN/Inf (or |x| >= 2**126): tell the aggregator about every chunk, so its
            # policy rejects the bucket or skips it, for every rank alike.
            log.warning("step %d bucket %d: %s; reporting non-finite gradients", step, bucket, error)
            reported = [
                self.push_pull_non_finite_async(
                    step, key, end - begin, out=out[begin:end], config=config, weight=weight
                )
                for key, (begin, end) in zip(keys, pieces, strict=True)
            ]
            return assemble(reported, out, shape)
        encode_seconds = (time.perf_counter() - started) / len(pieces)
        parts: list[concurrent.futures.Future[Any]] = []
        for key, tensor, (begin, end) in zip(keys, tensors, pieces, strict=True):
            error_ratio = self._codecs.sampled_error(arrays, key, flat[begin:end], tensor)
            self._stats.pushed(tensor.numel, tensor.nbytes, encode_seconds, error_ratio, tensor.dtype)
            try:
                parts.append(
                    self.push_pull_encoded_async(step, key, tensor, counted=True, out=out[begin:end], weight=weight)
                )
            except AggregationError as error:
                if not parts:
                    raise
                # Chunks already sent still land in ``out``: fail through the future, once they have.
                failed: concurrent.futures.Future[Any] = concurrent.futures.Future()
                failed.set_exception(error)
                parts.append(failed)
                break
        return assemble(parts, out, shape)

    def check_weight(self, weight: int) -> None:
        """A weighted client's push carries a weight in range, another's none (the aggregator would refuse it)."""
        if self.spec.weighted and not (isinstance(weight, int) and 1 <= weight <= MAX_PUSH_WEIGHT):
            raise ValueError(
                f"weight={weight!r} is invalid; expected an integer in 1..{MAX_PUSH_WEIGHT}: this client's job "
                f"weights its means (JobSpec(weighted=True)) by what each push stands for (tokens, samples)"
            )
        if not self.spec.weighted and weight:
            raise ValueError(f"weight={weight!r} is invalid; expected 0: this client's job is not weighted")

    def round_keys(self, bucket: int, numel: int) -> list[tuple[int, int, int]]:
        """The rounds a bucket of ``numel`` elements travels as: (round key, begin, end) of each chunk.

        The one place that says which round key carries (and so which residual
        holds) which elements of a bucket; checkpoints ask here too.
        """
        pieces = chunk_bounds(numel, self.chunk_elements, self.config.channel_size, len(self.addresses))
        return [(chunk_key(bucket, index), begin, end) for index, (begin, end) in enumerate(pieces)]

    def array_libraries(self) -> list[str]:
        """The array libraries this client has encoded with: the ones that may hold residuals."""
        return self._codecs.libraries()

    def requests_in_flight_bytes(self) -> int:
        """Bytes of the encoded pushes not yet answered (each kept for a resend until its mean arrives)."""
        return self._sender.held_bytes

    def residuals(self, library: str = "numpy") -> ResidualStore | None:
        """The error-feedback residuals of the buckets pushed as ``library`` arrays, by round key.

        Made on first use, so a checkpoint can be restored into it before the
        first push; None when error feedback is off.
        """
        return self._codecs.residuals(library)

    def stats(self) -> ClientStats:
        """Encode / network / decode time, bytes, compression ratio and relative error so far."""
        return self._stats.snapshot()

    @property
    def bytes_sent(self) -> int:
        """Wire bytes pushed so far."""
        return self._stats.snapshot().bytes_sent

    @property
    def bytes_received(self) -> int:
        """Wire bytes of the means pulled so far."""
        return self._stats.snapshot().bytes_received

    def push_pull_non_finite_async(
        self,
        step: int,
        bucket: int,
        numel: int,
        shape: tuple[int, ...] | None = None,
        out: Any | None = None,
        config: QuantConfig | None = None,
        weight: int = 0,
    ) -> concurrent.futures.Future[Any]:
        """Report that this rank's bucket holds NaN/Inf; the future gets zeros if the round is skipped.

        ``config`` is the bucket's grid (None: the client's), which the placeholder must share.

        Raises (through the future):
            AggregationError: INVALID_ARGUMENT under the aggregator's default reject policy.
        """
        placeholder = encode(np.zeros(numel, np.float32), config or self.config)
        return self.push_pull_encoded_async(step, bucket, placeholder, shape, non_finite=True, out=out, weight=weight)

    def push_pull_encoded_async(
        self,
        step: int,
        bucket: int,
        tensor: QuantizedArray,
        shape: tuple[int, ...] | None = None,
        *,
        non_finite: bool = False,
        counted: bool = False,
        out: Any | None = None,
        weight: int = 0,
    ) -> concurrent.futures.Future[Any]:
        """Push an already encoded bucket (e.g. quantized on a GPU); the future gets the mean.

        Args:
            step: training step.
            bucket: bucket index; picks the shard.
            tensor: the encoded bucket.
            shape: shape of the returned mean; flat when None.
            non_finite: ``tensor`` is a placeholder for a NaN/Inf bucket.
            counted: the caller already recorded this push in ``stats()``.
            out: contiguous float32 array (or tensor, on any device) of
                ``tensor.numel`` elements to decode the mean into; None allocates an array.
            weight: see ``push_pull``.
        """
        self.check_weight(weight)
        shard = shard_for(bucket, len(self.addresses))
        flat_shape = (tensor.numel,) if shape is None else shape
        arrays = self._codecs.of(out)
        out = arrays.output(out, tensor.numel, out)
        pending = PendingPush(shard, step, bucket, b"", flat_shape, arrays, out, concurrent.futures.Future())
        pending.result.set_running_or_notify_cancel()  # settled only here: cancel() would free its slot early
        if self._sender.window.closed:
            self._sender.fail(pending, grpc.StatusCode.CANCELLED, "the client is closed")
            return pending.result
        if not self.membership.joined[shard]:
            self.membership.join_shard(shard)
        pending.sequence = self._sender.next_sequence()
        pending.request = serde.push_pull_request(
            self.job_id,
            step,
            bucket,
            self.membership.rank,
            tensor,
            non_finite,
            self.membership.incarnations[shard],
            pending.sequence,
            weight,
        )
        if not counted:
            self._stats.pushed(tensor.numel, tensor.nbytes, 0.0, None, tensor.dtype)
        self._sender.submit(pending)
        return pending.result


def _load_kernels(config: QuantConfig) -> None:
    """Compile or load from numba's cache the kernels ``config``'s pushes run."""
    try:
        decode(encode(np.zeros(8, np.float32), config))
    except Exception:  # a broken kernel fails the first push itself, with its own error
        log.debug("loading the quantization kernels failed", exc_info=True)
