"""Elastic training through the DDP hook: hosts that are lost and hosts that join while the job trains.

Each host is one process with a process group of its own, or a host's ranks
under their own launch (e.g. one torchrun per host), whose process group is
the host's (``elastic_hosts=N`` on every rank's GradqHookState, the same job
id everywhere, one aggregator). The aggregator's members are the hosts: a
host's ranks reduce each bucket together first and push its pieces as that
member (two-level, see gradq.client.ddp.host_groups), and its first rank
joins, sends and receives the state for all of them. Every host must hold the
same number of ranks. The job trains once N hosts have joined. Then:

- **A host is lost** (its process dies, or its host drops off the network):
  the aggregator drops it within about a second (its Watch stream ends) and
  finishes the open rounds over the hosts left; the mean divides by the ranks
  they stand for. The others go on, without restarting; at most the step in
  flight is averaged over fewer hosts.
- **A host joins** (a replacement, or one more): ``start()`` joins as a
  pending member and waits. At its next step boundary (the first bucket of a
  step, before any of that step's pushes, when parameters and optimizer state
  are those after the previous step) the lowest member training sends it the
  state of the objects given to ``share`` through the aggregator, and the
  newcomer trains from that step on. The rounds of that step wait for it, so
  after its first step its parameters equal everyone's bit for bit.

``state.world()`` says who trains now and for how many ranks (e.g. to scale the
learning rate or the batch).
"""

from __future__ import annotations

import datetime
import io
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradq.client.ddp.host_groups import HostGroup
from gradq.client.elastic import ANY_RANK
from gradq.client.sending import AggregationError
from gradq.client.worker import WorkerClient

if TYPE_CHECKING:
    from gradq.client.ddp.hook import GradqHookState

__all__ = ["elastic_host", "serve_joiners", "share_objects", "start_member", "training_state"]

log = logging.getLogger(__name__)


def elastic_host(group: dist.ProcessGroup, hosts: int, timeout_s: float) -> HostGroup:
    """This host as one elastic member: its process group's ranks reduce together first (two-level).

    The member id comes from the aggregator at the Join. Every host of a job
    must hold as many ranks (its buckets are cut into that many pieces); the
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
            f"elastic_hosts={hosts}: a host's {size} ranks reduce over DDP's process group, which must be the "
            f"default group of the host's own launch (e.g. its torchrun)"
        )
    ranks = dist.get_process_group_ranks(group)
    timeout = datetime.timedelta(seconds=timeout_s)
    reducing, gathering = dist.new_group(ranks, timeout=timeout), dist.new_group(ranks, timeout=timeout)
    return HostGroup(0, hosts, dist.get_rank(group), size, size, reducing, gathering)


def join_elastic_host(
    group: dist.ProcessGroup,
    host: HostGroup,
    client_for: Callable[[int, str], WorkerClient],
    join: Callable[[WorkerClient], AggregationError | None],
    incarnation: str,
) -> tuple[WorkerClient | None, AggregationError | None]:
    """The host's first rank joins for any member id; its other ranks then join as that member, in its run.

    Collective over ``group``. Returns this rank's client (None when the
    first rank could not join) and its own failure to join, if any.
    """
    client: WorkerClient | None = None
    failure: AggregationError | None = None
    if host.local_rank == 0:
        client = client_for(ANY_RANK, incarnation)
        failure = join(client)
    joined: list[Any] = [(client.rank, client.incarnation) if client is not None and failure is None else None]
    if host.local_size > 1:
        dist.broadcast_object_list(joined, src=dist.get_global_rank(group, 0), group=group)
        if host.local_rank != 0 and joined[0] is not None:
            client = client_for(*joined[0])
            failure = join(client)
    return client, failure


def share_objects(state: GradqHookState, objects: Sequence[Any]) -> None:
    """Record the objects whose state a joiner receives; see ``GradqHookState.share``.

    Raises:
        TypeError: an object lacks state_dict / load_state_dict.
    """
    for index, shared in enumerate(objects):
        if not (callable(getattr(shared, "state_dict", None)) and callable(getattr(shared, "load_state_dict", None))):
            raise TypeError(
                f"objects[{index}]={type(shared).__name__} has no state_dict()/load_state_dict(); expected a model, "
                f"an optimizer or another object torch checkpoints"
            )
    state._shared = list(objects)


def fix_bucket_layout(shared: Sequence[Any]) -> None:
    """Give the shared DDP model the bucket layout every elastic host has, before its first forward.

    DDP rebuilds its buckets once, after the first backward, in the order the
    gradients became ready; a joiner's first step would then use the initial
    layout while the others use the rebuilt one, and a round would mix
    different parameters. Rebuilding now from the parameters' own order (what
    DDP's Join does) gives every host, starter or joiner, the same layout from
    its first step on. The price: buckets follow the model's order, so a
    bucket is sent only once backward has reached the model's first layers.

    Raises:
        ValueError: nothing is shared, or no shared object is the DistributedDataParallel model.
    """
    ddp = next((shared for shared in shared if isinstance(shared, DistributedDataParallel)), None)
    if ddp is None:
        raise ValueError(
            "an elastic host shares its training state, the DDP model among it: call "
            "state.share(ddp_model, optimizer) with the DistributedDataParallel the hook is registered on first"
        )
    ddp.reducer._push_all_rebuilt_params()
    ddp.reducer._rebuild_buckets()


def training_state(state: GradqHookState, step: int) -> bytes:
    """The shared objects' state, taken before ``step``, as the bytes a joiner receives."""
    buffer = io.BytesIO()
    torch.save({"step": step, "objects": [shared.state_dict() for shared in state._shared]}, buffer)
    return buffer.getvalue()


