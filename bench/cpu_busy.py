"""Machine-wide CPU time from /proc/stat: how much of the cores a benchmark row kept busy.

The benchmarks run every rank, every aggregator and (in bench/network.py) the
emulated links on one machine. A row whose cores are nearly all busy is
CPU-bound here: it cannot step faster than its CPU time per step divided by the
cores, whatever the links allow. The machine's counters, not each process's,
count all of that work, including the kernel's softirq time for loopback and
veth traffic, which no process is charged for.

The counters tick at USER_HZ (100 per second), so one short interval is coarse;
sums over many timed steps are what the reports print.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuTimes", "parse_cpu_line", "read_cpu_times", "read_process_cpu_s", "CORES"]

CORES = os.cpu_count() or 1
_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
_PROC_STAT = Path("/proc/stat")
# Fields of the "cpu" line, in order: user nice system idle iowait irq softirq steal ...
_BUSY_FIELDS = (0, 1, 2, 5, 6)  # user, nice, system, irq, softirq (guest time is inside user)
_IDLE_FIELDS = (3, 4, 7)  # idle, iowait, steal (the hypervisor ran someone else)


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Seconds of CPU summed over all cores: busy, and busy + idle."""

    busy_s: float = 0.0
    total_s: float = 0.0

    def __add__(self, other: CpuTimes) -> CpuTimes:
        return CpuTimes(self.busy_s + other.busy_s, self.total_s + other.total_s)

    def __sub__(self, other: CpuTimes) -> CpuTimes:
        return CpuTimes(self.busy_s - other.busy_s, self.total_s - other.total_s)

    @property
    def busy_fraction(self) -> float | None:
        """Share of the cores' time that was busy (None for an empty interval)."""
        return self.busy_s / self.total_s if self.total_s > 0 else None


def parse_cpu_line(line: str, ticks_per_second: int = _TICKS_PER_SECOND) -> CpuTimes:
    """The aggregate ``cpu`` line of /proc/stat as CpuTimes.

    Raises:
        ValueError: the line is not the aggregate cpu line or has too few fields.
    """
    name, *fields = line.split()
    if name != "cpu" or len(fields) < 8:
        raise ValueError(f"line={line.strip()!r} is not /proc/stat's cpu line; expected 'cpu' and 8+ counters")
    ticks = [int(field) for field in fields]
    busy = sum(ticks[index] for index in _BUSY_FIELDS)
    idle = sum(ticks[index] for index in _IDLE_FIELDS)
    return CpuTimes(busy / ticks_per_second, (busy + idle) / ticks_per_second)


def read_cpu_times() -> CpuTimes:
    """The machine's CPU times since boot (all zeros where /proc/stat is missing, as off Linux)."""
    try:
        with _PROC_STAT.open() as stat:
            return parse_cpu_line(stat.readline())
    except OSError:
        return CpuTimes()


def read_process_cpu_s(pids: Sequence[int]) -> float:
    """User + system CPU seconds the processes ``pids`` (all their threads) have used; one that is gone counts 0."""
    total = 0
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / _TICKS_PER_SECOND
