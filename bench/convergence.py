"""Held-out loss against steps for gradq and the peers a user would pick, and time to fp32's accuracy.

Run from the repository root with the virtualenv's interpreter::

    python bench/convergence.py                                   # all four tasks, SGD and AdamW, the main rows
    python bench/convergence.py --tasks transformer --optimizers adamw --methods fp32 gradq2ef gradq2ef-sef
    python bench/convergence.py --step-times bench/results/network-<time>.json   # adds time to accuracy
    python bench/convergence.py --hosts 2x2 --tasks transformer --optimizers adamw --methods gradq4ef gradq4ef-2l

World 2 on gloo over loopback: two spawned ranks train every (task, optimizer,
method) in turn from the same initial weights (fixed seeds) on the same
batches, the gradq rows through real aggregators (``python -m gradq.server``;
one per distinct set of server flags). Rank 0 evaluates the held-out loss
(and digits accuracy) every ``--eval-every`` steps. The tasks are in
convergence_tasks.py: the digits MLP and a character-level transformer language
model on the text of Python's reference manual, which ships with CPython (the
tasks gradq was tuned on), and two held back from tuning: a conv net on the
digits as images and a word-level language model on the standard library's
source (``--tasks digits-cnn source-lm``; all four run by default). Each row
also records its parameters' sum at the end: a biased mean makes it drift.

"Steps to fp32" is the first evaluated step at which a row's held-out loss is
within 1% of the fp32 row's final held-out loss ("never" within the budget).
With ``--step-times``, each row's steps are multiplied by the median ms/step of
its counterpart row in a bench/network.py results file (world 4, 1 Gbit/s links
by default): time to accuracy; the table also shows that row's CPU per step (the
whole machine's, and the ranks' and the shards' own where the file has them).
Steps do not depend on the machine's load; the step times do, so take them
from one network run. The report (markdown, JSON, PNG of the curves when
matplotlib is installed) goes to ``bench/results/convergence-<time>.*``. This
is a benchmark, not a test.

``--hosts HxL`` runs H x L ranks instead, rank r on emulated host r // L (all on
loopback): the two-level rows (``-2l``) pass ``host=...``, so each host's ranks
reduce inside it and push 1/L each (two-level aggregation); every other gradq row runs
``host_grouping="flat"``, every rank its own member at the aggregator.
"""

import os

for _variable in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_variable] = "1"

# No `from __future__ import annotations`: DDP checks a hook's annotations at registration.
import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from datetime import datetime  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import convergence_report  # noqa: E402
import netns  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from convergence_tasks import TASKS, Task  # noqa: E402
from peer_hooks import PEER_HOOKS, PEER_SINGLE_BUCKET_MB  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from gradq.client.apps.demo import free_port, local_aggregator  # noqa: E402
from gradq.client.ddp import GradqHookState, gradq_hook  # noqa: E402
from gradq.qcore import DEFAULT_CHANNEL_SIZE, QuantConfig, Rounding, Scheme  # noqa: E402

SEED = 0
POWERSGD_START_STEP = 10  # plain allreduce for the first steps, as PyTorch's docs advise
WEIGHT_DECAY = 0.01  # AdamW's
MOMENTUM = 0.9  # SGD's
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True, slots=True)
class Method:
    """One row: how gradients are averaged, and which bench/network.py row times its steps."""

    key: str
    label: str
    network_key: str  # the bench/network.py row with the same wire traffic per step
    peer: str | None = None  # a PEER_HOOKS key; None with neither peer nor bits: plain DDP allreduce
    bits: int | None = None  # gradq push bits
    scheme: str = "per_channel_affine"  # gradq push scheme
    error_feedback: bool = False
    channel_size: int = 0  # 0: QuantConfig's default for the bits (128 at 1 and 2 bits, else 512)
    rounding: str = "nearest"
    server_flags: tuple[str, ...] = ()  # `gradq serve` flags of the aggregator this row needs
    two_level: bool = False  # reduce inside each host of --hosts first (host=...); otherwise host_grouping="flat"
    bit_policy: str = "uniform"  # "adaptive": more bits for 1-D and hard parameters (gradq.client.bit_policy)
    average_bits: float = 2.5  # the adaptive policy's target


