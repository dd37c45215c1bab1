"""DDP step time and wire bytes of gradq beside gloo allreduce, PyTorch's fp16/bf16/PowerSGD hooks and seed 000's.

Run from the repository root with the virtualenv's interpreter::

    python bench/ddp_step.py                     # world 2 and 4, every method; report only, exits 0
    python bench/ddp_step.py --check             # exits 1 when a target is missed
    python bench/ddp_step.py --worlds 2 --methods allreduce gradq-8bit --steps 50

One DDP job per world size on gloo over loopback: W spawned ranks (one thread
each) train a 784-2048-2048-10 MLP (5,824,522 parameters) on synthetic data
(fixed seed, batch 32, 10 classes) with plain SGD. Every method (row) has its
own DDP model in those ranks, and the methods take turns step by step, so load
from anything else on the machine falls on every row alike instead of on
whichever row ran at the time. After ``--warmup`` untimed steps (which also
cover DDP's bucket rebuild, gradq's join and numba's first call), rank 0 times
``--steps`` steps per method (forward + backward + optimizer.step, wall clock)
and the row shows their median. Seed 000's per-channel hook loops over
512-element channels in Python (slow: figures in bench/results/ddp-step.md), so it takes
``--slow-steps`` timed steps after one warm-up step, spread over the run.

The gradq rows push to a real aggregator (``python -m gradq.server``, one per
world size, a distinct job per row). The seed rows run a faithful torch port of
seed 000's two hooks, kept in seed_hooks.py (shared with bench/network.py) as
the baseline. PyTorch's own quantization hooks are not measured: on CPU/gloo
they crash (IndexError: they index gloo's all_gather result as if it were
NCCL's). All three allgather rows (the seed's two and gradq's vectorised one)
start a bucket's all_gathers only once the previous bucket's are done
(``ordered_buckets_hook``): they issue their second all_gather from inside a
gloo callback, and with DDP's two buckets in flight that aborts or deadlocks.

On a small machine the ranks share the cores with each other and with the
aggregator: world 4 on 2 cores runs 4 ranks plus the aggregator on 2 cores, so
its times include waiting for a core; compare rows within one world size. The
run prints the load average before and after: other work on the machine skews
the ratios (figures, and how long a default run takes: bench/results/ddp-step.md).
This is a benchmark, not a test.
"""

import os

# One thread per process, here and (through the inherited environment) in the ranks and the aggregator.
for _variable in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_variable] = "1"

# No `from __future__ import annotations`: DDP checks a hook's annotations at
# registration and needs real types, not strings.
import argparse  # noqa: E402
import contextlib  # noqa: E402
import itertools  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from cpu_busy import CORES, CpuTimes, read_cpu_times  # noqa: E402
from peer_hooks import PEER_HOOKS, PEER_SINGLE_BUCKET_MB, PeerHook  # noqa: E402
from seed_hooks import (  # noqa: E402
    SEED_CHANNEL_SIZE,
    Hook,
    OrderedBucketsState,
    no_communication_hook,
    ordered_buckets_hook,
    seed_perchannel_hook,
    seed_pertensor_hook,
)
from torch import nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from gradq.client.apps.demo import free_port, local_aggregator  # noqa: E402
from gradq.client.ddp import GradqHookState, gradq_hook  # noqa: E402
from gradq.client.ddp.allgather_hooks import allgather_perchannel_hook  # noqa: E402
from gradq.qcore import METADATA_BYTES, QuantConfig, Scheme, wire_size  # noqa: E402

LAYERS = (784, 2048, 2048, 10)
BATCH_SIZE = 32
CLASSES = 10
DISTINCT_BATCHES = 8  # cycled through; synthetic, fixed per rank
LEARNING_RATE = 0.01
SEED = 0
POWERSGD_START_STEP = 2  # its first two steps are plain allreduce (the least PyTorch allows with error feedback)
FP32_BYTES = 4
FP16_BYTES = 2
SLOW_WARMUP_STEPS = 1  # seed per-channel: enough for DDP's bucket rebuild, it has nothing to compile
PROGRESS_EVERY = 5  # iterations between rank 0's progress lines
# Time targets hold at this world size; wire targets at every one.
TARGET_WORLD = 2
TARGET_VS_ALLREDUCE = 1.2
TARGET_VS_SEED_PERTENSOR = 0.5
TARGET_WIRE_RATIO = {8: 0.26, 4: 0.14}
# "Not growing with world size": per-worker bytes may differ by rounding only.
WIRE_GROWTH_TOLERANCE = 1.001


