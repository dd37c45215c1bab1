"""An elastic member's side of membership: who trains now (from its Watch stream) and the state transfer.

A newcomer to an elastic job in training is pending: it waits in FetchState
until the donor the aggregator names (the lowest member training) sends it the
state with PutState at a step boundary, and then trains from that step on.
See gradq.server.state_relay for the aggregator's side.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from gradq.client.sending import AggregationError
from gradq.proto.transport import MAX_STATE_CHUNK_BYTES
from gradq.proto.v1 import aggregator_pb2 as pb

__all__ = ["ANY_RANK", "STATE_CHUNK_BYTES", "JobWorld", "ReceivedState", "fetch_state", "send_state", "world_of"]

log = logging.getLogger(__name__)

# An elastic Join's rank asking the aggregator for the lowest free member id.
ANY_RANK = 0xFFFFFFFF
# The largest chunk the aggregator accepts (it holds at most 4 of one transfer).
STATE_CHUNK_BYTES = MAX_STATE_CHUNK_BYTES


@dataclass(frozen=True, slots=True)
class JobWorld:
    """An elastic job's members as its aggregator last announced them."""

    members: tuple[int, ...]  # member ids training now
    ranks: int  # the ranks they stand for: what the mean divides by (scale a learning rate by it)
    joiners: tuple[int, ...]  # pending members waiting for the state
    donor: int  # the member asked to send it to them

    @property
    def size(self) -> int:
        """Members training now."""
        return len(self.members)


@dataclass(frozen=True, slots=True)
class ReceivedState:
    """The state a joiner received: its bytes, the step it trains from, and who sent it."""

    data: bytes
    step: int
    sender: int


def world_of(event: pb.WatchEvent) -> JobWorld:
    """The JobWorld a Watch event announces."""
    return JobWorld(tuple(event.members), event.ranks, tuple(event.joiners), event.donor)


def fetch_state(stub: Any, address: str, request: pb.StateRequest, timeout_s: float, metadata: Any) -> ReceivedState:
    """Wait for the training state and receive it, chunk by chunk.

    Raises:
        AggregationError: the aggregator refused, the sender went away, the
            deadline passed, or the chunks did not add up to the announced size.
    """
    parts: list[bytes] = []
    first: pb.StateChunk | None = None
    try:
        for chunk in stub.FetchState(request, timeout=timeout_s, metadata=metadata):
            first = first or chunk
            parts.append(chunk.data)
    except grpc.RpcError as error:
        raise AggregationError.of_call(address, error, "receiving the training state") from None
    data = b"".join(parts)
    if first is None or len(data) != first.total_bytes:
        announced = first.total_bytes if first is not None else "?"
        raise AggregationError(address, None, f"the training state ended at {len(data)} of {announced} bytes")
    return ReceivedState(data, first.step, first.rank)


def send_state(
    stub: Any,
    address: str,
    header: pb.StateChunk,
    data: bytes,
    timeout_s: float,
    metadata: Any,
) -> int:
    """Send ``data`` to the joiner ``header`` names, as chunks of ``STATE_CHUNK_BYTES``; returns the bytes relayed.

    Raises:
        AggregationError: the aggregator refused (the joiner is not waiting, or
            went away) or could not be reached.
    """

    def chunks() -> Iterator[pb.StateChunk]:
        view = memoryview(data)
        for offset in range(0, max(len(data), 1), STATE_CHUNK_BYTES):
            chunk = pb.StateChunk()
            chunk.CopyFrom(header)
            chunk.total_bytes = len(data)
            chunk.data = bytes(view[offset : offset + STATE_CHUNK_BYTES])
            yield chunk

    try:
        response = stub.PutState(chunks(), timeout=timeout_s, metadata=metadata)
    except grpc.RpcError as error:
        raise AggregationError.of_call(address, error, "sending the training state") from None
    return int(response.relayed_bytes)
