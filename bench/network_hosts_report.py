"""bench/network.py's report on hosts of several ranks (--hosts HxL): their table and the two-level targets."""

from __future__ import annotations

from collections.abc import Sequence

from cpu_busy import CORES
from network_report import MEGA, Row, find_row, format_optional, format_percent, verdict

__all__ = ["flat_counterpart", "host_sections"]

# The targets for two-level aggregation (docs/performance.md#targets).
TARGET_BYTES_SLACK = 1.05  # two-level host link bytes <= (1/L) x flat gradq's + 5%
TARGET_STEP_RATIO = 0.7  # two-level step <= 0.7 x flat gradq's step ...
TARGET_STEP_RANKS_PER_HOST = 2  # ... at 2 hosts x 2 ranks
TARGET_RATE = "1gbit"


def flat_counterpart(rows: Sequence[Row], row: Row) -> Row | None:
    """The flat gradq row (host_grouping="flat") of the same scenario and grid as a two-level ``row``."""
    method = row.method
    for other in rows:
        if other.scenario == row.scenario and not other.method.two_level and other.method.bits is not None:
            grid = (other.method.bits, other.method.error_feedback, other.method.shards, other.method.scheme)
            if grid == (method.bits, method.error_feedback, method.shards, method.scheme):
                return other
    return None


def _host_bytes(row: Row) -> float:
    """Bytes per step through one host's link, the larger direction (mean over hosts)."""
    return max(row.tx_per_step, row.rx_per_step)


def _host_rows(rows: Sequence[Row]) -> list[Row]:
    return [row for row in rows if row.scenario.ranks_per_host > 1]