# -- what each allgather row puts on the wire ----------------------------------------------------


def _seed_pertensor_gather_bytes(numel: int) -> int:
    return numel + 2 * FP32_BYTES  # uint8 levels + float32 (scale, zero_point)


def _seed_perchannel_gather_bytes(numel: int) -> int:
    channels = (numel + SEED_CHANNEL_SIZE - numel % SEED_CHANNEL_SIZE) // SEED_CHANNEL_SIZE
    return channels * SEED_CHANNEL_SIZE + 2 * FP32_BYTES * channels  # padded uint8 levels + float32 (2, C)


def _gradq_allgather_gather_bytes(numel: int) -> int:
    # The hook gathers the payload and the qparams, not the wire message's fixed fields.
    return wire_size(numel, QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=8)) - METADATA_BYTES


def ring_allreduce_bytes(numel: int, world_size: int, element_bytes: int) -> float:
    """Bytes one worker sends in a ring allreduce: reduce-scatter then allgather, (W-1)/W each."""
    return 2 * (world_size - 1) / world_size * element_bytes * numel


@dataclass(frozen=True, slots=True)
class Method:
    """One row kind of the report: how its ranks communicate and how its wire bytes are counted."""

    key: str  # name on the command line
    label: str  # name in the table
    hook: Hook | None = None  # DDP comm hook (state None); None: DDP's own allreduce or gradq
    gather_bytes: Callable[[int], int] | None = None  # allgather rows: one rank's contribution per bucket
    ring_element_bytes: int | None = None  # allreduce rows: bytes per element on the ring
    bits: int | None = None  # gradq rows: push bits (they need the aggregator)
    peer: PeerHook | None = None  # PyTorch's bf16 / PowerSGD hooks (fresh state per model)
    slow: bool = False  # timed for --slow-steps after SLOW_WARMUP_STEPS


METHODS = (
    Method("no-comm", "no communication", hook=no_communication_hook),
    Method("allreduce", "gloo allreduce fp32", ring_element_bytes=FP32_BYTES),
    Method("fp16", "fp16 compress hook", hook=fp16_compress_hook, ring_element_bytes=FP16_BYTES),
    Method(
        "seed-pertensor",
        "seed allgather per-tensor [c]",
        hook=seed_pertensor_hook,
        gather_bytes=_seed_pertensor_gather_bytes,
    ),
    Method(
        "seed-perchannel",
        "seed allgather per-channel [c][d]",
        hook=seed_perchannel_hook,
        gather_bytes=_seed_perchannel_gather_bytes,
        slow=True,
    ),
    Method(
        "gradq-allgather",
        "gradq allgather per-channel [c]",
        hook=allgather_perchannel_hook,
        gather_bytes=_gradq_allgather_gather_bytes,
    ),
    Method("bf16", PEER_HOOKS["bf16"].label, peer=PEER_HOOKS["bf16"], ring_element_bytes=FP16_BYTES),
    Method(
        "powersgd-r1",
        PEER_HOOKS["powersgd-r1"].label + " [f]",
        peer=PEER_HOOKS["powersgd-r1"],
        ring_element_bytes=FP32_BYTES,
    ),
    Method(
        "powersgd-r4",
        PEER_HOOKS["powersgd-r4"].label + " [f]",
        peer=PEER_HOOKS["powersgd-r4"],
        ring_element_bytes=FP32_BYTES,
    ),
    Method("gradq-8bit", "gradq 8-bit", bits=8),
    Method("gradq-4bit", "gradq 4-bit", bits=4),
)
METHOD_BY_KEY = {method.key: method for method in METHODS}


# -- one job --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What every rank of one world size's job runs."""

    world_size: int
    init_method: str  # tcp://127.0.0.1:PORT
    methods: tuple[Method, ...]  # each gets its own DDP model, interleaved step by step
    warmup: int  # untimed steps first
    steps: int  # timed steps
    slow_steps: int  # timed steps of the slow methods
    address: str | None  # the aggregator, for gradq rows
    job_prefix: str  # + method key = that method's gradq job


@dataclass(frozen=True, slots=True)
class RankResult:
    """What rank 0 measured for one method."""

    step_seconds: tuple[float, ...]  # timed steps, in order
    numel: int  # model parameters
    sent_per_step: float  # wire bytes this worker sends per step
    received_per_step: float | None  # gradq: bytes pulled per step (the encoded means)
    cpu: CpuTimes  # the machine's CPU times summed over the timed steps


