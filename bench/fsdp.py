"""FSDP2 across hosts behind shaped links: native HSDP (fp32, bf16 reductions) beside gradq 8-bit and 4-bit + EF.

Run as root from the repository root with the virtualenv's interpreter::

    sudo .venv/bin/python bench/fsdp.py                          # 2x2 and 2x4 at 1 Gbit/s
    sudo .venv/bin/python bench/fsdp.py --hosts 2x2 --rates 100mbit --steps 20
    sudo .venv/bin/python bench/fsdp.py --hosts 2x2 --rates 1gbit --rtt 50       # 50 ms between hosts

Each host is a network namespace (bench/netns.py) whose one veth is shaped with
tc's tbf in both directions; its ranks talk to each other over the namespace's
loopback, unshaped, as a host's ranks would over NVLink or shared memory. The
aggregator has a namespace and a shaped link of its own. Every rank runs
examples/fsdp_train.py (the transformer sharded per block over its host's
ranks) on the same batches for ``--steps`` optimizer steps:

- native HSDP: the 2-D mesh, torch's gloo all-reduce across hosts, with
  ``reduce_dtype`` float32 or bfloat16;
- gradq: the 1-D mesh and ``use_gradq``, 8-bit, and 4-bit with error feedback.

Reported per row: median ms per step (after ``--warmup`` steps), bytes through a
host's link per step (its device's tx + rx counters over the whole run, divided
by the steps: protocol headers and the start included), CPU seconds per step
(ranks and aggregator apart), how busy the machine's cores were, the held-out
loss after the same steps, and for gradq the share of its cross-host time that
overlapped backward. The report goes to stdout and ``bench/results/fsdp-<time>.md``.
This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import FrameType

import netns
from cpu_busy import read_process_cpu_s

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "fsdp_train.py"
RESULTS = REPO / "bench" / "results"
AGGREGATOR_PORT = 50051
RENDEZVOUS_PORT = 29600
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")
RUN_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Method:
    key: str
    label: str
    bits: int | None = None  # None: native HSDP
    error_feedback: bool = False
    reduce_dtype: str = "float32"


METHODS = {
    method.key: method
    for method in (
        Method("native-fp32", "native HSDP, fp32 all-reduce"),
        Method("native-bf16", "native HSDP, reduce_dtype=bf16", reduce_dtype="bfloat16"),
        Method("gradq8", "gradq 8-bit", bits=8),
        Method("gradq4ef", "gradq 4-bit + EF", bits=4, error_feedback=True),
    )
}


@dataclass
class Row:
    shape: str
    rate: str
    method: Method
    step_ms: float
    link_bytes_per_step: float
    rank_cpu_s_per_step: float
    aggregator_cpu_s_per_step: float
    busy: float  # share of the machine's cores in use over the timed steps
    held_out_loss: float
    overlap: float | None  # gradq: share of the cross-host time that overlapped backward


def _environment(**extra: str) -> dict[str, str]:
    # No proxy variables: gRPC would otherwise try to reach the aggregator through a proxy.
    environment = {name: value for name, value in os.environ.items() if "proxy" not in name.lower()}
    environment.update(dict.fromkeys(THREAD_VARIABLES, "1"), PYTHONUNBUFFERED="1", **extra)
    return environment


def _counters(host: netns.Host) -> int:
    """tx + rx bytes of the host's device, read inside its namespace."""
    path = f"/sys/class/net/{host.device}/statistics"
    text = subprocess.run(
        host.command(["cat", f"{path}/tx_bytes", f"{path}/rx_bytes"]), capture_output=True, text=True, check=True
    ).stdout
    return sum(int(value) for value in text.split())


