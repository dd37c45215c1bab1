"""Shared by the abuse tests: a legitimate job whose means must stay exact, and raw attacker calls."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
from waiting import wait_until

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
                    mean = client.push_pull(step, 0, gradient(client.membership.rank, step))
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


class UnreadStream:
    """An attacker's PushPullStream: up to ``count`` pushes, to ``job_ids`` in turn, and never an answer read.

    ``sent`` counts the pushes gRPC has taken from it; it stops growing once the
    aggregator stops reading the stream (and gRPC's flow control holds the sender).
    """

    def __init__(self, address: str, job_ids: list[str], count: int) -> None:
        self.sent = 0
        self._job_ids = job_ids
        self._count = count
        # Its own connection, as a separate attacker's, that takes as few answers as gRPC lets it (a small
        # window, not grown by bandwidth probes): what it leaves, the aggregator holds or stops reading for.
        window = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
        self._channel = grpc.insecure_channel(address, options=window)
        method = self._channel.stream_stream("/gradq.v1.Aggregator/PushPullStream")
        self.call = method(self._pushes(), timeout=600)

    def _pushes(self) -> Iterator[bytes]:
        tensor = tensor_to_proto(encode(gradient(0, 0), EXACT))
        for sequence in range(1, self._count + 1):
            job = self._job_ids[sequence % len(self._job_ids)]
            push = pb.PushPullRequest(job_id=job, step=0, bucket=sequence, rank=0, sequence=sequence, tensor=tensor)
            yield push.SerializeToString()
            self.sent = sequence  # gRPC asks for the next push once this one is written

    def close(self) -> None:
        self.call.cancel()
        self._channel.close()


def wait_until_unread(streams: list[UnreadStream], quiet_s: float = 1.0, timeout_s: float = 120.0) -> int:
    """Wait until the aggregator reads no more of ``streams`` (none sent a push for ``quiet_s``); the pushes sent.

    Raises:
        AssertionError: they were still sending after ``timeout_s``.
    """
    sent, since = -1, time.monotonic()  # the pushes sent so far, and since when that count stands

    def quiet() -> bool:
        nonlocal sent, since
        now = sum(stream.sent for stream in streams)
        if now != sent:
            sent, since = now, time.monotonic()
        return time.monotonic() - since >= quiet_s

    wait_until(quiet, f"the streams unread for {quiet_s:g} s", timeout_s, detail=lambda: f"{sent} pushes sent")
    return sent
