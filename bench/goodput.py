"""Goodput under failures: DiLoCo (synchronous and semi-synchronous) and elastic DDP, each beside its fault-free run.

Run from the repository root with the virtualenv's interpreter::

    python bench/goodput.py                          # 8 hosts, every loop
    python bench/goodput.py --hosts 8 --loops diloco ddp --rounds 30

Every host is a real single-process host on this one machine and every
aggregator shard a real ``gradq serve`` process. The loops:

- ``diloco``: examples/diloco_train.py (the character transformer), H = 10,
  4-bit + EF, the outer step on the aggregator, over 2 shards;
- ``diloco-semi``: the same, semi-synchronous (quorum = hosts - 2, grace
  0.5 s), on one aggregator (semi-synchronous rounds run on one);
- ``ddp``: examples/elastic_train.py (the digits MLP), elastic DDP through the
  comm hook, 8 bits, over 2 shards.

Every inner step sleeps ``--step-delay`` (a bigger model's compute; the
stopped host must come back before the job ends). Each runs twice with the
same hosts and job length: without faults, then with
this schedule, keyed to the job's progress (host 0's outer round, or step / 10
for DDP) so that it lands at the same point of training every time:

- at 5: host 7 is SIGKILLed and a fresh process started in its place (it
  joins as a newcomer when its torch has loaded);
- at 10: host 6 is SIGSTOPped for ``--stop-s`` seconds, then continued (it is
  dropped meanwhile, and joins again by itself);
- at 15: the last shard is SIGKILLed and a new one started on its port 1 s
  later (the hosts rejoin it and, for DiLoCo, seed it again).

Goodput = useful inner steps done / inner steps possible in the same wall time
without faults. Possible: the fault-free run's host-steps per second (every
host, start-up included) times the faulty run's wall time. Useful: every
host's steps that count in the job: for DDP the steps each host reports in
sync (a step dropped with a host is not), for DiLoCo the inner steps of the
outer rounds each host completed (a host killed mid-round loses that round;
a semi-synchronous host late for a round is counted as losing it, though its
pseudo-gradient was merged: a floor). Also printed: the final held-out loss
against the fault-free run's, and "nothing lost": every host that finished
holds the same parameters and, for DiLoCo, the aggregator's copy matches.
This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reliability"))
from elastic_hosts import ElasticHost, start_host

from gradq.server.process import free_port, spawn_aggregator

REPO = Path(__file__).resolve().parents[1]
DILOCO = REPO / "examples" / "diloco_train.py"
SYNC_EVERY = 10
LOOPS = ("diloco", "diloco-semi", "ddp")
KILL_AT, STOP_AT, SHARD_AT = 5, 10, 15  # the schedule, in outer rounds (DDP: tens of steps)


@dataclass
class Run:
    loop: str
    faults: bool
    wall_s: float
    useful_steps: int
    held_out: float
    identical: bool
    matches: bool


class Shards:
    """One ``gradq serve`` process per shard, each restartable on its port."""

    def __init__(self, count: int) -> None:
        self.ports = [free_port() for _ in range(count)]
        self.processes = [self._spawn(port) for port in self.ports]

    @property
    def address(self) -> str:
        return ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def restart_last(self) -> None:
        self.processes[-1].kill()
        self.processes[-1].wait()
        time.sleep(1.0)
        self.processes[-1] = self._spawn(self.ports[-1])

    def close(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()

    @staticmethod
    def _spawn(port: int) -> subprocess.Popen[bytes]:
        return spawn_aggregator("--log-level", "WARNING", "--round-timeout", "120", port=port)[0]


class DiLoCoHost:
    """One examples/diloco_train.py process; its outer round in ``progress``, its figures at the end."""

    def __init__(
        self, address: str, job: str, seed: int, out: Path, rounds: int, hosts: int, semi: bool, delay: float
    ) -> None:
        self.out, self.seed = out, seed
        self.progress = out / f"progress{seed}"
        environment = {
            **os.environ,
            "GRADQ_AGGREGATORS": address,
            "GRADQ_JOB_ID": job,
            "GRADQ_ELASTIC_HOSTS": str(hosts),
            "GRADQ_BITS": "4",
            "GRADQ_ERROR_FEEDBACK": "1",
            "OMP_NUM_THREADS": "1",
        }
        command = [sys.executable, str(DILOCO), "--data-seed", str(seed), "--sync-every", str(SYNC_EVERY)]
        command += ["--rounds", str(rounds), "--bucket-elements", "20000", "--report", str(out)]
        command += ["--progress", str(self.progress), "--step-delay", str(delay)]
        command += ["--quorum", str(hosts - 2), "--grace", "0.5"] if semi else []
        self.process = subprocess.Popen(
            command, env=environment, stdout=(out / f"host{seed}.log").open("wb"), stderr=subprocess.STDOUT
        )

    def round(self) -> int:
        text = self.progress.read_text() if self.progress.exists() else ""
        return int(text) if text.strip() else 0

    def figures(self) -> dict[str, Any] | None:
        path = self.out / f"host{self.seed}.json"
        return json.loads(path.read_text()) if path.exists() else None


def wait_for(done: Callable[[], bool], timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError("the schedule's point never came")
        time.sleep(0.05)


def stop_for(pid: int, seconds: float) -> None:
    os.kill(pid, signal.SIGSTOP)
    time.sleep(seconds)
    os.kill(pid, signal.SIGCONT)


def run_diloco(args: argparse.Namespace, semi: bool, faults: bool, out: Path) -> Run:
    shards = Shards(1 if semi else 2)
    job = f"goodput-{'semi' if semi else 'sync'}-{faults}"
    started = time.monotonic()

    def launch(seed: int) -> DiLoCoHost:
        return DiLoCoHost(shards.address, job, seed, out, args.rounds, args.hosts, semi, args.step_delay)

    hosts = [launch(seed) for seed in range(args.hosts)]
    every = list(hosts)
    try:
        if faults:
            wait_for(lambda: hosts[0].round() >= KILL_AT)
            hosts[-1].process.kill()
            every.append(launch(args.hosts))
            wait_for(lambda: hosts[0].round() >= STOP_AT)
            stop_for(hosts[-2].process.pid, args.stop_s)
            wait_for(lambda: hosts[0].round() >= SHARD_AT)
            shards.restart_last()
        for host in every:
            host.process.wait(timeout=1800)
        wall = time.monotonic() - started
    finally:
        for host in every:
            if host.process.poll() is None:
                host.process.kill()
        shards.close()
    for host in every:
        if host.process.returncode not in (0, -signal.SIGKILL):
            log = (out / f"host{host.seed}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{job}: host {host.seed} exited {host.process.returncode}:\n{log}")
    finished = [figures for host in every if (figures := host.figures()) is not None]
    useful = 0
    for host in every:
        figures = host.figures()
        rounds = len(figures["digests"]) if figures is not None else host.round()
        useful += rounds * SYNC_EVERY
    last = [figures["digests"].get(str(args.rounds)) for figures in finished]
    return Run(
        "diloco-semi" if semi else "diloco",
        faults,
        wall,
        useful,
        sum(float(f["held_out_loss"]) for f in finished) / len(finished),
        len(set(last)) == 1 and None not in last,
        all(bool(f["matches_aggregator"]) for f in finished),
    )


def run_ddp(args: argparse.Namespace, faults: bool, out: Path) -> Run:
    shards = Shards(2)
    job, steps = f"goodput-ddp-{faults}", args.rounds * SYNC_EVERY
    started = time.monotonic()

    def launch(index: int) -> ElasticHost:
        return start_host(shards.address, job, args.hosts, steps, out / f"ddp{index}.jsonl", args.step_delay)

    hosts = [launch(index) for index in range(args.hosts)]
    every = list(hosts)
    try:
        if faults:
            wait_for(lambda: hosts[0].last_step() >= KILL_AT * SYNC_EVERY)
            hosts[-1].process.kill()
            every.append(launch(args.hosts))
            wait_for(lambda: hosts[0].last_step() >= STOP_AT * SYNC_EVERY)
            stop_for(hosts[-2].process.pid, args.stop_s)
            wait_for(lambda: hosts[0].last_step() >= SHARD_AT * SYNC_EVERY)
            shards.restart_last()
        for index, each in enumerate(every):
            output, _ = each.process.communicate(timeout=1800)
            if each.process.returncode not in (0, -signal.SIGKILL):
                log = output.decode(errors="replace")[-3000:]
                raise RuntimeError(f"{job}: host {index} exited {each.process.returncode}:\n{log}")
        wall = time.monotonic() - started
    finally:
        for each in every:
            if each.process.poll() is None:
                each.process.kill()
        shards.close()
    results = [each.records("result")[0] for each in every if each.records("result")]
    return Run(
        "ddp",
        faults,
        wall,
        sum(len(each.records()) for each in every),
        sum(float(result["held_out_loss"]) for result in results) / len(results),
        len({result["parameters_sha256"] for result in results}) == 1,
        True,  # the aggregator holds no copy of a DDP job's parameters
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=8, help="single-process hosts (at least 4)")
    parser.add_argument("--rounds", type=int, default=30, help="DiLoCo outer rounds (DDP: ten times as many steps)")
    parser.add_argument("--stop-s", type=float, default=5.0, help="how long the stopped host stays stopped")
    parser.add_argument(
        "--step-delay", type=float, default=0.05, help="seconds slept per inner step: a bigger model's compute"
    )
    parser.add_argument("--loops", nargs="+", choices=LOOPS, default=list(LOOPS), help="which loops to run")
    args = parser.parse_args()
    if args.hosts < 4 or args.rounds <= SHARD_AT + 5:
        parser.error(f"expected --hosts >= 4 and --rounds > {SHARD_AT + 5} (the schedule's last fault is at 15)")
    print(
        f"{args.hosts} hosts on {os.cpu_count()} cores, {args.rounds * SYNC_EVERY} inner steps each; schedule: "
        f"kill + replace a host at {KILL_AT}, SIGSTOP one {args.stop_s:g} s at {STOP_AT}, kill + restart a shard "
        f"at {SHARD_AT} (outer rounds; DDP: x10 steps)"
    )
    print(
        "| loop | wall s: fault-free / faults | useful host-steps | possible | goodput | held-out loss: "
        "fault-free / faults | every host identical | aggregator's copy matches |"
    )
    print("|---|---|---:|---:|---:|---|---|---|")
    for loop in args.loops:
        runs = []
        for faults in (False, True):
            with tempfile.TemporaryDirectory(prefix="gradq-goodput-") as work:
                out = Path(work)
                if loop == "ddp":
                    runs.append(run_ddp(args, faults, out))
                else:
                    runs.append(run_diloco(args, loop == "diloco-semi", faults, out))
        steady, faulty = runs
        possible = steady.useful_steps / steady.wall_s * faulty.wall_s
        print(
            f"| {loop} | {steady.wall_s:.1f} / {faulty.wall_s:.1f} | {faulty.useful_steps:,} | {possible:,.0f} "
            f"| {100 * faulty.useful_steps / possible:.1f}% | {steady.held_out:.4f} / {faulty.held_out:.4f} "
            f"| {steady.identical} / {faulty.identical} | {steady.matches} / {faulty.matches} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
