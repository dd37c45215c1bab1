"""What liveness costs the aggregator: RSS, threads and CPU of N joined ranks each holding a Watch stream.

Run from the repository root::

    .venv/bin/python bench/watch_cost.py                 # 0, 1000 and 4000 ranks in 100 jobs
    .venv/bin/python bench/watch_cost.py --ranks 0 2000 --jobs 50
    .venv/bin/python bench/watch_cost.py --ranks 0 1000 --heartbeat-ms 0 1000   # without and with heartbeats

A real `gradq serve` process; the ranks Join and open their Watch over a few
shared channels (as many client processes would, one stream per rank). For
each row the server's RSS, thread count and CPU time are read after every
stream is in place and after 10 idle seconds (HTTP/2 keepalive pings run
meanwhile, and each stream's heartbeat where the row promises one, as
gradq's client does every second), side by side with the row of no ranks.
The bench's client sends each stream's heartbeats from a thread of its own,
as gRPC's synchronous client does. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import psutil

from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc
from gradq.server.process import spawn_aggregator

CHANNELS = 8  # client connections the streams share
IDLE_S = 10.0


def _requests(first: pb.WatchRequest, heartbeat_ms: int, ended: threading.Event) -> Iterator[pb.WatchRequest]:
    """A Watch's requests: ``first``, then a heartbeat every ``heartbeat_ms`` (none at 0) until ``ended``."""
    yield first
    while heartbeat_ms and not ended.wait(heartbeat_ms / 1000):
        yield pb.WatchRequest()


def measure(ranks: int, jobs: int, heartbeat_ms: int = 0) -> dict[str, float]:
    """Start a server, hold ``ranks`` Watch streams in ``jobs`` jobs (each beating every ``heartbeat_ms``), read
    its footprint."""
    # Its log stays quiet: the streams end without a Leave at the end of each row, which loses their ranks.
    flags = ("--log-level", "ERROR", "--max-watches", str(max(ranks, 1)))
    process, port = spawn_aggregator(*flags)
    server = psutil.Process(process.pid)
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}") for _ in range(CHANNELS)]
    streams: list[Any] = []
    ended = threading.Event()
    try:
        time.sleep(1.0)
        base_rss = server.memory_info().rss
        world = max(1, ranks // jobs)
        for rank_index in range(ranks):
            job, rank = divmod(rank_index, world)
            stub = pb_grpc.AggregatorStub(channels[rank_index % CHANNELS])
            stub.Join(pb.JoinRequest(job_id=f"job{job}", rank=rank, world_size=world), timeout=10)
            first = pb.WatchRequest(job_id=f"job{job}", rank=rank, heartbeat_ms=heartbeat_ms)
            stream = stub.Watch(_requests(first, heartbeat_ms, ended))
            next(stream)  # the stream is in place
            streams.append(stream)
        cpu_before = sum(server.cpu_times()[:2])
        time.sleep(IDLE_S)
        idle_cpu = sum(server.cpu_times()[:2]) - cpu_before
        return {
            "ranks": ranks,
            "heartbeat_ms": heartbeat_ms,
            "rss_mb": server.memory_info().rss / 1e6,
            "rss_per_watch_kb": (server.memory_info().rss - base_rss) / 1e3 / ranks if ranks else 0.0,
            "threads": server.num_threads(),
            "idle_cpu_ms_per_s": idle_cpu / IDLE_S * 1e3,
        }
    finally:
        ended.set()
        for stream in streams:
            stream.cancel()
        for channel in channels:
            channel.close()
        process.terminate()
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[0, 1000, 4000], help="rows: Watch streams held")
    parser.add_argument("--jobs", type=int, default=100, help="jobs the ranks are spread over")
    parser.add_argument(
        "--heartbeat-ms", type=int, nargs="+", default=[0], help="each row per period: 0 (none) or 50..10000"
    )
    args = parser.parse_args()
    print("| ranks watching | heartbeat ms | server RSS MB | RSS per watch KB | server threads | idle CPU ms/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for ranks in args.ranks:
        for heartbeat_ms in args.heartbeat_ms:
            row = measure(ranks, args.jobs, heartbeat_ms)
            print(
                f"| {row['ranks']} | {row['heartbeat_ms']} | {row['rss_mb']:.1f} | {row['rss_per_watch_kb']:.1f} "
                f"| {row['threads']} | {row['idle_cpu_ms_per_s']:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