def start_member(state: GradqHookState) -> int:
    """Join now; an elastic newcomer receives and loads the training state. See ``GradqHookState.start``."""
    if state.elastic_hosts:
        fix_bucket_layout(state._shared)
    if state.mode is None:
        state._connect()
    client, host = state.client, state._host
    if client is None or host is None or not client.catch_up:
        return state.step
    # The host's first rank receives the state; its other ranks get it from that rank.
    received: list[Any] = [None]
    if host.local_rank == 0:
        try:
            received[0] = client.fetch_state()
        except AggregationError as error:  # the host's other ranks must not wait for it forever
            received[0] = (error.address, error.details)
            if host.local_size == 1:
                raise
    if host.local_size > 1:
        group = state._group()
        dist.broadcast_object_list(received, src=dist.get_global_rank(group, 0), group=group)
        client.catch_up = False
    state_bytes = received[0]
    if isinstance(state_bytes, tuple):
        address, details = state_bytes
        raise AggregationError(address, None, f"the host's first rank could not receive the state: {details}")
    # weights_only: the bytes come from another host through the aggregator, so no pickled code runs.
    payload = torch.load(io.BytesIO(state_bytes.data), map_location="cpu", weights_only=True)
    objects = payload["objects"]
    if len(objects) != len(state._shared):
        raise ValueError(
            f"member {state_bytes.sender} shared {len(objects)} objects, this host {len(state._shared)}; "
            f"every host must share the same objects in the same order"
        )
    for shared, saved in zip(state._shared, objects, strict=True):
        shared.load_state_dict(saved)
    state.step = state_bytes.step
    log.info(
        "joined %s as member %d at step %d: %d bytes of state from member %d",
        state.job_id,
        client.rank,
        state_bytes.step,
        len(state_bytes.data),
        state_bytes.sender,
    )
    return state.step


def serve_joiners(state: GradqHookState, step: int) -> None:
    """At the first bucket of ``step``: if the aggregator asks this member, send the waiting joiners the state.

    A failed transfer is logged, not raised: the joiner's loss is handled by the
    aggregator like any other, and this host trains on.
    """
    if step == state._served_step:
        return
    state._served_step = step
    client, host = state.client, state._host
    world = client.world if client is not None else None
    if client is None or world is None or not world.joiners or world.donor != client.rank:
        return
    if host is not None and host.local_rank != 0:
        return  # the host's first rank sends, before its first collective of the step: the others wait in it
    data = training_state(state, step)
    for joiner in world.joiners:
        try:
            relayed = client.send_state(joiner, step, data)
        except AggregationError as error:
            log.warning("could not send member %d the training state: %s", joiner, error)
            continue
        log.info("sent member %d the training state before step %d (%d bytes)", joiner, step, relayed)
