"""The report of bench/network.py: rows from the ranks' measurements, the markdown tables, the targets, the plot."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import netns
from cpu_busy import CORES

from gradq.client.chunks import chunk_bounds, chunk_key, shard_for, slow_link_chunk_elements
from gradq.client.session.host_groups import piece_bounds
from gradq.qcore import QuantConfig, Scheme

__all__ = [
    "Method",
    "MethodResult",
    "Scenario",
    "Row",
    "find_row",
    "format_optional",
    "format_percent",
    "make_row",
    "plot",
    "render",
    "verdict",
]

FP32_BYTES = 4
MEGA = 1e6
# The targets (docs/performance.md#targets).
TARGET_RATE = "1gbit"
TARGET_WORLD = 4
TARGET_SPEEDUP = {8: 2.0, 4: 3.5}  # gloo allreduce fp32 time / gradq time
TARGET_SHARD_GAIN = 1.6


@dataclass(frozen=True, slots=True)
class Method:
    """One row kind of the report."""

    key: str  # name on the command line
    label: str  # name in the table
    bits: int | None = None  # gradq push bits; None: no aggregator involved
    error_feedback: bool = False  # gradq: carry quantization error into the next step
    shards: int = 0  # gradq: aggregator shards used
    scheme: str = "per_channel_affine"  # gradq push scheme
    channel_size: int = 0  # gradq: elements per channel; 0: QuantConfig's default for the bits
    two_level: bool = False  # gradq: reduce inside each host first (host=...); otherwise host_grouping="flat"


@dataclass(frozen=True, slots=True)
class Scenario:
    """One job: a model at one world size over links shaped one way."""

    model: str
    world_size: int
    worker_rate: str | None  # tc rate of every worker link; None: unshaped
    aggregator_rate: str | None  # tc rate of every aggregator link; None: unshaped
    methods: tuple[str, ...]
    warmup: int
    steps: int
    chunk_elements: int | None  # gradq's largest round (GradqHookState.chunk_elements); None: per grid, slow-link
    ranks_per_host: int = 1  # L: ranks sharing one host's namespace and link (--hosts HxL)

    @property
    def hosts(self) -> int:
        """Emulated hosts (worker namespaces) of the scenario."""
        return self.world_size // self.ranks_per_host

    @property
    def aggregator_bottleneck(self) -> bool:
        """Only the aggregators' links are shaped: the shard scenario."""
        return self.worker_rate is None and self.aggregator_rate is not None

    def links(self) -> str:
        """The link rates in words."""
        if self.worker_rate == self.aggregator_rate:
            return f"all {self.worker_rate or 'unshaped'}"
        return f"workers {self.worker_rate or 'unshaped'}, aggregators {self.aggregator_rate or 'unshaped'}"

    def describe(self) -> str:
        """One line for the progress log."""
        return f"{self.model}, {self.size()}, {self.links()}: {len(self.methods)} methods"

    def size(self) -> str:
        """``world 4``, or ``2 hosts x 2 ranks`` when hosts hold several ranks."""
        if self.ranks_per_host == 1:
            return f"world {self.world_size}"
        return f"{self.hosts} hosts x {self.ranks_per_host} ranks"


@dataclass(slots=True)
class MethodResult:
    """What one rank measured for one method (JSON between the rank and the orchestrator)."""

    key: str
    step_s: list[float]  # timed steps, in order
    window_s: list[float]  # per step: first bucket ready -> backward returned (hooked methods only)
    tail_s: list[float]  # per step: last bucket ready (compute done) -> backward returned
    tx_per_step: float  # bytes this rank's host device sent per timed step, headers included
    rx_per_step: float  # bytes it received
    bucket_numels: list[int]  # elements per DDP bucket, in index order (hooked methods only)
    numel: int  # model parameters
    cpu_busy_s: float = 0.0  # the machine's busy CPU time over the timed steps, all cores
    cpu_total_s: float = 0.0  # busy + idle time of all cores over the same interval
    aggregator_cpu_s: float = 0.0  # CPU time of the aggregator shards' processes over the same interval
    rank_cpu_s: float = 0.0  # CPU time of this rank's own process (all its threads) over its timed steps


