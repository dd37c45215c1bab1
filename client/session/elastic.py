"""Elastic training through a session: hosts that are lost and hosts that join while the job trains.

Each host is one process with a process group of its own, or a host's ranks
under their own launch (e.g. one torchrun per host), whose process group is
the host's (``elastic_hosts=N`` in every rank's GradqConfig, the same job
id everywhere, one aggregator). The aggregator's members are the hosts: a
host's ranks reduce each bucket together first and push its pieces as that
member (two-level, see gradq.client.session.host_groups), and its first rank
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

``session.world()`` (the DDP hook state's ``world()``) says who trains now and for how many ranks (e.g. to scale the
learning rate or the batch).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gradq.client.sending import AggregationError

if TYPE_CHECKING:
    from gradq.client.session.session import GradqSession

__all__ = [
    "check_shareable",
    "dropped_from_job",
    "model_signature",
    "receive_training_state",
    "serve_joiners",
    "training_state",
]

# The most the aggregator takes of a model's signature (gradq.proto: JoinRequest.model_signature).
MAX_SIGNATURE_BYTES = 1 << 20

log = logging.getLogger(__name__)

# The refusals that say the aggregator no longer counts this host a member training: it is not one (dropped
# while silent), it waits for the state, or the job's run there is another (a restarted shard resumed by the
# hosts that hold the job). Each is answered the same way: a Join as a joiner, which takes the state.
_DROPPED_REFUSALS = frozenset({"NOT_JOINED", "PENDING", "ANOTHER_RUN"})


def check_shareable(objects: Sequence[Any]) -> list[Any]:
    """The objects whose state a joiner receives, each checked to have state_dict / load_state_dict.

    Raises:
        TypeError: an object lacks state_dict / load_state_dict.
    """
    for index, shared in enumerate(objects):
        if not (callable(getattr(shared, "state_dict", None)) and callable(getattr(shared, "load_state_dict", None))):
            raise TypeError(
                f"objects[{index}]={type(shared).__name__} has no state_dict()/load_state_dict(); expected a model, "
                f"an optimizer or another object torch checkpoints"
            )
    return list(objects)


def model_signature(shared: Sequence[Any]) -> str:
    """The shared modules' tensors, one line each: ``<object>.<name> <dtype>[<shape>]``, in state_dict order.

    Only modules count: an optimizer's state appears at its first step, so a
    joiner's would differ from a donor's for no fault of its own. A signature
    longer than the aggregator takes is cut at a line (its start still tells
    most mis-built hosts apart).
    """
    lines = []
    for index, item in enumerate(shared):
        if isinstance(item, torch.nn.Module):
            for name, value in item.state_dict().items():
                if isinstance(value, torch.Tensor):
                    dtype = str(value.dtype).removeprefix("torch.")
                    lines.append(f"{index}.{name} {dtype}{list(value.shape)}")
    text = "\n".join(lines)
    if len(text) > MAX_SIGNATURE_BYTES:
        text = text[:MAX_SIGNATURE_BYTES].rsplit("\n", 1)[0]
    return text


def training_state(shared: Sequence[Any], step: int) -> bytes:
    """The shared objects' state, taken before ``step``, as the bytes a joiner receives."""
    buffer = io.BytesIO()
    torch.save({"step": step, "objects": [item.state_dict() for item in shared]}, buffer)
    return buffer.getvalue()


def receive_training_state(session: GradqSession, shared: Sequence[Any], step: int) -> int:
    """A pending member receives and loads the training state; returns the step to train from.

    A member that joined a job not yet training (or a fixed job) returns ``step`` as it is.
    Collective over the session's group for a host of several ranks.
    """
    client, host = session.client, session.host
    if client is None or not client.catch_up:
        return step
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
        dist.broadcast_object_list(received, src=dist.get_global_rank(session.group, 0), group=session.group)
        client.catch_up = False
    state_bytes = received[0]
    if isinstance(state_bytes, tuple):
        address, details = state_bytes
        raise AggregationError(address, None, f"the host's first rank could not receive the state: {details}")
    # weights_only: the bytes come from another host through the aggregator, so no pickled code runs.
    payload = torch.load(io.BytesIO(state_bytes.data), map_location="cpu", weights_only=True)
    objects = payload["objects"]
    if len(objects) != len(shared):
        raise ValueError(
            f"member {state_bytes.sender} shared {len(objects)} objects, this host {len(shared)}; "
            f"every host must share the same objects in the same order"
        )
    for item, saved in zip(shared, objects, strict=True):
        item.load_state_dict(saved)
    log.info(
        "joined %s as member %d at step %d: %d bytes of state from member %d",
        session.job_id,
        client.rank,
        state_bytes.step,
        len(state_bytes.data),
        state_bytes.sender,
    )
    return int(state_bytes.step)


def serve_joiners(session: GradqSession, shared: Sequence[Any], step: int) -> None:
    """At the first call of ``step``: if the aggregator asks this member, send the waiting joiners the state.

    A failed transfer is logged, not raised: the joiner's loss is handled by the
    aggregator like any other, and this host trains on.
    """
    if step == session.served_step:
        return
    session.served_step = step
    client, host = session.client, session.host
    world = client.world if client is not None else None
    if client is None or world is None or not world.joiners or world.donor != client.rank:
        return
    if host.local_rank != 0:
        return  # the host's first rank sends, before its first collective of the step: the others wait in it
    data = training_state(shared, step)
    for joiner in world.joiners:
        try:
            relayed = client.send_state(joiner, step, data)
        except AggregationError as error:
            log.warning("could not send member %d the training state: %s", joiner, error)
            continue
        log.info("sent member %d the training state before step %d (%d bytes)", joiner, step, relayed)


def dropped_from_job(error: BaseException) -> bool:
    """A refusal saying the aggregator no longer counts this host a member (dropped while it was silent).

    Its way back is a Join as a joiner, which takes the state (never its own model, which is stale).
    """
    if not isinstance(error, AggregationError):
        return False
    return error.refusal in _DROPPED_REFUSALS