def run_row(
    topology: netns.Topology, shape: tuple[int, int], rate: str, method: Method, args: argparse.Namespace, work: Path
) -> Row:
    """Start the aggregator (gradq rows) and every rank of ``shape``; wait; read the reports and counters."""
    hosts, local = shape
    out = work / f"{hosts}x{local}-{rate}-{method.key}"
    out.mkdir()
    processes: list[subprocess.Popen[bytes]] = []
    aggregator_pids: list[int] = []
    environment = _environment()
    try:
        if method.bits is not None:
            server = topology.aggregators[0]
            port_file = out / "aggregator.port"
            argv = [sys.executable, "-m", "gradq.server", "--host", server.address, "--port", str(AGGREGATOR_PORT)]
            argv += ["--log-level", "WARNING", "--port-file", str(port_file), "--grace", "1"]
            with (out / "aggregator.log").open("wb") as log:
                processes.append(subprocess.Popen(server.command(argv), stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + 120
            while not (port_file.exists() and port_file.read_text().strip()):
                if time.monotonic() > deadline or processes[0].poll() is not None:
                    raise RuntimeError(f"the aggregator did not start:\n{(out / 'aggregator.log').read_text()[-2000:]}")
                time.sleep(0.1)
            aggregator_pids = netns.namespace_pids(server.namespace)
            environment.update(
                GRADQ_AGGREGATORS=f"{server.address}:{AGGREGATOR_PORT}",
                GRADQ_JOB_ID=f"fsdp-{out.name}-{os.getpid()}",
                GRADQ_BITS=str(method.bits),
                GRADQ_ERROR_FEEDBACK="1" if method.error_feedback else "0",
            )
        workers = topology.workers[:hosts]
        before = [_counters(host) for host in workers]
        script = [str(EXAMPLE), "--hosts", str(hosts), "--steps", str(args.steps), "--report", str(out / "report")]
        script += ["--width", str(args.width), "--layers", str(args.layers), "--reduce-dtype", method.reduce_dtype]
        script += ["--native"] if method.bits is None else []
        started = time.monotonic()
        for rank in range(hosts * local):
            host = workers[rank // local]
            rank_environment = {
                **environment,
                "RANK": str(rank),
                "WORLD_SIZE": str(hosts * local),
                "LOCAL_RANK": str(rank % local),
                "MASTER_ADDR": workers[0].address,
                "MASTER_PORT": str(RENDEZVOUS_PORT),
                "GLOO_SOCKET_IFNAME": host.device,
            }
            with (out / f"rank{rank}.log").open("wb") as log:
                command = host.command([sys.executable, *script])
                processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=rank_environment))
        ranks = processes[1:] if method.bits is not None else processes
        samples = []  # (wall time, the aggregator's CPU seconds): its CPU over the timed steps alone
        while any(process.poll() is None for process in ranks):
            samples.append((time.time(), read_process_cpu_s(aggregator_pids)))
            if time.monotonic() - started > RUN_TIMEOUT_S:
                raise RuntimeError(f"the ranks did not finish within {RUN_TIMEOUT_S:.0f} s")
            time.sleep(0.1)
        for rank, process in enumerate(ranks):
            if process.returncode != 0:
                raise RuntimeError(f"rank {rank} failed:\n{(out / f'rank{rank}.log').read_text()[-3000:]}")
        link_bytes = statistics.mean(_counters(host) - was for host, was in zip(workers, before, strict=True))
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=30)
    reports = [json.loads((out / "report" / f"rank{rank}.json").read_text()) for rank in range(hosts * local)]
    timed = slice(args.warmup, None)
    step_s = statistics.median(max(report["step_s"][i] for report in reports) for i in range(args.warmup, args.steps))
    rank_cpu = sum(statistics.mean(report["step_cpu_s"][timed]) for report in reports)
    timed_from = reports[0]["started_at"] + sum(reports[0]["step_s"][: args.warmup])
    timed_to = reports[0]["started_at"] + sum(reports[0]["step_s"])
    aggregator_cpu_s = _cpu_between(samples, timed_from, timed_to) / (args.steps - args.warmup)
    traveled = sum(report.get("traveled_s", 0.0) for report in reports)
    waited = sum(report.get("waited_s", 0.0) for report in reports)
    return Row(
        f"{hosts}x{local}",
        rate,
        method,
        step_s * 1000,
        link_bytes / args.steps,
        rank_cpu,
        aggregator_cpu_s,
        (rank_cpu + aggregator_cpu_s) / (step_s * (os.cpu_count() or 1)),
        reports[0]["held_out_loss"],
        1 - waited / traveled if traveled else None,
    )


def _cpu_between(samples: Sequence[tuple[float, float]], begin: float, end: float) -> float:
    """CPU seconds used between wall times ``begin`` and ``end``, from the nearest samples (0 without any)."""
    inside = [cpu for when, cpu in samples if begin <= when <= end]
    return inside[-1] - inside[0] if len(inside) > 1 else 0.0