@dataclass(frozen=True, slots=True)
class Row:
    """One (scenario, method) measurement, ranks combined."""

    scenario: Scenario
    method: Method
    step_ms: float  # median of rank 0's timed steps
    tail_ms: float | None  # median of rank 0's tails
    hidden_ms: float | None  # median of rank 0's (window - tail): communication while backward computed
    overlap: float | None  # median over rank 0's steps of (window - tail) / window
    tx_per_step: float  # mean over ranks
    rx_per_step: float  # mean over ranks
    largest_share: float | None  # gradq: the busiest shard's share of the gradient elements
    numel: int
    cpu_ms: float  # the machine's CPU time per timed step (rank 0's reading), all cores together
    busy: float | None  # share of the cores' time that was busy over the timed steps
    aggregator_cpu_ms: float  # the aggregator shards' CPU time per timed step (rank 0's reading)
    processes_cpu_ms: float = 0.0  # every rank's own CPU time plus the shards', per timed step

    @property
    def cpu_floor_ms(self) -> float:
        """The step time this machine's cores allow at most: CPU per step / cores."""
        return self.cpu_ms / CORES

    def link_ms(self) -> float | None:
        """Time the busiest shaped link needs for this row's bytes per step (None: nothing shaped).

        A worker (host) link carries what the host sends and receives (full duplex: the
        larger). A shard's link carries the busiest shard's share of every host's bytes.
        """
        scenario, seconds = self.scenario, []
        per_worker = max(self.tx_per_step, self.rx_per_step)
        if scenario.worker_rate is not None:
            seconds.append(8 * per_worker / netns.parse_rate(scenario.worker_rate))
        if scenario.aggregator_rate is not None and self.largest_share is not None:
            per_shard = scenario.hosts * per_worker * self.largest_share
            seconds.append(8 * per_shard / netns.parse_rate(scenario.aggregator_rate))
        return 1e3 * max(seconds) if seconds else None

    def to_json(self) -> dict[str, Any]:
        """Plain fields, for the raw results file."""
        return {**asdict(self), "link_ms": self.link_ms()}


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def gradq_grid(method: Method, chunk_elements: int | None) -> tuple[QuantConfig, int]:
    """A gradq row's push grid and largest round: the run's ``chunk_elements``, else the library's slow-link round."""
    config = QuantConfig(Scheme.parse(method.scheme), method.bits or 8, method.channel_size)
    return config, chunk_elements or slow_link_chunk_elements(config)


def _largest_share(
    bucket_numels: Sequence[int], method: Method, chunk_elements: int | None, pieces: int
) -> float | None:
    # The client's own rules: buckets cut into pieces (two-level; round key b * pieces + p), pieces
    # into chunk rounds, each round's key picks its shard.
    shards = method.shards
    if shards < 1 or not bucket_numels:
        return None
    config, rounds = gradq_grid(method, chunk_elements)
    loads = [0] * shards
    for bucket, numel in enumerate(bucket_numels):
        for piece, (piece_begin, piece_end) in enumerate(piece_bounds(numel, config.channel_size, pieces)):
            key = bucket * pieces + piece
            for index, (begin, end) in enumerate(
                chunk_bounds(piece_end - piece_begin, rounds, config.channel_size, shards)
            ):
                loads[shard_for(chunk_key(key, index), shards)] += end - begin
    return max(loads) / sum(loads)


def make_row(scenario: Scenario, method: Method, per_rank: Sequence[MethodResult]) -> Row:
    """Combine the ranks' results for ``method`` (rank 0 first) into a Row."""
    first = per_rank[0]
    steps = list(zip(first.window_s, first.tail_s, strict=True))
    tail = _median(first.tail_s)
    hidden = _median([window - after for window, after in steps])
    return Row(
        scenario=scenario,
        method=method,
        step_ms=1e3 * statistics.median(first.step_s),
        tail_ms=None if tail is None else 1e3 * tail,
        hidden_ms=None if hidden is None else 1e3 * hidden,
        overlap=_median([(window - after) / window for window, after in steps if window > 0]),
        tx_per_step=statistics.fmean(result.tx_per_step for result in per_rank),
        rx_per_step=statistics.fmean(result.rx_per_step for result in per_rank),
        largest_share=_largest_share(
            first.bucket_numels, method, scenario.chunk_elements, scenario.ranks_per_host if method.two_level else 1
        ),
        numel=first.numel,
        cpu_ms=1e3 * first.cpu_busy_s / len(first.step_s),
        busy=first.cpu_busy_s / first.cpu_total_s if first.cpu_total_s > 0 else None,
        aggregator_cpu_ms=1e3 * first.aggregator_cpu_s / len(first.step_s),
        processes_cpu_ms=1e3
        * (sum(result.rank_cpu_s for result in per_rank) + first.aggregator_cpu_s)
        / len(first.step_s),
    )


# -- tables --------------------------------------------------------------------------------------


def find_row(rows: Sequence[Row], scenario: Scenario, key: str) -> Row | None:
    """The row of ``key`` in ``scenario``, if measured."""
    return next((row for row in rows if row.scenario == scenario and row.method.key == key), None)


