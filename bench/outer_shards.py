"""DiLoCo's outer state over 1, 2 and 4 aggregator shards, no model: RSS per shard, round, seed and joiner times.

Run from the repository root with the virtualenv's interpreter::

    python bench/outer_shards.py                               # 2^26 elements (a 512 MiB state), 1 2 4 shards
    python bench/outer_shards.py --elements 1000000000 --shards 1 2 4 --key-elements 4194304

For each shard count N, ``gradq serve --shards N`` runs in processes of its
own, and two elastic hosts in this process (real WorkerClients, real
channels) hold a synthetic outer state of ``--elements`` float32 parameters
in round keys of ``--key-elements`` (spread over the shards as every push is,
``gradq.client.chunks.shard_for``; ``chunk_elements=0`` keeps a key whole).
Timed, each from the hosts' side:

- seed: both hosts seed every key on its shard before outer round 0 (the
  first takes it, the second is compared);
- round: both hosts push every key's 4-bit pseudo-gradient for one outer
  round; from the last push handed to the client to the last mean back (the
  shards decode, average, take the outer step on their keys and re-encode);
- joiner: a third host joins, waits for the next boundary (one more round),
  and takes every shard's part of the state; from that round's last mean to
  the joiner's state in hand.

RSS is each shard process's peak (psutil, every 20 ms) over the whole run,
and its baseline before the job; the peak of each phase (seed, round,
joiner) is printed apart, summed over the shards, to say where it comes from. The targets: peak RSS over baseline per
shard <= 1/N of one shard's + 10%, and the round time not growing with N.
This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import psutil

from gradq.client import JobSpec, WorkerClient
from gradq.client.chunks import shard_for
from gradq.client.elastic import ANY_RANK
from gradq.qcore import QuantConfig
from gradq.qcore.outer_step import OuterStep
from gradq.server.process import spawn_shards

GRID = QuantConfig(bits=4)


@dataclass
class Figures:
    shards: int
    baseline_mb: list[float]
    peak_mb: list[float]
    seed_s: float
    round_s: float
    joiner_s: float
    phase_peaks_mb: list[float]  # seed, round, joiner: each phase's peak RSS summed over the shards


class PeakRss:
    """Samples processes' RSS every 20 ms on a thread; ``peaks`` in bytes."""

    def __init__(self, processes: Sequence[psutil.Process]) -> None:
        self.processes = list(processes)
        self.peaks = [process.memory_info().rss for process in self.processes]
        self._phase = list(self.peaks)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            with self._lock:
                for index, process in enumerate(self.processes):
                    rss = process.memory_info().rss
                    self.peaks[index] = max(self.peaks[index], rss)
                    self._phase[index] = max(self._phase[index], rss)

    def phase(self) -> float:
        """The peak since the last phase began, summed over the processes, in bytes; then a new phase begins."""
        with self._lock:
            peak = sum(self._phase)
            self._phase = [process.memory_info().rss for process in self.processes]
        return peak

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join()
        return self.peaks


