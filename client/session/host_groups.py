"""Two-level aggregation: reduce a tensor inside each host, push only this rank's slices across the host's link.

A host holds several ranks behind one network link. Pushing every rank's whole
bucket would carry L times the compressed bucket through that link; instead:

- **Pieces.** Every host cuts a bucket into the same P pieces of whole channels,
  P being the most ranks any host of the job holds, so the aggregator's round
  for piece p gets exactly one contribution per host. Piece p of bucket b
  travels as round key ``b * P + p`` (spread over the shards like buckets).
  Under the adaptive bit policy a bucket is first split at parameter bounds
  into runs on their own grids (gradq.client.bit_policy), each with a key of
  its own, and each run is cut into P pieces the same way, so the two compose.
- **Ownership.** On a host of L ranks, local rank j owns the pieces p with
  ``p % L == j``: one each when L = P, several on a smaller host (3 + 1 ranks:
  the lone rank owns all three). A host of one rank runs no collective at all.
- **A bucket's way.** (1) The host's ranks sum the bucket in fp32 over their
  local process group (gloo on loopback, NCCL inside a GPU host), issued from
  the autograd thread in DDP's bucket order. (2) Each rank pushes its pieces of
  that sum, compressed, as member ``host`` of the aggregator's job, standing
  for the host's L ranks: the aggregator divides the sum over hosts by the
  ranks they stand for, so the mean stays the mean over every rank of the job
  (also for partial rounds). (3) The mean pieces are written into a zeroed
  buffer and summed over the host's ranks again (each piece has one owner),
  from one thread in bucket order, on a second local group so that step 3 of
  one bucket never interleaves with step 1 of a later one differently on two
  ranks.

The host's link thus carries 1/L of the flat path's bytes each way and the
aggregator decodes one contribution per host. Hosts are found from the
launcher (see ``host_key``); one rank per host keeps the flat path unchanged.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradq.client.bit_policy import Piece
from gradq.client.chunks import assemble
from gradq.client.env import HOST_GROUPINGS
from gradq.client.sending import AggregationError
from gradq.client.session.placement import bucket_and_output, on_callers_stream, quantizes_on_device
from gradq.client.session.residuals import Segment
from gradq.client.worker import WorkerClient
from gradq.qcore import QuantConfig, channel_count

__all__ = [
    "HOST_GROUPINGS",
    "HostGroup",
    "Segment",
    "elastic_host",
    "find_host_group",
    "host_key",
    "piece_bounds",
    "push_segments",
]

log = logging.getLogger(__name__)


# The variables launchers set that name a rank's host, checked in this order: torchrun's
# node rank, then Lightning's and Ray Train's.
_LAUNCHER_HOST_VARIABLES = ("GROUP_RANK", "NODE_RANK")


@dataclass(frozen=True, slots=True)
class HostGroup:
    """Where this rank stands among the job's hosts (see the module docstring)."""

    host: int  # this host's index: its member id at the aggregator
    hosts: int  # hosts in the job: the aggregator's world size
    local_rank: int  # this rank's place among its host's ranks
    local_size: int  # ranks on this host: what its contributions stand for
    pieces: int  # P: the most ranks any host holds; every bucket is cut into this many pieces
    reduce_group: dist.ProcessGroup | None  # the host's ranks, summing buckets (None: alone on the host)
    gather_group: dist.ProcessGroup | None  # the same ranks, gathering mean pieces
    # The host's ranks hold different shards of one replica (FSDP2 inside a DiLoCo host): each pushes its
    # own tensors whole, under round key ``key * P + local_rank``, as the host's member; none sums with another.
    sharded: bool = False

    @property
    def member_ranks(self) -> int:
        """The job's ranks this host's member stands for: its ranks, or one replica when they hold shards."""
        return 1 if self.sharded else self.local_size

    @property
    def flat(self) -> bool:
        """Every host holds one rank: buckets travel whole, as round key = bucket index."""
        return self.pieces == 1

    def segments(self, pieces: Sequence[tuple[int, Piece]]) -> tuple[list[Segment], dict[int, QuantConfig]]:
        """What this rank pushes of a tensor cut into ``pieces`` (round key, span, grid): segments and their grids.

        Each piece is cut again into ``self.pieces`` spans of whole channels;
        span p of the piece with key k travels as round key ``k * P + p`` and
        is pushed by the local rank that owns p. On the flat path (P = 1) the
        segments are the pieces themselves.
        """
        segments: list[Segment] = []
        grids: dict[int, QuantConfig] = {}
        if self.sharded:
            for key, piece in pieces:
                segments.append((key * self.pieces + self.local_rank, piece.begin, piece.end))
                grids[key * self.pieces + self.local_rank] = piece.config
            return segments, grids
        for key, piece in pieces:
            bounds = piece_bounds(piece.end - piece.begin, piece.config.channel_size, self.pieces)
            for part, (begin, end) in enumerate(bounds):
                if part % self.local_size == self.local_rank and end > begin:
                    segments.append((key * self.pieces + part, piece.begin + begin, piece.begin + end))
                    grids[key * self.pieces + part] = piece.config
        return segments, grids

    def describe(self) -> str:
        """``host 1 of 2, local rank 0 of 3`` for logs."""
        return f"host {self.host} of {self.hosts}, local rank {self.local_rank} of {self.local_size}"