MAIN_METHODS = (
    Method("fp32", "fp32 allreduce", "allreduce"),
    Method("bf16", "bf16 compress hook", "bf16", peer="bf16"),
    Method("powersgd-r1", "PowerSGD rank 1", "powersgd-r1", peer="powersgd-r1"),
    Method("powersgd-r4", "PowerSGD rank 4", "powersgd-r4", peer="powersgd-r4"),
    Method("gradq8", "gradq 8-bit", "gradq8-2", bits=8),
    Method("gradq4ef", "gradq 4-bit + EF", "gradq4ef-2", bits=4, error_feedback=True),
    Method("gradq2ef", "gradq 2-bit + EF", "gradq2ef-2", bits=2, error_feedback=True),
    Method("gradq1ef", "gradq 1-bit + EF", "gradq1ef-2", bits=1, error_feedback=True),
)
# Techniques tried on the low-bit rows (--methods picks them): each changes one thing.
_SERVER_FEEDBACK = ("--server-error-feedback", "true")
# The aggregator's former default: the mean re-encoded to nearest with no residual (biased at low bits).
_NO_SERVER_FEEDBACK = ("--server-error-feedback", "false")
CANDIDATE_METHODS = (
    Method(
        "gradq2ef-adaptive",
        "gradq 2-bit + EF, adaptive bits (average 2.5)",
        "gradq2ef-2",
        bits=2,
        error_feedback=True,
        bit_policy="adaptive",
    ),
    Method(
        "gradq2ef-nosef",
        "gradq 2-bit + EF, no server EF (the former default)",
        "gradq2ef-2",
        bits=2,
        error_feedback=True,
        server_flags=_NO_SERVER_FEEDBACK,
    ),
    Method(
        "gradq1sign-nosef",
        "gradq 1-bit scaled sign + EF, no server EF (the former default)",
        "gradq1sign-2",
        bits=1,
        scheme="per_channel_sign",
        error_feedback=True,
        server_flags=_NO_SERVER_FEEDBACK,
    ),
    Method(
        "gradq2ef-sef",
        "gradq 2-bit + EF, server EF",
        "gradq2ef-2",
        bits=2,
        error_feedback=True,
        server_flags=_SERVER_FEEDBACK,
    ),
    Method(
        "gradq1ef-sef",
        "gradq 1-bit + EF, server EF",
        "gradq1ef-2",
        bits=1,
        error_feedback=True,
        server_flags=_SERVER_FEEDBACK,
    ),
    Method(
        "gradq2ef-r8",
        "gradq 2-bit + EF, mean back at 8 bits",
        "gradq2ef-2",
        bits=2,
        error_feedback=True,
        server_flags=("--return-scheme", "per_channel_affine", "--return-bits", "8"),
    ),
    Method(
        "gradq2ef-r4",
        "gradq 2-bit + EF, mean back at 4 bits",
        "gradq2ef-2",
        bits=2,
        error_feedback=True,
        server_flags=("--return-scheme", "per_channel_affine", "--return-bits", "4"),
    ),
    Method(
        "gradq2ef-sr",
        "gradq 2-bit + EF, stochastic rounding",
        "gradq2ef-2",
        bits=2,
        error_feedback=True,
        rounding="stochastic",
    ),
    Method(
        "gradq2ef-c128",
        "gradq 2-bit + EF, 128-element channels (the default)",
        "gradq2ef-2",
        bits=2,
        error_feedback=True,
        channel_size=128,
    ),
    Method(
        "gradq1sign",
        "gradq 1-bit scaled sign + EF",
        "gradq1sign-2",
        bits=1,
        scheme="per_channel_sign",
        error_feedback=True,
    ),
    Method(
        "gradq1sign-sef",
        "gradq 1-bit scaled sign + EF, server EF",
        "gradq1sign-2",
        bits=1,
        scheme="per_channel_sign",
        error_feedback=True,
        server_flags=_SERVER_FEEDBACK,
    ),
    Method(
        "gradq2ef-c512",
        "gradq 2-bit + EF, 512-element channels",
        "gradq2ef-2",
        bits=2,
        error_feedback=True,
        channel_size=DEFAULT_CHANNEL_SIZE,
    ),
    Method(
        "gradq2ef-c256",
        "gradq 2-bit + EF, 256-element channels",
        "gradq2ef-2",
        bits=2,
        error_feedback=True,
        channel_size=256,
    ),
    Method(
        "gradq2ef-c64",
        "gradq 2-bit + EF, 64-element channels",
        "gradq2ef-2",
        bits=2,
        error_feedback=True,
        channel_size=64,
    ),
    Method(
        "gradq1ef-c64",
        "gradq 1-bit + EF, 64-element channels",
        "gradq1ef-2",
        bits=1,
        error_feedback=True,
        channel_size=64,
    ),
    Method(
        "gradq1sign-c64",
        "gradq 1-bit scaled sign + EF, 64-element channels",
        "gradq1sign-2",
        bits=1,
        scheme="per_channel_sign",
        error_feedback=True,
        channel_size=64,
    ),
    Method(
        "gradq1sign-c32",
        "gradq 1-bit scaled sign + EF, 32-element channels",
        "gradq1sign32-2",
        bits=1,
        scheme="per_channel_sign",
        error_feedback=True,
        channel_size=32,
    ),
    Method(
        "gradq1sign-c512",
        "gradq 1-bit scaled sign + EF, 512-element channels",
        "gradq1sign-2",
        bits=1,
        scheme="per_channel_sign",
        error_feedback=True,
        channel_size=DEFAULT_CHANNEL_SIZE,
    ),
    Method(
        "gradq4ef-2l",
        "gradq 4-bit + EF, two-level",
        "gradq4ef-2-twolevel",
        bits=4,
        error_feedback=True,
        two_level=True,
    ),
    Method(
        "gradq4ef-sef",
        "gradq 4-bit + EF, server EF",
        "gradq4ef-2",
        bits=4,
        error_feedback=True,
        server_flags=_SERVER_FEEDBACK,
    ),
)
METHOD_BY_KEY = {method.key: method for method in (*MAIN_METHODS, *CANDIDATE_METHODS)}
OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What every rank runs."""

    init_method: str
    tasks: tuple[str, ...]
    optimizers: tuple[str, ...]
    methods: tuple[str, ...]
    steps: int
    eval_every: int
    aggregators: dict[str, str]  # " ".join(server_flags) -> address
    world_size: int
    ranks_per_host: int  # L of --hosts HxL; 1: every rank its own host


def _optimizer(key: str, model: torch.nn.Module, task: Task) -> torch.optim.Optimizer:
    rate = task.learning_rates[key]
    if key == "sgd":
        return torch.optim.SGD(model.parameters(), lr=rate, momentum=MOMENTUM)
    return torch.optim.AdamW(model.parameters(), lr=rate, weight_decay=WEIGHT_DECAY)


def _attach(
    model: DistributedDataParallel, method: Method, spec: JobSpec, job_id: str, rank: int
) -> GradqHookState | None:
    if method.peer is not None:
        peer = PEER_HOOKS[method.peer]
        model.register_comm_hook(peer.make_state(POWERSGD_START_STEP), peer.hook)
    elif method.bits is not None:
        config = QuantConfig(
            Scheme.parse(method.scheme), method.bits, method.channel_size, Rounding.parse(method.rounding), seed=SEED
        )
        address = spec.aggregators[" ".join(method.server_flags)]
        state = GradqHookState(
            address,
            config,
            error_feedback=method.error_feedback,
            job_id=job_id,
            host_grouping="auto" if method.two_level else "flat",
            host=f"host{rank // spec.ranks_per_host}" if method.two_level else None,
            bit_policy=method.bit_policy,
            average_bits=method.average_bits,
        )
        model.register_comm_hook(state, gradq_hook)
        return state
    return None


def _evaluate(model: torch.nn.Module, task: Task, held_out: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, Any]:
    with torch.no_grad():
        output = model(held_out[0])
        return float(task.loss(output, held_out[1])), task.accuracy(output, held_out[1])


def train_one(rank: int, spec: JobSpec, task: Task, optimizer_key: str, method: Method) -> dict[str, list]:
    """Train one row from the shared initial weights; rank 0's held-out curve."""
    torch.manual_seed(SEED)
    single_bucket = method.peer is not None and PEER_HOOKS[method.peer].single_bucket
    model = DistributedDataParallel(task.build_model(), bucket_cap_mb=PEER_SINGLE_BUCKET_MB if single_bucket else None)
    job_id = f"convergence-{task.key}-{optimizer_key}-{method.key}-{spec.init_method}"
    state = _attach(model, method, spec, job_id, rank)
    optimizer = _optimizer(optimizer_key, model, task)
    held_out = task.held_out(SEED)
    curve: dict[str, list] = {"step": [], "loss": [], "accuracy": [], "diverged_at": [], "parameter_sum": []}
    try:
        for step in range(1, spec.steps + 1):
            inputs, targets = task.batch(rank, step, SEED)
            optimizer.zero_grad(set_to_none=True)
            try:
                task.loss(model(inputs), targets).backward()
            except RuntimeError as error:
                # The aggregator fails a round with a NaN/Inf contribution for every rank, so all stop here.
                if "NaN/Inf" not in str(error):
                    raise
                curve["diverged_at"].append(step)
                break
            optimizer.step()
            if rank == 0 and (step % spec.eval_every == 0 or step == spec.steps):
                loss, accuracy = _evaluate(model.module, task, held_out)
                curve["step"].append(step)
                curve["loss"].append(loss)
                curve["accuracy"].append(accuracy)
        # A biased mean shows as the parameters' sum drifting away from fp32's.
        curve["parameter_sum"].append(float(sum(float(p.detach().sum()) for p in model.module.parameters())))
        dist.barrier()
    finally:
        if state is not None:
            state.close()
    return curve


