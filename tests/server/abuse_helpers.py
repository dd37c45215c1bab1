"""Shared by the abuse tests: a legitimate job whose means must stay exact, and raw attacker calls."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import numpy as np

from gradq.client import ChannelSecurity, WorkerClient
from gradq.proto.convert import tensor_to_proto
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc
from gradq.qcore import QuantConfig, Scheme, encode

EXACT = QuantConfig(scheme=Scheme.FLOAT32)
NUMEL = 64


def gradient(rank: int, step: int) -> np.ndarray:
    """Integer-valued, so the mean over ranks is exact in float32."""
    return np.arange(NUMEL, dtype=np.float32) + 100 * step + 2 * rank


def expected_mean(world: int, step: int) -> np.ndarray:
    return np.arange(NUMEL, dtype=np.float32) + 100 * step + (world - 1)


class LegitJob:
    """A job's ranks as WorkerClients kept joined across ``run`` calls; each mean must be exact."""

    def __init__(
        self,
        address: str,
        job: str,
        world: int,
        securities: list[ChannelSecurity] | None = None,
        incarnation: str = "",
        timeout_s: float = 20.0,
    ) -> None:
        self.world = world
        self.clients = [
            WorkerClient(
                address,
                job,
                rank,
                world,
                EXACT,
                timeout_s=timeout_s,
                security=securities[rank] if securities else None,
                incarnation=incarnation,
            )
            for rank in range(world)
        ]

    def run(self, steps: range) -> None:
        """Every rank runs ``steps`` in its own thread; asserts each mean is exact."""
        failures: list[BaseException] = []

        def work(client: WorkerClient) -> None:
            try:
                for step in steps:
                    mean = client.push_pull(step, 0, gradient(client.rank, step))
                    np.testing.assert_array_equal(mean, expected_mean(self.world, step))
            except BaseException as error:  # re-raised in the test's thread below
                failures.append(error)

        threads = [threading.Thread(target=work, args=(client,)) for client in self.clients]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not failures, failures[0]

    def close(self) -> None:
        for client in self.clients:
            client.close()


def run_legit_job(address: str, job: str, world: int, steps: range, **options: object) -> None:
    """A whole run of a job: join, ``steps`` exact rounds, leave."""
    legit = LegitJob(address, job, world, **options)  # type: ignore[arg-type]
    try:
        legit.run(steps)
    finally:
        legit.close()


def stub(address: str) -> tuple[grpc.Channel, pb_grpc.AggregatorStub]:
    """A raw stub (the attacker's) on its own channel."""
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 1 << 30)])
    return channel, pb_grpc.AggregatorStub(channel)


def bearer(token: str) -> list[tuple[str, str]]:
    """Call metadata presenting ``token``."""
    return [("authorization", f"Bearer {token}")]


def push_request(
    job: str, rank: int, step: int, values: np.ndarray, config: QuantConfig = EXACT, bucket: int = 0
) -> pb.PushPullRequest:
    return pb.PushPullRequest(
        job_id=job, step=step, bucket=bucket, rank=rank, tensor=tensor_to_proto(encode(values, config))
    )


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")