def _table(rows: Sequence[Row]) -> list[str]:
    lines = [
        "| hosts x ranks | links | method | ms/step | x faster than allreduce | compute-only ms | link ms [a] "
        "| host link MB sent/step [h] | host link MB received/step [h] | x flat gradq's host bytes "
        f"| machine CPU ms/step [g] | cores busy % [g] | CPU ms / {CORES} cores [g] | aggregator CPU ms/step [i] |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        scenario = row.scenario
        allreduce, compute = find_row(rows, scenario, "allreduce"), find_row(rows, scenario, "compute-only")
        flat = flat_counterpart(rows, row) if row.method.two_level else None
        aggregator = f"{row.aggregator_cpu_ms:.1f}" if row.method.bits is not None else "-"
        speedup = None if allreduce is None else allreduce.step_ms / row.step_ms
        lines.append(
            f"| {scenario.hosts} x {scenario.ranks_per_host} | {scenario.links()} | {row.method.label} "
            f"| {row.step_ms:.1f} | {format_optional(speedup, '.2f')} "
            f"| {format_optional(None if compute is None else compute.step_ms, '.1f')} "
            f"| {format_optional(row.link_ms(), '.1f')} | {row.tx_per_step / MEGA:.2f} | {row.rx_per_step / MEGA:.2f} "
            f"| {format_optional(None if flat is None else _host_bytes(row) / _host_bytes(flat), '.3f')} "
            f"| {row.cpu_ms:.1f} | {format_percent(row.busy)} | {row.cpu_floor_ms:.1f} | {aggregator} |"
        )
    return lines


FOOTNOTES = """\
Every host (a namespace of L ranks) has one shaped link; its ranks talk over the
namespace's loopback, unshaped and not counted. gradq rows without "two-level" run
host_grouping="flat" (every rank pushes its whole bucket, today's path); two-level rows
pass host=<namespace>, so each rank pushes 1/L of the host's sum.
[a] Time the busiest shaped link needs for the row's bytes per step: a host link carries
    max(sent, received) of the host; a shard's link the busiest shard's share of every host's.
[g] /proc/stat over rank 0's timed steps: the whole machine's CPU time per step (every rank,
    shard and the kernel's veth/tc work, and also anything else running on the machine), and
    the share of the cores it kept busy. Near 100% busy a row is CPU-bound here: it cannot
    step faster than CPU ms / cores.
[h] tx/rx counters of the host's veth over the timed steps, divided by the steps: everything
    the host's L ranks sent or received through its link. Mean over the hosts.
[i] User + system CPU time of the aggregator shards' processes (/proc/<pid>/stat) over rank
    0's timed steps, per step. Part of the machine CPU column."""


def _bytes_targets(rows: Sequence[Row]) -> list[str]:
    lines = []
    for row in (row for row in rows if row.method.two_level):
        scenario, flat = row.scenario, flat_counterpart(rows, row)
        ranks = scenario.ranks_per_host
        name = (
            f"{scenario.model} {scenario.size()} {scenario.links()}: {row.method.label} host link bytes "
            f"<= (1/{ranks}) x flat's + 5%"
        )
        if flat is None:
            lines.append(verdict(None, name, "needs the flat gradq row of the same grid"))
            continue
        bound = _host_bytes(flat) / ranks * TARGET_BYTES_SLACK
        detail = (
            f"{_host_bytes(row) / MEGA:.2f} MB vs flat {_host_bytes(flat) / MEGA:.2f} MB; bound {bound / MEGA:.2f} MB"
        )
        lines.append(verdict(_host_bytes(row) <= bound, name, detail))
    return lines


def _step_targets(rows: Sequence[Row]) -> list[str]:
    lines = []
    for row in (row for row in rows if row.method.two_level):
        scenario, flat = row.scenario, flat_counterpart(rows, row)
        if scenario.ranks_per_host != TARGET_STEP_RANKS_PER_HOST or scenario.worker_rate != TARGET_RATE:
            continue
        name = f"{scenario.model} {scenario.size()} {scenario.links()}: {row.method.label} step"
        name += f" <= {TARGET_STEP_RATIO} x flat's"
        if flat is None:
            lines.append(verdict(None, name, "needs the flat gradq row of the same grid"))
            continue
        ratio = row.step_ms / flat.step_ms
        detail = f"{row.step_ms:.1f} ms / {flat.step_ms:.1f} ms = {ratio:.2f}"
        needed = TARGET_STEP_RATIO * flat.step_ms
        if ratio > TARGET_STEP_RATIO:
            compute = find_row(rows, scenario, "compute-only")
            detail += f"; needs <= {needed:.1f} ms, and its CPU alone needs >= {row.cpu_floor_ms:.1f} ms/step"
            detail += f" on {CORES} cores"
            detail += f" ({format_percent(row.busy)}% busy; column 'CPU ms / {CORES} cores')"
            if compute is not None:
                detail += f"; compute-only takes {compute.step_ms:.1f} ms"
            if row.cpu_floor_ms > needed:
                detail += ": unreachable on these shared cores"
        lines.append(verdict(ratio <= TARGET_STEP_RATIO, name, detail))
    return lines


def _aggregator_targets(rows: Sequence[Row]) -> list[str]:
    """Aggregator CPU per step: two-level below flat, and its share of flat's shrinking as L grows."""
    lines = []
    grids = dict.fromkeys((row.scenario.model, row.method.label) for row in rows if row.method.two_level)
    for model, label in grids:
        measured = []  # (L, two-level ms, flat ms)
        for row in rows:
            flat = flat_counterpart(rows, row)
            if row.scenario.model == model and row.method.label == label and flat is not None:
                measured.append((row.scenario.ranks_per_host, row.aggregator_cpu_ms, flat.aggregator_cpu_ms))
        name = f"{model}: {label}, aggregator CPU per step falls with L (below flat's, share of flat's falling)"
        if not measured:
            lines.append(verdict(None, name, "needs the flat gradq row of the same grid"))
            continue
        measured.sort()
        ratios = [two_level / flat if flat > 0 else float("inf") for _, two_level, flat in measured]
        falling = all(later < earlier for earlier, later in zip([1.0, *ratios], ratios, strict=False))
        detail = "; ".join(
            f"L={ranks}: {two_level:.1f} vs flat {flat:.1f} ms = {ratio:.2f}"
            for (ranks, two_level, flat), ratio in zip(measured, ratios, strict=True)
        )
        lines.append(verdict(falling, name, detail))
    return lines


def host_sections(rows: Sequence[Row]) -> list[str]:
    """Markdown lines for the scenarios whose hosts hold several ranks (none when there are none)."""
    chosen = _host_rows(rows)
    if not chosen:
        return []
    lines = ["", "## hosts of several ranks: flat vs two-level gradq"]
    for model in dict.fromkeys(row.scenario.model for row in chosen):
        model_rows = [row for row in chosen if row.scenario.model == model]
        lines += ["", f"### {model} ({model_rows[0].numel:,} parameters)", "", *_table(model_rows)]
    targets = _bytes_targets(chosen) + _step_targets(chosen) + _aggregator_targets(chosen)
    return [*lines, "", FOOTNOTES, "", "## targets (hosts of several ranks)", "", *targets]