def _run_rank(rank: int, spec: JobSpec, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=spec.init_method, rank=rank, world_size=spec.world_size)
    try:
        for task_key in spec.tasks:
            for optimizer_key in spec.optimizers:
                for method_key in spec.methods:
                    curve = train_one(rank, spec, TASKS[task_key], optimizer_key, METHOD_BY_KEY[method_key])
                    if rank == 0:
                        queue.put((task_key, optimizer_key, method_key, curve))
                        final = f"diverged at step {curve['diverged_at'][0]}" if curve["diverged_at"] else ""
                        final = final or f"held-out loss {curve['loss'][-1]:.4f}"
                        print(f"  {task_key} {optimizer_key} {method_key}: {final}", flush=True)
    finally:
        dist.destroy_process_group()


def run(spec_args: argparse.Namespace) -> dict[str, Any]:
    """Start the aggregators and the ranks; returns curves[task][optimizer][method]."""
    methods = [METHOD_BY_KEY[key] for key in spec_args.methods]
    flag_sets = sorted({method.server_flags for method in methods if method.bits is not None})
    hosts, ranks_per_host = spec_args.hosts
    world = hosts * ranks_per_host
    # Two-level jobs join with one member per host: the aggregator then cannot pin the world size.
    pinned = world if ranks_per_host == 1 else 0
    curves: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        aggregators = {" ".join(flags): stack.enter_context(local_aggregator(pinned, *flags)) for flags in flag_sets}
        spec = JobSpec(
            f"tcp://127.0.0.1:{free_port()}",
            tuple(spec_args.tasks),
            tuple(spec_args.optimizers),
            tuple(spec_args.methods),
            spec_args.steps,
            spec_args.eval_every,
            aggregators,
            world,
            ranks_per_host,
        )
        queue = mp.get_context("spawn").SimpleQueue()
        ranks = mp.spawn(_run_rank, args=(spec, queue), nprocs=world, join=False)
        finished = False
        while not finished:
            finished = ranks.join(timeout=1.0)  # raises, with the rank's traceback, when a rank fails
            while not queue.empty():
                task_key, optimizer_key, method_key, curve = queue.get()
                curves.setdefault(task_key, {}).setdefault(optimizer_key, {})[method_key] = curve
    return curves


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=list(METHOD_BY_KEY),
        default=[method.key for method in MAIN_METHODS],
        help="rows; fp32 is always added (it sets the target)",
    )
    parser.add_argument("--steps", type=int, default=300, help="training steps per row")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations")
    parser.add_argument("--step-times", type=Path, help="a bench/network.py results .json: adds time to accuracy")
    parser.add_argument("--world", type=int, default=4, help="the network scenario's world size for --step-times")
    parser.add_argument("--rate", default="1gbit", help="the network scenario's link rate for --step-times")
    parser.add_argument(
        "--hosts",
        type=_hosts,
        default=(2, 1),
        help="HOSTSxRANKS: world HOSTS x RANKS, rank r on host r // RANKS (the -2l rows reduce inside hosts)",
    )
    parser.add_argument("--from-json", type=Path, help="report on a previous run's .json instead of training")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the report goes")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.eval_every < 1:
        parser.error(f"--steps={args.steps} --eval-every={args.eval_every}: expected both >= 1")
    args.methods = list(dict.fromkeys(["fp32", *args.methods]))
    two_level = [key for key in args.methods if METHOD_BY_KEY[key].two_level]
    if two_level and args.hosts[1] < 2:
        parser.error(f"--methods {' '.join(two_level)} reduce inside hosts; expected --hosts with 2+ ranks per host")
    return args