def piece_bounds(numel: int, channel_size: int, pieces: int) -> list[tuple[int, int]]:
    """``pieces`` spans of whole channels covering ``numel`` elements, sizes differing by at most one channel.

    A span may be empty when the bucket has fewer channels than pieces; every
    host computes the same spans, so all skip the same empty ones.
    """
    channels = channel_count(numel, channel_size)
    edges = [min(channels * piece // pieces * channel_size, numel) for piece in range(pieces + 1)]
    return list(itertools.pairwise(edges))


def host_key(rank: int, grouping: str, host: str | None, environ: Mapping[str, str]) -> str:
    """The name ranks of one host share: ``host`` if given, else the launcher's node rank, else the rank's own.

    Args:
        rank: this rank in DDP's group.
        grouping: one of ``HOST_GROUPINGS``.
        host: an explicit host name (GradqHookState's ``host``, GRADQ_HOST); wins under "auto".
        environ: the launcher's variables.
    """
    if grouping not in HOST_GROUPINGS:
        raise ValueError(f"host_grouping={grouping!r} is invalid; expected one of {', '.join(HOST_GROUPINGS)}")
    if grouping == "auto":
        if host:
            return f"host={host}"
        for name in _LAUNCHER_HOST_VARIABLES:
            if environ.get(name, "").strip():
                return f"{name}={environ[name].strip()}"
    return f"rank={rank}"


def find_host_group(
    group: dist.ProcessGroup, grouping: str, host: str | None, environ: Mapping[str, str], timeout_s: float
) -> HostGroup:
    """Agree with every rank of ``group`` on the hosts, and make the local groups; collective over ``group``.

    Two-level needs DDP's group to be the default one (every process takes
    part in making each host's groups); under a subgroup, or when every host
    holds one rank, the result is flat and makes no group.
    """
    me, world = dist.get_rank(group), dist.get_world_size(group)
    keys: list[Any] = [None] * world
    dist.all_gather_object(keys, host_key(me, grouping, host, environ), group=group)
    members: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        members.setdefault(key, []).append(rank)
    mine = members[keys[me]]
    pieces = max(len(ranks) for ranks in members.values())
    if pieces > 1 and world != dist.get_world_size():
        log.warning("DDP's process group is not the default group: hosts reduce flat, one rank per host")
        return HostGroup(me, world, 0, 1, 1, None, None)
    reduce_group = gather_group = None
    global_ranks = dist.get_process_group_ranks(group)
    timeout = datetime.timedelta(seconds=timeout_s)
    for ranks in members.values():  # every rank makes every host's groups, in the same order
        if len(ranks) > 1:
            reducing = dist.new_group([global_ranks[rank] for rank in ranks], timeout=timeout)
            gathering = dist.new_group([global_ranks[rank] for rank in ranks], timeout=timeout)
            if ranks is mine:
                reduce_group, gather_group = reducing, gathering
    found = HostGroup(
        list(members).index(keys[me]), len(members), mine.index(me), len(mine), pieces, reduce_group, gather_group
    )
    if pieces > 1:
        log.info("two-level aggregation: %s (%d ranks, %d pieces per bucket)", found.describe(), world, pieces)
    return found


def elastic_host(group: dist.ProcessGroup, hosts: int, timeout_s: float) -> HostGroup:
    """This host as one elastic member: its process group's ranks reduce together first (two-level).

    The member id comes from the aggregator at the Join. Every host of a job
    must hold as many ranks (its tensors are cut into that many pieces); the
    aggregator refuses a host that holds another number. Collective over ``group``.

    Raises:
        ValueError: several ranks, but ``group`` is not the default group (the local groups are made from it).
    """
    size = dist.get_world_size(group)
    if size == 1:
        return HostGroup(
            host=0, hosts=hosts, local_rank=0, local_size=1, pieces=1, reduce_group=None, gather_group=None
        )
    if size != dist.get_world_size():
        raise ValueError(
            f"elastic_hosts={hosts}: a host's {size} ranks reduce over the loop's process group, which must be the "
            f"default group of the host's own launch (e.g. its torchrun)"
        )
    ranks = dist.get_process_group_ranks(group)
    timeout = datetime.timedelta(seconds=timeout_s)
    reducing, gathering = dist.new_group(ranks, timeout=timeout), dist.new_group(ranks, timeout=timeout)
    return HostGroup(0, hosts, dist.get_rank(group), size, size, reducing, gathering)


def push_segments(
    host: HostGroup,
    client: WorkerClient,
    values: torch.Tensor,
    step: int,
    segments: list[Segment],
    grids: Mapping[int, QuantConfig],
    codec: str,
    sender: concurrent.futures.Executor,
    gatherer: concurrent.futures.Executor,
    weight: int = 0,
) -> torch.futures.Future[torch.Tensor]:
    """Average one flat tensor: summed inside the host first when it holds several ranks (see the module docstring).

    Args:
        host: this rank's place among the hosts.
        client: the connected worker client (member ``host.host``, standing for ``host.local_size`` ranks).
        values: the tensor; left alone by the caller until the future is done.
        step: the round's step.
        segments: ``host.segments(...)`` of this tensor.
        grids: the grid of each segment's round key.
        codec: the configured codec (see gradq.client.session.placement).
        sender: the one thread that encodes and pushes, in call order.
        gatherer: the one thread that gathers mean pieces inside the host, in call order.
        weight: a weighted job's push, what the host trained on (the same on its every rank); 0 elsewhere.

    Returns:
        A future of the mean, shaped and typed like ``values``; it fails with
        this rank's AggregationError, or one naming the host when another of
        its ranks failed its pieces.
    """
    if host.reduce_group is None:
        return _push_alone(client, values, step, segments, grids, codec, sender, weight)
    numel = values.numel()
    flat = values.detach().reshape(-1)
    # The host's sum, in fp32: in the tensor itself when it is fp32 (the caller leaves it
    # alone until the future is done, as the decode-in-place of a rank alone relies on too).
    summed = flat if flat.dtype == torch.float32 else flat.to(torch.float32)
    reduced = dist.all_reduce(summed, group=host.reduce_group, async_op=True)
    on_device = quantizes_on_device(values.device, codec)
    # Where the mean pieces land: the sum itself (each piece is encoded before its mean
    # comes back), or a host buffer when a device tensor is quantized by numpy.
    landing = summed if on_device or summed.device.type == "cpu" else torch.empty(numel, dtype=torch.float32)
    pushed: concurrent.futures.Future[list[concurrent.futures.Future[Any]]] = concurrent.futures.Future()
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    dtype = str(values.dtype).removeprefix("torch.")

    @on_callers_stream(values)
    def push() -> None:
        try:
            assert reduced is not None
            reduced.wait()
            sums = summed if on_device else summed.cpu().numpy()
            out = landing if on_device else landing.numpy()
            pushed.set_result(
                [
                    client.push_pull_async(
                        step,
                        key,
                        sums[begin:end],
                        out=out[begin:end],
                        dtype=dtype,
                        config=grids.get(key),
                        weight=weight,
                    )
                    for key, begin, end in segments
                ]
            )
        except Exception as error:  # every rank of the host still gathers, then all fail
            pushed.set_exception(error)

    def gather() -> None:
        failure: BaseException | None = None
        try:
            for part in pushed.result():
                part.result()
        except Exception as error:
            failure = error
        mean = landing.to(values.device)
        try:
            # First whether every rank of the host has its pieces: all gather the mean, or all fail.
            failed = torch.tensor([0.0 if failure is None else 1.0], device=values.device)
            dist.all_reduce(failed, group=host.gather_group)
            if failure is None and failed.item() > 0:
                reason = f"another rank of host {host.host} failed its pieces of step {step}; its error says why"
                failure = AggregationError(client.addresses[0], None, reason)
            if failure is None:
                _zero_outside(mean, segments)  # each piece then has exactly one owner in the sum
                dist.all_reduce(mean, group=host.gather_group)
        except Exception as error:
            failure = failure or error
        if failure is not None:
            result.set_exception(failure)  # type: ignore[arg-type]  # torch's stub says Tensor
        else:
            result.set_result(mean.to(values.dtype).view_as(values))

    sender.submit(push)
    gatherer.submit(gather)
    return result


def _push_alone(
    client: WorkerClient,
    values: torch.Tensor,
    step: int,
    segments: list[Segment],
    grids: Mapping[int, QuantConfig],
    codec: str,
    sender: concurrent.futures.Executor,
    weight: int,
) -> torch.futures.Future[torch.Tensor]:
    """A rank alone on its host pushes every piece itself; the answers' callbacks complete the future.

    Its segments cover the whole tensor. An fp32 tensor's mean is decoded
    straight into it, as allreduce would; no thread waits for the answer.
    """
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    pushed, out = bucket_and_output(values, codec)
    dtype = str(values.dtype).removeprefix("torch.")  # a host copy is float32; stats compare with this

    def deliver(done: concurrent.futures.Future[Any]) -> None:
        try:
            done.result()  # every piece's mean is in ``out``
        except Exception as error:  # handed to the adapter, which raises it where the loop waits
            result.set_exception(error)  # type: ignore[arg-type]  # torch's stub says Tensor
            return
        result.set_result(torch.as_tensor(out).to(values.device, values.dtype).view_as(values))

    # Encoding and building the request happen on the sender thread, so the caller (DDP's
    # backward) goes on computing meanwhile (the kernels release the GIL); on a GPU it
    # queues after the work that made the tensor.
    @on_callers_stream(values)
    def send() -> None:
        try:
            parts = [
                client.push_pull_async(
                    step,
                    key,
                    pushed[begin:end],
                    out=out[begin:end],
                    dtype=dtype,
                    config=grids.get(key),
                    weight=weight,
                )
                for key, begin, end in segments
            ]
            assemble(parts, out, (len(out),)).add_done_callback(deliver)
        except Exception as error:
            result.set_exception(error)  # type: ignore[arg-type]

    sender.submit(send)
    return result


def _zero_outside(values: torch.Tensor, segments: list[Segment]) -> None:
    """Zero every element of ``values`` outside the (sorted, disjoint) segments."""
    start = 0
    for _, begin, end in segments:
        values[start:begin] = 0.0
        start = end
    values[start:] = 0.0
