"""What liveness costs the aggregator: RSS, threads and CPU of N joined ranks each holding a Watch stream.

Run from the repository root::

    .venv/bin/python bench/watch_cost.py                 # 0, 1000 and 4000 ranks in 100 jobs
    .venv/bin/python bench/watch_cost.py --ranks 0 2000 --jobs 50

A real `gradq serve` process; the ranks Join and open their Watch over a few
shared channels (as many client processes would, one stream per rank). For
each row the server's RSS, thread count and CPU time are read after every
stream is in place and after 10 idle seconds (HTTP/2 keepalive pings run
meanwhile), side by side with the row of no ranks. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import grpc
import psutil

from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc
from gradq.server.process import spawn_aggregator

CHANNELS = 8  # client connections the streams share
IDLE_S = 10.0


def measure(ranks: int, jobs: int) -> dict[str, float]:
    """Start a server, hold ``ranks`` Watch streams in ``jobs`` jobs, read its footprint."""
    # Its log stays quiet: the streams end without a Leave at the end of each row, which loses their ranks.
    flags = ("--log-level", "ERROR", "--max-watches", str(max(ranks, 1)))
    process, port = spawn_aggregator(*flags)
    server = psutil.Process(process.pid)
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}") for _ in range(CHANNELS)]
    streams: list[Any] = []
    try:
        time.sleep(1.0)
        base_rss = server.memory_info().rss
        world = max(1, ranks // jobs)
        for rank_index in range(ranks):
            job, rank = divmod(rank_index, world)
            stub = pb_grpc.AggregatorStub(channels[rank_index % CHANNELS])
            stub.Join(pb.JoinRequest(job_id=f"job{job}", rank=rank, world_size=world), timeout=10)
            stream = stub.Watch(pb.WatchRequest(job_id=f"job{job}", rank=rank))
            next(stream)  # the stream is in place
            streams.append(stream)
        cpu_before = sum(server.cpu_times()[:2])
        time.sleep(IDLE_S)
        idle_cpu = sum(server.cpu_times()[:2]) - cpu_before
        return {
            "ranks": ranks,
            "rss_mb": server.memory_info().rss / 1e6,
            "rss_per_watch_kb": (server.memory_info().rss - base_rss) / 1e3 / ranks if ranks else 0.0,
            "threads": server.num_threads(),
            "idle_cpu_ms_per_s": idle_cpu / IDLE_S * 1e3,
        }
    finally:
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
    args = parser.parse_args()
    print("| ranks watching | server RSS MB | RSS per watch KB | server threads | idle CPU ms/s |")
    print("|---:|---:|---:|---:|---:|")
    for ranks in args.ranks:
        row = measure(ranks, args.jobs)
        print(
            f"| {row['ranks']} | {row['rss_mb']:.1f} | {row['rss_per_watch_kb']:.1f} | {row['threads']} "
            f"| {row['idle_cpu_ms_per_s']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