def _hosts(text: str) -> tuple[int, int]:
    try:
        return netns.parse_hosts(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _setup(args: argparse.Namespace) -> str:
    hosts, ranks_per_host = args.hosts
    layout = f"World {hosts * ranks_per_host} on gloo over loopback"
    if ranks_per_host > 1:
        layout += f", as {hosts} hosts x {ranks_per_host} ranks (gradq rows without 'two-level' run flat)"
    return f"{layout}; {args.steps} steps, held-out loss every {args.eval_every}."


def main(argv: Sequence[str] | None = None) -> int:
    """Train (or load) the curves, print the report and save it under --results."""
    args = _parse_args(argv)
    curves = json.loads(args.from_json.read_text())["curves"] if args.from_json is not None else run(args)
    labels = {key: METHOD_BY_KEY[key].label for key in METHOD_BY_KEY}
    step_times = None
    if args.step_times is not None:
        network_keys = {key: METHOD_BY_KEY[key].network_key for key in METHOD_BY_KEY}
        step_times = convergence_report.network_step_costs(args.step_times, args.world, args.rate, network_keys)
    report = convergence_report.format_report(curves, labels, {k: t.label for k, t in TASKS.items()}, step_times)
    if args.from_json is None:
        report = f"{_setup(args)}\n\n{report}"
    print(report)
    args.results.mkdir(parents=True, exist_ok=True)
    stem = args.results / f"convergence-{datetime.now():%Y%m%d-%H%M%S}"
    stem.with_suffix(".md").write_text(report + "\n")
    methods = {key: asdict(method) for key, method in METHOD_BY_KEY.items()}
    stem.with_suffix(".json").write_text(json.dumps({"curves": curves, "methods": methods}, indent=1))
    plot = convergence_report.plot(curves, labels, stem.with_suffix(".png"))
    print(f"\nwrote {stem}.md, .json{', .png' if plot else ' (no plot: matplotlib is not installed)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
