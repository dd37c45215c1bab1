"""Elastic training under a schedule of kills and joins, side by side with the same run without failures.

    python bench/elastic.py [--hosts 3] [--steps 400] [--kill-at 100] [--join-at 150] [--step-sleep 0.02]

Every host is a real process (examples/elastic_train.py, the digits MLP, 8 bits)
and the aggregator a real `gradq serve`. Two runs, one after the other:

- **steady**: ``--hosts`` hosts train ``--steps`` steps;
- **faults**: the same, but one host is SIGKILLed at ``--kill-at``, a warm
  standby (torch loaded, model built) joins at ``--join-at``, and a cold host
  (a fresh process) is started at the same moment and joins when it is ready;
- **silent**: the same hosts, but one is SIGSTOPped at ``--kill-at`` for
  ``--stop-for`` seconds (a hung driver, a frozen VM, a partition: its
  connections stay open and it answers nothing), then ended.

Printed (and written to bench/results/elastic.md with --write):
- kill -> the survivors' next completed step, in seconds;
- a joiner's start -> its first step in sync (parameters equal the survivors'), warm and cold;
- the bytes of state relayed per joiner;
- the survivors' steps per second over the whole run, against the steady run's;
- stop -> the silent host dropped (the survivors' first step without it), and
  the survivors' longest stall while it was stopped.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reliability"))
from elastic_hosts import ElasticHost, finish, start_host, wait_for

from gradq.server.process import free_port, spawn_aggregator

RESULTS = Path(__file__).with_name("results") / "elastic.md"


def main() -> None:
    """Run both schedules and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--kill-at", type=int, default=100)
    parser.add_argument("--join-at", type=int, default=150)
    parser.add_argument("--step-sleep", type=float, default=0.02, help="a stand-in for a bigger model's compute")
    parser.add_argument("--stop-for", type=float, default=10.0, help="seconds the silent host stays stopped")
    parser.add_argument("--write", action="store_true", help=f"also write {RESULTS.name} under bench/results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        log = folder / "server.log"
        port = free_port()
        with log.open("w") as server_output:
            server, _ = spawn_aggregator("--log-level", "INFO", port=port, stderr=server_output)
        try:
            address = f"127.0.0.1:{port}"
            steady = _steady(address, folder, args)
            faults = _faults(address, folder, args)
            faults.update(_silent(address, folder, args))
        finally:
            server.kill()
            server.wait()
        relayed = [int(size) for size in re.findall(r"admitted .* (\d+) bytes of state", log.read_text())]
    table = _table(args, steady, faults, relayed)
    print(table)
    if args.write:
        RESULTS.write_text(table + "\n")


def _steady(address: str, folder: Path, args: argparse.Namespace) -> float:
    """The run without failures: the hosts' steps per second."""
    hosts = [
        start_host(address, "steady", args.hosts, args.steps, folder / f"steady{i}.jsonl", args.step_sleep)
        for i in range(args.hosts)
    ]
    finish(hosts, timeout_s=600)
    return statistics.mean(_steps_per_second(host) for host in hosts)


def _faults(address: str, folder: Path, args: argparse.Namespace) -> dict[str, float]:
    """The run with a kill and two joins: what each took."""
    go = folder / "go"
    hosts = [
        start_host(address, "faults", args.hosts, args.steps, folder / f"faults{i}.jsonl", args.step_sleep)
        for i in range(args.hosts)
    ]
    warm = start_host(address, "faults", args.hosts, args.steps, folder / "warm.jsonl", args.step_sleep, go)
    survivors, victim = hosts[:-1], hosts[-1]
    everyone = [*hosts, warm]
    try:
        wait_for("the kill step", lambda: victim.last_step() >= args.kill_at, 600, everyone)
        victim.process.kill()
        killed_at = time.time()
        wait_for("the join step", lambda: min(h.last_step() for h in survivors) >= args.join_at, 600, everyone)
        go.touch()
        joined_at = time.time()
        cold = start_host(address, "faults", args.hosts, args.steps, folder / "cold.jsonl", args.step_sleep)
        everyone.append(cold)
        finish([*survivors, warm, cold], timeout_s=600)
    finally:
        for host in everyone:
            host.process.kill()
            host.process.wait()
    reference = survivors[0].steps()
    next_step = min(r["finished_at"] for r in reference.values() if r["finished_at"] > killed_at)
    return {
        "kill_to_next_step_s": next_step - killed_at,
        "warm_join_s": _in_sync(warm, reference) - joined_at,
        "cold_join_s": _in_sync(cold, reference) - cold.started_at,
        "steps_per_second": statistics.mean(_steps_per_second(host) for host in survivors),
        "warm_first_step": min(warm.steps()),
        "cold_first_step": min(cold.steps()),
    }


def _silent(address: str, folder: Path, args: argparse.Namespace) -> dict[str, float]:
    """The run with a host stopped (SIGSTOP) for ``--stop-for`` seconds: when it was dropped, the longest stall."""
    hosts = [
        start_host(address, "silent", args.hosts, args.steps, folder / f"silent{i}.jsonl", args.step_sleep)
        for i in range(args.hosts)
    ]
    survivors, silent = hosts[:-1], hosts[-1]
    try:
        wait_for("the stop step", lambda: silent.last_step() >= args.kill_at, 600, hosts)
        os.kill(silent.process.pid, signal.SIGSTOP)
        stopped_at = time.time()
        time.sleep(args.stop_for)  # the schedule: how long the host stays silent
        os.kill(silent.process.pid, signal.SIGCONT)
        silent.process.kill()
        finish(survivors, timeout_s=600)
    finally:
        for host in hosts:
            host.process.kill()
            host.process.wait()
    reference = survivors[0].steps()
    during = sorted(
        r["finished_at"] for r in reference.values() if stopped_at - 1 <= r["finished_at"] <= stopped_at + args.stop_for
    )
    dropped = min(
        r["finished_at"] for r in reference.values() if r["finished_at"] > stopped_at and r["ranks"] < args.hosts
    )
    return {
        "stop_to_drop_s": dropped - stopped_at,
        "longest_stall_s": max(later - earlier for earlier, later in itertools.pairwise(during)),
        "silent_steps_per_second": statistics.mean(_steps_per_second(host) for host in survivors),
    }


def _in_sync(joiner: ElasticHost, reference: dict[int, dict[str, float]]) -> float:
    """When the joiner's first step finished, checking its parameters equal the survivors' after that step."""
    first = min(joiner.steps())
    record = joiner.steps()[first]
    if record["parameters_sha256"] != reference[first]["parameters_sha256"]:
        raise AssertionError(f"the joiner's parameters differ from the survivors' after step {first}")
    return float(record["finished_at"])


def _steps_per_second(host: ElasticHost) -> float:
    records = host.records()
    return (len(records) - 1) / (records[-1]["finished_at"] - records[0]["finished_at"])


def _table(args: argparse.Namespace, steady: float, faults: dict[str, float], relayed: list[int]) -> str:
    rows = [
        f"# Elastic gradq: {args.hosts} hosts, digits MLP, {args.steps} steps, kill at step {args.kill_at}, "
        f"joins at step {args.join_at}",
        "",
        f"`python bench/elastic.py --hosts {args.hosts} --steps {args.steps} --kill-at {args.kill_at} "
        f"--join-at {args.join_at} --step-sleep {args.step_sleep:g}` (one machine, {args.step_sleep:g} s of "
        f"sleep per step standing in for compute)",
        "",
        "| figure | value |",
        "|---|---|",
        f"| kill -> survivors' next completed step | {faults['kill_to_next_step_s']:.2f} s |",
        f"| warm standby: join signal -> first step in sync (bit for bit) | {faults['warm_join_s']:.2f} s "
        f"(entered at step {faults['warm_first_step']:.0f}) |",
        f"| cold host: process start -> first step in sync (bit for bit) | {faults['cold_join_s']:.2f} s "
        f"(entered at step {faults['cold_first_step']:.0f}) |",
        f"| state relayed per joiner | {', '.join(f'{size:,} B' for size in relayed) or 'none'} |",
        f"| survivors' steps/s with the faults / without | {faults['steps_per_second']:.1f} / {steady:.1f} "
        f"({faults['steps_per_second'] / steady:.2f}x) |",
        f"| stop (SIGSTOP {args.stop_for:g} s) -> the silent host dropped (first step without it) | "
        f"{faults['stop_to_drop_s']:.2f} s |",
        f"| the survivors' longest stall while it was stopped | {faults['longest_stall_s']:.2f} s |",
        f"| survivors' steps/s with a host stopped / without | {faults['silent_steps_per_second']:.1f} / "
        f"{steady:.1f} ({faults['silent_steps_per_second'] / steady:.2f}x) |",
    ]
    return "\n".join(rows)


if __name__ == "__main__":
    main()
