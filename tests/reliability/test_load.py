"""A short load run for CI: 16 workers x 20 rounds against one aggregator and two shards, nothing lost or doubled.

The full size (16 x 200 x 25 MB) is `python bench/server_throughput.py --workers 16 --rounds 200`.
"""

from __future__ import annotations

import threading

import numpy as np
import psutil
import pytest

from gradq.client import WorkerClient
from gradq.qcore import QuantConfig, Scheme
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.policy import RoundPolicy

WORKERS, ROUNDS, NUMEL = 16, 20, 1 << 18  # 1 MiB of fp32 per bucket


@pytest.mark.parametrize("shards", [1, 2])
def test_sixteen_workers_lose_and_double_count_nothing(shards: int) -> None:
    servers = [
        AggregatorServer(RoundPolicy(world_size=WORKERS, round_timeout_s=60.0), ServerOptions("127.0.0.1:0", grace_s=1))
        for _ in range(shards)
    ]
    for server in servers:
        server.start()
    addresses = [f"127.0.0.1:{server.port}" for server in servers]
    process = psutil.Process()
    rss_before = process.memory_info().rss
    threads_before = threading.active_count()
    wrong: list[tuple[int, int]] = []
    peak_threads = [0]

    def work(rank: int) -> None:
        with WorkerClient(addresses, "load", rank, WORKERS, QuantConfig(scheme=Scheme.FLOAT32)) as client:
            for step in range(ROUNDS):
                bucket = step % 4
                mine = np.full(NUMEL, float(rank * ROUNDS + step), np.float32)
                mean = client.push_pull(step, bucket, mine)
                # mean over ranks of rank*ROUNDS + step: integers/16 are exact in fp32
                if not np.all(mean == np.float32((WORKERS - 1) / 2 * ROUNDS + step)):
                    wrong.append((rank, step))
                peak_threads[0] = max(peak_threads[0], threading.active_count())

    try:
        threads = [threading.Thread(target=work, args=(rank,)) for rank in range(WORKERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert not any(thread.is_alive() for thread in threads), "a worker hung"
        assert wrong == []
        # With two shards every bucket is cut in halves, one per shard (see chunk_bounds).
        assert [s.table.counters["contributions"] for s in servers] == [WORKERS * ROUNDS] * shards
        assert [s.table.counters["rounds_completed"] for s in servers] == [ROUNDS] * shards
        assert sum(s.table.counters["rounds_failed"] for s in servers) == 0
        # Threads: bounded, not growing per round. The 16 workers; per rank and shard four of gRPC's (a
        # channel's poller for the Join's and Watch's connection and one for the pushes', and a sender each
        # for the push stream and the heartbeats); the pushes' own and the servers' handlers.
        assert peak_threads[0] - threads_before < WORKERS * (1 + 4 * shards) + 64
        # Memory: in-flight rounds hold one accumulator per bucket, not one per push.
        assert process.memory_info().rss - rss_before < 400 * 2**20
    finally:
        for server in servers:
            server.stop()
