"""Sparse DiLoCo against 4-bit, exact fp32 DiLoCo and DDP: held-out loss, bytes on the wire, the aggregator's CPU.

Run from the repository root with the virtualenv's interpreter::

    python bench/sparse_diloco.py --report bench/results/sparse_diloco.md    # everything (about 20 min on 2 cores)
    python bench/sparse_diloco.py --steps 20 --tasks digits --hosts 4 --syncs 10 --cpu-elements 1000000  # smoke

The simulation is bench/outer_lr.py's: M model replicas in this process, each
with its own AdamW inner optimizer and its own batches
(bench/convergence_tasks.py), an outer round every H inner steps, the held-out
loss of the global parameters at the end, at equal tokens. Methods:

- ``ddp``: AdamW on the mean gradient of the M hosts' batches, every step.
- ``fp32``: DiLoCo on the exact fp32 mean, gradq's outer step
  (gradq.qcore.outer_step, ``OuterStep()``: SGD lr 0.3, momentum 0.9, Nesterov).
- ``4bit``: DiLoCo as gradq runs it on ``QuantConfig("per_channel_affine", bits=4)``
  with error feedback on the hosts (docs/diloco.md's recipe sets
  ``GRADQ_ERROR_FEEDBACK=1``): each host pushes its pseudo-gradient through
  ``ErrorFeedback()``; the aggregator decode-accumulates the pushes into a
  float32 sum, divides by M and encodes the mean on its codec's ``mean_config``,
  through its own ``ErrorFeedback()`` where gradq.server.policy.feeds_back says
  a default aggregator does; everyone steps ``OuterStep()`` on the decoded mean.
- ``sparse``: the same path on ``QuantConfig("sparse_topk")`` (chunks of 4096,
  the 64 largest entries each), the hosts' error feedback decaying by beta
  (SparseLoCo's ``e <- beta e + delta``), the aggregator's by 1, and the outer
  SGD at its own lr and momentum (0, as SparseLoCo, or 0.9 Nesterov).

Sparse's lr, beta and momentum are chosen on the tuning tasks only (digits and
transformer: bench/convergence_tasks.py's ``tuned``) at M = 4, H = 10 and 50,
as the setting whose worst loss over 4-bit's in those 4 cells is least; then
that one setting runs on every (task, M, H), the held-back tasks included.
Bytes on the wire are ``QuantizedArray.nbytes`` of what each host pushes
(upload) and of the mean it gets back (download), per host per round, as bits
per parameter. The aggregator's CPU per round is timed on a model of
``--cpu-elements`` parameters (25M) cut into round keys of 2**22 (DiLoCo's
``bucket_elements``), with M = 8 pushes: the decode-accumulate of every push
plus the mean's error-feedback encode, ``time.process_time`` and wall. The round
time at 100 Mbit/s and 100 ms is computed from those bytes, not measured.
One seed per cell, fewer inner steps than bench/outer_lr.py (150 against its 300)
to fit 2 shared cores: read differences under about 1% as noise. This is a
benchmark, not a test.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from gradq.qcore import QuantConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))

SEED = 0
TUNING_HOSTS = 4  # the tuning cells' M: the grid runs at one host count to keep the sweep to 2 cores
BUCKET_ELEMENTS = 1 << 22  # DiLoCo's default bucket_elements: the most parameters one round key carries
LINK_BITS_PER_S = 100e6
ROUND_TRIP_S = 0.1


@dataclass(frozen=True, slots=True)
class Method:
    """One way of training a cell: ``kind`` is ddp, fp32, 4bit or sparse; the rest is sparse's outer step."""

    kind: str
    lr: float = 0.3
    momentum: float = 0.9
    beta: float = 1.0
    restart: bool = False  # the aggregator restarts halfway: its error-feedback residual starts again from zero

    @property
    def label(self) -> str:
        """``sparse lr 0.7 beta 0.95 mom 0``, or the kind."""
        if self.kind != "sparse":
            return self.kind
        restart = ", aggregator restarted halfway" if self.restart else ""
        return f"sparse lr {self.lr:g} beta {self.beta:g} mom {self.momentum:g}{restart}"


