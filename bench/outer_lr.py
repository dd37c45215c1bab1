"""Which outer learning rate DiLoCo should default to, by number of hosts: a sweep on several tasks.

Run from the repository root with the virtualenv's interpreter::

    python bench/outer_lr.py                                   # every task, M = 2, 4, 8, H = 10 and 50
    python bench/outer_lr.py --tasks digits source-lm --hosts 4 --syncs 10 --lrs 0.3 0.7

DiLoCo's outer step is what gradq's aggregator runs (gradq.qcore.outer_step:
SGD, momentum 0.9, Nesterov) on the exact fp32 mean of the hosts' outer
gradients: M model replicas in this process, each with its own AdamW inner
optimizer and its own batches (bench/convergence_tasks.py: the same data
every row sees), synced every H inner steps. No gRPC and no quantization: the
question is the optimizer's, and gradq's DiLoCo equals this exact one within
0.13% (issue 42's outside measurement). Beside each (task, M, H) it trains DDP
at equal tokens (AdamW on the mean of the M batches' gradients), and reports
each outer lr's held-out loss over the best one's of that (task, M, H), so a
rule for the default can be judged by its worst regret across tasks, tasks
held back from gradq's tuning included. One seed per cell: read differences
under ~1% as noise. This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

SEED = 0
DEFAULT_LRS = (0.3, 0.5, 0.7, 0.9)


def run_cell(task_key: str, hosts: int, sync_every: int, lrs: Sequence[float], steps: int) -> dict[str, object]:
    """Held-out losses of DDP and of DiLoCo at each outer lr, for one (task, M, H); one thread."""
    import torch
    from convergence_tasks import TASKS

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

    # DDP at equal tokens: one model stepping on the mean gradient of the M hosts' batches.
    model = fresh()
    optimizer = torch.optim.AdamW(model.parameters(), lr=inner_lr)
    for step in range(steps):
        optimizer.zero_grad()
        for host in range(hosts):
            inputs, targets = task.batch(host, step, SEED)
            (task.loss(model(inputs), targets) / hosts).backward()
        optimizer.step()
    losses: dict[str, float] = {"ddp": held_out_loss(model)}

    for lr in lrs:
        outer = OuterStep(lr=lr)
        replicas = [fresh() for _ in range(hosts)]
        inner = [torch.optim.AdamW(r.parameters(), lr=inner_lr) for r in replicas]
        global_flat = torch.nn.utils.parameters_to_vector(replicas[0].parameters()).detach().clone()
        momentum = np.zeros(global_flat.numel(), np.float32)
        for step in range(1, steps + 1):
            for host, (replica, optimizer) in enumerate(zip(replicas, inner, strict=True)):
                inputs, targets = task.batch(host, step - 1, SEED)
                optimizer.zero_grad()
                task.loss(replica(inputs), targets).backward()
                optimizer.step()
            if step % sync_every == 0 or step == steps:
                # The outer gradient: global - local, averaged over the hosts (exact fp32).
                mean = torch.stack(
                    [global_flat - torch.nn.utils.parameters_to_vector(r.parameters()).detach() for r in replicas]
                ).mean(0)
                parameters = global_flat.numpy()
                take_outer_step(parameters, momentum, mean.numpy(), outer)
                for replica in replicas:
                    torch.nn.utils.vector_to_parameters(global_flat, replica.parameters())
        losses[f"{lr:g}"] = held_out_loss(replicas[0])
    return {"task": task_key, "hosts": hosts, "sync_every": sync_every, "steps": steps, "losses": losses}


def render(cells: Sequence[dict[str, object]], lrs: Sequence[float]) -> str:
    """One row per (task, M, H): DDP, each lr's loss and its regret over the row's best DiLoCo."""
    header = ["task", "M", "H", "DDP", *[f"lr {lr:g}" for lr in lrs], "best lr", "best vs DDP"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cell in cells:
        losses: dict[str, float] = cell["losses"]  # type: ignore[assignment]
        diloco = {lr: losses[f"{lr:g}"] for lr in lrs}
        best_lr = min(diloco, key=lambda lr: diloco[lr])
        best = diloco[best_lr]
        row = [str(cell["task"]), str(cell["hosts"]), str(cell["sync_every"]), f"{losses['ddp']:.4f}"]
        row += [f"{diloco[lr]:.4f} (+{100 * (diloco[lr] / best - 1):.1f}%)" for lr in lrs]
        row += [f"{best_lr:g}", f"{100 * (best / losses['ddp'] - 1):+.1f}%"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from convergence_tasks import TASKS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=["digits", "digits-cnn", "transformer", "source-lm"])
    parser.add_argument("--hosts", nargs="+", type=int, default=[2, 4, 8], help="M, hosts averaged per round")
    parser.add_argument("--syncs", nargs="+", type=int, default=[10, 50], help="H, inner steps per outer round")
    parser.add_argument("--lrs", nargs="+", type=float, default=list(DEFAULT_LRS), help="outer learning rates")
    parser.add_argument("--steps", type=int, default=300, help="inner steps per host")
    parser.add_argument("--workers", type=int, default=2, help="cells trained at once (one thread each)")
    parser.add_argument("--output", type=Path, default=None, help="write the cells as JSON here too")
    args = parser.parse_args(argv)
    for key in args.tasks:
        if key not in TASKS:
            parser.error(f"--tasks: {key!r} is not a task; expected one of {sorted(TASKS)}")
    if any(lr <= 0 for lr in args.lrs) or any(m < 1 for m in args.hosts) or any(h < 1 for h in args.syncs):
        parser.error("--lrs, --hosts and --syncs take positive values")

    jobs = [(task, m, h) for task in args.tasks for m in args.hosts for h in args.syncs]
    began = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(args.workers) as pool:
        futures = {job: pool.submit(run_cell, *job, args.lrs, args.steps) for job in jobs}
        cells = []
        for job in jobs:
            cells.append(futures[job].result())
            print(f"  {job[0]} M={job[1]} H={job[2]}: {cells[-1]['losses']}", flush=True)
    print(f"\n# outer lr sweep ({args.steps} inner steps per host, AdamW inner, SGD Nesterov 0.9 outer)\n")
    print(render(cells, args.lrs))
    print(f"\n{time.perf_counter() - began:.0f} s")
    if args.output is not None:
        args.output.write_text(json.dumps(cells, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