def format_optional(value: float | None, form: str) -> str:
    """``value`` formatted, or ``-`` when None."""
    return "-" if value is None else format(value, form)


def format_percent(fraction: float | None) -> str:
    """A fraction as a whole percentage, or ``-``."""
    return "-" if fraction is None else f"{100 * fraction:.0f}"


def _main_table(rows: Sequence[Row], model: str) -> list[str]:
    lines = [
        "| world | links | method | ms/step | x faster than allreduce | compute-only ms | exposed comm ms "
        "| link ms [a] | overlap % [b] | tail ms [b] | wire MB sent/worker/step [c] | wire MB received/worker/step "
        f"| machine CPU ms/step [g] | cores busy % [g] | CPU ms / {CORES} cores [g] | ranks + shards CPU ms/step [h] |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        scenario = row.scenario
        if scenario.model != model or scenario.aggregator_bottleneck or scenario.ranks_per_host > 1:
            continue
        allreduce, compute = find_row(rows, scenario, "allreduce"), find_row(rows, scenario, "compute-only")
        speedup = None if allreduce is None else allreduce.step_ms / row.step_ms
        compute_ms = None if compute is None else compute.step_ms
        lines.append(
            f"| {scenario.world_size} | {scenario.links()} | {row.method.label} | {row.step_ms:.1f} "
            f"| {format_optional(speedup, '.2f')} | {format_optional(compute_ms, '.1f')} "
            f"| {format_optional(None if compute_ms is None else row.step_ms - compute_ms, '.1f')} "
            f"| {format_optional(row.link_ms(), '.1f')} | {format_percent(row.overlap)} "
            f"| {format_optional(row.tail_ms, '.1f')} | {row.tx_per_step / MEGA:.2f} | {row.rx_per_step / MEGA:.2f} "
            f"| {row.cpu_ms:.1f} | {format_percent(row.busy)} | {row.cpu_floor_ms:.1f} | {row.processes_cpu_ms:.1f} |"
        )
    return lines


def _shard_rows(rows: Sequence[Row]) -> list[Row]:
    return [row for row in rows if row.scenario.aggregator_bottleneck]


def _with_shards(rows: Sequence[Row], scenario: Scenario, shards: int) -> Row | None:
    return next((row for row in rows if row.scenario == scenario and row.method.shards == shards), None)


def _gradient_rate(row: Row) -> float:
    """fp32 gradient bytes averaged per second: every worker's gradient, once per step."""
    return row.scenario.world_size * FP32_BYTES * row.numel / (row.step_ms / 1e3)


def _shard_table(rows: Sequence[Row]) -> list[str]:
    lines = [
        "| model | world | links | shards | busiest shard's share [d] | ms/step | gradient MB/s [e] "
        "| wire MB/s into the aggregators [f] | x one shard |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in _shard_rows(rows):
        one = _with_shards(rows, row.scenario, 1)
        gain = None if one is None else _gradient_rate(row) / _gradient_rate(one)
        wire_rate = row.scenario.world_size * row.tx_per_step / (row.step_ms / 1e3)
        lines.append(
            f"| {row.scenario.model} | {row.scenario.world_size} | {row.scenario.links()} | {row.method.shards} "
            f"| {format_optional(row.largest_share, '.3f')} | {row.step_ms:.1f} | {_gradient_rate(row) / MEGA:.1f} "
            f"| {wire_rate / MEGA:.1f} | {format_optional(gain, '.2f')} |"
        )
    return lines


FOOTNOTES = """\
[a] Time the busiest shaped link needs for the row's bytes: a worker link carries
    max(sent, received) of one worker; a shard's link carries the busiest shard's share
    of every worker's bytes (gradq rows). Exposed comm = ms/step - compute-only ms;
    exposed < link ms means part of the wire time was hidden behind backward.
[b] From the hook wrapper's timestamps (no hook, no figure: gloo allreduce runs DDP's
    built-in path). Window = first bucket ready -> backward returns; tail = last bucket
    ready (backward's compute done) -> backward returns; overlap = (window - tail) /
    window, the share of the communication window during which backward still computed.
    The seed rows' hook blocks backward until the previous bucket is done (see
    seed_hooks.ordered_buckets_hook), which stretches the first part: their overlap overstates.
[c] tx/rx byte counters of the worker's own veth over the timed steps (between two
    barriers), divided by the steps: payload plus gRPC/HTTP2, gloo and TCP/IP framing.
    Mean over the workers. The veth counts TCP/IP headers once per GSO packet (up to
    64 KiB), so a real Ethernet link would carry a few percent more.
[g] /proc/stat over rank 0's timed steps (bench/cpu_busy.py): CPU time of the whole machine
    per step (every rank and shard, and the kernel's veth, bridge and tc work, which no
    process is charged for), and the share of the cores it kept busy. Every emulated host
    shares this machine's cores, so a row near 100% busy is CPU-bound here, not
    link-bound: it cannot step faster than the last column, CPU ms / cores.
[h] The bench's own processes only: each rank's CPU time (all its threads, user + system)
    over its timed steps, summed over the ranks, plus the aggregator shards' over rank 0's,
    per step. Other work on the machine does not enter it, as it does [g]; the kernel's
    softirq work for the links, which no process is charged for, does not either."""

SHARD_FOOTNOTES = """\
[d] Share of the gradient elements on the busiest shard, by the client's own rules
    (client/chunks.py): buckets cut into rounds of at most --chunk-elements, a multiple
    of the shard count of them, and round i of bucket b on shard (b + i) mod shards;
    when the busiest shard's link sets the pace, two shards gain about 1 / share over one.
[e] world x 4 bytes x parameters / median step time: fp32 gradient bytes averaged per second.
[f] Sum of the workers' sent bytes per step / median step time."""


# -- targets -------------------------------------------------------------------------------------


def verdict(passed: bool | None, name: str, detail: str) -> str:
    """One target line: PASS, FAIL or SKIP (``passed`` None), its name and the numbers."""
    outcome = "SKIP" if passed is None else "PASS" if passed else "FAIL"
    return f"- {outcome} {name}: {detail}"


def _at_target(rows: Sequence[Row]) -> dict[str, list[Row]]:
    """Rows at world TARGET_WORLD on all-TARGET_RATE links, by model."""
    chosen: dict[str, list[Row]] = {}
    for row in rows:
        scenario = row.scenario
        if (
            scenario.ranks_per_host == 1
            and scenario.world_size == TARGET_WORLD
            and scenario.worker_rate == scenario.aggregator_rate == TARGET_RATE
        ):
            chosen.setdefault(scenario.model, []).append(row)
    return chosen


def _speedup_targets(rows: Sequence[Row]) -> list[str]:
    lines = []
    for model, chosen in _at_target(rows).items():
        allreduce = next((row for row in chosen if row.method.key == "allreduce"), None)
        for bits, limit in TARGET_SPEEDUP.items():
            for row in (row for row in chosen if row.method.bits == bits):
                name = (
                    f"{model}: {row.method.label} >= {limit}x faster than gloo allreduce fp32 ({TARGET_RATE}, world 4)"
                )
                if allreduce is None:
                    lines.append(verdict(None, name, "allreduce not measured"))
                    continue
                speedup = allreduce.step_ms / row.step_ms
                detail = f"{allreduce.step_ms:.1f} ms / {row.step_ms:.1f} ms = {speedup:.2f}x"
                if speedup < limit:
                    detail += (
                        f"; needs <= {allreduce.step_ms / limit:.1f} ms, and its CPU alone needs "
                        f">= {row.cpu_floor_ms:.1f} ms/step on {CORES} cores "
                        f"({format_percent(row.busy)}% busy; see [g])"
                    )
                lines.append(verdict(speedup >= limit, name, detail))
    return lines


def _allgather_targets(rows: Sequence[Row]) -> list[str]:
    lines = []
    for shards in (1, 2, 4):
        gradq = [row for row in rows if row.method.bits == 8 and row.method.shards == shards]
        gradq = [row for row in gradq if row.scenario.worker_rate == TARGET_RATE]
        name = f"gradq 8-bit, {shards} shard(s) faster than the seed allgather hook at every world size ({TARGET_RATE})"
        pairs = [(row, find_row(rows, row.scenario, "seed-pertensor")) for row in gradq]
        measured = [(row, seed) for row, seed in pairs if seed is not None]
        if not measured:
            lines.append(verdict(None, name, "needs gradq8 and seed-pertensor rows"))
            continue
        detail = "; ".join(
            f"{row.scenario.model} world {row.scenario.world_size}: {row.step_ms:.1f} vs {seed.step_ms:.1f} ms"
            for row, seed in measured
        )
        lines.append(verdict(all(row.step_ms < seed.step_ms for row, seed in measured), name, detail))
    return lines


def _shard_targets(rows: Sequence[Row]) -> list[str]:
    lines = []
    shard_rows = _shard_rows(rows)
    for scenario in dict.fromkeys(row.scenario for row in shard_rows):
        one, two = _with_shards(shard_rows, scenario, 1), _with_shards(shard_rows, scenario, 2)
        name = f"{scenario.model}: 2 shards move >= {TARGET_SHARD_GAIN}x the gradient bytes/s of 1 ({scenario.links()})"
        if one is None or two is None:
            lines.append(verdict(None, name, "needs both gradq8 rows"))
            continue
        gain = _gradient_rate(two) / _gradient_rate(one)
        bound = format_optional(None if two.largest_share is None else 1 / two.largest_share, ".2f")
        detail = (
            f"{_gradient_rate(one) / MEGA:.1f} -> {_gradient_rate(two) / MEGA:.1f} MB/s = {gain:.2f}x "
            f"(1 / busiest shard's share = {bound}x)"
        )
        lines.append(verdict(gain >= TARGET_SHARD_GAIN, name, detail))
    return lines


def _overlap_lines(rows: Sequence[Row]) -> list[str]:
    """How much communication ran while backward still computed, for each hooked row at the target point."""
    lines = []
    for model, chosen in _at_target(rows).items():
        compute = next((row for row in chosen if row.method.key == "compute-only"), None)
        for row in chosen:
            if row.hidden_ms is None or row.tail_ms is None or compute is None:
                continue
            lines.append(
                f"- SHOWN {model}, {row.method.label} ({TARGET_RATE}, world {TARGET_WORLD}): {row.hidden_ms:.1f} ms "
                f"of communication in flight while backward still computed ({format_percent(row.overlap)}% of the "
                f"window), {row.tail_ms:.1f} ms after it; step {row.step_ms:.1f} ms = compute-only "
                f"{compute.step_ms:.1f} + exposed {row.step_ms - compute.step_ms:.1f} ms "
                f"(busiest link needs >= {format_optional(row.link_ms(), '.1f')} ms)"
            )
    return lines


def render(rows: Sequence[Row], setup: str, host_sections: Sequence[str] = ()) -> str:
    """The whole report as markdown.

    Args:
        rows: every measured row, in run order.
        setup: a paragraph on how the run was made (steps, machine, load, gradq revision).
        host_sections: lines on the scenarios whose hosts hold several ranks (network_hosts_report).
    """
    lines = ["# DDP step over rate-limited links (bench/network.py)", "", setup]
    rows = [row for row in rows if row.scenario.ranks_per_host == 1]
    if rows:
        lines += _single_rank_sections(rows)
    return "\n".join([*lines, *host_sections])


def _single_rank_sections(rows: Sequence[Row]) -> list[str]:
    lines: list[str] = []
    numel = {row.scenario.model: row.numel for row in rows}
    for model, parameters in numel.items():
        lines += ["", f"## {model} ({parameters:,} parameters)", "", *_main_table(rows, model)]
    lines += ["", FOOTNOTES]
    if _shard_rows(rows):
        lines += [
            "",
            "## shards when the aggregator link is the bottleneck",
            "",
            *_shard_table(rows),
            "",
            SHARD_FOOTNOTES,
        ]
    targets = _speedup_targets(rows) + _allgather_targets(rows) + _shard_targets(rows)
    lines += ["", "## targets", "", *targets]
    lines += ["", f"## overlap with backward ({TARGET_RATE}, world {TARGET_WORLD}; see [b])", "", *_overlap_lines(rows)]
    return lines


# -- plot ----------------------------------------------------------------------------------------


def plot(rows: Sequence[Row], path: Path) -> Path | None:
    """Step time vs link speed per method, one panel per (model, world); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError:
        return None
    main = [
        row
        for row in rows
        if not row.scenario.aggregator_bottleneck
        and row.scenario.worker_rate is not None
        and row.scenario.ranks_per_host == 1
    ]
    panels = list(dict.fromkeys((row.scenario.model, row.scenario.world_size) for row in main))
    if not panels:
        return None
    figure, axes = pyplot.subplots(1, len(panels), figsize=(6 * len(panels) + 3, 5), squeeze=False)
    for axis, (model, world) in zip(axes[0], panels, strict=True):
        panel = [row for row in main if row.scenario.model == model and row.scenario.world_size == world]
        for label in dict.fromkeys(row.method.label for row in panel):
            points = sorted(
                (netns.parse_rate(str(row.scenario.worker_rate)) / MEGA, row.step_ms)
                for row in panel
                if row.method.label == label
            )
            style = "--" if label.startswith("compute only") else "-"
            axis.plot([x for x, _ in points], [y for _, y in points], style, marker="o", label=label)
        axis.set(xscale="log", yscale="log", xlabel="link rate (Mbit/s)", ylabel="median ms/step")
        axis.set_title(f"{model}, world {world}")
        axis.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    return path