def quant_configs() -> dict[str, tuple[QuantConfig, QuantConfig, bool]]:
    """Each compressed method's push grid, its mean grid and whether the aggregator feeds its error back."""
    from gradq.qcore import QuantConfig, Scheme
    from gradq.server.policy import PushedGrid, RoundPolicy, feeds_back, return_config_for

    configs = {}
    pushes = (("4bit", QuantConfig(Scheme.PER_CHANNEL_AFFINE, bits=4)), ("sparse", QuantConfig(Scheme.SPARSE_TOPK)))
    for kind, push in pushes:
        pushed = PushedGrid(push.scheme, push.bits, push.channel_size, 0, "float32", push.topk)
        policy = RoundPolicy()  # a default aggregator's
        configs[kind] = (push, return_config_for(policy, pushed), feeds_back(policy, pushed))
    return configs


def run_method(task_key: str, hosts: int, sync_every: int, method: Method, steps: int) -> dict[str, Any]:
    """Train one (task, M, H) with ``method``; its held-out loss and its bits per parameter each way; one thread."""
    import torch
    from convergence_tasks import TASKS

    from gradq.qcore import ErrorFeedback, decode, decode_accumulate, encode
    from gradq.qcore.outer_step import OuterStep, take_outer_step

    torch.set_num_threads(1)
    task = TASKS[task_key]
    inner_lr = task.learning_rates["adamw"]
    held_inputs, held_targets = task.held_out(SEED)

    def held_out_loss(model: torch.nn.Module) -> float:
        with torch.no_grad():
            return float(task.loss(model(held_inputs), held_targets))

    def fresh() -> torch.nn.Module:
        torch.manual_seed(SEED)
        return task.build_model()

    result: dict[str, Any] = {
        "task": task_key,
        "hosts": hosts,
        "sync_every": sync_every,
        "steps": steps,
        "method": asdict(method),
    }
    if method.kind == "ddp":  # equal tokens: one model stepping on the mean gradient of the M hosts' batches
        model = fresh()
        optimizer = torch.optim.AdamW(model.parameters(), lr=inner_lr)
        for step in range(steps):
            optimizer.zero_grad()
            for host in range(hosts):
                inputs, targets = task.batch(host, step, SEED)
                (task.loss(model(inputs), targets) / hosts).backward()
            optimizer.step()
        result["loss"] = held_out_loss(model)
        return result

    compressed = method.kind in ("4bit", "sparse")
    if compressed:
        push_config, mean_config, server_feedback = quant_configs()[method.kind]
        host_feedback = [ErrorFeedback(method.beta) for _ in range(hosts)]
        aggregator_feedback = ErrorFeedback()
    outer = OuterStep() if method.kind != "sparse" else OuterStep(method.lr, method.momentum, method.momentum > 0)
    replicas = [fresh() for _ in range(hosts)]
    inner = [torch.optim.AdamW(r.parameters(), lr=inner_lr) for r in replicas]
    global_flat = torch.nn.utils.parameters_to_vector(replicas[0].parameters()).detach().clone()
    numel = global_flat.numel()
    momentum = np.zeros(numel, np.float32)
    up_bits: list[float] = []
    down_bits: list[float] = []
    restart_after = (steps // sync_every) // 2 if method.restart else -1  # outer rounds before the restart
    outer_rounds = 0
    for step in range(1, steps + 1):
        for host, (replica, optimizer) in enumerate(zip(replicas, inner, strict=True)):
            inputs, targets = task.batch(host, step - 1, SEED)
            optimizer.zero_grad()
            task.loss(replica(inputs), targets).backward()
            optimizer.step()
        if step % sync_every and step != steps:
            continue
        pseudo = [
            (global_flat - torch.nn.utils.parameters_to_vector(r.parameters()).detach()).numpy() for r in replicas
        ]
        if outer_rounds == restart_after:  # a restarted shard is seeded again by its hosts; its residual is lost
            aggregator_feedback = ErrorFeedback()
        outer_rounds += 1
        if compressed:
            # The aggregator's round: every push decoded into one float32 sum, the last dividing by M.
            total = np.zeros(numel, np.float32)
            for host, delta in enumerate(pseudo):
                pushed = host_feedback[host].encode(0, delta, push_config)
                up_bits.append(8 * pushed.nbytes / numel)
                decode_accumulate(pushed, total, divide_by=hosts if host == hosts - 1 else 1)
            if server_feedback:
                returned = aggregator_feedback.encode(0, total, mean_config)
            else:
                returned = encode(total, mean_config)
            down_bits.append(8 * returned.nbytes / numel)
            mean = decode(returned)
        else:
            mean = np.stack(pseudo).mean(0, dtype=np.float32)
        take_outer_step(global_flat.numpy(), momentum, mean, outer)
        for replica in replicas:
            torch.nn.utils.vector_to_parameters(global_flat, replica.parameters())
    result["loss"] = held_out_loss(replicas[0])
    result["parameters"] = numel
    if compressed:
        result["up_bits"] = statistics.fmean(up_bits)
        result["down_bits"] = statistics.fmean(down_bits)
    return result


def time_aggregator(elements: int, hosts: int, rounds: int) -> dict[str, dict[str, float]]:
    """The aggregator's CPU and wall seconds per round, per scheme: decode-accumulate M pushes, then encode the mean.

    The pushes are host-encoded (not timed) from pseudo-gradients drawn with a
    scale that varies by chunk, as a model's layers do; each round key holds
    at most ``BUCKET_ELEMENTS`` and keeps its own server residual.
    """
    from gradq.qcore import ErrorFeedback, decode_accumulate, encode

    generator = np.random.default_rng(SEED)
    keys = [(first, min(first + BUCKET_ELEMENTS, elements)) for first in range(0, elements, BUCKET_ELEMENTS)]
    timings: dict[str, dict[str, float]] = {}
    for kind, (push_config, mean_config, _) in quant_configs().items():
        server = ErrorFeedback()
        spent = dict.fromkeys(("decode_cpu", "decode_wall", "encode_cpu", "encode_wall", "bits_up", "bits_down"), 0.0)
        for _ in range(rounds):
            for key, (first, last) in enumerate(keys):
                size = last - first
                scales = np.repeat(generator.lognormal(0.0, 1.0, size // 4096 + 1).astype(np.float32), 4096)[:size]
                pushes = [
                    encode(generator.standard_normal(size, np.float32) * scales, push_config) for _ in range(hosts)
                ]
                spent["bits_up"] += 8 * pushes[0].nbytes / elements
                total = np.zeros(size, np.float32)
                cpu, wall = time.process_time(), time.perf_counter()
                for host, pushed in enumerate(pushes):
                    decode_accumulate(pushed, total, divide_by=hosts if host == hosts - 1 else 1)
                spent["decode_cpu"] += time.process_time() - cpu
                spent["decode_wall"] += time.perf_counter() - wall
                cpu, wall = time.process_time(), time.perf_counter()
                returned = server.encode(key, total, mean_config)
                spent["encode_cpu"] += time.process_time() - cpu
                spent["encode_wall"] += time.perf_counter() - wall
                spent["bits_down"] += 8 * returned.nbytes / elements
        timings[kind] = {name: value / rounds for name, value in spent.items()}
    return timings


def tuning_grid(plain_lrs: Sequence[float], nesterov_lrs: Sequence[float], betas: Sequence[float]) -> list[Method]:
    """Sparse settings to sweep: momentum 0 at ``plain_lrs``, Nesterov 0.9 at ``nesterov_lrs``, each beta."""
    grid = [Method("sparse", lr, 0.0, beta) for lr in plain_lrs for beta in betas]
    return grid + [Method("sparse", lr, 0.9, beta) for lr in nesterov_lrs for beta in betas]


def choose(tuning: Sequence[dict[str, Any]], grid: Sequence[Method]) -> tuple[Method, list[tuple[Method, list[float]]]]:
    """The grid setting whose worst loss over 4-bit's across the tuning cells is least (ties: the lower mean)."""
    baseline = {_cell(r): float(r["loss"]) for r in tuning if r["method"]["kind"] == "4bit"}
    rows: list[tuple[Method, list[float]]] = []
    for method in grid:
        ratios = [float(r["loss"]) / baseline[_cell(r)] for r in tuning if Method(**r["method"]) == method]
        rows.append((method, ratios))
    best = min(rows, key=lambda row: (max(row[1]), statistics.fmean(row[1])))
    return best[0], rows


def _cell(result: dict[str, Any]) -> tuple[str, int, int]:
    return (str(result["task"]), int(result["hosts"]), int(result["sync_every"]))


def render(
    results: Sequence[dict[str, Any]],
    chosen: Method,
    tuning_rows: Sequence[tuple[Method, list[float]]],
    tuning_cells: Sequence[tuple[str, int, int]],
    timings: dict[str, dict[str, float]],
    cpu_elements: int,
    cpu_hosts: int,
) -> str:
    """The report: the tuning sweep, losses per cell, bits on the wire, the aggregator's CPU, the round time."""
    by_cell: dict[tuple[str, int, int], dict[str, dict[str, Any]]] = {}
    for r in results:
        method = Method(**r["method"])
        if method.kind != "sparse" or method == chosen:
            by_cell.setdefault(_cell(r), {})[method.kind] = r
    out = [f"## Tuning: sparse settings on {', '.join(f'{t} M={m} H={h}' for t, m, h in tuning_cells)}", ""]
    out.append("Loss over 4-bit DiLoCo's in each tuning cell; the chosen setting has the least worst ratio.")
    out += ["", "| setting | " + " | ".join(f"{t} M={m} H={h}" for t, m, h in tuning_cells) + " | worst | mean |"]
    out.append("|" + "---|" * (len(tuning_cells) + 3))
    for method, ratios in sorted(tuning_rows, key=lambda row: max(row[1])):
        mark = " (chosen)" if method == chosen else ""
        cells = " | ".join(f"{ratio:.4f}" for ratio in ratios)
        out.append(f"| {method.label}{mark} | {cells} | {max(ratios):.4f} | {statistics.fmean(ratios):.4f} |")
    out += ["", f"## Held-out loss at equal tokens ({chosen.label})", ""]
    columns = ["task", "M", "H", "DDP", "fp32 DiLoCo", "4-bit DiLoCo", "sparse DiLoCo"]
    out.append("| " + " | ".join([*columns, "sparse / 4-bit", "sparse / fp32", "sparse / DDP"]) + " |")
    out.append("|" + "---|" * 10)
    for (task, hosts, sync), row in by_cell.items():
        losses = {kind: float(row[kind]["loss"]) for kind in ("ddp", "fp32", "4bit", "sparse")}
        sparse = losses["sparse"]
        out.append(
            f"| {task} | {hosts} | {sync} | {losses['ddp']:.4f} | {losses['fp32']:.4f} | {losses['4bit']:.4f} | "
            f"{sparse:.4f} | {sparse / losses['4bit']:.4f} | {sparse / losses['fp32']:.4f} | "
            f"{sparse / losses['ddp']:.4f} |"
        )
    out += ["", "## Bits per parameter on the wire, per host per round (measured: QuantizedArray.nbytes)", ""]
    out.append("| task | parameters | M | 4-bit up | 4-bit down | sparse up | sparse down | 4-bit / sparse bytes |")
    out.append("|" + "---|" * 8)
    seen: set[tuple[str, int]] = set()
    for (task, hosts, _), row in by_cell.items():
        if (task, hosts) in seen:
            continue
        seen.add((task, hosts))
        four, sparse_row = row["4bit"], row["sparse"]
        ratio = (float(four["up_bits"]) + float(four["down_bits"])) / (
            float(sparse_row["up_bits"]) + float(sparse_row["down_bits"])
        )
        out.append(
            f"| {task} | {four['parameters']} | {hosts} | {four['up_bits']:.3f} | {four['down_bits']:.3f} | "
            f"{sparse_row['up_bits']:.3f} | {sparse_row['down_bits']:.3f} | {ratio:.1f}x |"
        )
    millions = cpu_elements / 1e6
    out += ["", f"## The aggregator's work per round: {millions:g}M parameters, M = {cpu_hosts} (measured)", ""]
    columns = ["scheme", "decode-accumulate CPU s", "wall s", "mean's EF encode CPU s", "wall s"]
    out.append("| " + " | ".join([*columns, "total CPU s", "total wall s"]) + " |")
    out.append("|" + "---|" * 7)
    for kind, spent in timings.items():
        cpu = spent["decode_cpu"] + spent["encode_cpu"]
        wall = spent["decode_wall"] + spent["encode_wall"]
        out.append(
            f"| {kind} | {spent['decode_cpu']:.3f} | {spent['decode_wall']:.3f} | {spent['encode_cpu']:.3f} | "
            f"{spent['encode_wall']:.3f} | {cpu:.3f} | {wall:.3f} |"
        )
    out += ["", f"## Round time at 100 Mbit/s, 100 ms round trip, {millions:g}M parameters (computed)", ""]
    out.append("One host's upload and download at the bits per parameter of the timed encodings, plus 2 round trips.")
    out += [
        "",
        "| scheme | bits/param up | down | MB up | MB down | round time s (computed) |",
        "|---|---|---|---|---|---|",
    ]
    for kind, spent in timings.items():
        up, down = (cpu_elements * spent[f"bits_{way}"] / 8 for way in ("up", "down"))
        seconds = (up + down) * 8 / LINK_BITS_PER_S + 2 * ROUND_TRIP_S
        out.append(
            f"| {kind} | {spent['bits_up']:.3f} | {spent['bits_down']:.3f} | {up / 1e6:.2f} | {down / 1e6:.2f} | "
            f"{seconds:.2f} |"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    from convergence_tasks import TASKS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=["digits", "digits-cnn", "transformer", "source-lm"])
    parser.add_argument("--hosts", nargs="+", type=int, default=[4, 8], help="M, hosts averaged per round")
    parser.add_argument("--syncs", nargs="+", type=int, default=[10, 50], help="H, inner steps per outer round")
    parser.add_argument("--steps", type=int, default=150, help="inner steps per host")
    parser.add_argument("--plain-lrs", nargs="+", type=float, default=[0.5, 0.7, 1.0], help="sparse, momentum 0")
    parser.add_argument("--nesterov-lrs", nargs="+", type=float, default=[0.3, 0.5, 0.7], help="sparse, Nesterov 0.9")
    parser.add_argument("--betas", nargs="+", type=float, default=[0.9, 0.95, 1.0], help="hosts' EF decay")
    parser.add_argument("--cpu-elements", type=int, default=25_000_000, help="model size of the aggregator timing")
    parser.add_argument("--cpu-rounds", type=int, default=2, help="rounds timed per scheme")
    parser.add_argument("--workers", type=int, default=2, help="runs trained at once (one thread each)")
    parser.add_argument("--report", type=Path, default=None, help="write the report (markdown) here too")
    parser.add_argument("--output", type=Path, default=None, help="write every run as JSON here too")
    parser.add_argument(
        "--restart",
        action="store_true",
        help="only the cost of an aggregator restart: sparse DiLoCo at its default outer step, with and without "
        "the aggregator's residual lost halfway, on every cell",
    )
    args = parser.parse_args(argv)
    for key in args.tasks:
        if key not in TASKS:
            parser.error(f"--tasks: {key!r} is not a task; expected one of {sorted(TASKS)}")
    tuning_tasks = [key for key in args.tasks if TASKS[key].tuned]
    if not tuning_tasks:
        parser.error(f"--tasks: expected at least one tuning task of {sorted(k for k in TASKS if TASKS[k].tuned)}")

    began = time.perf_counter()
    if args.restart:
        return restart_study(args, began)
    grid = tuning_grid(args.plain_lrs, args.nesterov_lrs, args.betas)
    tuning_hosts = TUNING_HOSTS if TUNING_HOSTS in args.hosts else args.hosts[0]
    tuning_cells = [(task, tuning_hosts, h) for task in tuning_tasks for h in args.syncs]
    cells = [(task, m, h) for task in args.tasks for m in args.hosts for h in args.syncs]
    baselines = [Method("4bit"), Method("fp32"), Method("ddp")]
    # The tuning cells' runs first, so the chosen setting is known while the other baselines still train.
    first = [(cell, m) for cell in tuning_cells for m in baselines + grid]
    rest = [(cell, m) for cell in cells if cell not in tuning_cells for m in baselines]
    with concurrent.futures.ProcessPoolExecutor(args.workers) as pool:
        futures = {job: pool.submit(run_method, *job[0], job[1], args.steps) for job in first + rest}

        def collect(jobs: Sequence[tuple[tuple[str, int, int], Method]]) -> list[dict[str, Any]]:
            done = []
            for job in jobs:
                done.append(futures[job].result())
                print(f"  {job[0]} {job[1].label}: {done[-1]['loss']:.4f}", flush=True)
            return done

        tuning = collect(first)
        chosen, tuning_rows = choose(tuning, grid)
        print(f"chosen on {tuning_cells}: {chosen.label}", flush=True)
        last = [(cell, chosen) for cell in cells if cell not in tuning_cells]
        futures.update({job: pool.submit(run_method, *job[0], job[1], args.steps) for job in last})
        results = tuning + collect(rest) + collect(last)
    print(f"timing the aggregator: {args.cpu_elements} parameters, {max(args.hosts)} hosts", flush=True)
    timings = time_aggregator(args.cpu_elements, max(args.hosts), args.cpu_rounds)
    order = {cell: index for index, cell in enumerate(cells)}
    results.sort(key=lambda r: order[_cell(r)])
    report = render(results, chosen, tuning_rows, tuning_cells, timings, args.cpu_elements, max(args.hosts))
    elapsed = time.perf_counter() - began
    header = (
        f"# Sparse DiLoCo ({args.steps} inner steps per host, bench/outer_lr.py's default is 300; AdamW inner; "
        f"{args.workers} workers of one thread each; {elapsed:.0f} s)\n\n"
        f"    python bench/sparse_diloco.py {' '.join(sys.argv[1:] if argv is None else argv)}\n"
    )
    print("\n" + header + "\n" + report)
    if args.report is not None:
        args.report.write_text(header + "\n" + report + "\n")
    if args.output is not None:
        args.output.write_text(json.dumps({"chosen": asdict(chosen), "runs": results, "aggregator": timings}, indent=1))
    return 0


def restart_study(args: argparse.Namespace, began: float) -> int:
    """Sparse DiLoCo at its defaults with and without an aggregator restart halfway: the held-out loss each way."""
    from gradq.client.diloco.options import SPARSE_OUTER_LR

    cells = [(task, m, h) for task in args.tasks for m in args.hosts for h in args.syncs]
    methods = [Method("sparse", SPARSE_OUTER_LR, 0.9), Method("sparse", SPARSE_OUTER_LR, 0.9, restart=True)]
    with concurrent.futures.ProcessPoolExecutor(args.workers) as pool:
        futures = {(cell, m): pool.submit(run_method, *cell, m, args.steps) for cell in cells for m in methods}
        losses = {job: future.result()["loss"] for job, future in futures.items()}
    lines = [
        f"# An aggregator restart in sparse DiLoCo ({args.steps} inner steps per host; residual lost after half "
        f"the outer rounds; {time.perf_counter() - began:.0f} s)",
        "",
        f"    python bench/sparse_diloco.py {' '.join(sys.argv[1:])}",
        "",
        "| task | M | H | loss, no restart | loss, restarted halfway | restarted / not |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for cell in cells:
        kept, lost = losses[(cell, methods[0])], losses[(cell, methods[1])]
        lines.append(f"| {cell[0]} | {cell[1]} | {cell[2]} | {kept:.4f} | {lost:.4f} | {lost / kept:.4f} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.report is not None:
        args.report.write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
