"""Links between regions: the delay line's validation report, and a DiLoCo-sized gradq push beside raw TCP.

Run as root from the repository root with the virtualenv's interpreter::

    sudo .venv/bin/python bench/wan.py --report bench/results/wan-delay-line.md   # round trips, raw TCP
    sudo .venv/bin/python bench/wan.py --push bench/results/wan-push.md           # 50M elements, 4 bits, 2 hosts
    sudo .venv/bin/python bench/wan.py --push out.md --trees old=OLD new=NEW --repeat 2   # two trees alternated
    sudo .venv/bin/python bench/wan.py --cleanup                                  # namespaces a killed run left

``--report`` builds one worker host and one aggregator host (bench/netns.py,
two links between them as in every benchmark) at each round trip of ``--rtts``
and measures, at each of ``--rates`` (and unshaped): one-byte TCP echoes (the
round trip a process sees), and the steady throughput of 1 and N TCP streams.
At 0 ms it measures the veth links the benchmarks use at ``--rtt 0`` and the
delay line with no delay (what the line itself costs).

``--push`` runs ``gradq.server`` on the aggregator host and one pusher per
worker host (``WorkerClient`` with GradqConfig's defaults for chunking and the
window, everything else the client's defaults): each round pushes
``--elements`` float32 elements pre-encoded at ``--bits`` (so quantizing is not
timed) and waits for every answer; the time is from the first push to the last
answer, per host. ``--trees`` alternates gradq trees row by row on the same
path (each a folder holding ``gradq/``, links to a tree's folders, put first
on the children's PYTHONPATH), so the machine's load falls on each alike.
Beside each row: the link's own bound (bytes / rate + 2 round trips) and raw
TCP on the same path (fresh connections carrying the same bytes, and steady
streams). Worker links get ``--rate``; the aggregator's link gets
the sum of theirs, so each host can reach its own rate.

Traffic goes only to addresses inside the namespaces this creates; they and the
delay-line processes are removed on exit, also on errors and signals.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import netns
import wan_tcp

REPO = Path(__file__).resolve().parent.parent
TCP_PORT = 5201
AGGREGATOR_PORT = 50051
RTT_ECHOES = 20


def _raise_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _ends(topology: netns.Topology, port: int = TCP_PORT) -> wan_tcp.Endpoints:
    worker, aggregator = topology.workers[0], topology.aggregators[0]
    return wan_tcp.Endpoints(worker.namespace, aggregator.namespace, aggregator.address, port)


def _git_revision() -> str:
    described = subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True, check=False
    )
    return described.stdout.strip() or "unknown revision"


def _machine() -> str:
    return f"{os.cpu_count()} CPU cores, 1-minute load average {os.getloadavg()[0]:.1f}"


# -- the validation report ---------------------------------------------------------------------------


@dataclass
class LinkRow:
    """One (link kind, round trip, rate) of the validation report."""

    links: str  # "veth" or "delay line"
    rtt_ms: float
    rate: str  # tc rate or "unshaped"
    rtt_median_ms: float
    rtt_min_ms: float
    rtt_max_ms: float
    streams: dict[int, tuple[float, float]]  # streams -> (steady, overall) MB/s


def measure_links(args: argparse.Namespace) -> list[LinkRow]:
    """Every row of the validation report, one topology per (link kind, round trip)."""
    setups = [("veth", 0.0, False)] + [("delay line", rtt, True) for rtt in args.rtts]
    rows = []
    for links, rtt, delay_lines in setups:
        topology = netns.build_topology(1, 1, rtt, delay_lines)
        try:
            for rate in [None, *args.rates]:
                topology.shape(topology.hosts, rate)
                label = rate or "unshaped"
                print(f"{links} {rtt:g} ms {label} ...", file=sys.stderr, flush=True)
                ends = _ends(topology)
                times = [seconds * 1e3 for seconds in wan_tcp.round_trips(ends, RTT_ECHOES)]
                streams = {}
                for count in args.streams:
                    steady, overall = wan_tcp.throughput(ends, count, args.seconds)
                    streams[count] = (steady / 1e6, overall / 1e6)
                rows.append(LinkRow(links, rtt, label, sorted(times)[len(times) // 2], min(times), max(times), streams))
        finally:
            topology.close()
    return rows


def render_links(rows: Sequence[LinkRow], args: argparse.Namespace) -> str:
    """The validation report in markdown."""
    counts = list(args.streams)
    lines = [
        "# The delay line: round trips and raw TCP",
        "",
        f"`sudo .venv/bin/python bench/wan.py --report {args.report}` "
        f"(rates {', '.join(args.rates)}, {args.seconds:g} s per throughput run) at gradq {_git_revision()}; "
        f"{_machine()} after the run (other helpers' work shared the machine: throughputs above about 200 MB/s "
        "are CPU-bound). One worker host and one aggregator host, two links between them as in every "
        "benchmark (bench/netns.py): each link's delay line holds frames rtt/4 per direction. Round trip: "
        f"{RTT_ECHOES} one-byte TCP echoes (Nagle off) on one connection, median (min-max). Throughput: MB/s "
        "(10^6 bytes) at the receiver, steady = the second half of the run, from-connect = the whole run; "
        "Linux defaults in every namespace (tcp_wmem max 4 MiB, cubic).",
        "",
        "| links | set round trip | rate | measured round trip ms | vs set | "
        + " | ".join(f"{count} stream{'s' if count > 1 else ''} steady / from-connect" for count in counts)
        + " |",
        "|---|---:|---|---:|---:|" + "---:|" * len(counts),
    ]
    for row in rows:
        versus = f"{row.rtt_median_ms / row.rtt_ms - 1:+.1%}" if row.rtt_ms > 0 else "-"
        cells = " | ".join(f"{row.streams[count][0]:.1f} / {row.streams[count][1]:.1f}" for count in counts)
        lines.append(
            f"| {row.links} | {row.rtt_ms:g} ms | {row.rate} | {row.rtt_median_ms:.2f} "
            f"({row.rtt_min_ms:.2f}-{row.rtt_max_ms:.2f}) | {versus} | {cells} |"
        )
    lines += ["", *_link_checks(rows)]
    return "\n".join(lines)


def _link_checks(rows: Sequence[LinkRow]) -> list[str]:
    delayed = [row for row in rows if row.rtt_ms > 0]
    worst = max(delayed, key=lambda row: abs(row.rtt_median_ms / row.rtt_ms - 1), default=None)
    if worst is None:
        return []
    error = worst.rtt_median_ms / worst.rtt_ms - 1
    verdict = "met" if abs(error) <= 0.05 else "missed"
    return [
        f"Round trip within 5% of the set value: {verdict} (worst median {worst.rtt_median_ms:.2f} ms at "
        f"{worst.rtt_ms:g} ms, {worst.rate}: {error:+.1%}).",
    ]


# -- the gradq push rows -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PushSpec:
    """What one pusher process does (passed as JSON to ``--push-main``)."""

    address: str
    job_id: str
    rank: int
    world_size: int
    elements: int
    bits: int
    scheme: str  # a QuantConfig scheme name ("" its default)
    rounds: int  # the first is a warm-up (the hosts start apart); the rest are timed
    output: str


def push_main(spec: PushSpec) -> None:
    """One host's pusher: pre-encode the array once, then time each round's pushes to the last answer."""
    import numpy as np

    from gradq.client.config import GradqConfig
    from gradq.client.worker import WorkerClient
    from gradq.qcore import QuantConfig, Scheme, encode

    defaults = GradqConfig(addresses=(spec.address,))
    config = QuantConfig(Scheme.parse(spec.scheme), bits=spec.bits) if spec.scheme else QuantConfig(bits=spec.bits)
    client = WorkerClient(
        spec.address,
        spec.job_id,
        spec.rank,
        spec.world_size,
        config,
        chunk_elements=defaults.chunk_elements,
        max_in_flight=defaults.max_in_flight,
    )
    values = np.random.default_rng(spec.rank).standard_normal(spec.elements, dtype=np.float32)
    out = np.empty_like(values)
    results = []
    with client:
        client.join()
        pieces = client.round_keys(0, spec.elements)
        tensors = [encode(values[begin:end], config) for _, begin, end in pieces]
        payload = sum(tensor.nbytes for tensor in tensors)
        for step in range(spec.rounds):
            tx, rx = netns.read_counters(netns.HOST_DEVICE)
            sampler = _WindowSampler(client)
            started = time.perf_counter()
            futures = [
                client.push_pull_encoded_async(step, key, tensor, out=out[begin:end])
                for (key, begin, end), tensor in zip(pieces, tensors, strict=True)
            ]
            for future in futures:
                future.result()
            seconds = time.perf_counter() - started
            tx_after, rx_after = netns.read_counters(netns.HOST_DEVICE)
            results.append({"seconds": seconds, "tx": tx_after - tx, "rx": rx_after - rx, **sampler.stop()})
    Path(spec.output).write_text(
        json.dumps({"payload": payload, "chunks": len(pieces), "in_flight": defaults.max_in_flight, "rounds": results})
    )


class _WindowSampler:
    """Peak pushes and bytes in flight on shard 0 during a round, and its connections, sampled every 5 ms.

    Reads the client's window, which is private and differs between trees (a count only before the bytes
    window): a diagnostic of what holds the round, not an API; whatever a tree lacks is reported as None.
    """

    def __init__(self, client: Any) -> None:
        self._window = getattr(getattr(client, "_sender", None), "window", None)
        self.peak_pushes: int | None = None
        self.peak_bytes: int | None = None
        self.connections: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _read(self) -> tuple[int | None, int | None, int | None]:
        window = self._window
        if window is None:
            return None, None, None
        if hasattr(window, "in_flight"):
            pushes, nbytes = window.in_flight(0)
            connections = window.connections(0) if hasattr(window, "connections") else None
            return pushes, nbytes, connections
        counts = getattr(window, "_in_flight", None)
        return (counts[0] if counts else None), None, 1

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            try:
                pushes, nbytes, connections = self._read()
            except Exception:  # the private shape changed under us: report nothing rather than fail the round
                return
            if pushes is not None:
                self.peak_pushes = max(self.peak_pushes or 0, pushes)
            if nbytes is not None:
                self.peak_bytes = max(self.peak_bytes or 0, nbytes)
            if connections is not None:
                self.connections = max(self.connections or 0, connections)

    def stop(self) -> dict[str, int | None]:
        self._stop.set()
        self._thread.join()
        return {"peak_pushes": self.peak_pushes, "peak_bytes": self.peak_bytes, "connections": self.connections}


def _link_drops(topology: netns.Topology) -> tuple[int, int]:
    """(frames tbf dropped, frames the devices dropped) on every host link, both ends, so far.

    A TAP device drops what its delay line did not read in time (its queue is full); tbf drops what
    overflows its own queue (rate x latency): where a round's losses happened, in numbers.
    """
    shaped = device = 0
    for host in topology.hosts:
        for namespace, name in ((host.namespace, host.device), (netns.SWITCH, host.port)):
            tc = subprocess.run(
                ["tc", "-s", "-j", "-n", namespace, "qdisc", "show", "dev", name], capture_output=True, text=True
            )
            shaped += sum(qdisc.get("drops", 0) for qdisc in json.loads(tc.stdout or "[]"))
            link = subprocess.run(
                ["ip", "-s", "-j", "-n", namespace, "link", "show", "dev", name], capture_output=True, text=True
            )
            for entry in json.loads(link.stdout or "[]"):
                statistics = entry.get("stats64", {})
                device += statistics.get("tx", {}).get("dropped", 0) + statistics.get("rx", {}).get("dropped", 0)
    return shaped, device


class RowFailedError(RuntimeError):
    """A pusher of one row exited with an error: the row is reported as failed and the run goes on."""


@dataclass
class PushRow:
    """One (round trip, rate, gradq tree) of the push report."""

    rtt_ms: float
    rate: str
    tree: str  # --trees' label, or "" for the gradq this interpreter imports
    payload_bytes: int  # per host, each way
    chunks: int
    in_flight: int | None
    host_seconds: list[list[float]]  # per host, its timed rounds
    wire_bytes: int  # the first host's device bytes per round, sent
    tcp_fresh_s: dict[int, float]  # streams -> seconds for payload_bytes on fresh connections
    tcp_steady: dict[int, float]  # streams -> steady MB/s
    windows: list[dict[str, int | None]]  # the first host's timed rounds: peak pushes and bytes in flight, connections
    drops: tuple[int, int]  # frames dropped on the links during the row's rounds: by tbf, by the devices


def _start_server(
    topology: netns.Topology, work: Path, world_size: int, environment: dict[str, str]
) -> subprocess.Popen[bytes]:
    host = topology.aggregators[0]
    port_file = work / "aggregator.port"
    argv = [sys.executable, "-m", "gradq.server", "--host", host.address, "--port", str(AGGREGATOR_PORT)]
    argv += ["--world-size", str(world_size), "--log-level", "WARNING", "--port-file", str(port_file), "--grace", "1"]
    with (work / "aggregator.log").open("wb") as log:
        server = subprocess.Popen(host.command(argv), stdout=log, stderr=subprocess.STDOUT, env=environment)
    deadline = time.monotonic() + 60.0
    while not (port_file.exists() and port_file.read_text().strip()):
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the aggregator did not start:\n{(work / 'aggregator.log').read_text()[-2000:]}")
        time.sleep(0.1)
    return server


def _environment(tree: str | None) -> dict[str, str]:
    # No proxy variables: gRPC would otherwise try to reach the aggregator through one.
    environment = {name: value for name, value in os.environ.items() if "proxy" not in name.lower()}
    environment.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if tree is not None:  # a folder holding gradq/ (links to a tree's qcore, server, client, ...) imported first
        environment["PYTHONPATH"] = tree
    return environment


def _push_row(
    topology: netns.Topology,
    rtt: float,
    rate: str | None,
    tree: tuple[str, str | None],
    args: argparse.Namespace,
    work: Path,
    raw: dict[tuple[float, str], tuple[dict[int, float], dict[int, float]]],
) -> PushRow:
    label = rate or "unshaped"
    topology.shape(topology.workers, rate)
    aggregator_rate = f"{netns.parse_rate(rate) * args.hosts / 1e6:g}mbit" if rate else None
    topology.shape(topology.aggregators, aggregator_rate)
    out = work / f"{rtt:g}ms-{label}-{tree[0] or 'default'}-{time.monotonic_ns()}"
    out.mkdir()
    environment = _environment(tree[1])
    drops_before = _link_drops(topology)
    server = _start_server(topology, out, args.hosts, environment)
    pushers = []
    try:
        for rank, host in enumerate(topology.workers):
            spec = PushSpec(
                f"{topology.aggregators[0].address}:{AGGREGATOR_PORT}",
                f"wan-{os.getpid()}-{out.name}",
                rank,
                args.hosts,
                args.elements,
                args.bits,
                args.scheme,
                args.rounds + 1,
                str(out / f"rank{rank}.json"),
            )
            argv = [sys.executable, str(Path(__file__).resolve()), "--push-main", json.dumps(asdict(spec))]
            with (out / f"rank{rank}.log").open("wb") as log:
                pushers.append(
                    subprocess.Popen(host.command(argv), stdout=log, stderr=subprocess.STDOUT, env=environment)
                )
        for rank, pusher in enumerate(pushers):
            if pusher.wait(timeout=900) != 0:
                error = (out / f"rank{rank}.log").read_text().strip().splitlines()[-1:]
                server_log = (out / "aggregator.log").read_text().strip().splitlines()[-5:]
                raise RowFailedError(
                    f"pusher {rank}: {' '.join(error)}; aggregator's log ends: {' / '.join(server_log)}"
                )
    finally:
        for process in [*pushers, server]:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=15)
    drops_after = _link_drops(topology)
    results = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(args.hosts)]
    payload = results[0]["payload"]
    ends = _ends(topology, TCP_PORT)
    if (rtt, label) not in raw:  # once per path: it does not depend on the tree
        raw[rtt, label] = (
            {count: wan_tcp.transfer_seconds(ends, count, payload) for count in args.streams},
            {count: wan_tcp.throughput(ends, count, args.seconds)[0] / 1e6 for count in args.streams},
        )
    fresh, steady = raw[rtt, label]
    return PushRow(
        rtt,
        label,
        tree[0],
        payload,
        results[0]["chunks"],
        results[0]["in_flight"],
        [[entry["seconds"] for entry in result["rounds"][1:]] for result in results],
        results[0]["rounds"][-1]["tx"],
        fresh,
        steady,
        [
            {name: entry.get(name) for name in ("peak_pushes", "peak_bytes", "connections")}
            for entry in results[0]["rounds"][1:]
        ],
        (drops_after[0] - drops_before[0], drops_after[1] - drops_before[1]),
    )


def measure_pushes(args: argparse.Namespace) -> list[PushRow]:
    """Every push row: one topology per round trip (veth at 0), every rate on it."""
    rows = []
    raw: dict[tuple[float, str], tuple[dict[int, float], dict[int, float]]] = {}
    failures: list[str] = args.failures
    with tempfile.TemporaryDirectory(prefix="gradq-wan-") as work:
        for rtt in args.rtts:
            topology = netns.build_topology(args.hosts, 1, rtt)
            try:
                for rate in args.rates:
                    for tree in args.trees * args.repeat:  # alternated: the machine's load changes alike for each
                        print(f"push {rtt:g} ms {rate or 'unshaped'} {tree[0]} ...", file=sys.stderr, flush=True)
                        try:
                            rows.append(_push_row(topology, rtt, rate, tree, args, Path(work), raw))
                        except RowFailedError as error:
                            failures.append(f"{rtt:g} ms, {rate or 'unshaped'}, {tree[0] or 'this tree'}: {error}")
                            print(f"    failed: {error}", file=sys.stderr, flush=True)
            finally:
                topology.close()
    return rows


def _grid(args: argparse.Namespace) -> str:
    """What the pushes were encoded with, in words."""
    from gradq.qcore import QuantConfig, Scheme

    config = QuantConfig(Scheme.parse(args.scheme), bits=args.bits) if args.scheme else QuantConfig(bits=args.bits)
    if config.topk:
        return f"{args.scheme} (top {config.topk} of every {config.channel_size})"
    return f"{config.scheme.name.lower()} at {config.bits} bits"


def render_pushes(rows: Sequence[PushRow], args: argparse.Namespace) -> str:
    """The push report in markdown."""
    command = " ".join(["sudo .venv/bin/python bench/wan.py", *sys.argv[1:]])
    lines = [
        "# A DiLoCo-sized push across a delay",
        "",
        f"`{command}` at gradq {_git_revision()}; {_machine()} after the run (other helpers' work shared the "
        f"2 cores). {args.hosts} hosts each push {args.elements:,} float32 elements pre-encoded at {_grid(args)} "
        "to one aggregator (`gradq.server`) and wait for every answer; per host, time from the first push to the "
        "last answer, median of the timed rounds (after one warm-up round), every host's rounds pooled; last round: "
        "the slower host's. Worker links "
        "at the rate; the aggregator's at the sum of theirs. Bound = payload / rate + 2 round trips. Raw TCP on the "
        "same path (worker to aggregator host): fresh connections carrying the payload (from the first connect to "
        f"the last byte received) and steady streams. {args.note}",
        "",
        "| round trip | rate | gradq | payload per host | chunks, count floor | "
        "host 0's rounds: peak in flight, connections | "
        "frames dropped: tbf, devices | gradq s (min-max) | last round s | gradq MB/s per host | "
        "of link rate | bound s | gradq / bound | "
        + " | ".join(f"raw TCP {count} fresh s" for count in args.streams)
        + " | "
        + " | ".join(f"raw TCP {count} steady MB/s" for count in args.streams)
        + " |",
        "|---:|---|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|" + "---:|" * (2 * len(args.streams)),
    ]
    for row in rows:
        times = sorted(seconds for host in row.host_seconds for seconds in host)
        median = times[len(times) // 2]
        rate = netns.parse_rate(row.rate) / 8 if row.rate != "unshaped" else None
        bound = row.payload_bytes / rate + 2 * row.rtt_ms / 1e3 if rate else None
        fresh = " | ".join(f"{row.tcp_fresh_s[count]:.2f}" for count in args.streams)
        steady = " | ".join(f"{row.tcp_steady[count]:.1f}" for count in args.streams)
        versus = (
            f"{row.payload_bytes / median / rate:.0%} | {bound:.2f} | {median / bound:.2f}x"
            if bound is not None and rate is not None
            else "- | - | -"
        )
        lines.append(
            f"| {row.rtt_ms:g} ms | {row.rate} | {row.tree or 'this tree'} | "
            f"{row.payload_bytes / 1e6:.1f} MB | {row.chunks}, "
            f"{row.in_flight} per shard | {_windows(row.windows)} | {row.drops[0]}, {row.drops[1]} | "
            f"{median:.2f} ({times[0]:.2f}-{times[-1]:.2f}) | "
            f"{max(host[-1] for host in row.host_seconds):.2f} | "
            f"{row.payload_bytes / median / 1e6:.1f} | {versus} | {fresh} | {steady} |"
        )
    if args.failures:
        lines += [
            "",
            "Rows that failed (a pusher exited with an error):",
            *(f"- {failure}" for failure in args.failures),
        ]
    return "\n".join(lines)


def _wait_for_free_namespaces(timeout_s: float = 1800.0) -> None:
    """Wait while another benchmark holds the gradq-* namespaces (they are one set per machine)."""
    deadline = time.monotonic() + timeout_s
    while leftovers := netns.leftover_namespaces():
        if time.monotonic() > deadline:
            raise RuntimeError(f"namespaces {', '.join(leftovers)} still exist after {timeout_s:.0f} s")
        print(f"waiting for another run's namespaces ({', '.join(leftovers)}) ...", file=sys.stderr, flush=True)
        time.sleep(10.0)  # a poll of a state another process owns, with a deadline


def _windows(rounds: Sequence[dict[str, int | None]]) -> str:
    cells = []
    for entry in rounds:
        pushes, nbytes, connections = entry.get("peak_pushes"), entry.get("peak_bytes"), entry.get("connections")
        cell = f"{pushes if pushes is not None else '?'}"
        if nbytes is not None:
            cell += f" ({nbytes / 1e6:.1f} MB)"
        if connections is not None:
            cell += f", {connections}c"
        cells.append(cell)
    return "; ".join(cells) or "-"


# -- command line ------------------------------------------------------------------------------------


def _rate_or_none(text: str) -> str | None:
    if text.lower() == "none":
        return None
    try:
        netns.parse_rate(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text.lower()


def _tree(text: str) -> tuple[str, str | None]:
    label, _, folder = text.partition("=")
    if not label or not (Path(folder) / "gradq").is_dir():
        raise argparse.ArgumentTypeError(f"tree={text!r} is invalid; expected LABEL=FOLDER with FOLDER/gradq/ in it")
    return label, folder


def _rtt(text: str) -> float:
    try:
        return netns.parse_rtt(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--report", type=Path, help="write the delay line's validation report here (and .json)")
    action.add_argument("--push", type=Path, help="write the gradq push rows here (and .json)")
    action.add_argument("--cleanup", action="store_true", help="delete namespaces a killed run left, then exit")
    action.add_argument("--push-main", help=argparse.SUPPRESS)
    parser.add_argument("--rtts", type=_rtt, nargs="+", help="round trips in ms (report: 50 100; push: 0 50 100)")
    parser.add_argument("--rates", type=_rate_or_none, nargs="+", help="link rates; 'none' is unshaped")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8], help="raw TCP stream counts")
    parser.add_argument("--seconds", type=float, default=4.0, help="each steady throughput run")
    parser.add_argument("--hosts", type=int, default=2, help="push: worker hosts")
    parser.add_argument("--elements", type=int, default=50_000_000, help="push: float32 elements per host")
    parser.add_argument("--bits", type=int, default=4, help="push: bits per element")
    parser.add_argument(
        "--scheme", default="", help="push: a QuantConfig scheme name, e.g. sparse_topk (default: QuantConfig's)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="push: timed rounds (after one warm-up)")
    parser.add_argument(
        "--trees",
        nargs="+",
        type=_tree,
        default=[("", None)],
        metavar="LABEL=FOLDER",
        help="push: gradq trees to alternate, each a folder holding gradq/ (links to a tree's qcore, server, "
        "client, proto, cli), put first on the pushers' and the aggregator's PYTHONPATH",
    )
    parser.add_argument("--repeat", type=int, default=1, help="push: runs of each tree per row, alternated")
    parser.add_argument("--note", default="", help="a sentence for the report's setup (e.g. which gradq tree ran)")
    args = parser.parse_args(argv)
    if args.scheme:
        from gradq.qcore import QuantConfig, Scheme

        try:
            QuantConfig(Scheme.parse(args.scheme), bits=args.bits)
        except ValueError as error:
            parser.error(f"--scheme: {error}")
    args.failures = []  # push rows whose pushers failed, filled while measuring
    if args.rtts is None:
        args.rtts = [50.0, 100.0] if args.report else [0.0, 50.0, 100.0]
    if args.rates is None:
        args.rates = ["1gbit", "100mbit"] if args.report else ["1gbit"]
    if args.report:
        args.rates = [rate for rate in args.rates if rate is not None]  # unshaped is always measured
        args.rtts = [0.0, *(rtt for rtt in args.rtts if rtt > 0)]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the report or the push rows; write markdown and JSON."""
    args = parse_args(argv)
    if args.push_main:
        push_main(PushSpec(**json.loads(args.push_main)))
        return 0
    if os.geteuid() != 0:
        print("bench/wan.py needs root (network namespaces, TAP devices and tc)", file=sys.stderr)
        return 2
    if args.cleanup:
        print("removed:", ", ".join(netns.remove_namespaces(netns.leftover_namespaces())) or "nothing")
        return 0
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_on_signal)
    _wait_for_free_namespaces()
    path: Path = args.report or args.push
    rows: Sequence[Any]
    if args.report:
        rows = measure_links(args)
        report = render_links(rows, args)
    else:
        rows = measure_pushes(args)
        report = render_pushes(rows, args)
    print(report)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report + "\n")
    path.with_suffix(".json").write_text(json.dumps([asdict(row) for row in rows], indent=1))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
