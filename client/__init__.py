"""The gradq worker client (numpy API); the DDP adapter builds on it."""

from gradq.client.security import ChannelSecurity
from gradq.client.worker import AggregationError, WorkerClient, shard_for

__all__ = ["AggregationError", "ChannelSecurity", "WorkerClient", "shard_for"]
