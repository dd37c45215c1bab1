"""What one client flooding its Watch stream with heartbeats costs the aggregator.

Run from the repository root::

    .venv/bin/python bench/watch_flood.py                                  # the gradq this interpreter imports
    .venv/bin/python bench/watch_flood.py --trees before=OLD now=NEW       # two trees side by side, alternated

A real `gradq serve` process per row. Rank 1 of a 2-rank job joins and opens
its Watch promising a heartbeat every second, reads the first event, then
sends heartbeats as fast as gRPC's synchronous client will take them, for
``--seconds`` or until the aggregator ends the call. Reported per row: the messages the client got out,
how its call ended, and the aggregator's CPU per second over the whole
``--seconds`` window from the Watch's start (user + system, read from /proc),
beside an idle server's. ``--trees`` names folders
that each hold gradq/ (links to a tree's qcore, server, client, proto, cli),
put first on the aggregator's PYTHONPATH. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Iterator

import grpc
import psutil

from gradq.client import serde
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc
from gradq.server.process import spawn_aggregator


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def measure(tree: str, seconds: float) -> dict[str, object]:
    """One row: a server from ``tree`` ("": this interpreter's gradq), one member flooding its Watch."""
    environment = dict(os.environ)
    if tree:
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, environment.get("PYTHONPATH", "")]))
    process, port = spawn_aggregator("--log-level", "ERROR", env=environment)
    server = psutil.Process(process.pid)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.AggregatorStub(channel)
    sent = 0
    stop = threading.Event()

    def flood() -> Iterator[pb.WatchRequest]:
        nonlocal sent
        yield serde.watch_request("flood", 1, heartbeat_ms=1000)
        while not stop.is_set():
            sent += 1
            yield pb.WatchRequest()

    try:
        stub.Join(serde.join_request("flood", 1, 2), timeout=10)
        idle_from = _cpu_s(server)
        time.sleep(1.0)  # the idle server's own CPU (keepalive, sweeper), the floor of the row
        idle = _cpu_s(server) - idle_from
        started, cpu_from = time.monotonic(), _cpu_s(server)
        call = stub.Watch(flood())
        next(call)  # the watch is in place (gRPC's synchronous client sees the call end only once it reads)
        ended = threading.Event()
        call.add_done_callback(lambda _: ended.set())
        ended.wait(seconds)
        lasted = time.monotonic() - started
        code = call.code() if ended.is_set() else None
        time.sleep(max(0.0, started + seconds - time.monotonic()))  # the whole window, however soon it was cut
        cpu = _cpu_s(server) - cpu_from
        stop.set()
        call.cancel()
        return {
            "tree": tree or "this",
            "sent": sent,
            "ended": f"{code.name} after {lasted:.2f} s" if code is not None else f"still open after {lasted:.1f} s",
            "cpu_ms_per_s": 1000 * cpu / seconds,
            "idle_cpu_ms_per_s": 1000 * idle,
        }
    finally:
        channel.close()
        process.terminate()
        process.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="the longest a flood runs")
    parser.add_argument("--trees", nargs="+", default=[""], help="label=FOLDER of gradq trees (default: this one)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each tree, alternated")
    args = parser.parse_args()
    trees = [tree.partition("=") for tree in args.trees]
    print("| tree | heartbeats the client got out | its Watch | aggregator CPU ms/s over the window | idle ms/s |")
    print("|---|---:|---|---:|---:|")
    for _ in range(args.repeat):
        for label, _, folder in trees:
            row = measure(folder if folder else label, args.seconds)
            name = label if folder else row["tree"]
            print(
                f"| {name} | {row['sent']} | {row['ended']} | {row['cpu_ms_per_s']:.0f} | "
                f"{row['idle_cpu_ms_per_s']:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
