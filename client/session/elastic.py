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
learning rate or the batch). This module holds what a host shares (its model's signature, the state's bytes);
taking and giving the state, and knowing a drop, are the session's member's (gradq.client.session.member).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    pass

__all__ = [
    "check_shareable",
    "model_signature",
    "training_state",
]

# The most the aggregator takes of a model's signature (gradq.proto: JoinRequest.model_signature).
MAX_SIGNATURE_BYTES = 1 << 20

log = logging.getLogger(__name__)


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
