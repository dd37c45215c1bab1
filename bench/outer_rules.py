"""Do three outer-step rules help DiLoCo's held-out loss? RDA, outer momentum warm-up, token-weighted means.

Run from the repository root with the virtualenv's interpreter::

    python bench/outer_rules.py --output bench/results/outer-rules.json --report bench/results/outer-rules.md
    python bench/outer_rules.py --steps 20 --tasks digits --hosts 4 --syncs 10    # a smoke run

The simulation is bench/outer_lr.py's: M model replicas in this process, each
with its own AdamW inner optimizer and its own batches (bench/convergence_tasks.py),
synced every H inner steps by gradq's outer step (gradq.qcore.outer_step,
``OuterStep()``: lr 0.3, momentum 0.9, Nesterov) on an exact fp32 aggregate of
the hosts' pseudo-gradients g_i = global - local_i. No gRPC, no quantization.
Every rule is compared with the baseline in the same (task, M, H) cell, same
seed, same data:

- ``mean`` (the baseline): the plain mean of the g_i, ``OuterStep()`` every round.
- ``rda``, Radial-Directional Averaging (Decoupled DiLoCo, arXiv 2604.21428):
  the norms and the directions are averaged apart, over the whole model vector
  (not per tensor): ``n = mean_i |g_i|``, ``d = sum_i g_i / |g_i|``, outer
  gradient ``n * d / |d|``. The paper's exact formula was not retrievable from
  here, so this is the definition as the issue states it. By the triangle
  inequality its norm is at least the mean's: where the hosts disagree it
  steps further (the run records the mean of ``n / |mean_i g_i|`` over rounds).
- ``warmup``, outer momentum warm-up (Pier, arXiv 2511.17849): with R outer
  rounds and K = max(1, R // 4), round r (0-based) uses
  ``OuterStep(momentum=0.9 * r / K)`` for r < K and ``OuterStep()`` after:
  at H = 10 (R = 20, K = 5) the momenta 0, 0.18, 0.36, 0.54, 0.72, then 0.9;
  at H = 50 (R = 4, K = 1) momentum 0 in the first round only.
- ``warmup+decay`` (not trained unless ``--rules`` names it): the same
  warm-up, and momentum decay over the last K rounds, ``0.9 * (R - 1 - r) / K``
  for r >= R - K (0 in the last round). Pier names both; its exact schedules
  were not retrievable from here, so these are ours.
- Heterogeneous hosts, for token weighting: host i trains on u_i half-batches
  of the task's batch, u = (1, 1, 2, 4) repeated for every 4 hosts (at M = 4:
  16, 16, 32, 64 rows for the digits tasks, 8, 8, 16, 32 sequences for the
  language models), so the M hosts together see as many tokens per step as
  the homogeneous runs. A host's rows are the first rows of
  ``task.batch(rank, step)`` over ranks that it alone uses. ``hetero mean``
  averages the g_i plainly; ``hetero tokens`` weights them by tokens,
  ``sum_i t_i g_i / sum_i t_i`` (t_i: the rows, or rows x context, host i
  trained on in the round; every sequence has the same length, so rows give
  the same weights). ``hetero DDP``: one AdamW model on all the hosts'
  samples of each step, the loss their mean (DDP at equal tokens).
- ``ddp`` (not trained unless ``--rules`` names it): the same for the
  homogeneous hosts, as bench/outer_lr.py trains it; at 200 steps it is
  bench/results/outer-lr-sweep.md's DDP column.

``mean`` is bench/outer_lr.py's lr 0.3 run, same batches, so its losses should
match bench/results/outer-lr-sweep.md's at the same steps. Each rule's loss is
reported as its change over the baseline of its cell (``mean`` for rda and
the warm-ups, ``hetero mean`` for ``hetero tokens``); one seed per cell, so
read changes under ~1% as noise. This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

if TYPE_CHECKING:
    import torch
    from convergence_tasks import Task

SEED = 0
BASE_MOMENTUM = 0.9  # OuterStep()'s
HETERO_UNITS = (1, 1, 2, 4)  # half-batches per host, repeated for every 4 hosts
DILOCO_RULES = ("mean", "rda", "warmup", "warmup+decay", "hetero mean", "hetero tokens")
DDP_RULES = ("hetero ddp", "ddp")  # independent of H: trained once per (task, M)
DEFAULT_RULES = ("mean", "rda", "warmup", "hetero mean", "hetero tokens", "hetero ddp")
# rule -> the baseline its change is reported over
BASELINES = {
    "rda": "mean",
    "warmup": "mean",
    "warmup+decay": "mean",
    "hetero mean": "mean",
    "hetero tokens": "hetero mean",
}
SUMMARISED = ("rda", "warmup", "warmup+decay", "hetero tokens")


def hetero_units(hosts: int) -> list[int]:
    """Half-batches per host: (1, 1, 2, 4) repeated; the M hosts' units sum to 2 M (as many rows as M batches)."""
    return [HETERO_UNITS[i % len(HETERO_UNITS)] for i in range(hosts)]