def _model() -> nn.Module:
    layers: list[nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(LAYERS):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])  # no ReLU on the logits


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(SEED + rank)
    return [
        (
            torch.randn(BATCH_SIZE, LAYERS[0], generator=generator),
            torch.randint(0, CLASSES, (BATCH_SIZE,), generator=generator),
        )
        for _ in range(DISTINCT_BATCHES)
    ]


def _gradq_counters(state: GradqHookState) -> tuple[int, int]:
    client = state.client
    assert client is not None, "the gradq hook has not connected (run at least one warm-up step)"
    return client.bytes_sent, client.bytes_received


class MethodRun:
    """One method inside a rank: its DDP model and hook, its schedule, what it measured."""

    __slots__ = (
        "counters",  # gradq (bytes_sent, bytes_received) when timing began
        "cpu",  # the machine's CPU times over the timed steps so far
        "method",  # the row
        "model",  # its own DDP model, same initial weights as every other method's
        "optimizer",  # plain SGD over ``model``
        "state",  # the hook's state: gradq's, the ordered-buckets wrapper's, or None
        "step_seconds",  # timed steps so far
        "steps",  # timed steps
        "stride",  # steps on every stride-th iteration, so slow rows sample the whole run
        "warmup",  # untimed steps first
    )

    def __init__(self, method: Method, spec: JobSpec) -> None:
        self.method = method
        torch.manual_seed(SEED)
        single_bucket = method.peer is not None and method.peer.single_bucket
        self.model = DistributedDataParallel(_model(), bucket_cap_mb=PEER_SINGLE_BUCKET_MB if single_bucket else None)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LEARNING_RATE)
        self.state = self._attach(spec)
        self.warmup = SLOW_WARMUP_STEPS if method.slow else spec.warmup
        self.steps = spec.slow_steps if method.slow else spec.steps
        self.stride = max(1, (spec.warmup + spec.steps) // (self.warmup + self.steps))
        self.step_seconds: list[float] = []
        self.counters = (0, 0)
        self.cpu = CpuTimes()

    def _attach(self, spec: JobSpec) -> GradqHookState | OrderedBucketsState | None:
        method = self.method
        if method.bits is not None:
            assert spec.address is not None, f"{method.key} needs an aggregator address"
            job_id = f"{spec.job_prefix}-{method.key}"
            gradq = GradqHookState(spec.address, QuantConfig(bits=method.bits), job_id=job_id)
            self.model.register_comm_hook(gradq, gradq_hook)
            return gradq
        if method.peer is not None:
            # PowerSGD compresses from its second step on, inside the untimed warm-up.
            self.model.register_comm_hook(method.peer.make_state(POWERSGD_START_STEP), method.peer.hook)
            return None
        if method.hook is not None and method.gather_bytes is not None:
            ordered = OrderedBucketsState(method.hook)
            self.model.register_comm_hook(ordered, ordered_buckets_hook)
            return ordered
        if method.hook is not None:
            self.model.register_comm_hook(None, method.hook)
        return None

    @property
    def iterations(self) -> int:
        """Iterations of the job loop this method needs."""
        return self.stride * (self.warmup + self.steps)

    def maybe_step(self, iteration: int, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Run (and, past the warm-up, time) one step if ``iteration`` is one of this method's."""
        index, offset = divmod(iteration, self.stride)
        if offset or index >= self.warmup + self.steps:
            return
        if index == self.warmup and isinstance(self.state, GradqHookState):
            self.counters = _gradq_counters(self.state)
        self.optimizer.zero_grad(set_to_none=True)
        cpu_before = read_cpu_times()
        started = time.perf_counter()
        nn.functional.cross_entropy(self.model(batch[0]), batch[1]).backward()
        self.optimizer.step()
        if index >= self.warmup:
            self.step_seconds.append(time.perf_counter() - started)
            self.cpu += read_cpu_times() - cpu_before

    def result(self, world_size: int) -> RankResult:
        """The measurements, with the wire bytes one worker sends (and, for gradq, pulls) per step."""
        method, state = self.method, self.state
        numel = sum(parameter.numel() for parameter in self.model.parameters())
        received: float | None = None
        if isinstance(state, GradqHookState):
            sent_total, received_total = _gradq_counters(state)
            sent = (sent_total - self.counters[0]) / self.steps
            received = (received_total - self.counters[1]) / self.steps
        elif isinstance(state, OrderedBucketsState) and method.gather_bytes is not None:
            sent = (world_size - 1) * sum(map(method.gather_bytes, state.bucket_numels.values()))
        elif method.ring_element_bytes is not None:
            ring_numel = method.peer.ring_elements(self.model.module) if method.peer is not None else numel
            sent = ring_allreduce_bytes(ring_numel, world_size, method.ring_element_bytes)
        else:
            sent = 0.0
        return RankResult(tuple(self.step_seconds), numel, sent, received, self.cpu)

    def close(self) -> None:
        """Leave the gradq job, if any."""
        if isinstance(self.state, GradqHookState):
            self.state.close()


def _run_rank(rank: int, spec: JobSpec, results: mp.SimpleQueue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=spec.init_method, rank=rank, world_size=spec.world_size)
    runs: list[MethodRun] = []
    try:
        for method in spec.methods:
            runs.append(MethodRun(method, spec))
        batches = _batches(rank)
        iterations = max(run.iterations for run in runs)
        for iteration in range(iterations):
            # Rotate the order so no method always runs right after the same other one.
            shift = iteration % len(runs)
            for run in runs[shift:] + runs[:shift]:
                run.maybe_step(iteration, batches[iteration % len(batches)])
            if rank == 0 and (iteration + 1) % PROGRESS_EVERY == 0:
                print(f"  iteration {iteration + 1}/{iterations}", file=sys.stderr, flush=True)
        if rank == 0:
            results.put({run.method.key: run.result(spec.world_size) for run in runs})
    finally:
        for run in runs:
            run.close()
        dist.destroy_process_group()


def run_job(spec: JobSpec) -> dict[str, RankResult]:
    """Spawn ``spec.world_size`` ranks, run the job, return rank 0's measurements by method key."""
    queue: mp.SimpleQueue = mp.get_context("spawn").SimpleQueue()
    ranks = mp.spawn(_run_rank, args=(spec, queue), nprocs=spec.world_size, join=False)
    results: list[dict[str, RankResult]] = []
    # Drain while waiting: a rank blocks on a full pipe until its result is read.
    while True:
        while not queue.empty():
            results.append(queue.get())
        if ranks.join(timeout=0.2):  # raises if a rank failed
            break
    while not queue.empty():
        results.append(queue.get())
    if len(results) != 1:
        raise RuntimeError(f"world {spec.world_size}: got {len(results)} results from rank 0; expected 1")
    return results[0]


# -- the report -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    """One (method, world size) measurement."""

    method: Method
    world_size: int
    result: RankResult

    @property
    def median_s(self) -> float:
        """Median step time of rank 0."""
        return statistics.median(self.result.step_seconds)

    @property
    def fp32_ratio(self) -> float:
        """Wire bytes sent per worker per step over the fp32 gradient (4 x parameters)."""
        return self.result.sent_per_step / (FP32_BYTES * self.result.numel)

    @property
    def cpu_ms(self) -> float:
        """Machine CPU time per timed step, all cores together."""
        return 1e3 * self.result.cpu.busy_s / len(self.result.step_seconds)


def _find(rows: Sequence[Row], key: str, world_size: int) -> Row | None:
    return next((row for row in rows if row.method.key == key and row.world_size == world_size), None)


def _times(row: Row, reference: Row | None) -> str:
    return f"{row.median_s / reference.median_s:.2f}x" if reference is not None else "-"


def format_table(rows: Sequence[Row]) -> str:
    """The markdown table, one line per row."""
    lines = [
        "| method | world | timed steps | median ms/step | x vs allreduce | x vs seed per-tensor "
        "| wire bytes/worker/step (sent) [a] | x fp32 | gradq pulled bytes/worker/step [b] "
        f"| machine CPU ms/step [e] | cores busy % [e] | CPU ms / {CORES} cores [e] |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        received = row.result.received_per_step
        busy = row.result.cpu.busy_fraction
        lines.append(
            f"| {row.method.label} | {row.world_size} | {len(row.result.step_seconds)} | {1e3 * row.median_s:.1f} "
            f"| {_times(row, _find(rows, 'allreduce', row.world_size))} "
            f"| {_times(row, _find(rows, 'seed-pertensor', row.world_size))} "
            f"| {row.result.sent_per_step:,.0f} | {row.fp32_ratio:.3f} "
            f"| {'-' if received is None else f'{received:,.0f}'} "
            f"| {row.cpu_ms:.1f} | {'-' if busy is None else f'{100 * busy:.0f}'} | {row.cpu_ms / CORES:.1f} |"
        )
    return "\n".join(lines)


FOOTNOTES = """\
[a] What one worker sends per step. gradq: WorkerClient.bytes_sent over the timed steps
    (payload + per-channel scale and zero point + a 32-byte bound for the message's fixed
    fields; protobuf, HTTP/2 and TCP framing not counted). gloo allreduce fp32 / fp16 hook:
    a ring allreduce is assumed, 2(W-1)/W x 4 (or 2) bytes x parameters. allgather rows:
    a ring allgather is assumed, so a worker sends (W-1) copies of its contribution
    (levels + qparams, over its two all_gathers) per bucket; the seed per-channel row pads
    every bucket to whole 512-element channels and ships zero points as float32.
    x fp32 = sent bytes / (4 x parameters).
[b] WorkerClient.bytes_received over the timed steps: the encoded means pulled back, on the
    pushers' own grid (the aggregator's default), so about what was pushed.
[c] One bucket's all_gathers at a time: these hooks issue their second all_gather from a
    gloo completion callback; with DDP's two buckets (4.2M + 1.6M elements) in flight, ranks
    issue collectives in different orders (gloo aborts) or block both gloo worker threads.
[d] Python loop over channels: {slow_steps} timed steps after {slow_warmup} warm-up, not {steps}.
[e] /proc/stat over rank 0's timed steps (bench/cpu_busy.py): CPU time of the whole machine
    (every rank, the aggregator, the kernel's loopback TCP) per step, and the share of the
    cores it kept busy. Near 100% busy, the row is CPU-bound here: it cannot step faster
    than its CPU ms per step divided by the cores, the last column.
[f] PyTorch's PowerSGD hook with error feedback and warm start, compressing from step
    {powersgd_start} on (inside the warm-up). One DDP bucket: on gloo its chained collectives
    abort with two buckets in flight. Wire bytes: a ring allreduce of P and Q (n + m) x rank
    per compressed matrix, plus the 1-D gradients whole, in fp32.
"""


@dataclass(frozen=True, slots=True)
class Verdict:
    """One target's outcome."""

    name: str
    passed: bool | None  # None: not measured in this run
    detail: str

    def line(self) -> str:
        """``- PASS name: detail``."""
        outcome = "SKIP" if self.passed is None else "PASS" if self.passed else "FAIL"
        return f"- {outcome} {self.name}: {self.detail}"


def _time_target(rows: Sequence[Row], reference_key: str, limit: float, name: str) -> Verdict:
    gradq, reference = _find(rows, "gradq-8bit", TARGET_WORLD), _find(rows, reference_key, TARGET_WORLD)
    if gradq is None or reference is None:
        return Verdict(name, None, f"needs gradq-8bit and {reference_key} at world {TARGET_WORLD}")
    ratio = gradq.median_s / reference.median_s
    detail = f"{1e3 * gradq.median_s:.1f} ms vs {1e3 * reference.median_s:.1f} ms = {ratio:.2f}x (limit {limit:.2f}x)"
    return Verdict(name, ratio <= limit, detail)


def _wire_target(rows: Sequence[Row], bits: int) -> Verdict:
    limit = TARGET_WIRE_RATIO[bits]
    name = f"gradq {bits}-bit wire bytes/worker/step <= {limit}x fp32 at every world size"
    measured = [row for row in rows if row.method.bits == bits]
    if not measured:
        return Verdict(name, None, f"needs gradq-{bits}bit")
    detail = ", ".join(f"world {row.world_size}: {row.fp32_ratio:.4f}x" for row in measured)
    return Verdict(name, all(row.fp32_ratio <= limit for row in measured), detail)


def _growth_target(rows: Sequence[Row], bits: int) -> Verdict:
    name = f"gradq {bits}-bit wire bytes/worker/step do not grow with world size"
    measured = sorted((row for row in rows if row.method.bits == bits), key=lambda row: row.world_size)
    if len(measured) < 2:
        return Verdict(name, None, f"needs gradq-{bits}bit at two or more world sizes")
    sent = [row.result.sent_per_step for row in measured]
    detail = ", ".join(f"world {row.world_size}: {row.result.sent_per_step:,.0f} B" for row in measured)
    return Verdict(name, max(sent) <= sent[0] * WIRE_GROWTH_TOLERANCE, detail)


def targets(rows: Sequence[Row]) -> list[Verdict]:
    """Every target (docs/performance.md#targets), judged on the measured rows."""
    return [
        _time_target(
            rows,
            "allreduce",
            TARGET_VS_ALLREDUCE,
            f"gradq 8-bit step <= {TARGET_VS_ALLREDUCE}x gloo allreduce fp32 at world {TARGET_WORLD}",
        ),
        _time_target(
            rows,
            "seed-pertensor",
            TARGET_VS_SEED_PERTENSOR,
            f"gradq 8-bit step <= {TARGET_VS_SEED_PERTENSOR}x seed allgather per-tensor at world {TARGET_WORLD}",
        ),
        _wire_target(rows, 8),
        _wire_target(rows, 4),
        _growth_target(rows, 8),
        _growth_target(rows, 4),
    ]


# -- command line ---------------------------------------------------------------------------------


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; expected an integer >= 1")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--worlds", type=_positive, nargs="+", default=[2, 4], help="world sizes (ranks per job)")
    parser.add_argument(
        "--methods", nargs="+", choices=list(METHOD_BY_KEY), default=list(METHOD_BY_KEY), help="rows to measure"
    )
    parser.add_argument("--warmup", type=_positive, default=5, help="untimed steps before the timed ones")
    parser.add_argument("--steps", type=_positive, default=20, help="timed steps per row")
    parser.add_argument(
        "--slow-steps",
        type=_positive,
        default=5,
        help=f"timed steps for the seed per-channel row (after {SLOW_WARMUP_STEPS} warm-up step)",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    return parser.parse_args(argv)


@contextlib.contextmanager
def _aggregator_if_needed(world_size: int, methods: Sequence[Method]) -> Iterator[str | None]:
    if any(method.bits is not None for method in methods):
        with local_aggregator(world_size) as address:
            yield address
    else:
        yield None


def measure(args: argparse.Namespace) -> list[Row]:
    """Run one job per world size (every method interleaved in it); one aggregator per world size."""
    methods = tuple(METHOD_BY_KEY[key] for key in dict.fromkeys(args.methods))  # each once, in the order given
    rows = []
    for world_size in args.worlds:
        with _aggregator_if_needed(world_size, methods) as address:
            port = free_port()
            spec = JobSpec(
                world_size=world_size,
                init_method=f"tcp://127.0.0.1:{port}",
                methods=methods,
                warmup=args.warmup,
                steps=args.steps,
                slow_steps=args.slow_steps,
                address=address,
                job_prefix=f"bench-ddp-step-w{world_size}-{port}",
            )
            print(f"world {world_size}: {len(methods)} methods interleaved ...", file=sys.stderr, flush=True)
            results = run_job(spec)
        rows += [Row(method, world_size, results[method.key]) for method in methods]
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print the table and the targets.

    Args:
        argv: command-line arguments; None reads ``sys.argv``.

    Returns:
        0, or 1 with ``--check`` when a target failed.
    """
    args = parse_args(argv)
    parameters = sum(fan_in * fan_out + fan_out for fan_in, fan_out in itertools.pairwise(LAYERS))
    print(
        f"# DDP step: MLP {'-'.join(map(str, LAYERS))} ({parameters:,} parameters), batch {BATCH_SIZE}, SGD, "
        f"gloo on loopback, 1 thread per rank, {os.cpu_count()} CPU cores shared by all ranks and the aggregator; "
        f"median of rank 0 over {args.steps} timed steps after {args.warmup} warm-up "
        f"(seed per-channel: {args.slow_steps} after {SLOW_WARMUP_STEPS})\n",
        flush=True,
    )
    load_before = os.getloadavg()[0]  # anything else running on these cores skews every row
    rows = measure(args)
    print(format_table(rows))
    print()
    print(
        FOOTNOTES.format(
            slow_steps=args.slow_steps,
            slow_warmup=SLOW_WARMUP_STEPS,
            steps=args.steps,
            powersgd_start=POWERSGD_START_STEP,
        )
    )
    print(f"1-minute load average: {load_before:.2f} before the run, {os.getloadavg()[0]:.2f} after")
    print("\n## targets\n")
    verdicts = targets(rows)
    for verdict in verdicts:
        print(verdict.line())
    failed = any(verdict.passed is False for verdict in verdicts)
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
