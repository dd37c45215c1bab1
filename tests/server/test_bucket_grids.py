"""One grid per (job, bucket): buckets may differ, a round's contributions may not, and the map is bounded."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from abuse_helpers import gradient, push_request, stub

from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.qcore import QuantConfig, Scheme
from gradq.server.app import AggregatorServer, ServerOptions, ServiceLimits
from gradq.server.policy import RoundPolicy
from gradq.server.step_window import GRID_ENTRY_BYTES

EIGHT_BIT = QuantConfig(Scheme.PER_CHANNEL_AFFINE, 8, channel_size=16)
TWO_BIT = QuantConfig(Scheme.PER_CHANNEL_AFFINE, 2, channel_size=16)


def _serve(limits: ServiceLimits | None = None) -> AggregatorServer:
    server = AggregatorServer(RoundPolicy(round_timeout_s=5.0), ServerOptions("127.0.0.1:0", grace_s=0.5), limits)
    server.start()
    return server


def _join(attacker: object, job: str, world: int) -> None:
    for rank in range(world):
        attacker.Join(pb.JoinRequest(job_id=job, rank=rank, world_size=world), timeout=5)  # type: ignore[attr-defined]


def test_buckets_of_one_job_may_carry_different_grids_each_returned_on_its_own() -> None:
    server = _serve()
    channel, client = stub(f"127.0.0.1:{server.port}")
    try:
        _join(client, "mixed", 2)
        for step in range(3):  # the grids stay fixed per bucket across steps
            calls = {
                (rank, bucket): client.PushPull.future(
                    push_request("mixed", rank, step, gradient(rank, step), config, bucket), timeout=5
                )
                for bucket, config in ((0, EIGHT_BIT), (1, TWO_BIT))
                for rank in (0, 1)
            }
            for (_, bucket), call in calls.items():
                answer = call.result()
                assert answer.contributors == 2
                assert answer.mean.bits == (8, 2)[bucket]
    finally:
        channel.close()
        server.stop()


def test_a_round_whose_contributions_disagree_is_refused_naming_the_bucket_and_both_grids() -> None:
    server = _serve()
    channel, client = stub(f"127.0.0.1:{server.port}")
    try:
        _join(client, "disagree", 2)
        first = client.PushPull.future(push_request("disagree", 0, 0, gradient(0, 0), EIGHT_BIT, 3), timeout=5)
        with pytest.raises(grpc.RpcError) as refused:
            client.PushPull(push_request("disagree", 1, 0, gradient(1, 0), TWO_BIT, 3), timeout=5)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = refused.value.details()
        assert "bucket 3" in details
        assert "bits=2, channel_size=16" in details and "bits=8, channel_size=16" in details
        # The bucket's grid stays the first push's: the same rank on it completes the round.
        client.PushPull(push_request("disagree", 1, 0, gradient(1, 0), EIGHT_BIT, 3), timeout=5)
        assert first.result().contributors == 2
        # A later step of the same bucket on the other grid is refused too: the grid is fixed per bucket.
        with pytest.raises(grpc.RpcError) as later:
            client.PushPull(push_request("disagree", 0, 1, gradient(0, 1), TWO_BIT, 3), timeout=5)
        assert later.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        channel.close()
        server.stop()


def test_a_job_inventing_bucket_keys_is_refused_by_its_memory_budget_and_gets_it_back_when_it_ends() -> None:
    # Rounds of 4 elements hold a few dozen bytes: the remembered grids are what fills the job's share.
    limit = 40 * GRID_ENTRY_BYTES
    server = _serve(ServiceLimits(max_job_memory_bytes=limit, max_steps_ahead=1))
    channel, attacker = stub(f"127.0.0.1:{server.port}")
    try:
        _join(attacker, "keys", 1)
        values = np.ones(4, np.float32)
        with pytest.raises(grpc.RpcError) as refused:
            for bucket in range(1000):
                attacker.PushPull(push_request("keys", 0, bucket, values, EIGHT_BIT, bucket), timeout=5)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "the grid of bucket" in refused.value.details()
        assert "--max-job-memory-bytes" in refused.value.details()
        accepted = int(refused.value.details().split("the grid of bucket ")[1].split(" ")[0])
        assert 30 <= accepted < 40
        # Buckets whose grid is known go on; leaving ends the job and hands back all it held.
        attacker.PushPull(push_request("keys", 0, accepted, values, EIGHT_BIT, 0), timeout=5)
        attacker.Leave(pb.LeaveRequest(job_id="keys", rank=0), timeout=5)
        assert server.table.budget.in_use == 0
    finally:
        channel.close()
        server.stop()