def host_ranks(units: Sequence[int]) -> list[list[int]]:
    """The ranks of task.batch each host draws from, disjoint: ceil(u / 2) full batches per host."""
    ranks, next_rank = [], 0
    for unit in units:
        count = (unit + 1) // 2
        ranks.append(list(range(next_rank, next_rank + count)))
        next_rank += count
    return ranks


def host_batch(task: Task, ranks: Sequence[int], unit: int | None, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A host's batch of ``step``: task.batch(rank) when ``unit`` is None, else ``unit`` half-batches of its ranks."""
    import torch

    if unit is None:
        return task.batch(ranks[0], step, SEED)
    parts = [task.batch(rank, step, SEED) for rank in ranks]
    rows = unit * task.batch_size // 2
    return torch.cat([p[0] for p in parts])[:rows], torch.cat([p[1] for p in parts])[:rows]


def momentum_schedule(rule: str, rounds: int) -> list[float]:
    """The outer momentum of each round (see the module docstring)."""
    momenta = [BASE_MOMENTUM] * rounds
    if rule not in ("warmup", "warmup+decay"):
        return momenta
    ramp = max(1, rounds // 4)
    for r in range(min(ramp, rounds)):
        momenta[r] = BASE_MOMENTUM * r / ramp
    if rule == "warmup+decay":
        for r in range(max(ramp, rounds - ramp), rounds):
            momenta[r] = BASE_MOMENTUM * (rounds - 1 - r) / ramp
    return momenta


def mean_rule(grads: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The plain mean over hosts (rows of ``grads``)."""
    return grads.mean(0)


def token_rule(grads: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """sum_i t_i g_i / sum_i t_i."""
    weights = tokens / tokens.sum()
    return (grads * weights[:, None]).sum(0)


def rda_rule(grads: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Radial-Directional Averaging over the whole vector: mean norm times the unit mean of unit directions."""
    norms = grads.norm(dim=1)
    keep = norms > 0
    if not bool(keep.any()):
        return grads.mean(0)
    direction = (grads[keep] / norms[keep, None]).sum(0)
    length = direction.norm()
    if float(length) == 0.0:
        return grads.mean(0)
    return norms.mean() * direction / length


AGGREGATES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mean": mean_rule,
    "rda": rda_rule,
    "warmup": mean_rule,
    "warmup+decay": mean_rule,
    "hetero mean": mean_rule,
    "hetero tokens": token_rule,
}


def held_out_loss(task: Task, model: torch.nn.Module) -> float:
    """The task's loss on its fixed held-out set."""
    import torch

    inputs, targets = task.held_out(SEED)
    with torch.no_grad():
        return float(task.loss(model(inputs), targets))


def fresh_model(task: Task) -> torch.nn.Module:
    """The same initial weights for every run."""
    import torch

    torch.manual_seed(SEED)
    return task.build_model()


def train_ddp(task: Task, hosts: int, hetero: bool, steps: int) -> dict[str, float]:
    """One AdamW model on the mean gradient of all the hosts' samples of each step (DDP at equal tokens)."""
    import torch

    units: list[int | None] = list(hetero_units(hosts)) if hetero else [None] * hosts
    ranks = host_ranks(hetero_units(hosts)) if hetero else [[host] for host in range(hosts)]
    model = fresh_model(task)
    optimizer = torch.optim.AdamW(model.parameters(), lr=task.learning_rates["adamw"])
    for step in range(steps):
        batches = [host_batch(task, r, u, step) for r, u in zip(ranks, units, strict=True)]
        inputs = torch.cat([b[0] for b in batches])
        targets = torch.cat([b[1] for b in batches])
        optimizer.zero_grad()
        task.loss(model(inputs), targets).backward()
        optimizer.step()
    return {"loss": held_out_loss(task, model)}


def train_diloco(task: Task, hosts: int, sync_every: int, rule: str, steps: int) -> dict[str, float]:
    """DiLoCo with ``rule``'s aggregate and momentum schedule; the held-out loss and the RDA norm ratio."""
    import torch

    from gradq.qcore.outer_step import OuterStep, take_outer_step

    hetero = rule.startswith("hetero")
    units: list[int | None] = list(hetero_units(hosts)) if hetero else [None] * hosts
    ranks = host_ranks(hetero_units(hosts)) if hetero else [[host] for host in range(hosts)]
    aggregate = AGGREGATES[rule]
    rounds = math.ceil(steps / sync_every)
    momenta = momentum_schedule(rule, rounds)
    inner_lr = task.learning_rates["adamw"]
    replicas = [fresh_model(task) for _ in range(hosts)]
    inner = [torch.optim.AdamW(r.parameters(), lr=inner_lr) for r in replicas]
    global_flat = torch.nn.utils.parameters_to_vector(replicas[0].parameters()).detach().clone()
    momentum = np.zeros(global_flat.numel(), np.float32)
    tokens = torch.zeros(hosts, dtype=torch.float64)
    ratios: list[float] = []
    round_index = 0
    for step in range(1, steps + 1):
        for host, (replica, optimizer) in enumerate(zip(replicas, inner, strict=True)):
            inputs, targets = host_batch(task, ranks[host], units[host], step - 1)
            tokens[host] += targets.numel()
            optimizer.zero_grad()
            task.loss(replica(inputs), targets).backward()
            optimizer.step()
        if step % sync_every == 0 or step == steps:
            grads = torch.stack(
                [global_flat - torch.nn.utils.parameters_to_vector(r.parameters()).detach() for r in replicas]
            )
            outer_grad = aggregate(grads, tokens.to(grads.dtype)).contiguous()
            mean_norm = float(grads.mean(0).norm())
            if mean_norm > 0:
                ratios.append(float(grads.norm(dim=1).mean()) / mean_norm)
            take_outer_step(global_flat.numpy(), momentum, outer_grad.numpy(), OuterStep(momentum=momenta[round_index]))
            for replica in replicas:
                torch.nn.utils.vector_to_parameters(global_flat, replica.parameters())
            tokens.zero_()
            round_index += 1
    return {"loss": held_out_loss(task, replicas[0]), "norm_ratio": float(np.mean(ratios)) if ratios else 1.0}


def run_job(task_key: str, hosts: int, sync_every: int | None, rule: str, steps: int) -> dict[str, object]:
    """One training run in this process (one thread): a DiLoCo rule at (M, H), or a DDP rule at M."""
    import torch
    from convergence_tasks import TASKS

    torch.set_num_threads(1)
    task = TASKS[task_key]
    began = time.perf_counter()
    if sync_every is None:
        result = train_ddp(task, hosts, rule == "hetero ddp", steps)
    else:
        result = train_diloco(task, hosts, sync_every, rule, steps)
    return {
        "task": task_key,
        "hosts": hosts,
        "sync_every": sync_every,
        "rule": rule,
        "steps": steps,
        **result,
        "seconds": time.perf_counter() - began,
    }


def change(loss: float, base: float) -> float:
    """Percent change of ``loss`` over ``base`` (negative: the rule helped)."""
    return 100.0 * (loss / base - 1.0)


def cells_of(runs: Sequence[dict[str, object]]) -> list[dict[str, object]]:
    """One cell per (task, M, H): every rule's loss, and the DDP runs of its (task, M)."""
    ddp = {(r["task"], r["hosts"], r["rule"]): r["loss"] for r in runs if r["sync_every"] is None}
    cells: dict[tuple[object, object, object], dict[str, object]] = {}
    for run in runs:
        if run["sync_every"] is None:
            continue
        key = (run["task"], run["hosts"], run["sync_every"])
        cell = cells.setdefault(key, {"task": key[0], "hosts": key[1], "sync_every": key[2], "losses": {}})
        cell["losses"][run["rule"]] = run["loss"]  # type: ignore[index]
        if run["rule"] == "rda":
            cell["rda_norm_ratio"] = run["norm_ratio"]
    for (task, hosts, _), cell in cells.items():
        for rule in DDP_RULES:
            if (task, hosts, rule) in ddp:
                cell["losses"][rule] = ddp[(task, hosts, rule)]  # type: ignore[index]
    return list(cells.values())


def render_table(cells: Sequence[dict[str, object]], rules: Sequence[str]) -> str:
    """Per (task, M, H): each rule's loss and, where it has a baseline, its change over it."""
    header = ["task", "M", "H", *rules, *(["RDA norm ratio"] if "rda" in rules else [])]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 3 + "---:|" * (len(header) - 3)]
    for cell in cells:
        losses: dict[str, float] = cell["losses"]  # type: ignore[assignment]
        row = [str(cell["task"]), str(cell["hosts"]), str(cell["sync_every"])]
        for rule in rules:
            base = BASELINES.get(rule)
            text = f"{losses[rule]:.4f}"
            row.append(text if base is None else f"{text} ({change(losses[rule], losses[base]):+.1f}%)")
        if "rda" in rules:
            row.append(f"{float(cell['rda_norm_ratio']):.2f}")  # type: ignore[arg-type]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def render_summary(cells: Sequence[dict[str, object]], rules: Sequence[str]) -> str:
    """Per rule over all cells: mean and worst change, and how many cells it helped or hurt by more than 1%."""
    lines = [
        "| rule | vs | mean change | best (cell) | worst (cell) | helped > 1% | hurt > 1% | within 1% |",
        "|---|---|---:|---|---|---:|---:|---:|",
    ]
    for rule in (r for r in SUMMARISED if r in rules):
        base = BASELINES[rule]
        changes = []
        for cell in cells:
            losses: dict[str, float] = cell["losses"]  # type: ignore[assignment]
            label = f"{cell['task']}, M = {cell['hosts']}, H = {cell['sync_every']}"
            changes.append((change(losses[rule], losses[base]), label))
        values = [c for c, _ in changes]
        best, worst = min(changes), max(changes)
        helped = sum(c < -1 for c in values)
        hurt = sum(c > 1 for c in values)
        lines.append(
            f"| {rule} | {base} | {np.mean(values):+.1f}% | {best[0]:+.1f}% ({best[1]}) | "
            f"{worst[0]:+.1f}% ({worst[1]}) | {helped} | {hurt} | {len(values) - helped - hurt} |"
        )
    return "\n".join(lines)


def job_cost(job: tuple[str, int, int | None, str]) -> float:
    """A rough relative cost, to start the longest jobs first."""
    per_host = {"source-lm": 8.0, "transformer": 4.0, "digits-cnn": 1.5, "digits": 0.3}.get(job[0], 1.0)
    return per_host * job[1]


def main(argv: Sequence[str] | None = None) -> int:
    from convergence_tasks import TASKS

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=["digits", "digits-cnn", "transformer", "source-lm"])
    parser.add_argument("--hosts", nargs="+", type=int, default=[4, 8], help="M, hosts averaged per round")
    parser.add_argument("--syncs", nargs="+", type=int, default=[10, 50], help="H, inner steps per outer round")
    parser.add_argument("--steps", type=int, default=200, help="inner steps per host")
    parser.add_argument(
        "--rules",
        nargs="+",
        default=list(DEFAULT_RULES),
        choices=[*DILOCO_RULES, *DDP_RULES],
        help="what to train (the baselines mean and hetero mean are added where needed)",
    )
    parser.add_argument("--workers", type=int, default=1, help="runs trained at once (one thread each)")
    parser.add_argument("--output", type=Path, default=None, help="write the runs and cells as JSON here too")
    parser.add_argument("--report", type=Path, default=None, help="write the markdown report here too")
    args = parser.parse_args(argv)
    for key in args.tasks:
        if key not in TASKS:
            parser.error(f"--tasks: {key!r} is not a task; expected one of {sorted(TASKS)}")
    if any(m < 1 for m in args.hosts) or any(h < 1 for h in args.syncs) or args.steps < 1:
        parser.error("--hosts, --syncs and --steps take positive values")

    wanted = set(args.rules) | {BASELINES[r] for r in args.rules if r in BASELINES}
    wanted |= {BASELINES[r] for r in list(wanted) if r in BASELINES}
    rules = [r for r in (*DILOCO_RULES, *DDP_RULES) if r in wanted]
    jobs: list[tuple[str, int, int | None, str]] = []
    for task in args.tasks:
        for m in args.hosts:
            jobs += [(task, m, None, rule) for rule in DDP_RULES if rule in wanted]
            jobs += [(task, m, h, rule) for h in args.syncs for rule in DILOCO_RULES if rule in wanted]
    jobs.sort(key=job_cost, reverse=True)
    interpreter = Path(sys.executable)
    if interpreter.is_relative_to(Path.cwd()):
        interpreter = interpreter.relative_to(Path.cwd())
    command = " ".join([str(interpreter), "bench/outer_rules.py", *(sys.argv[1:] if argv is None else argv)])
    began = time.perf_counter()
    runs = []
    with concurrent.futures.ProcessPoolExecutor(args.workers) as pool:
        futures = [pool.submit(run_job, *job, args.steps) for job in jobs]
        for future in concurrent.futures.as_completed(futures):
            run = future.result()
            runs.append(run)
            print(
                f"  {run['task']} M={run['hosts']} H={run['sync_every']} {run['rule']}: "
                f"{run['loss']:.4f} ({run['seconds']:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    seconds = time.perf_counter() - began
    order = {
        (t, m, h): i
        for i, (t, m, h) in enumerate((t, m, h) for t in args.tasks for m in args.hosts for h in args.syncs)
    }
    cells = sorted(cells_of(runs), key=lambda c: order[(c["task"], c["hosts"], c["sync_every"])])  # type: ignore[index]
    report = render_report(command, args, rules, cells, seconds)
    print(report)
    if args.report is not None:
        args.report.write_text(report + "\n")
    if args.output is not None:
        args.output.write_text(json.dumps({"seconds": seconds, "runs": runs, "cells": cells}, indent=1))
    return 0


DEFINITIONS = {
    "mean": "mean: the baseline, mean_i g_i, `OuterStep()` every round.",
    "rda": "rda: mean_i |g_i| * d / |d| with d = sum_i g_i / |g_i|, over the whole model vector (the issue's "
    "definition; Decoupled DiLoCo's exact formula was not retrievable here). RDA norm ratio: the mean over rounds "
    "of mean_i |g_i| / |mean_i g_i|, how much longer RDA's outer gradient is than the mean's.",
    "warmup": "warmup: outer momentum 0.9 r / K in round r < K (0-based), K = max(1, R // 4) of R rounds, 0.9 after "
    "(H = 10: 0, 0.18, 0.36, 0.54, 0.72, then 0.9; H = 50: 0 in the first round only). Pier's exact schedule was "
    "not retrievable here; this is ours.",
    "warmup+decay": "warmup+decay: the same, and 0.9 (R - 1 - r) / K in the last K rounds (0 in the last); ours too.",
    "hetero mean": "hetero mean: host i trains on u_i half-batches, u = (1, 1, 2, 4) repeated, from ranks only it "
    "uses (as many rows per step as the homogeneous hosts together); plain mean (its % is over the homogeneous "
    "mean: what the heterogeneity itself costs).",
    "hetero tokens": "hetero tokens: the same hosts, sum_i t_i g_i / sum_i t_i with t_i the tokens host i trained "
    "on in the round (its % is over hetero mean).",
    "hetero ddp": "hetero ddp: one AdamW model on all the heterogeneous hosts' samples of each step, the loss their "
    "mean (DDP at equal tokens).",
    "ddp": "ddp: the same for the homogeneous hosts, as bench/outer_lr.py trains it.",
}


def render_report(
    command: str, args: argparse.Namespace, rules: Sequence[str], cells: Sequence[dict[str, object]], seconds: float
) -> str:
    """The markdown report: title, command, date, machine, time, definitions, the table and the summary."""
    rounds = ", ".join(f"H = {h}: {math.ceil(args.steps / h)} rounds" for h in args.syncs)
    lines = [
        "# Outer-step rules for DiLoCo: RDA, momentum warm-up, token-weighted means "
        f"({datetime.date(2026, 12, 5).isoformat()})",
        "",
        f"    {command}",
        "",
        f"Machine: 2 cores, shared (another engineer's tests ran at the same time); --workers {args.workers}; "
        f"{seconds:.0f} s in all. {args.steps} inner steps per host ({rounds}), AdamW inner at each task's lr, "
        "outer `OuterStep()` (lr 0.3, momentum 0.9, Nesterov) on an exact fp32 aggregate, no transport; "
        "one seed per cell. The mean column is bench/outer_lr.py's lr 0.3 run (same batches and seed).",
        "",
        "Definitions (g_i = global - local_i, host i's pseudo-gradient of the round):",
        "",
        *[f"- {DEFINITIONS[rule]}" for rule in rules],
        "",
        "Held-out loss per cell; in brackets the change over the rule's baseline (negative: the rule helped):",
        "",
        render_table(cells, rules),
        "",
        "Per rule over all cells (one seed per cell: changes under ~1% are noise):",
        "",
        render_summary(cells, rules),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
