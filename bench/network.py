"""DDP step time over emulated 1 and 0.1 Gbit/s links: gradq beside allreduce, fp16, bf16, PowerSGD, seed 000.

Run as root from the repository root with the virtualenv's interpreter::

    sudo .venv/bin/python bench/network.py                  # quick preset (5.8M MLP), < 15 minutes
    sudo .venv/bin/python bench/network.py --preset full    # adds the ~25M-parameter MLP
    sudo .venv/bin/python bench/network.py --worlds 4 --rates 1gbit --methods compute-only gradq8-1 --steps 30
    sudo .venv/bin/python bench/network.py --hosts 2x2 --rates 1gbit   # hosts of 2 ranks: flat vs two-level gradq
    sudo .venv/bin/python bench/network.py --worlds 2 4 --rates 1gbit --rtt 50   # 50 ms between any two hosts
    sudo .venv/bin/python bench/network.py --cleanup        # remove namespaces a killed run left behind

Every worker (rank) and every aggregator shard runs in its own network namespace
(``gradq-w<K>``, ``gradq-a<K>``), wired to a bridge in ``gradq-sw`` through a veth
pair shaped with tc's tbf in both directions (see netns.py). Traffic goes only
to 10.77.0.0/24, which exists only inside those namespaces; they are deleted on
exit, on SIGTERM/SIGINT/SIGHUP and by ``--cleanup``.

With ``--hosts HxL`` (instead of ``--worlds``) each of H worker namespaces is a
host of L ranks: they share its one shaped link and talk to each other over its
loopback, unshaped. Its default rows put gradq's flat path
(host_grouping="flat") beside two-level aggregation (host=<namespace>) at the
same grids, with DDP's allreduce, bf16 and PowerSGD rank 4; the report adds the
bytes through each host's link, the aggregator shards' own CPU time and the
two-level targets (network_hosts_report.py).

One *scenario* is a (model, world size, link rates) triple. Its ranks start once
(``ip netns exec gradq-wK python bench/network.py --rank-main ...``), along with
the aggregator shards (``python -m gradq.server``) when gradq rows are selected, and
then measure every method in turn on a fresh DDP model: ``--warmup`` untimed
steps, a barrier, ``--steps`` timed steps (forward + backward + SGD step, one
thread per rank, synthetic batch of 32), a barrier. Each rank reads its device's
tx/rx byte counters around the timed steps: the bytes really on the wire,
protocol headers included. The hook of each row is wrapped to time its buckets,
which shows how much of the communication overlaps backward. A last scenario
limits only the aggregators' links to measure what a second and a fourth shard
add when the aggregator link is the bottleneck. gradq rows use rounds of at most
``--chunk-elements`` (default: the library's ``slow_link_chunk_elements``, 512 KiB of payload per round),
and the hook's default of two pushes per shard in flight. The report (markdown
table, targets, PNG plot of step time vs link speed) goes to
``bench/results/network-<time>.*``.

PyTorch's bf16 and PowerSGD hooks (rank 1 and 4, error feedback and warm start,
compressing from the third step) come from peer_hooks.py; PowerSGD rows run
with a single DDP bucket, since on gloo its chained collectives abort with
several buckets in flight.

The machine's cores are shared by all ranks and the aggregators, so CPU, not the
link, can set the pace at 1 Gbit/s; the compute-only row of each scenario shows
that floor. This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

import netns
import network_hosts_report
import network_report
from network_rank import METHOD_BY_KEY, MODELS, RankSpec, rank_main
from network_report import MethodResult, Row, Scenario

from gradq.client.chunks import SLOW_LINK_CHUNK_BYTES

SHARD_METHODS = ("gradq8-1", "gradq8-2", "gradq8-4")  # the bottleneck scenario's rows
HOST_METHODS = (  # --hosts's default rows: flat gradq beside two-level at each grid
    "compute-only",
    "allreduce",
    "bf16",
    "powersgd-r4",
    "gradq8-2",
    "gradq8-2-twolevel",
    "gradq4ef-2",
    "gradq4ef-2-twolevel",
    "gradq2ef-2",
    "gradq2ef-2-twolevel",
)
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {"models": ["mlp-5.8m"], "warmup": 3, "steps": 8},
    "full": {"models": ["mlp-5.8m", "mlp-25m"], "warmup": 3, "steps": 8},
}
AGGREGATOR_PORT = 50051
GLOO_BASE_PORT = 29500  # plus the scenario's index: no rendezvous port is reused
SCENARIO_TIMEOUT_S = 3600.0
STOP_GRACE_S = 15.0
REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")


# -- processes in namespaces -----------------------------------------------------------------------


def _child_environment(**extra: str) -> dict[str, str]:
    # No proxy variables: gRPC would otherwise try to reach the aggregators through a proxy.
    environment = {name: value for name, value in os.environ.items() if "proxy" not in name.lower()}
    environment.update(dict.fromkeys(THREAD_VARIABLES, "1"), PYTHONUNBUFFERED="1", **extra)
    return environment


class NamespaceProcesses:
    """Processes started in namespaces, logged to files; ``stop_all()`` ends every one still running."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.processes: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, host: netns.Host, argv: Sequence[str], environment: dict[str, str]) -> None:
        """Start ``argv`` in ``host``'s namespace; stdout and stderr go to ``<log_dir>/<name>.log``."""
        with (self.log_dir / f"{name}.log").open("wb") as log:
            # A session of its own: the terminal's Ctrl-C reaches this process only, which stops them in order.
            process = subprocess.Popen(
                host.command(argv), stdout=log, stderr=subprocess.STDOUT, env=environment, start_new_session=True
            )
        self.processes.append((name, process))

    def log_tail(self, name: str, lines: int = 30) -> str:
        """The last ``lines`` lines of a process's log."""
        return "\n".join((self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])

    def failed(self) -> str | None:
        """Name of a process that exited with a non-zero status, if any."""
        return next((name for name, process in self.processes if process.poll() not in (None, 0)), None)

    def stop_all(self) -> None:
        """SIGTERM every process still running, then SIGKILL those that outlive the grace period."""
        for _, process in self.processes:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for _, process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()


