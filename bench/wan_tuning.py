"""Host tuning between regions: each TCP sysctl's effect on raw TCP and on a DiLoCo-sized gradq push.

Run as root from the repository root with the virtualenv's interpreter::

    sudo GRADQ_NETNS_RUN=tune .venv/bin/python bench/wan_tuning.py --out bench/results/wan-tuning.md --rtts 100

One topology per round trip (2 worker hosts, 1 aggregator host, delay lines,
worker links at ``--rate``, the aggregator's at the sum). For each setting of
``--settings`` (alternated, ``--repeat`` times, so the machine's load falls on
each alike) the TCP sysctls are written inside every namespace of the run
(net.ipv4.tcp_* are per network namespace, so the machine's own values are
never touched) and then measured:

- raw TCP, one stream, steady MB/s (the second half of a ``--seconds`` run);
- raw TCP on one kept-open connection: the payload sent ``--steady`` times back
  to back (each answered by a one-byte receipt), then again after ``--tcp-idle``
  seconds of silence: what slow start after idle costs a transfer;
- gradq: ``gradq.server`` and one ``WorkerClient`` per worker host pushing
  ``--elements`` float32 elements pre-encoded at 4 bits: one warm-up round,
  ``--steady`` timed rounds back to back, then one round after ``--idle`` seconds
  with nothing sent (a DiLoCo outer round after its inner steps).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import netns
import wan
import wan_tcp
from delay_line import in_namespace

MIB = 1 << 20
BASE = {
    "net.ipv4.tcp_wmem": f"4096 16384 {4 * MIB}",
    "net.ipv4.tcp_rmem": f"4096 131072 {32 * MIB}",
    "net.ipv4.tcp_slow_start_after_idle": "1",
    "net.ipv4.tcp_congestion_control": "cubic",
}
BIG = {"net.ipv4.tcp_wmem": f"4096 16384 {64 * MIB}", "net.ipv4.tcp_rmem": f"4096 131072 {64 * MIB}"}
NO_SSAI = {"net.ipv4.tcp_slow_start_after_idle": "0"}
BBR = {"net.ipv4.tcp_congestion_control": "bbr"}
SETTINGS: dict[str, dict[str, str]] = {
    "defaults": {},
    "buffers 64 MiB": BIG,
    "no slow start after idle": NO_SSAI,
    "bbr": BBR,
    "all three": {**BIG, **NO_SSAI, **BBR},
}


def apply(topology: netns.Topology, changes: dict[str, str]) -> dict[str, str]:
    """Write BASE with ``changes`` over it in every namespace of the run; return what one namespace reads back."""
    values = {**BASE, **changes}
    for host in topology.hosts:  # the switch only forwards frames: no TCP ends there
        argv = ["ip", "netns", "exec", host.namespace, "sysctl", "-q", "-w"]
        argv += [f"{name}={value}" for name, value in values.items()]
        result = subprocess.run(argv, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(argv)}` failed: {result.stderr.strip()}")
    read = subprocess.run(
        ["ip", "netns", "exec", topology.workers[0].namespace, "sysctl", "-n", *values],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\n")
    got = {name: " ".join(line.split()) for name, line in zip(values, read, strict=False)}
    for name, value in values.items():
        if got.get(name) != value:
            raise RuntimeError(f"{name} reads {got.get(name)!r} inside the namespace; expected {value!r}")
    return got


# -- raw TCP on a kept-open connection ----------------------------------------------------------------


def kept_open(ends: wan_tcp.Endpoints, total_bytes: int, steady: int, idle_s: float) -> tuple[list[float], float]:
    """(seconds of ``steady`` back-to-back transfers, seconds of one after ``idle_s`` idle) on one connection.

    Each transfer is timed from its first byte sent to the receiver's one-byte receipt of its last.
    """
    with in_namespace(ends.server_namespace):
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((ends.server_address, ends.port))
    server.listen(1)
    with in_namespace(ends.client_namespace):
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.connect((ends.server_address, ends.port))
    peer, _ = server.accept()
    server.close()
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def receive() -> None:
        buffer = bytearray(MIB)
        left = total_bytes
        while count := peer.recv_into(buffer):
            left -= count
            while left <= 0:
                peer.sendall(b"!")
                left += total_bytes

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    payload = memoryview(b"\0" * total_bytes)

    def one() -> float:
        started = time.perf_counter()
        client.sendall(payload)
        if client.recv(1) != b"!":
            raise RuntimeError("the receipt came back wrong")
        return time.perf_counter() - started

    try:
        one()  # warm-up: slow start and the windows' first growth
        times = [one() for _ in range(steady)]
        time.sleep(idle_s)  # the idle spell under test, not a synchronisation
        after = one()
    finally:
        client.close()
        receiver.join(timeout=10.0)
        peer.close()
    return times, after


# -- the gradq pusher ---------------------------------------------------------------------------------


def pusher_main(spec: dict[str, Any]) -> None:
    """One host: join, warm up, ``steady`` timed rounds, ``idle_s`` of silence, one more timed round."""
    import numpy as np

    from gradq.client.config import GradqConfig
    from gradq.client.worker import WorkerClient
    from gradq.qcore import QuantConfig, encode

    defaults = GradqConfig(addresses=(spec["address"],))
    config = QuantConfig(bits=4)
    client = WorkerClient(
        spec["address"],
        spec["job_id"],
        spec["rank"],
        spec["world_size"],
        config,
        chunk_elements=defaults.chunk_elements,
        max_in_flight=defaults.max_in_flight,
    )
    values = np.random.default_rng(spec["rank"]).standard_normal(spec["elements"], dtype=np.float32)
    out = np.empty_like(values)
    with client:
        client.join()
        pieces = client.round_keys(0, spec["elements"])
        tensors = [encode(values[begin:end], config) for _, begin, end in pieces]

        def one(step: int) -> float:
            started = time.perf_counter()
            futures = [
                client.push_pull_encoded_async(step, key, tensor, out=out[begin:end])
                for (key, begin, end), tensor in zip(pieces, tensors, strict=True)
            ]
            for future in futures:
                future.result()
            return time.perf_counter() - started

        one(0)
        steady = [one(step) for step in range(1, spec["steady"] + 1)]
        time.sleep(spec["idle_s"])  # the compute between outer rounds: nothing sent, not a synchronisation
        after = one(spec["steady"] + 1)
    payload = sum(tensor.nbytes for tensor in tensors)
    Path(spec["output"]).write_text(json.dumps({"payload": payload, "steady": steady, "after_idle": after}))


def gradq_rounds(
    topology: netns.Topology, args: argparse.Namespace, work: Path
) -> tuple[int, list[list[float]], list[float]]:
    """(payload per host, each host's steady rounds, each host's round after the idle spell)."""
    out = Path(tempfile.mkdtemp(prefix="push-", dir=work))
    environment = wan._environment(None)
    host = topology.aggregators[0]
    port_file = out / "aggregator.port"
    argv = [sys.executable, "-m", "gradq.server", "--host", host.address, "--port", str(wan.AGGREGATOR_PORT)]
    argv += ["--world-size", str(args.hosts), "--log-level", "WARNING", "--port-file", str(port_file)]
    argv += ["--grace", "1", "--keepalive-timeout", str(args.keepalive_timeout)]
    with (out / "aggregator.log").open("wb") as log:
        server = subprocess.Popen(host.command(argv), stdout=log, stderr=subprocess.STDOUT, env=environment)
    pushers: list[subprocess.Popen[bytes]] = []
    try:
        deadline = time.monotonic() + 60.0
        while not (port_file.exists() and port_file.read_text().strip()):  # polled with a deadline
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the aggregator did not start: {(out / 'aggregator.log').read_text()[-2000:]}")
            time.sleep(0.1)
        for rank, worker in enumerate(topology.workers):
            spec = {
                "address": f"{host.address}:{wan.AGGREGATOR_PORT}",
                "job_id": f"tune-{os.getpid()}-{out.name}",
                "rank": rank,
                "world_size": args.hosts,
                "elements": args.elements,
                "steady": args.steady,
                "idle_s": args.idle,
                "output": str(out / f"rank{rank}.json"),
            }
            argv = [sys.executable, str(Path(__file__).resolve()), "--pusher", json.dumps(spec)]
            with (out / f"rank{rank}.log").open("wb") as log:
                pushers.append(
                    subprocess.Popen(worker.command(argv), stdout=log, stderr=subprocess.STDOUT, env=environment)
                )
        for rank, pusher in enumerate(pushers):
            if pusher.wait(timeout=600) != 0:
                error = (out / f"rank{rank}.log").read_text().strip().splitlines()[-1:]
                server_log = (out / "aggregator.log").read_text().strip().splitlines()[-3:]
                raise wan.RowFailedError(f"pusher {rank}: {' '.join(error)}; aggregator: {' / '.join(server_log)}")
    finally:
        for process in [*pushers, server]:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=15)
    results = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(args.hosts)]
    return results[0]["payload"], [r["steady"] for r in results], [r["after_idle"] for r in results]


# -- one row ------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One (round trip, setting, repeat)."""

    rtt_ms: float
    setting: str
    sysctls: dict[str, str]
    load_before: float
    tcp_steady_mbs: float = 0.0
    tcp_kept_steady_s: list[float] = field(default_factory=list)
    tcp_kept_after_idle_s: float = 0.0
    payload_bytes: int = 0
    gradq_steady_s: list[list[float]] = field(default_factory=list)
    gradq_after_idle_s: list[float] = field(default_factory=list)
    failure: str = ""


