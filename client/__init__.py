"""The gradq worker client (numpy API); the DDP adapter builds on it."""

from gradq.client.security import ChannelSecurity
from gradq.client.serde import JobSpec
from gradq.client.worker import AggregationError, WorkerClient, shard_for
from gradq.proto.transport import share_one_arena

# At import, before the training script starts its threads (DDP's, gloo's, gRPC's): a rank's round buffers are
# then reused across threads instead of held once per thread (see share_one_arena).
share_one_arena()

__all__ = ["AggregationError", "ChannelSecurity", "JobSpec", "WorkerClient", "shard_for"]
