"""The push window in bytes against the old count of pushes, on one delay-line path, alternated.

Run as root from the repository root with the virtualenv's interpreter::

    .venv/bin/python bench/wan_window.py --rtt 100 --rate 1gbit --pairs 3

Builds ``--hosts`` worker hosts and one aggregator host (bench/netns.py, a
delay line on every link), starts ``gradq.server``, and per pair runs the
push of bench/wan.py twice on fresh pushers: with the client's defaults
(pushes in flight sized to the path, up to 8 connections per shard) and with
the transport as it was, through ``WorkerClient(window=...)``: 2 pushes per
shard and one connection (``WindowSettings(sized_to_path=False,
max_connections=1)``). Each host pushes ``--elements`` float32 elements
pre-encoded at ``--bits`` bits (``--rounds`` timed rounds after one warm-up)
and prints each round's seconds from the first push to the last answer, and
what its window held after the last round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import netns

AGGREGATOR_PORT = 50051

OLD: dict[str, Any] = {"sized_to_path": False, "max_connections": 1}


def pusher(spec: dict[str, Any]) -> None:
    """One host: pre-encode, join, time each round, write rounds and the window's state as JSON."""
    import numpy as np

    from gradq.client.config import GradqConfig
    from gradq.client.window import WindowSettings
    from gradq.client.worker import WorkerClient
    from gradq.qcore import QuantConfig, encode

    defaults = GradqConfig(addresses=(str(spec["address"]),))
    config = QuantConfig(bits=int(spec["bits"]))
    window = WindowSettings(**spec["window"]) if spec["window"] else WindowSettings()
    trace: list[tuple[float, ...]] = []
    if spec.get("trace"):
        import dataclasses

        from gradq.client.window import PathEstimate

        class TracingPath(PathEstimate):
            def answered(self, sent: tuple[float, int, bool], nbytes: int, measured: bool = True) -> None:
                super().answered(sent, nbytes, measured)
                now = time.monotonic()
                trace.append(
                    (
                        now,
                        now - sent[0],
                        (self.delivered - sent[1]) / max(now - sent[0], 1e-6) / 1e6,
                        self.min_rtt * 1000,
                        self.rate / 1e6,
                        self.target() / 1e6,
                        float(self.queueing),
                    )
                )

        window = dataclasses.replace(window, path_estimate=TracingPath)
    elements = int(spec["elements"])
    client = WorkerClient(
        str(spec["address"]),
        str(spec["job"]),
        int(spec["rank"]),
        int(spec["world"]),
        config,
        chunk_elements=defaults.chunk_elements,
        max_in_flight=defaults.max_in_flight,
        window=window,
    )
    values = np.random.default_rng(int(spec["rank"])).standard_normal(elements, dtype=np.float32)
    out = np.empty_like(values)
    seconds = []
    with client:
        pieces = client.round_keys(0, elements)
        tensors = [encode(values[begin:end], config) for _, begin, end in pieces]
        for step in range(int(spec["rounds"]) + 1):
            started = time.perf_counter()
            futures = [
                client.push_pull_encoded_async(step, key, tensor, out=out[begin:end])
                for (key, begin, end), tensor in zip(pieces, tensors, strict=True)
            ]
            for future in futures:
                future.result()
            seconds.append(time.perf_counter() - started)
        sender = client._sender
        path = sender.window.path(0)
        state = {
            "seconds": seconds[1:],
            "window_bytes": sender.window.window_bytes(0),
            "connections": getattr(sender.transports[0], "opened", 1),
            "min_rtt_ms": path.min_rtt * 1000,
            "rate_mb_s": path.rate / 1e6,
            "trace": trace,
        }
    Path(str(spec["output"])).write_text(json.dumps(state))


def _environment() -> dict[str, str]:
    # No proxy variables: gRPC would otherwise try to reach the aggregator through one.
    environment = {name: value for name, value in os.environ.items() if "proxy" not in name.lower()}
    environment.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return environment


def _start_server(topology: netns.Topology, work: Path, world_size: int) -> subprocess.Popen[bytes]:
    """``gradq.server`` on the aggregator host, once it has written its port."""
    host = topology.aggregators[0]
    port_file = work / "aggregator.port"
    argv = [sys.executable, "-m", "gradq.server", "--host", host.address, "--port", str(AGGREGATOR_PORT)]
    argv += ["--world-size", str(world_size), "--log-level", "WARNING", "--port-file", str(port_file), "--grace", "1"]
    with (work / "aggregator.log").open("wb") as log:
        server = subprocess.Popen(host.command(argv), stdout=log, stderr=subprocess.STDOUT, env=_environment())
    deadline = time.monotonic() + 60.0
    while not (port_file.exists() and port_file.read_text().strip()):
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the aggregator did not start:\n{(work / 'aggregator.log').read_text()[-2000:]}")
        time.sleep(0.1)  # polling for the port file, with a deadline
    return server


