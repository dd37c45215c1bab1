"""A legitimate job's step time and the aggregator's RSS, quiet and under each flood, side by side in one run.

Run from the repository root with the virtualenv's interpreter::

    python bench/abuse.py                      # 4 workers, 2^20-element 8-bit buckets, 100 steps per row
    python bench/abuse.py --steps 50 --numel 4000000

One `gradq serve` process (a real separate process, so its RSS is its own)
serves a legitimate 4-worker job (WorkerClients in this process, one thread
each, integer-valued gradients whose means are checked exactly) while a
flood runs in a child process of this script:

- parked: waves of PushPull calls (client deadline 1 s, distinct buckets)
  that never complete, every ``--wave-every`` seconds;
- open rounds: 1-bit pushes of 2^20 elements to fresh rounds that never
  complete (each holds a 4 MiB accumulator until its deadline);
- join storm: Joins with ever new job ids;
- malformed: random bytes to Join, PushPull and Leave.

Each row reports the legitimate job's median step, its ratio to the quiet
row, the server's peak RSS and thread count during the row, the budget, and what the flood
sent and how much of it the server refused. The flood process runs at
nice 19 (an attacker's own CPU is not the victim's); the server and the
legitimate workers share this machine's cores at normal priority, so the
server's cost of refusing the flood is in the ratio. This is a benchmark,
not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np

from gradq.client import WorkerClient
from gradq.proto.convert import tensor_to_proto
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc
from gradq.qcore import QuantConfig, Scheme, encode
from gradq.server.process import spawn_aggregator

# The join storm last: the jobs it made stay until they expire, and would refuse the next row's new job.
_ROUND_TIMEOUT_S = 5.0
FLOODS = ("parked", "open_rounds", "malformed", "join_storm")


def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def rss_bytes(pid: int) -> int:
    return _status(pid, "VmRSS:") * 1024


def thread_count(pid: int) -> int:
    return _status(pid, "Threads:")


class PeakUse:
    """Samples a process's RSS and thread count every 50 ms on a thread until ``stop``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.rss = rss_bytes(pid)
        self.threads = thread_count(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.rss = max(self.rss, rss_bytes(self.pid))
            self.threads = max(self.threads, thread_count(self.pid))

    def stop(self) -> tuple[int, int]:
        """Stop sampling; returns the peaks (RSS bytes, threads)."""
        self._stop.set()
        self._thread.join()
        return self.rss, self.threads


# -- the floods (each runs in a child process until killed; prints its counts on SIGTERM) ----------------------


_COUNTS_LOCK = threading.Lock()  # completion callbacks run on gRPC's threads


def _outcome(counts: Counter[str], call: grpc.Future) -> None:
    error = call.exception()
    with _COUNTS_LOCK:
        counts[error.code().name if isinstance(error, grpc.RpcError) else "OK"] += 1


def flood_parked(stub: pb_grpc.AggregatorStub, counts: Counter[str], wave: int, every: float) -> None:
    stub.Join(pb.JoinRequest(job_id="park", rank=0, world_size=2), timeout=5)
    tensor = tensor_to_proto(encode(np.zeros(64, np.float32), QuantConfig(scheme=Scheme.FLOAT32)))
    bucket = 0
    while True:
        for _ in range(wave):
            request = pb.PushPullRequest(job_id="park", step=0, bucket=bucket, rank=0, tensor=tensor)
            stub.PushPull.future(request, timeout=1.0).add_done_callback(lambda call: _outcome(counts, call))
            bucket += 1
        time.sleep(every)


def flood_open_rounds(stub: pb_grpc.AggregatorStub, counts: Counter[str], wave: int, every: float) -> None:
    """Keeps 32 pushes to fresh rounds in flight, each abandoned by its client after 0.2 s."""
    stub.Join(pb.JoinRequest(job_id="hog", rank=0, world_size=2), timeout=5)
    values = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
    tensor = tensor_to_proto(encode(values, QuantConfig(scheme=Scheme.PER_TENSOR_AFFINE, bits=1)))
    slots = threading.Semaphore(32)
    bucket = 0

    def done(call: grpc.Future) -> None:
        _outcome(counts, call)
        slots.release()

    while True:
        slots.acquire()
        request = pb.PushPullRequest(job_id="hog", step=0, bucket=bucket, rank=0, tensor=tensor)
        stub.PushPull.future(request, timeout=0.2).add_done_callback(done)
        bucket += 1


def flood_join_storm(stub: pb_grpc.AggregatorStub, counts: Counter[str], wave: int, every: float) -> None:
    number = 0
    while True:
        try:
            stub.Join(pb.JoinRequest(job_id=f"storm-{number}", rank=0, world_size=2), timeout=5)
            counts["OK"] += 1
        except grpc.RpcError as error:
            counts[error.code().name] += 1
        number += 1


def flood_malformed(stub: pb_grpc.AggregatorStub, counts: Counter[str], wave: int, every: float) -> None:
    channel: grpc.Channel = stub.channel  # type: ignore[attr-defined]
    calls = [channel.unary_unary(f"/gradq.v1.Aggregator/{name}") for name in ("Join", "PushPull", "Leave")]
    rng = np.random.default_rng(1)
    while True:
        call = calls[int(rng.integers(3))]
        try:
            call(rng.bytes(int(rng.integers(1, 512))), timeout=5)
            counts["OK"] += 1
        except grpc.RpcError as error:
            counts[error.code().name] += 1


def run_flood(name: str, address: str, wave: int, every: float) -> None:
    """Child process: flood until stdin closes, then print the counts.

    It runs at the lowest CPU priority, standing in for an attacker on its own
    machine: on this one the flood's client side would otherwise take CPU from
    the legitimate workers that a remote attacker could not. What the server
    spends answering the flood is still paid at normal priority.
    """
    os.nice(19)
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.AggregatorStub(channel)
    stub.channel = channel  # type: ignore[attr-defined]
    counts: Counter[str] = Counter()
    flood: Callable[..., None] = globals()[f"flood_{name}"]
    threading.Thread(target=flood, args=(stub, counts, wave, every), daemon=True).start()
    sys.stdin.read()  # the parent closes stdin to stop us
    print(" ".join(f"{code}={count}" for code, count in sorted(counts.items())), flush=True)


# -- the legitimate job ------------------------------------------------------------------------------------------


class LegitJob:
    """A ``world``-rank job, joined before the flood starts (it is already running when the flood comes)."""

    def __init__(self, address: str, world: int, numel: int, job: str) -> None:
        config = QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=8)
        self.clients = [WorkerClient(address, job, rank, world, config, timeout_s=60) for rank in range(world)]
        for client in self.clients:
            client.join()
        self.base = np.arange(numel, dtype=np.float32) % 251

    def steps(self, steps: int) -> list[float]:
        """Rank 0's step times after two warm-up steps; every mean is checked."""
        world = len(self.clients)
        times: list[float] = []
        barrier = threading.Barrier(world)
        failures: list[BaseException] = []

        def work(rank: int) -> None:
            try:
                for step in range(steps):
                    barrier.wait()
                    started = time.perf_counter()
                    mean = self.clients[rank].push_pull(step, 0, self.base + rank * 2)
                    if rank == 0:
                        times.append(time.perf_counter() - started)
                    # 8-bit per channel of integers 0..256: exact up to the grid's rounding, checked loosely.
                    assert abs(float(mean[7]) - (7 + world - 1)) < 1.0
            except BaseException as error:
                failures.append(error)
                barrier.abort()

        threads = [threading.Thread(target=work, args=(rank,)) for rank in range(world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for client in self.clients:
            client.close()
        if failures:
            raise failures[0]
        return times[2:]


def warm_up(address: str) -> None:
    """One complete round on each grid pushed here, so the quiet row's RSS already holds the compiled kernels.

    Otherwise the RSS after the floods would be compared with a baseline
    that lacks code the floods made the server compile, not round memory.
    """
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.AggregatorStub(channel)
    values = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
    grids = (
        ("warm-1bit", values, QuantConfig(scheme=Scheme.PER_TENSOR_AFFINE, bits=1)),
        ("warm-fp32", values[:64], QuantConfig(scheme=Scheme.FLOAT32)),
        ("warm-8bit", values, QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=8)),  # the legitimate job's
    )
    for job, bucket, config in grids:
        tensor = tensor_to_proto(encode(bucket, config))
        stub.Join(pb.JoinRequest(job_id=job, rank=0, world_size=1), timeout=5)
        stub.PushPull(pb.PushPullRequest(job_id=job, step=0, bucket=0, rank=0, tensor=tensor), timeout=60)
        stub.Leave(pb.LeaveRequest(job_id=job, rank=0), timeout=5)
    channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--budget", type=int, default=512 << 20, help="--max-memory-bytes of the server")
    parser.add_argument("--wave", type=int, default=300, help="parked calls per wave")
    parser.add_argument("--wave-every", type=float, default=1.0, help="seconds between waves of parked calls")
    parser.add_argument("--flood", choices=FLOODS, help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flood:
        run_flood(args.flood, args.address, args.wave, args.wave_every)
        return
    server, port = spawn_aggregator(
        "--max-memory-bytes", str(args.budget), "--round-timeout", str(_ROUND_TIMEOUT_S), "--log-level", "ERROR",
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    address = f"127.0.0.1:{port}"
    rows = []
    settled = 0
    try:
        warm_up(address)
        for number, name in enumerate(("quiet", *FLOODS)):
            legit = LegitJob(address, args.workers, args.numel, f"legit-{number}")
            flood = None
            if name != "quiet":
                command = [sys.executable, __file__, "--flood", name, "--address", address, "--wave", str(args.wave)]
                command += ["--wave-every", str(args.wave_every)]
                flood = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                time.sleep(3.0)  # let the flood reach its steady state (and the server JIT-compile its kernels)
            peak = PeakUse(server.pid)
            times = legit.steps(args.steps)
            peak_bytes, peak_threads = peak.stop()
            counts = ""
            if flood is not None:
                counts, _ = flood.communicate("", timeout=60)
            rows.append((name, statistics.median(times), peak_bytes, peak_threads, counts.strip()))
        # Every flood's rounds reach their deadline, idle accumulators are unmapped (2 s) and the heap is trimmed (5 s).
        time.sleep(_ROUND_TIMEOUT_S + 8.0)
        settled = rss_bytes(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=30)
    quiet = rows[0][1]
    print(f"legitimate job: {args.workers} workers, {args.numel} elements 8-bit per channel, {args.steps} steps")
    header = f"{'flood':<12} {'median step':>12} {'x quiet':>8} {'peak RSS':>10} {'budget':>8} {'threads':>8}"
    print(f"{header}  flood calls (status=count)")
    for name, median, rss, threads, counts in rows:
        print(
            f"{name:<12} {median * 1e3:>9.1f} ms {median / quiet:>7.2f}x {rss / 2**20:>6.0f} MiB "
            f"{args.budget / 2**20:>4.0f} MiB {threads:>8}  {counts}"
        )
    quiet_rss = rows[0][2] / 2**20
    print(f"RSS once every flood's rounds had ended: {settled / 2**20:.0f} MiB (quiet row's peak {quiet_rss:.0f} MiB)")


if __name__ == "__main__":
    main()