def _start_aggregators(
    runner: NamespaceProcesses, topology: netns.Topology, world_size: int
) -> tuple[list[str], list[int]]:
    """Start every shard (``world_size`` 0: each job's first Join decides); returns (addresses, their pids)."""
    addresses = []
    for shard, host in enumerate(topology.aggregators):
        port_file = runner.log_dir / f"aggregator{shard}.port"
        argv = [sys.executable, "-m", "gradq.server", "--host", host.address, "--port", str(AGGREGATOR_PORT)]
        argv += ["--world-size", str(world_size), "--log-level", "WARNING", "--port-file", str(port_file)]
        argv += ["--grace", "1"]  # stopped only after the ranks are done: nothing is in flight
        runner.start(f"aggregator{shard}", host, argv, _child_environment())
        addresses.append(f"{host.address}:{AGGREGATOR_PORT}")
    for shard in range(len(topology.aggregators)):
        _wait_for_file(runner, runner.log_dir / f"aggregator{shard}.port", f"aggregator{shard}", 120.0)
    pids = [pid for host in topology.aggregators for pid in netns.namespace_pids(host.namespace)]
    return addresses, pids


def _wait_for_file(runner: NamespaceProcesses, path: Path, name: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text().strip()):
        failed = runner.failed()
        if failed is not None or time.monotonic() > deadline:
            culprit = failed or name
            raise RuntimeError(f"{culprit} did not start within {timeout_s:.0f} s:\n{runner.log_tail(culprit)}")
        time.sleep(0.1)


def _wait_for_ranks(runner: NamespaceProcesses) -> None:
    deadline = time.monotonic() + SCENARIO_TIMEOUT_S
    ranks = [process for name, process in runner.processes if name.startswith("rank")]
    while any(process.poll() is None for process in ranks):
        failed = runner.failed()
        if failed is not None:
            raise RuntimeError(f"{failed} failed:\n{runner.log_tail(failed)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the ranks did not finish within {SCENARIO_TIMEOUT_S:.0f} s")
        time.sleep(0.2)
    failed = runner.failed()
    if failed is not None:
        raise RuntimeError(f"{failed} failed:\n{runner.log_tail(failed)}")