def run(
    topology: netns.Topology, work: Path, label: str, window: dict[str, Any] | None, args: argparse.Namespace
) -> list[dict[str, Any]]:
    out = work / label
    out.mkdir()
    server = _start_server(topology, out, args.hosts)
    processes = []
    try:
        for rank, host in enumerate(topology.workers):
            spec = {
                "address": f"{topology.aggregators[0].address}:{AGGREGATOR_PORT}",
                "job": f"window-{label}",
                "rank": rank,
                "world": args.hosts,
                "elements": args.elements,
                "bits": args.bits,
                "rounds": args.rounds,
                "window": window,
                "trace": args.trace and rank == 0,
                "output": str(out / f"rank{rank}.json"),
            }
            argv = [sys.executable, str(Path(__file__).resolve()), "--pusher", json.dumps(spec)]
            with (out / f"rank{rank}.log").open("wb") as log:
                processes.append(
                    subprocess.Popen(host.command(argv), stdout=log, stderr=subprocess.STDOUT, env=_environment())
                )
        for rank, process in enumerate(processes):
            if process.wait(timeout=600) != 0:
                raise RuntimeError(f"pusher {rank} failed:\n{(out / f'rank{rank}.log').read_text()[-3000:]}")
    finally:
        for process in [*processes, server]:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=15)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(args.hosts)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pusher", help=argparse.SUPPRESS)
    parser.add_argument("--rtt", type=float, default=100.0, help="round trip, ms")
    parser.add_argument("--rate", default="1gbit", help="worker link rate ('none': unshaped)")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--elements", type=int, default=50_000_000)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=3, help="alternated (default, old) pairs")
    parser.add_argument("--only", choices=("default", "old"), help="run only this setting")
    parser.add_argument("--trace", action="store_true", help="print host 0's path samples (default setting)")
    args = parser.parse_args()
    if args.pusher:
        pusher(json.loads(args.pusher))
        return 0
    if os.geteuid() != 0:
        print("bench/wan_window.py needs root (network namespaces, TAP devices and tc)", file=sys.stderr)
        return 2
    rate = None if args.rate == "none" else args.rate
    # Namespaces another run holds are left alone (build_topology refuses to start over them); only this
    # run's topology is removed, by its close.
    topology = netns.build_topology(args.hosts, 1, args.rtt)
    results: dict[str, list[float]] = {"default": [], "old": []}
    try:
        topology.shape(topology.workers, rate)
        topology.shape(topology.aggregators, f"{netns.parse_rate(rate) * args.hosts / 1e6:g}mbit" if rate else None)
        with tempfile.TemporaryDirectory(prefix="gradq-window-") as work:
            for pair in range(args.pairs):
                for label, window in (("default", None), ("old", OLD)):
                    if args.only not in (None, label):
                        continue
                    hosts = run(topology, Path(work), f"{label}-{pair}", window, args)
                    if args.trace:
                        start = hosts[0]["trace"][0][0] if hosts[0]["trace"] else 0.0
                        for entry in hosts[0]["trace"]:
                            when, rtt, sample, min_rtt, rate, target, queueing = entry
                            print(
                                f"  t {when - start:.3f} rtt {rtt:.3f} sample {sample:.1f} MB/s min {min_rtt:.0f} ms "
                                f"rate {rate:.1f} target {target:.1f} MB q {queueing:.0f}"
                            )
                    for host in hosts:
                        results[label] += host["seconds"]
                    first = hosts[0]
                    print(
                        f"pair {pair} {label:7s}: rounds s {[round(s, 2) for h in hosts for s in h['seconds']]}; "
                        f"host 0 window {first['window_bytes'] / 1e6:.1f} MB over {first['connections']} connections, "
                        f"min rtt {first['min_rtt_ms']:.0f} ms, rate {first['rate_mb_s']:.0f} MB/s",
                        flush=True,
                    )
    finally:
        topology.close()
    payload = args.elements * args.bits / 8 / 1e6
    for label, seconds in results.items():
        if not seconds:
            continue
        median = statistics.median(seconds)
        print(
            f"{label}: median {median:.2f} s (min {min(seconds):.2f}, max {max(seconds):.2f}), "
            f"{payload / median:.1f} MB/s per host at {args.rtt:g} ms {args.rate}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
