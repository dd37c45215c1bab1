"""DDP step time over emulated 1 Gbit/s and 100 Mbit/s links: gradq beside gloo allreduce, fp16 and seed 000's hook.

Run as root from the repository root with the virtualenv's interpreter::

    sudo .venv/bin/python bench/network.py                  # quick preset (5.8M MLP), < 15 minutes
    sudo .venv/bin/python bench/network.py --preset full    # adds the ~25M-parameter MLP
    sudo .venv/bin/python bench/network.py --worlds 4 --rates 1gbit --methods compute-only gradq8-1 --steps 30
    sudo .venv/bin/python bench/network.py --cleanup        # remove namespaces a killed run left behind

Every worker (rank) and every aggregator shard runs in its own network namespace
(``gradq-w<K>``, ``gradq-a<K>``), wired to a bridge in ``gradq-sw`` through a veth
pair shaped with tc's tbf in both directions (see netns.py). Traffic goes only
to 10.77.0.0/24, which exists only inside those namespaces; they are deleted on
exit, on SIGTERM/SIGINT/SIGHUP and by ``--cleanup``.

One *scenario* is a (model, world size, link rates) triple. Its ranks start once
(``ip netns exec gradq-wK python bench/network.py --rank-main ...``), along with
two aggregators (``python -m gradq.server``) when gradq rows are selected, and
then measure every method in turn on a fresh DDP model: ``--warmup`` untimed
steps, a barrier, ``--steps`` timed steps (forward + backward + SGD step, one
thread per rank, synthetic batch of 32), a barrier. Each rank reads its device's
tx/rx byte counters around the timed steps: the bytes really on the wire,
protocol headers included. The hook of each row is wrapped to time its buckets,
which shows how much of the communication overlaps backward. A last scenario
limits only the aggregators' links to measure what a second shard adds when the
aggregator link is the bottleneck. The report (markdown table, targets, PNG plot
of step time vs link speed) goes to ``bench/results/network-<time>.*``.

The machine's cores are shared by all ranks and the aggregators, so CPU, not the
link, can set the pace at 1 Gbit/s; the compute-only row of each scenario shows
that floor. This is a benchmark, not a test.
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations at
# registration and needs real types, not strings.
import argparse
import atexit
import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import netns
import network_report
import torch
import torch.distributed as dist
from network_report import Method, MethodResult, Row, Scenario
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel

from gradq.client.ddp_hook import GradqHookState, gradq_hook
from gradq.qcore import QuantConfig

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]

MODELS = {
    "mlp-5.8m": (784, 2048, 2048, 10),  # 5,824,522 parameters
    "mlp-25m": (784, 2176, 2176, 2176, 2176, 2176, 2176, 10),  # 25,415,690 parameters
}
METHODS = (
    Method("compute-only", "compute only (no-communication hook)"),
    Method("allreduce", "gloo allreduce fp32"),
    Method("fp16", "fp16 compress hook"),
    Method("seed-pertensor", "seed allgather per-tensor 8-bit"),
    Method("gradq8-1", "gradq 8-bit, 1 shard", bits=8, shards=1),
    Method("gradq8-2", "gradq 8-bit, 2 shards", bits=8, shards=2),
    Method("gradq4-1", "gradq 4-bit, 1 shard", bits=4, shards=1),
    Method("gradq4-2", "gradq 4-bit, 2 shards", bits=4, shards=2),
    Method("gradq2ef-1", "gradq 2-bit + EF, 1 shard", bits=2, error_feedback=True, shards=1),
    Method("gradq2ef-2", "gradq 2-bit + EF, 2 shards", bits=2, error_feedback=True, shards=2),
)
METHOD_BY_KEY = {method.key: method for method in METHODS}
SHARD_METHODS = ("gradq8-1", "gradq8-2")  # the bottleneck scenario's rows
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {"models": ["mlp-5.8m"], "warmup": 3, "steps": 8},
    "full": {"models": ["mlp-5.8m", "mlp-25m"], "warmup": 3, "steps": 8},
}
BATCH_SIZE = 32
CLASSES = 10
DISTINCT_BATCHES = 4  # synthetic, fixed per rank, cycled through
LEARNING_RATE = 0.01
SEED = 0
AGGREGATOR_PORT = 50051
GLOO_BASE_PORT = 29500  # plus the scenario's index: no rendezvous port is reused
SCENARIO_TIMEOUT_S = 3600.0
STOP_GRACE_S = 15.0
REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")


# -- seed 000's per-tensor hook, ported from tensorplay to torch ------------------------------------
#
# As the seed wrote it: its min/max observer with .item(), uint8 affine levels,
# two all_gathers, the second issued and waited on inside the first one's
# callback. One change: gloo's all_gather future holds the output list itself
# (NCCL's holds [output list]), so the seed's ``fut.wait()[0]`` reads ``fut.wait()``.

SEED_QMIN, SEED_QMAX = 0, 255


class _SeedMinMaxObserver:
    def __init__(self) -> None:
        self.min_val = 0.0
        self.max_val = 0.0

    def __call__(self, tensor: torch.Tensor) -> "_SeedMinMaxObserver":
        self.min_val = tensor.min().item()
        self.max_val = tensor.max().item()
        return self

    def calculate_qparams(self) -> tuple[float, int]:
        if self.max_val == self.min_val:
            return 1.0, SEED_QMIN
        scale = (self.max_val - self.min_val) / float(SEED_QMAX - SEED_QMIN)
        zero_point = round(SEED_QMIN - self.min_val / scale)  # the seed wraps it in int(): already one
        return scale, max(SEED_QMIN, min(SEED_QMAX, zero_point))


def _seed_quantize_per_tensor(x: torch.Tensor, scale: float, zero_point: float) -> torch.Tensor:
    y = torch.round(x / scale) + zero_point
    return torch.clamp(y, SEED_QMIN, SEED_QMAX).to(torch.uint8)


def _seed_dequantize_per_tensor(y: torch.Tensor, scale: float, zero_point: float) -> torch.Tensor:
    return scale * (y.to(torch.float32) - zero_point)


def _seed_allgather_out_list(tensor: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    return [torch.zeros_like(tensor) for _ in range(world_size)]


def seed_pertensor_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Seed 000's ``quantization_pertensor_hook``: uint8 per-tensor affine over two all_gathers.

    Args:
        process_group: group to average over (None: the default group).
        bucket: DDP's gradient bucket.

    Returns:
        Future of the mean bucket.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    tensor = bucket.buffer()
    scale, zero_point = _SeedMinMaxObserver()(tensor).calculate_qparams()
    s_and_z = torch.tensor([scale, zero_point], dtype=torch.float32)
    all_ranks_s_and_z = _seed_allgather_out_list(s_and_z, world_size)
    fut = dist.all_gather(all_ranks_s_and_z, s_and_z, group=group, async_op=True).get_future()

    def quantize_and_allgather(fut: torch.futures.Future[list[torch.Tensor]]) -> list[torch.Tensor]:
        gathered = fut.wait()
        quantized = _seed_quantize_per_tensor(tensor, gathered[rank][0].item(), gathered[rank][1].item())
        out = _seed_allgather_out_list(quantized, world_size)
        return dist.all_gather(out, quantized, group=group, async_op=True).get_future().wait()

    def dequantize_and_aggregate(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        all_ranks_quantized = fut.wait()
        aggregated = torch.zeros(all_ranks_quantized[0].shape, device=tensor.device, dtype=torch.float32)
        for r, quantized in enumerate(all_ranks_quantized):
            aggregated += _seed_dequantize_per_tensor(
                quantized, all_ranks_s_and_z[r][0].item(), all_ranks_s_and_z[r][1].item()
            )
        return aggregated / world_size

    return fut.then(quantize_and_allgather).then(dequantize_and_aggregate)


class SerialBucketsState:
    """State of ``serial_buckets_hook``: the allgather hook it runs and the previous bucket's future."""

    __slots__ = (
        "hook",  # the hook run on each bucket, with process group None (the default group)
        "in_flight",  # this step's previous bucket; None before the first bucket of a step
    )

    def __init__(self, hook: Hook) -> None:
        self.hook = hook
        self.in_flight: torch.futures.Future[torch.Tensor] | None = None