def render(rows: Sequence[Row], args: argparse.Namespace, setup: str) -> str:
    """The markdown report: one table per (shape, rate), ratios against native fp32, the targets."""
    lines = ["# FSDP2 across hosts: native HSDP beside gradq", "", setup, ""]
    for shape, rate in dict.fromkeys((row.shape, row.rate) for row in rows):
        group = [row for row in rows if (row.shape, row.rate) == (shape, rate)]
        native = next((row for row in group if row.method.key == "native-fp32"), None)
        lines += [f"## {shape} hosts x ranks, {rate} per host link", ""]
        lines += [
            "| method | ms/step | host-link MB/step | x fp32 bytes | rank CPU s/step | aggregator CPU s/step "
            "| cores busy | held-out loss | Δ vs fp32 | overlap |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in group:
            ratio = f"{row.link_bytes_per_step / native.link_bytes_per_step:.3f}" if native else "-"
            delta = f"{(row.held_out_loss / native.held_out_loss - 1) * 100:+.2f}%" if native else "-"
            overlap = f"{row.overlap * 100:.0f}%" if row.overlap is not None else "-"
            lines.append(
                f"| {row.method.label} | {row.step_ms:.0f} | {row.link_bytes_per_step / 1e6:.2f} | {ratio} "
                f"| {row.rank_cpu_s_per_step:.3f} | {row.aggregator_cpu_s_per_step:.3f} | {row.busy * 100:.0f}% "
                f"| {row.held_out_loss:.4f} | {delta} | {overlap} |"
            )
        lines.append("")
        lines += _targets(group, native)
    return "\n".join(lines)


def _targets(group: Sequence[Row], native: Row | None) -> list[str]:
    if native is None:
        return []
    by_key = {row.method.key: row for row in group}
    lines = []
    if "gradq8" in by_key:
        ratio = by_key["gradq8"].link_bytes_per_step / native.link_bytes_per_step
        lines.append(
            f"- gradq 8-bit moves {ratio:.3f}x native fp32's host-link bytes (target ≤ 0.3): "
            f"{'met' if ratio <= 0.3 else 'missed'}"
        )
    if "gradq4ef" in by_key:
        delta = by_key["gradq4ef"].held_out_loss / native.held_out_loss - 1
        lines.append(
            f"- gradq 4-bit + EF's held-out loss is {delta * 100:+.2f}% of native fp32's (target within 1%): "
            f"{'met' if abs(delta) <= 0.01 else 'missed'}"
        )
    for key in ("gradq8", "gradq4ef"):
        if key in by_key:
            row = by_key[key]
            pace = "CPU-bound" if row.busy >= 0.85 else "not CPU-bound"
            lines.append(
                f"- {row.method.label}: {row.step_ms / native.step_ms:.2f}x native fp32's step time "
                f"(target ≤ 1 where the link sets the pace); cores {row.busy * 100:.0f}% busy: {pace}"
            )
    return [*lines, ""]


def _raise_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", nargs="+", type=netns.parse_hosts, default=[(2, 2), (2, 4)], help="HxL shapes")
    parser.add_argument("--rates", nargs="+", default=["1gbit"], help="link rates (tc syntax: 1gbit, 100mbit)")
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=list(METHODS), help="rows")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per row")
    netns.add_rtt_argument(parser)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the times")
    parser.add_argument("--width", type=int, default=256, help="the transformer's width")
    parser.add_argument("--layers", type=int, default=4, help="the transformer's blocks")
    parser.add_argument("--cleanup", action="store_true", help="remove namespaces a killed run left behind, then exit")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup={args.warmup} must be below --steps={args.steps}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cleanup:
        print("removed:", ", ".join(netns.remove_namespaces(netns.leftover_namespaces())) or "nothing")
        return 0
    if os.geteuid() != 0:
        print("bench/fsdp.py needs root (network namespaces and tc); run it with sudo", file=sys.stderr)
        return 2
    topology = netns.build_topology(max(hosts for hosts, _ in args.hosts), 1, args.rtt)
    atexit.register(topology.close)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_on_signal)
    rows: list[Row] = []
    try:
        with tempfile.TemporaryDirectory(prefix="gradq-fsdp-") as work:
            for shape in args.hosts:
                for rate in args.rates:
                    topology.shape(topology.hosts, rate)
                    for key in args.methods:
                        print(f"{shape[0]}x{shape[1]} {rate} {key} ...", file=sys.stderr, flush=True)
                        rows.append(run_row(topology, shape, rate, METHODS[key], args, Path(work)))
    finally:
        topology.close()
    setup = (
        f"examples/fsdp_train.py's transformer (width {args.width}, {args.layers} blocks), AdamW, batch 8 x 48 "
        f"characters per rank, {args.steps} steps ({args.warmup} untimed); {os.cpu_count()} cores shared by every "
        f"rank and the aggregator; each host's link and the aggregator's shaped to the rate in both directions; "
        f"{netns.describe_rtt(args.rtt)}."
    )
    report = render(rows, args, setup)
    print(report)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"fsdp-{datetime.now():%Y%m%d-%H%M%S}.md"
    path.write_text(report + "\n")
    print(f"saved {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