ALLOWED = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")


def measure(args: argparse.Namespace) -> list[Row]:
    """Every row, with cubic and bbr allowed inside namespaces for the run (the machine's list restored after).

    A namespace may only pick congestion controls from this machine-wide list, the one sysctl here
    that is not per namespace.
    """
    allowed = ALLOWED.read_text().strip()
    ALLOWED.write_text(" ".join(dict.fromkeys([*allowed.split(), "cubic", "bbr"])))
    try:
        return _measure(args)
    finally:
        ALLOWED.write_text(allowed)


def _measure(args: argparse.Namespace) -> list[Row]:
    """Every row: one topology per round trip, the settings alternated ``--repeat`` times on it."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="gradq-tune-") as work:
        for rtt in args.rtts:
            topology = netns.build_topology(args.hosts, 1, rtt)
            try:
                rate = args.rate
                topology.shape(topology.workers, rate)
                topology.shape(topology.aggregators, f"{netns.parse_rate(rate) * args.hosts / 1e6:g}mbit")
                ends = wan._ends(topology)
                for _ in range(args.repeat):
                    for name in args.settings:
                        print(f"{rtt:g} ms {name} ...", file=sys.stderr, flush=True)
                        row = Row(rtt, name, apply(topology, SETTINGS[name]), os.getloadavg()[0])
                        try:
                            row.tcp_steady_mbs = wan_tcp.throughput(ends, 1, args.seconds)[0] / 1e6
                            row.payload_bytes, row.gradq_steady_s, row.gradq_after_idle_s = gradq_rounds(
                                topology, args, Path(work)
                            )
                            row.tcp_kept_steady_s, row.tcp_kept_after_idle_s = kept_open(
                                ends, row.payload_bytes, args.steady, args.tcp_idle
                            )
                        except (wan.RowFailedError, RuntimeError, OSError) as error:
                            row.failure = str(error)
                            print(f"    failed: {error}", file=sys.stderr, flush=True)
                        rows.append(row)
            finally:
                topology.close()
    return rows


def _spread(values: Sequence[float], digits: int = 2) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def render(rows: Sequence[Row], args: argparse.Namespace) -> str:
    """Markdown: one line per (round trip, setting) pooling its repeats, then every row."""
    command = " ".join(["sudo GRADQ_NETNS_RUN=... .venv/bin/python bench/wan_tuning.py", *sys.argv[1:]])
    lines = [
        "# Host tuning between regions: raw TCP and a DiLoCo-sized gradq push",
        "",
        f"`{command}` at gradq {wan._git_revision()}; {wan._machine()} after the run (other helpers' work shared "
        f"the 2 cores; each row's load before it is in the JSON). {args.hosts} worker hosts and one aggregator "
        f"host on delay lines, worker links at {args.rate}, the aggregator's at the sum. Every setting is written "
        "inside every namespace of the run over the base: tcp_wmem max 4 MiB, tcp_rmem max 32 MiB, "
        "slow start after idle on, cubic (this machine's namespaces start with those buffers and slow start "
        "after idle; a setting changes only what its name says). Settings alternated, "
        f"{args.repeat} times; medians (min-max) over every repeat and host. Raw TCP: one stream's steady MB/s "
        f"(second half of {args.seconds:g} s); one kept-open connection sending the gradq payload {args.steady} "
        f"times back to back, then once after {args.tcp_idle:g} s idle (each timed to the receiver's receipt). "
        f"gradq: {args.elements:,} float32 elements at 4 bits per host, GradqConfig's defaults; a warm-up round, "
        f"{args.steady} rounds back to back, then one round after {args.idle:g} s with nothing sent. "
        f"Aggregator `--keepalive-timeout {args.keepalive_timeout:g}`.",
        "",
        "| round trip | setting | raw TCP 1 stream steady MB/s | raw TCP kept-open transfer s, steady | "
        "after idle s | after idle / steady | gradq push s, steady | gradq MB/s per host | gradq after idle s | "
        "gradq after idle / steady |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rtt in args.rtts:
        for name in args.settings:
            group = [row for row in rows if row.rtt_ms == rtt and row.setting == name and not row.failure]
            if not group:
                lines.append(f"| {rtt:g} ms | {name} | failed | | | | | | | |")
                continue
            tcp = [row.tcp_steady_mbs for row in group]
            kept = [seconds for row in group for seconds in row.tcp_kept_steady_s]
            kept_idle = [row.tcp_kept_after_idle_s for row in group]
            steady = [seconds for row in group for host in row.gradq_steady_s for seconds in host]
            after = [seconds for row in group for seconds in row.gradq_after_idle_s]
            payload = group[0].payload_bytes
            lines.append(
                f"| {rtt:g} ms | {name} | {_spread(tcp, 1)} | {_spread(kept)} | {_spread(kept_idle)} | "
                f"{statistics.median(kept_idle) / statistics.median(kept):.2f}x | {_spread(steady)} | "
                f"{payload / statistics.median(steady) / 1e6:.1f} | {_spread(after)} | "
                f"{statistics.median(after) / statistics.median(steady):.2f}x |"
            )
    failures = [row for row in rows if row.failure]
    if failures:
        lines += ["", "Rows that failed:", *(f"- {row.rtt_ms:g} ms, {row.setting}: {row.failure}" for row in failures)]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--out", type=Path, help="write the report here (and .json)")
    action.add_argument("--pusher", help=argparse.SUPPRESS)
    parser.add_argument("--rtts", type=wan._rtt, nargs="+", default=[100.0], help="round trips in ms")
    parser.add_argument("--rate", default="1gbit", help="each worker host's link rate (tc syntax)")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--repeat", type=int, default=2, help="passes over the settings, alternated")
    parser.add_argument("--hosts", type=int, default=2, help="worker hosts")
    parser.add_argument("--elements", type=int, default=50_000_000, help="float32 elements per host")
    parser.add_argument("--steady", type=int, default=3, help="timed rounds back to back")
    parser.add_argument("--idle", type=float, default=20.0, help="seconds with nothing sent before the last round")
    parser.add_argument("--tcp-idle", type=float, default=10.0, help="idle seconds on the kept-open connection")
    parser.add_argument("--seconds", type=float, default=4.0, help="the steady throughput run")
    parser.add_argument("--keepalive-timeout", type=float, default=5.0, help="the aggregator's keepalive timeout")
    args = parser.parse_args(argv)
    if args.rtts and any(rtt <= 0 for rtt in args.rtts):
        parser.error(f"--rtts={args.rtts!r} is invalid; expected round trips above 0 ms (delay lines)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Measure every setting and write markdown and JSON."""
    args = parse_args(argv)
    if args.pusher:
        pusher_main(json.loads(args.pusher))
        return 0
    if os.geteuid() != 0:
        print("bench/wan_tuning.py needs root (network namespaces, TAP devices, tc, sysctl)", file=sys.stderr)
        return 2
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, wan._raise_on_signal)
    rows = measure(args)
    report = render(rows, args)
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report + "\n")
    args.out.with_suffix(".json").write_text(json.dumps([asdict(row) for row in rows], indent=1))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
