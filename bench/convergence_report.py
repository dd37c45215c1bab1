"""bench/convergence.py's report: final held-out loss, steps to fp32's loss, time to accuracy, the curves' plot."""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TARGET_SLACK", "StepCost", "steps_to_target", "network_step_costs", "format_report", "plot"]

# A row has reached fp32's accuracy when its held-out loss is within this of fp32's final one.
TARGET_SLACK = 0.01

Curve = Mapping[str, list]  # "step", "loss", "accuracy": rank 0's held-out evaluations


def steps_to_target(curve: Curve, target: float) -> int | None:
    """The first evaluated step whose held-out loss is <= ``target``; None if none is."""
    return next((step for step, loss in zip(curve["step"], curve["loss"], strict=True) if loss <= target), None)


@dataclass(frozen=True, slots=True)
class StepCost:
    """What one step of a method cost in a bench/network.py run (medians over the file's rows of it)."""

    ms: float  # wall time per step
    machine_cpu_ms: float  # the whole machine's CPU per step (/proc/stat), other work on it included
    ranks_cpu_ms: float | None  # the training ranks' own CPU per step; None in files from before it was measured
    shards_cpu_ms: float | None  # the aggregator shards' CPU per step (0 for rows without gradq); None likewise


def network_step_costs(path: Path, world: int, rate: str, network_keys: Mapping[str, str]) -> dict[str, StepCost]:
    """Step time and CPU per step of each convergence row's counterpart in a bench/network.py results file.

    Args:
        path: the ``network-<time>.json`` a bench/network.py run wrote.
        world: the scenario's world size.
        rate: its worker link rate (e.g. "1gbit").
        network_keys: convergence row key -> bench/network.py row key.

    Returns:
        convergence row key -> its StepCost, for the rows the file measured.
    """
    measured: dict[str, list[dict[str, Any]]] = {}
    for row in json.loads(path.read_text()):
        scenario = row["scenario"]
        if scenario["world_size"] == world and scenario["worker_rate"] == rate == scenario["aggregator_rate"]:
            measured.setdefault(row["method"]["key"], []).append(row)
    costs = {}
    for key, net in network_keys.items():
        if net in measured:
            rows = measured[net]
            # [h] of bench/network.py: the ranks' and the shards' CPU summed; the shards' share apart.
            split = [row for row in rows if row.get("processes_cpu_ms") is not None]
            shards = [row.get("aggregator_cpu_ms") or 0.0 for row in split]
            ranks = [row["processes_cpu_ms"] - shard for row, shard in zip(split, shards, strict=True)]
            costs[key] = StepCost(
                ms=statistics.median(row["step_ms"] for row in rows),
                machine_cpu_ms=statistics.median(row["cpu_ms"] for row in rows),
                ranks_cpu_ms=statistics.median(ranks) if ranks else None,
                shards_cpu_ms=statistics.median(shards) if shards else None,
            )
    return costs


def format_report(
    curves: Mapping[str, Mapping[str, Mapping[str, Curve]]],
    labels: Mapping[str, str],
    task_labels: Mapping[str, str],
    step_times: Mapping[str, StepCost] | None,
) -> str:
    """One table per (task, optimizer): final held-out loss, gap to fp32, steps (and time) to fp32's loss."""
    sections = []
    for task, by_optimizer in curves.items():
        for optimizer, rows in by_optimizer.items():
            sections.append(_table(task_labels.get(task, task), optimizer, rows, labels, step_times))
    return "\n\n".join(sections)


def _table(
    task: str,
    optimizer: str,
    rows: Mapping[str, Curve],
    labels: Mapping[str, str],
    step_times: Mapping[str, StepCost] | None,
) -> str:
    reference = rows["fp32"]["loss"][-1]
    target = reference * (1 + TARGET_SLACK)
    budget = rows["fp32"]["step"][-1]
    has_accuracy = rows["fp32"]["accuracy"][-1] is not None
    header = ["method", "final held-out loss", "vs fp32"]
    header += ["final accuracy", "vs fp32 (points)"] if has_accuracy else []
    header += [f"steps to fp32 loss +{100 * TARGET_SLACK:g}%"]
    if step_times:
        header += ["ms/step (network)", "machine CPU ms/step", "ranks' CPU ms/step", "shards' CPU ms/step"]
        header += ["time to fp32 loss (s)", "x allreduce"]
    lines = [
        f"### {task}, {optimizer.upper() if optimizer == 'sgd' else 'AdamW'}: fp32's final held-out loss "
        f"{reference:.4f} after {budget} steps (target <= {target:.4f})",
        "",
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * (len(header) - 1),
    ]
    reference_seconds = _seconds(rows["fp32"], target, step_times, "fp32")
    for key, curve in rows.items():
        if curve.get("diverged_at"):
            cells = [labels.get(key, key), f"diverged (NaN/Inf) at step {curve['diverged_at'][0]}", "-"]
            cells += ["-", "-"] if has_accuracy else []
        else:
            loss = curve["loss"][-1]
            cells = [labels.get(key, key), f"{loss:.4f}", f"{100 * (loss / reference - 1):+.2f}%"]
            if has_accuracy:
                accuracy = curve["accuracy"][-1]
                cells += [f"{accuracy:.1f}%", f"{accuracy - rows['fp32']['accuracy'][-1]:+.1f}"]
        reached = steps_to_target(curve, target)
        cells.append("never" if reached is None else str(reached))
        if step_times:
            seconds = _seconds(curve, target, step_times, key)
            cost = step_times.get(key)
            if cost is None:
                cells += ["not measured"] * 4
            else:
                cells += [f"{cost.ms:.1f}", f"{cost.machine_cpu_ms:.1f}"]
                split = (cost.ranks_cpu_ms, cost.shards_cpu_ms)
                cells += ["not measured" if ms is None else f"{ms:.1f}" for ms in split]
            cells.append("-" if seconds is None else f"{seconds:.1f}")
            speedup = reference_seconds / seconds if seconds and reference_seconds else None
            cells.append("-" if speedup is None else f"{speedup:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _seconds(curve: Curve, target: float, step_times: Mapping[str, StepCost] | None, key: str) -> float | None:
    reached = steps_to_target(curve, target)
    if reached is None or not step_times or key not in step_times:
        return None
    return reached * step_times[key].ms / 1e3


def plot(curves: Mapping[str, Mapping[str, Mapping[str, Curve]]], labels: Mapping[str, str], path: Path) -> Any:
    """Held-out loss against steps, one panel per (task, optimizer); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError:
        return None
    panels = [(task, optimizer, rows) for task, by in curves.items() for optimizer, rows in by.items()]
    figure, axes = pyplot.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for axis, (task, optimizer, rows) in zip(axes[0], panels, strict=True):
        for key, curve in rows.items():
            axis.plot(curve["step"], curve["loss"], label=labels.get(key, key), linewidth=2 if key == "fp32" else 1)
        axis.set_title(f"{task}, {optimizer}")
        axis.set_xlabel("step")
        axis.set_ylabel("held-out loss")
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    return path