def run_scenario(topology: netns.Topology, scenario: Scenario, index: int, work_dir: Path) -> list[Row]:
    """Shape the links, start the aggregators (if needed) and the ranks, collect one Row per method.

    Rank r runs in worker namespace r // ranks_per_host: a host's ranks are consecutive, as under torchrun.
    """
    workers = topology.workers[: scenario.hosts]
    topology.shape(topology.workers, scenario.worker_rate)
    topology.shape(topology.aggregators, scenario.aggregator_rate)
    log_dir = work_dir / f"scenario{index}"
    log_dir.mkdir()
    runner = NamespaceProcesses(log_dir)
    try:
        needs_aggregators = any(METHOD_BY_KEY[key].bits is not None for key in scenario.methods)
        # Two-level jobs join with one member per host: the aggregator cannot pin the world size.
        world = scenario.world_size if scenario.ranks_per_host == 1 else 0
        aggregators, pids = _start_aggregators(runner, topology, world) if needs_aggregators else ([], [])
        for rank in range(scenario.world_size):
            host = workers[rank // scenario.ranks_per_host]
            spec = RankSpec(
                rank=rank,
                world_size=scenario.world_size,
                host=rank // scenario.ranks_per_host,
                rendezvous=f"{workers[0].address}:{GLOO_BASE_PORT + index}",
                layers=MODELS[scenario.model],
                methods=scenario.methods,
                aggregators=tuple(aggregators),
                aggregator_pids=tuple(pids),
                warmup=scenario.warmup,
                steps=scenario.steps,
                job_prefix=f"net{index}-{os.getpid()}",
                chunk_elements=scenario.chunk_elements,
                output=str(log_dir / f"rank{rank}.json"),
            )
            argv = [sys.executable, str(Path(__file__).resolve()), "--rank-main", json.dumps(dataclasses.asdict(spec))]
            runner.start(f"rank{rank}", host, argv, _child_environment(GLOO_SOCKET_IFNAME=host.device))
        _wait_for_ranks(runner)
    finally:
        runner.stop_all()
    per_rank = [_read_results(log_dir / f"rank{rank}.json") for rank in range(scenario.world_size)]
    return [
        network_report.make_row(scenario, METHOD_BY_KEY[key], [results[key] for results in per_rank])
        for key in scenario.methods
    ]


def _read_results(path: Path) -> dict[str, MethodResult]:
    return {entry["key"]: MethodResult(**entry) for entry in json.loads(path.read_text())}


# -- the run ---------------------------------------------------------------------------------------


def plan(args: argparse.Namespace) -> list[Scenario]:
    """Every scenario: each (model, world or hosts, rate) on all links, then (without --hosts) the bottleneck one."""
    shapes = args.hosts or [(world, 1) for world in args.worlds]  # (hosts, ranks per host)
    scenarios = [
        Scenario(
            model, hosts * ranks, rate, rate, tuple(args.methods), args.warmup, args.steps, args.chunk_elements, ranks
        )
        for model in args.models
        for hosts, ranks in shapes
        for rate in args.rates
    ]
    if args.hosts:
        return scenarios
    shard_methods = tuple(key for key in SHARD_METHODS if key in args.methods)
    if SHARD_METHODS[0] in shard_methods and len(shard_methods) > 1 and args.bottleneck_rate:
        scenarios += [
            Scenario(
                model,
                max(args.worlds),
                None,
                args.bottleneck_rate,
                shard_methods,
                args.warmup,
                args.steps,
                args.chunk_elements,
            )
            for model in args.models
        ]
    return scenarios


def _raise_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> list[Row]:
    """Build the namespaces, run every scenario, always delete the namespaces."""
    scenarios = plan(args)
    shards = max((METHOD_BY_KEY[key].shards for key in args.methods), default=0)
    topology = netns.build_topology(max(scenario.hosts for scenario in scenarios), shards, args.rtt)
    atexit.register(topology.close)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_on_signal)
    rows: list[Row] = []
    try:
        with tempfile.TemporaryDirectory(prefix="gradq-network-") as work_dir:
            for index, scenario in enumerate(scenarios):
                print(f"[{index + 1}/{len(scenarios)}] {scenario.describe()} ...", file=sys.stderr, flush=True)
                started = time.monotonic()
                rows += run_scenario(topology, scenario, index, Path(work_dir))
                print(f"    done in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    finally:
        topology.close()
    return rows


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; expected an integer >= 1")
    return value


def _rate(text: str) -> str:
    try:
        netns.parse_rate(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text.lower()


def _hosts(text: str) -> tuple[int, int]:
    try:
        return netns.parse_hosts(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _rate_or_none(text: str) -> str | None:
    return None if text.lower() == "none" else _rate(text)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line flags; the preset fills in what is not given."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--preset", choices=list(PRESETS), default="quick", help="models and step counts")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), help="override the preset's models")
    parser.add_argument("--worlds", type=_positive, nargs="+", default=[2, 4], help="world sizes (ranks)")
    parser.add_argument("--rates", type=_rate, nargs="+", default=["1gbit", "100mbit"], help="link rates (tc)")
    parser.add_argument(
        "--hosts",
        type=_hosts,
        nargs="+",
        help="HOSTSxRANKS topologies (e.g. 2x2 2x4), replacing --worlds: each host's ranks share one namespace "
        "and one shaped link; no bottleneck scenario",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=list(METHOD_BY_KEY),
        help="rows (default: every row; with --hosts, flat and two-level gradq beside DDP's allreduce, bf16, PowerSGD)",
    )
    parser.add_argument("--warmup", type=_positive, help="untimed steps per method (default: the preset's)")
    parser.add_argument("--steps", type=_positive, help="timed steps per method (default: the preset's)")
    parser.add_argument(
        "--bottleneck-rate",
        type=_rate_or_none,
        default="100mbit",
        help="aggregator link rate of the shard scenario (worker links unshaped); 'none' skips it; needs the "
        "gradq8-1 row and gradq8-2 or gradq8-4",
    )
    parser.add_argument(
        "--chunk-elements",
        type=_positive,
        help="gradq's largest round (GradqHookState.chunk_elements) for every gradq row; default: the library's "
        "choice for slow links, slow_link_chunk_elements (512 KiB of payload: 2^19 elements at 8 bits, 2^21 at "
        "2); pass 2097152 for its default, which suits fast links and loopback",
    )
    netns.add_rtt_argument(parser)
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for the report files")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    parser.add_argument("--cleanup", action="store_true", help="delete namespaces left by a killed run, then exit")
    parser.add_argument("--rank-main", metavar="SPEC_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    if args.methods is None:
        args.methods = list(HOST_METHODS if args.hosts else METHOD_BY_KEY)
    for name in ("models", "warmup", "steps"):
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or one rank of it, or the cleanup); print and save the report.

    Args:
        argv: command-line arguments; None reads ``sys.argv``.

    Returns:
        0 once the report is written (a missed target is reported, not an error); 1 when the run
        failed; 2 when not root.
    """
    args = parse_args(argv)
    if args.rank_main:
        fields = json.loads(args.rank_main)
        rank_main(RankSpec(**{**fields, "layers": tuple(fields["layers"])}))
        return 0
    if os.geteuid() != 0:
        print("bench/network.py needs root (network namespaces and tc): sudo .venv/bin/python ...", file=sys.stderr)
        return 2
    if args.cleanup:
        removed = netns.remove_namespaces(netns.leftover_namespaces())
        print(f"removed: {', '.join(removed) or 'nothing'}")
        return 0
    load_before = os.getloadavg()[0]
    try:
        rows = run(args)
    except RuntimeError as error:  # a command, an aggregator or a rank failed; the namespaces are gone
        print(f"bench/network.py: {error}", file=sys.stderr)
        return 1
    report = network_report.render(rows, _setup(args, load_before), network_hosts_report.host_sections(rows))
    print(report)
    for path in _save(report, rows, args):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _setup(args: argparse.Namespace, load_before: float) -> str:
    rounds = (
        f"{args.chunk_elements:,} elements"
        if args.chunk_elements
        else f"{SLOW_LINK_CHUNK_BYTES // 1024} KiB of payload (slow_link_chunk_elements: 2^19 elements at 8 bits, "
        "2^20 at 4, 2^21 at 2, 2^22 at 1)"
    )
    git = subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True, check=False
    )
    return (
        f"Preset {args.preset}; {args.warmup} warm-up + {args.steps} timed steps per row; median of rank 0; batch 32, "
        f"SGD, gloo, 1 thread per rank; gradq rounds of at most {rounds}; "
        f"{os.cpu_count()} CPU cores shared by all ranks and the aggregator shards; "
        f"{_namespaces(args)}, links shaped with tc tbf in both directions; {netns.describe_rtt(args.rtt)}. "
        f"1-minute load average {load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after it "
        f"(other work on the machine skews the times). gradq at {git.stdout.strip() or 'unknown revision'}."
    )


def _namespaces(args: argparse.Namespace) -> str:
    if not args.hosts:
        return "every worker and shard in its own network namespace"
    shapes = ", ".join(f"{hosts} hosts x {ranks} ranks" for hosts, ranks in args.hosts)
    return f"{shapes}: the ranks of a host share its network namespace, every shard in its own"


def _save(report: str, rows: Sequence[Row], args: argparse.Namespace) -> Iterator[Path]:
    args.results.mkdir(parents=True, exist_ok=True)
    stem = args.results / f"network-{datetime.now():%Y%m%d-%H%M%S}"
    markdown = stem.with_suffix(".md")
    markdown.write_text(report + "\n")
    yield markdown
    raw = stem.with_suffix(".json")
    raw.write_text(json.dumps([row.to_json() for row in rows], indent=1))
    yield raw
    if not args.no_plot:
        plot = network_report.plot(rows, stem.with_suffix(".png"))
        if plot is not None:
            yield plot


if __name__ == "__main__":
    sys.exit(main())