def listeners(ports: Sequence[int]) -> list[int]:
    """The processes listening on ``ports``, in their order: the shards (the supervisor serves none)."""
    owners = {c.laddr.port: c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    return [owners[port] for port in ports]


def host(addresses: list[str], job: str, timeout_s: float) -> WorkerClient:
    return WorkerClient(
        addresses,
        job,
        ANY_RANK,
        JobSpec(world_size=2, elastic=True, outer_step=OuterStep()),
        GRID,
        timeout_s=timeout_s,
        chunk_elements=0,
        max_in_flight=64,
    )


def measure(shards: int, elements: int, key_elements: int, timeout_s: float) -> Figures:
    flags = ("--max-memory-bytes", str(64 << 30), "--max-job-memory-bytes", "-1", "--round-timeout", "600")
    supervisor, ports = spawn_shards(shards, *flags, stderr=subprocess.DEVNULL)
    try:
        workers = [psutil.Process(pid) for pid in listeners(ports)]
        baseline = [process.memory_info().rss for process in workers]
        rss = PeakRss(workers)
        address = [f"127.0.0.1:{port}" for port in ports]
        keys = -(-elements // key_elements)
        sizes = [min(key_elements, elements - key * key_elements) for key in range(keys)]
        keys_on = Counter(shard_for(key, shards) for key in range(keys))
        parameters = np.random.default_rng(0).normal(size=key_elements).astype(np.float32)
        gradient = np.random.default_rng(1).normal(scale=1e-3, size=key_elements).astype(np.float32)
        hosts = [host(address, "outer-shards", timeout_s) for _ in range(2)]
        for client in hosts:
            client.join()
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for client in hosts:
                seeds = [
                    pool.submit(
                        client.membership.seed_outer, 0, key, keys_on[shard_for(key, shards)], parameters[:size], None
                    )
                    for key, size in enumerate(sizes)
                ]
                assert all(seed.result()[0] for seed in seeds)
        seed_s = time.perf_counter() - started
        phases = [rss.phase()]
        pieces = [gradient[:size] for size in sizes]
        futures = [client.push_pull_async(0, key, piece) for client in hosts for key, piece in enumerate(pieces)]
        queued = time.perf_counter()
        for future in futures:
            future.result(timeout=600)
        round_s = time.perf_counter() - queued
        phases.append(rss.phase())
        joiner = host(address, "outer-shards", timeout_s)
        joiner.join()
        assert joiner.membership.catch_up
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fetched = pool.submit(joiner.membership.fetch_state)
            time.sleep(0.5)  # its transfers wait on every shard before the boundary comes
            futures = [client.push_pull_async(1, key, piece) for client in hosts for key, piece in enumerate(pieces)]
            for future in futures:
                future.result(timeout=600)
            answered = time.perf_counter()
            states = fetched.result(timeout=600)
            joiner_s = time.perf_counter() - answered
        phases.append(rss.phase())
        assert sum(len(state.data) for state in states) == 8 * elements
        for client in (*hosts, joiner):
            client.close()
        peaks = rss.stop()
        return Figures(
            shards,
            [b / 2**20 for b in baseline],
            [p / 2**20 for p in peaks],
            seed_s,
            round_s,
            joiner_s,
            [(peak - sum(baseline)) / 2**20 for peak in phases],
        )
    finally:
        supervisor.send_signal(signal.SIGTERM)
        try:
            supervisor.wait(timeout=60)
        except subprocess.TimeoutExpired:
            supervisor.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=1 << 26, help="float32 parameters of the outer state")
    parser.add_argument("--key-elements", type=int, default=1 << 22, help="elements per round key")
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4], help="shard counts to run")
    parser.add_argument("--timeout", type=float, default=600.0, help="a Join's and a transfer's deadline, seconds")
    args = parser.parse_args()
    rows = [measure(n, args.elements, args.key_elements, args.timeout) for n in args.shards]
    one = next((row for row in rows if row.shards == 1), None)
    print(
        f"outer state: {args.elements:,} float32 elements ({8 * args.elements / 2**20:,.0f} MiB with momentum), "
        f"round keys of {args.key_elements:,}"
    )
    print(
        "| shards | peak RSS over baseline per shard, MiB | x one shard's / N | seed s | round s | joiner s "
        "| all shards' peak over baseline, MiB: seed / round / joiner |"
    )
    print("|---:|---|---:|---:|---:|---:|---|")
    for row in rows:
        over = [peak - base for peak, base in zip(row.peak_mb, row.baseline_mb, strict=True)]
        ratio = (
            max(over) / ((sum(one.peak_mb) - sum(one.baseline_mb)) / row.shards) if one is not None else float("nan")
        )
        shown = " / ".join(f"{value:,.0f}" for value in over)
        phases = " / ".join(f"{value:,.0f}" for value in row.phase_peaks_mb)
        print(
            f"| {row.shards} | {shown} | {ratio:.2f} | {row.seed_s:.2f} | {row.round_s:.2f} | {row.joiner_s:.2f} "
            f"| {phases} |"
        )


if __name__ == "__main__":
    main()