def serial_buckets_hook(state: SerialBucketsState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Run ``state.hook`` on ``bucket`` after the previous bucket's future is done.

    The seed's hook issues its second all_gather from gloo's completion callback;
    with two buckets in flight the ranks can issue collectives in different orders
    (gloo aborts on a size mismatch) or block gloo's worker threads. One bucket at
    a time keeps every rank's order the same, at the price of overlap.
    """
    if state.in_flight is not None:
        state.in_flight.wait()
    future = state.hook(None, bucket)
    state.in_flight = None if bucket.is_last() else future
    return future


def no_communication_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Hand DDP its own bucket back at once: the step's compute alone."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


# -- timing the buckets of one step ----------------------------------------------------------------


class TimedHookState:
    """State of ``timed_hook``: the hook it wraps and when this step's buckets reached it."""

    __slots__ = (
        "bucket_numels",  # bucket index -> elements (DDP's layout as of the latest step)
        "first_entry",  # perf_counter() at this step's first bucket; None before it
        "hook",  # the measured hook
        "inner",  # the measured hook's state
        "last_entry",  # perf_counter() at this step's last bucket: backward's compute is done
    )

    def __init__(self, hook: Hook, inner: Any) -> None:
        self.hook = hook
        self.inner = inner
        self.bucket_numels: dict[int, int] = {}
        self.first_entry: float | None = None
        self.last_entry: float | None = None

    def reset(self) -> None:
        """Forget the previous step's times."""
        self.first_entry = self.last_entry = None


def timed_hook(state: TimedHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Record when ``bucket`` became ready, then run the wrapped hook on it."""
    now = time.perf_counter()
    if state.first_entry is None:
        state.first_entry = now
    if bucket.is_last():
        state.last_entry = now
    state.bucket_numels[bucket.index()] = bucket.buffer().numel()
    return state.hook(state.inner, bucket)


# -- one rank --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What every rank of one scenario runs; travels as JSON on the command line."""

    rank: int
    world_size: int
    rendezvous: str  # host:port of rank 0's TCPStore
    layers: tuple[int, ...]
    methods: tuple[str, ...]
    aggregators: tuple[str, ...]  # host:port of each shard
    warmup: int
    steps: int
    job_prefix: str  # gradq job ids are <prefix>-<method>
    output: str  # where this rank writes its MethodResult list


def build_model(layers: Sequence[int]) -> nn.Module:
    """An MLP with ReLU between the ``layers`` widths; same weights on every rank."""
    torch.manual_seed(SEED)
    modules: list[nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(layers):
        modules += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*modules[:-1])


def _batches(rank: int, inputs: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(SEED + rank)
    return [
        (
            torch.randn(BATCH_SIZE, inputs, generator=generator),
            torch.randint(0, CLASSES, (BATCH_SIZE,), generator=generator),
        )
        for _ in range(DISTINCT_BATCHES)
    ]


def _hook_for(method: Method, spec: RankSpec) -> tuple[Hook, Any, GradqHookState | None]:
    """(hook, its state, the gradq state to close afterwards) for a hooked method."""
    if method.bits is not None:
        config = QuantConfig(bits=method.bits)
        addresses = list(spec.aggregators[: method.shards])
        state = GradqHookState(
            addresses,
            config,
            error_feedback=method.error_feedback,
            job_id=f"{spec.job_prefix}-{method.key}",
            connect_timeout_s=60.0,
        )
        return gradq_hook, state, state
    if method.key == "seed-pertensor":
        return serial_buckets_hook, SerialBucketsState(seed_pertensor_hook), None
    if method.key == "fp16":
        return fp16_compress_hook, None, None  # process group None: the default group
    if method.key == "compute-only":
        return no_communication_hook, None, None
    raise ValueError(f"method={method.key!r} has no hook; expected one of {', '.join(METHOD_BY_KEY)}")


def _train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[float, float]:
    """One step; returns (start, end of backward) in perf_counter() seconds."""
    inputs, labels = batch
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(inputs), labels).backward()
    backward_done = time.perf_counter()
    optimizer.step()
    return started, backward_done


def measure_method(
    spec: RankSpec, method: Method, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> MethodResult:
    """Warm up, then time ``spec.steps`` steps of ``method`` and count this rank's wire bytes.

    Returns:
        This rank's step times, bucket timings, wire bytes per step and bucket sizes.
    """
    model = DistributedDataParallel(build_model(spec.layers))
    timer: TimedHookState | None = None
    gradq_state: GradqHookState | None = None
    if method.key != "allreduce":  # plain DDP: its built-in allreduce, no hook
        hook, inner, gradq_state = _hook_for(method, spec)
        timer = TimedHookState(hook, inner)
        model.register_comm_hook(timer, timed_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    try:
        for step in range(spec.warmup):
            _train_step(model, optimizer, batches[step % len(batches)])
        dist.barrier()
        tx_before, rx_before = netns.read_counters(netns.HOST_DEVICE)
        step_s, window_s, tail_s = [], [], []
        for step in range(spec.steps):
            if timer is not None:
                timer.reset()
            started, backward_done = _train_step(model, optimizer, batches[step % len(batches)])
            step_s.append(time.perf_counter() - started)
            if timer is not None and timer.first_entry is not None and timer.last_entry is not None:
                window_s.append(backward_done - timer.first_entry)
                tail_s.append(backward_done - timer.last_entry)
        dist.barrier()  # every peer has received what this rank sent: the counters are complete
        tx_after, rx_after = netns.read_counters(netns.HOST_DEVICE)
    finally:
        if gradq_state is not None:
            gradq_state.close()
    return MethodResult(
        key=method.key,
        step_s=step_s,
        window_s=window_s,
        tail_s=tail_s,
        tx_per_step=(tx_after - tx_before) / spec.steps,
        rx_per_step=(rx_after - rx_before) / spec.steps,
        bucket_numels=[timer.bucket_numels[index] for index in sorted(timer.bucket_numels)] if timer else [],
        numel=sum(parameter.numel() for parameter in model.parameters()),
    )


def rank_main(spec: RankSpec) -> None:
    """Join the gloo group over this namespace's link, measure every method, write the results."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{spec.rendezvous}",
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(minutes=15),
    )
    try:
        batches = _batches(spec.rank, spec.layers[0])
        results = [measure_method(spec, METHOD_BY_KEY[key], batches) for key in spec.methods]
        Path(spec.output).write_text(json.dumps([dataclasses.asdict(result) for result in results]))
    finally:
        dist.destroy_process_group()


# -- processes in namespaces -----------------------------------------------------------------------


def _child_environment(**extra: str) -> dict[str, str]:
    # No proxy variables: gRPC would otherwise try to reach the aggregators through a proxy.
    environment = {name: value for name, value in os.environ.items() if "proxy" not in name.lower()}
    environment.update(dict.fromkeys(THREAD_VARIABLES, "1"), PYTHONUNBUFFERED="1", **extra)
    return environment


class ProcessGroupRunner:
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


def _start_aggregators(runner: ProcessGroupRunner, topology: netns.Topology, world_size: int) -> list[str]:
    addresses = []
    for shard, host in enumerate(topology.aggregators):
        port_file = runner.log_dir / f"aggregator{shard}.port"
        argv = [sys.executable, "-m", "gradq.server", "--host", host.address, "--port", str(AGGREGATOR_PORT)]
        argv += ["--world-size", str(world_size), "--log-level", "WARNING", "--port-file", str(port_file)]
        runner.start(f"aggregator{shard}", host, argv, _child_environment())
        addresses.append(f"{host.address}:{AGGREGATOR_PORT}")
    for shard in range(len(topology.aggregators)):
        _wait_for_file(runner, runner.log_dir / f"aggregator{shard}.port", f"aggregator{shard}", 120.0)
    return addresses


def _wait_for_file(runner: ProcessGroupRunner, path: Path, name: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text().strip()):
        failed = runner.failed()
        if failed is not None or time.monotonic() > deadline:
            culprit = failed or name
            raise RuntimeError(f"{culprit} did not start within {timeout_s:.0f} s:\n{runner.log_tail(culprit)}")
        time.sleep(0.1)


def _wait_for_ranks(runner: ProcessGroupRunner, ranks: int) -> None:
    deadline = time.monotonic() + SCENARIO_TIMEOUT_S
    rank_processes = [process for name, process in runner.processes if name.startswith("rank")][:ranks]
    while any(process.poll() is None for process in rank_processes):
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
    """Shape the links, start the aggregators (if needed) and the ranks, collect one Row per method."""
    workers = topology.workers[: scenario.world_size]
    topology.shape(topology.workers, scenario.worker_rate)
    topology.shape(topology.aggregators, scenario.aggregator_rate)
    log_dir = work_dir / f"scenario{index}"
    log_dir.mkdir()
    runner = ProcessGroupRunner(log_dir)
    try:
        needs_aggregators = any(METHOD_BY_KEY[key].bits is not None for key in scenario.methods)
        aggregators = _start_aggregators(runner, topology, scenario.world_size) if needs_aggregators else []
        for rank, host in enumerate(workers):
            spec = RankSpec(
                rank=rank,
                world_size=scenario.world_size,
                rendezvous=f"{workers[0].address}:{GLOO_BASE_PORT + index}",
                layers=MODELS[scenario.model],
                methods=scenario.methods,
                aggregators=tuple(aggregators),
                warmup=scenario.warmup,
                steps=scenario.steps,
                job_prefix=f"net{index}-{os.getpid()}",
                output=str(log_dir / f"rank{rank}.json"),
            )
            argv = [sys.executable, str(Path(__file__).resolve()), "--rank-main", json.dumps(dataclasses.asdict(spec))]
            runner.start(f"rank{rank}", host, argv, _child_environment(GLOO_SOCKET_IFNAME=host.device))
        _wait_for_ranks(runner, len(workers))
    finally:
        runner.stop_all()
    per_rank = [_read_results(log_dir / f"rank{rank}.json") for rank in range(len(workers))]
    return [
        network_report.make_row(scenario, METHOD_BY_KEY[key], [results[key] for results in per_rank])
        for key in scenario.methods
    ]


def _read_results(path: Path) -> dict[str, MethodResult]:
    return {entry["key"]: MethodResult(**entry) for entry in json.loads(path.read_text())}


# -- the run ---------------------------------------------------------------------------------------


def plan(args: argparse.Namespace) -> list[Scenario]:
    """Every scenario of the run: each (model, world, rate) on all links, then the aggregator-bottleneck one."""
    scenarios = [
        Scenario(model, world, rate, rate, tuple(args.methods), args.warmup, args.steps)
        for model in args.models
        for world in args.worlds
        for rate in args.rates
    ]
    shard_methods = tuple(key for key in SHARD_METHODS if key in args.methods)
    if len(shard_methods) == len(SHARD_METHODS) and args.bottleneck_rate:
        scenarios += [
            Scenario(model, max(args.worlds), None, args.bottleneck_rate, shard_methods, args.warmup, args.steps)
            for model in args.models
        ]
    return scenarios


def _raise_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> list[Row]:
    """Build the namespaces, run every scenario, always delete the namespaces."""
    scenarios = plan(args)
    shards = max((METHOD_BY_KEY[key].shards for key in args.methods), default=0)
    topology = netns.build_topology(max(args.worlds), shards)
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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line flags; the preset fills in what is not given."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--preset", choices=list(PRESETS), default="quick", help="models and step counts")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), help="override the preset's models")
    parser.add_argument("--worlds", type=_positive, nargs="+", default=[2, 4], help="world sizes (ranks)")
    parser.add_argument("--rates", type=_rate, nargs="+", default=["1gbit", "100mbit"], help="link rates (tc)")
    parser.add_argument("--methods", nargs="+", choices=list(METHOD_BY_KEY), default=list(METHOD_BY_KEY))
    parser.add_argument("--warmup", type=_positive, help="untimed steps per method (default: the preset's)")
    parser.add_argument("--steps", type=_positive, help="timed steps per method (default: the preset's)")
    parser.add_argument(
        "--bottleneck-rate",
        type=_rate,
        default="100mbit",
        help="aggregator link rate of the shard scenario (worker links unlimited); needs both gradq8 rows",
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for the report files")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    parser.add_argument("--cleanup", action="store_true", help="delete namespaces left by a killed run, then exit")
    parser.add_argument("--rank-main", metavar="SPEC_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    for name in ("models", "warmup", "steps"):
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or one rank of it, or the cleanup); print and save the report.

    Args:
        argv: command-line arguments; None reads ``sys.argv``.

    Returns:
        0 once the report is written (a missed target is reported, not an error); 2 when not root.
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
    rows = run(args)
    report = network_report.render(rows, args, os.cpu_count() or 0)
    print(report)
    for path in _save(report, rows, args):
        print(f"wrote {path}", file=sys.stderr)
    return 0


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
