"""bench/elastic.py's schedule with torchft instead of gradq: the same model, data, optimizer, kills and joins.

    python bench/elastic_torchft.py --python /tmp/ftvenv/bin/python [--hosts 3] [--steps 400] [--kill-at 100]
        [--join-at 150] [--step-sleep 0.02] [--quorum-tick-ms 100] [--join-timeout-ms 1000]
        [--heartbeat-timeout-ms 5000]

torchft is not a gradq dependency: ``--python`` names an interpreter that has
torch, torchft, numpy and scikit-learn (this script itself needs only the
standard library, and runs its replicas with that interpreter).

Every replica group is one process (CPU, gloo) running this file with
``--replica``: torchft's ``Manager`` (``ProcessGroupGloo``, ``min_replica_size=1``,
the model and optimizer as its state dict), its ``DistributedDataParallel`` and
``Optimizer`` wrappers, and a ``torchft_lighthouse --min_replicas 1``. The digits
MLP, AdamW at 1e-3 on a cosine to 0 at ``--steps``, 128 examples per replica and
step drawn from ``np.random.default_rng([seed, step, replica_id])``, the seed's
initial model on every starting replica: all as client/apps/elastic_training.py.

Two runs, one after the other (as bench/elastic.py):

- **steady**: ``--hosts`` replicas train ``--steps`` steps;
- **faults**: the same, but one replica is SIGKILLed at ``--kill-at``; at
  ``--join-at`` a warm standby (torch loaded, data and model built, no Manager
  yet: torchft has no standby of its own) is told to join, and a cold replica
  (a fresh process) is started at the same moment.

Printed: the rows of bench/elastic.py (bench/results/elastic-torchft.md has both side by side).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reliability"))
from elastic_hosts import ElasticHost, wait_for


def main() -> None:
    """Run both schedules and print the table (or, with --replica, be one replica group)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=sys.executable, help="an interpreter with torch, torchft, sklearn")
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--kill-at", type=int, default=100)
    parser.add_argument("--join-at", type=int, default=150)
    parser.add_argument("--step-sleep", type=float, default=0.02, help="a stand-in for a bigger model's compute")
    parser.add_argument("--stop-for", type=float, default=10.0, help="seconds the silent replica stays stopped")
    parser.add_argument("--quorum-tick-ms", type=int, default=100, help="the lighthouse's")
    parser.add_argument("--join-timeout-ms", type=int, default=1000, help="the lighthouse's")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5000, help="the lighthouse's (its default)")
    parser.add_argument("--replica", type=int, help=argparse.SUPPRESS)  # the child: this replica group's id
    parser.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--start-when", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--join-when", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replica is not None:
        _replica(args)
        return
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        steady = _steady(folder, args)
        faults = _faults(folder, args)
        faults.update(_silent(folder, args))
    table = _table(args, steady, faults)
    print(table)


class _Lighthouse:
    """A torchft_lighthouse beside --python, on a free port."""

    def __init__(self, args: argparse.Namespace, log: Path) -> None:
        self.port = _free_port()
        binary = Path(args.python).with_name("torchft_lighthouse")
        command = [str(binary), "--min_replicas", "1", "--bind", f"[::]:{self.port}"]
        command += ["--quorum_tick_ms", str(args.quorum_tick_ms), "--join_timeout_ms", str(args.join_timeout_ms)]
        command += ["--heartbeat_timeout_ms", str(args.heartbeat_timeout_ms)]
        with log.open("w") as output:
            self.process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not _listening(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the lighthouse did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


def _start(
    args: argparse.Namespace,
    lighthouse: _Lighthouse,
    replica: int,
    report: Path,
    start_when: Path | None = None,
    join_when: Path | None = None,
) -> ElasticHost:
    command = [args.python, str(Path(__file__).resolve()), "--replica", str(replica), "--report", str(report)]
    command += ["--steps", str(args.steps), "--step-sleep", str(args.step_sleep)]
    command += ["--start-when", str(start_when)] if start_when is not None else []
    command += ["--join-when", str(join_when)] if join_when is not None else []
    environment = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "REPLICA_GROUP_ID": str(replica),
        "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lighthouse.port}",
    }
    # To a file, not a pipe: torchft logs a few lines per step, and a full pipe would stall the replica.
    with report.with_suffix(".log").open("w") as output:
        process = subprocess.Popen(command, env=environment, stdout=output, stderr=subprocess.STDOUT)
    return ElasticHost(process, report, time.time())


def _finish(hosts: list[ElasticHost], timeout_s: float) -> None:
    """Wait for every replica to exit 0; else fail with the end of its log."""
    for host in hosts:
        try:
            host.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            host.process.kill()
            host.process.wait()
        if host.process.returncode != 0:
            log = host.report.with_suffix(".log").read_text(errors="replace")
            raise AssertionError(f"{host.report.stem} exited {host.process.returncode}: {log[-3000:]}")


def _ready(host: ElasticHost) -> bool:
    return bool(host.records("ready"))


def _steady(folder: Path, args: argparse.Namespace) -> float:
    """The run without failures: the replicas' steps per second."""
    lighthouse = _Lighthouse(args, folder / "steady-lighthouse.log")
    try:
        go = folder / "steady-go"
        hosts = [_start(args, lighthouse, i, folder / f"steady{i}.jsonl", start_when=go) for i in range(args.hosts)]
        # Every Manager heartbeats before any asks for a quorum: the first quorum holds them all (as gradq's
        # job starts once its hosts have joined).
        wait_for("the replicas' managers", lambda: all(_ready(h) for h in hosts), 600, hosts)
        go.touch()
        _finish(hosts, timeout_s=600)
    finally:
        lighthouse.close()
    return statistics.mean(_steps_per_second(host) for host in hosts)


def _faults(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The run with a kill and two joins: what each took."""
    lighthouse = _Lighthouse(args, folder / "faults-lighthouse.log")
    start, go = folder / "faults-start", folder / "faults-go"
    hosts = [_start(args, lighthouse, i, folder / f"faults{i}.jsonl", start_when=start) for i in range(args.hosts)]
    warm = _start(args, lighthouse, args.hosts, folder / "warm.jsonl", join_when=go)
    survivors, victim = hosts[:-1], hosts[-1]
    everyone = [*hosts, warm]
    try:
        wait_for("the replicas' managers", lambda: all(_ready(h) for h in hosts), 600, everyone)
        wait_for("the warm standby", lambda: _ready(warm), 600, everyone)
        start.touch()
        wait_for("the kill step", lambda: victim.last_step() >= args.kill_at, 600, everyone)
        victim.process.send_signal(signal.SIGKILL)
        killed_at = time.time()
        wait_for("the join step", lambda: min(h.last_step() for h in survivors) >= args.join_at, 600, everyone)
        go.touch()
        joined_at = time.time()
        cold = _start(args, lighthouse, args.hosts + 1, folder / "cold.jsonl")
        everyone.append(cold)
        _finish([*survivors, warm, cold], timeout_s=600)
    finally:
        for host in everyone:
            host.process.kill()
            host.process.wait()
        lighthouse.close()
    reference = survivors[0].steps()
    next_step = min(r["finished_at"] for r in reference.values() if r["finished_at"] > killed_at)
    warm_sync, warm_note = _in_sync(warm, reference)
    cold_sync, cold_note = _in_sync(cold, reference)
    return {
        "kill_to_next_step_s": next_step - killed_at,
        "warm_join_s": warm_sync - joined_at,
        "warm_note": warm_note,
        "cold_join_s": cold_sync - cold.started_at,
        "cold_note": cold_note,
        "relayed": [warm.result()["received_bytes"], cold.result()["received_bytes"]],
        "steps_per_second": statistics.mean(_steps_per_second(host) for host in survivors),
        "warm_first_step": min(warm.steps()),
        "cold_first_step": min(cold.steps()),
        "lost_steps": sorted({r["step"] for h in survivors for r in h.records("uncommitted")}),
    }


def _silent(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The run with a replica stopped (SIGSTOP) for ``--stop-for`` seconds: when the others went on without it."""
    lighthouse = _Lighthouse(args, folder / "silent-lighthouse.log")
    start = folder / "silent-start"
    hosts = [_start(args, lighthouse, i, folder / f"silent{i}.jsonl", start_when=start) for i in range(args.hosts)]
    survivors, silent = hosts[:-1], hosts[-1]
    try:
        wait_for("the replicas' managers", lambda: all(_ready(h) for h in hosts), 600, hosts)
        start.touch()
        wait_for("the stop step", lambda: silent.last_step() >= args.kill_at, 600, hosts)
        silent.process.send_signal(signal.SIGSTOP)
        stopped_at = time.time()
        time.sleep(args.stop_for)  # the schedule: how long the replica stays silent
        silent.process.send_signal(signal.SIGCONT)
        silent.process.kill()
        _finish(survivors, timeout_s=600)
    finally:
        for host in hosts:
            host.process.kill()
            host.process.wait()
        lighthouse.close()
    finished = sorted(r["finished_at"] for r in survivors[0].steps().values())
    during = [when for when in finished if stopped_at - 1 <= when <= stopped_at + args.stop_for]
    return {
        "stop_to_next_step_s": min(when for when in finished if when > stopped_at) - stopped_at,
        "silent_longest_stall_s": max(later - earlier for earlier, later in itertools.pairwise(during or [0.0, 0.0])),
        "silent_steps_per_second": statistics.mean(_steps_per_second(host) for host in survivors),
    }


def _in_sync(joiner: ElasticHost, reference: dict[int, dict[str, Any]]) -> tuple[float, str]:
    """When the joiner's first step finished, and whether its parameters equal the survivors' after that step."""
    first = min(joiner.steps())
    record = joiner.steps()[first]
    if first == 0:  # with --steps too few for its start-up, the survivors had finished: it trained alone
        return float(record["finished_at"]), "never joined the survivors (they had finished; it started at step 0)"
    same = record["parameters_sha256"] == reference[first]["parameters_sha256"]
    return float(record["finished_at"]), "bit for bit" if same else "parameters DIFFER from the survivors'"


def _steps_per_second(host: ElasticHost) -> float:
    records = host.records()
    return (len(records) - 1) / (records[-1]["finished_at"] - records[0]["finished_at"])


def _table(args: argparse.Namespace, steady: float, faults: dict[str, Any]) -> str:
    lost = faults["lost_steps"]
    rows = [
        f"# Elastic torchft: {args.hosts} replica groups, digits MLP, {args.steps} steps, kill at step "
        f"{args.kill_at}, joins at step {args.join_at}",
        "",
        f"`python bench/elastic_torchft.py --python PYTHON --hosts {args.hosts} --steps {args.steps} --kill-at "
        f"{args.kill_at} --join-at {args.join_at} --step-sleep {args.step_sleep:g} --quorum-tick-ms "
        f"{args.quorum_tick_ms} --join-timeout-ms {args.join_timeout_ms} --heartbeat-timeout-ms "
        f"{args.heartbeat_timeout_ms}` (one machine, {args.step_sleep:g} s of sleep per step standing in for compute)",
        "",
        "| figure | value |",
        "|---|---|",
        f"| kill -> survivors' next completed step | {faults['kill_to_next_step_s']:.2f} s "
        f"(steps not committed and redone: {', '.join(map(str, lost)) or 'none'}) |",
        f"| warm standby: join signal -> first step in sync | {faults['warm_join_s']:.2f} s, "
        f"{faults['warm_note']} (entered at step {faults['warm_first_step']:.0f}) |",
        f"| cold replica: process start -> first step in sync | {faults['cold_join_s']:.2f} s, "
        f"{faults['cold_note']} (entered at step {faults['cold_first_step']:.0f}) |",
        f"| state received per joiner (HTTP body) | {', '.join(f'{size:,} B' for size in faults['relayed'])} |",
        f"| survivors' steps/s with the faults / without | {faults['steps_per_second']:.1f} / {steady:.1f} "
        f"({faults['steps_per_second'] / steady:.2f}x) |",
        f"| stop (SIGSTOP {args.stop_for:g} s) -> survivors' next completed step | "
        f"{faults['stop_to_next_step_s']:.2f} s |",
        f"| the survivors' longest stall while it was stopped | {faults['silent_longest_stall_s']:.2f} s |",
        f"| survivors' steps/s with a replica stopped / without | {faults['silent_steps_per_second']:.1f} / "
        f"{steady:.1f} ({faults['silent_steps_per_second'] / steady:.2f}x) |",
    ]
    return "\n".join(rows)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


# The replica group: runs under --python, where torch and torchft are.


def _replica(args: argparse.Namespace) -> None:
    """One replica group of one process; appends ready/step/uncommitted/result JSON lines to --report."""
    import io
    import urllib.request
    from datetime import timedelta

    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from torch import nn
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    def write(kind: str, **record: Any) -> None:
        with args.report.open("a") as report:
            report.write(json.dumps({"kind": kind, **record}) + "\n")

    received: list[int] = []

    class CountingTransport(HTTPTransport):  # type: ignore[misc]
        """torchft's default transport, counting the bytes a joiner reads."""

        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as body:
                data = body.read()
            received.append(len(data))
            return _streaming_load(io.BytesIO(data), weights_only=False)

    torch.set_num_threads(1)
    seed, batch_size, learning_rate, hidden = 0, 128, 1e-3, 64  # client/apps/elastic_training.py's
    images, labels = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(labels))
    train = order[: int(0.8 * len(labels))]
    features = (images / 16.0).astype(np.float32)
    x_train, y_train = features[train], labels[train]
    torch.manual_seed(seed)
    module = nn.Sequential(
        nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
    )
    inner = torch.optim.AdamW(module.parameters(), lr=learning_rate)
    if args.join_when is not None:
        write("ready")
        while not args.join_when.exists():
            time.sleep(0.01)

    # A replica group of one process still needs its own store (Manager reads MASTER_ADDR/MASTER_PORT).
    store_port = _free_port()
    store = torch.distributed.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port), RANK="0", WORLD_SIZE="1")

    def load_state_dict(state: dict[str, Any]) -> None:
        module.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": module.state_dict(), "optim": inner.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        replica_id=f"bench_{args.replica}",
        timeout=timedelta(seconds=30),
        checkpoint_transport=CountingTransport(timeout=timedelta(seconds=30), num_chunks=0),
        init_sync=False,  # every starting replica builds the seed's model, as gradq's hosts do
    )
    commits: list[bool] = []
    should_commit = manager.should_commit

    def recording_should_commit(timeout: timedelta | None = None) -> bool:
        commits.append(should_commit(timeout))
        return commits[-1]

    manager.should_commit = recording_should_commit
    model = DistributedDataParallel(manager, module)
    optimizer = Optimizer(manager, inner)
    if args.start_when is not None:
        write("ready")
        while not args.start_when.exists():
            time.sleep(0.01)
    first: int | None = None
    while (step := manager.current_step()) < args.steps:
        # Set before zero_grad starts the quorum: a joiner receives this rate with the optimizer state.
        for group in inner.param_groups:
            group["lr"] = learning_rate * 0.5 * (1.0 + math.cos(math.pi * step / args.steps))
        optimizer.zero_grad()
        # A joiner heals during this step (its step counter jumps): its batch is zeroed in the allreduce anyway.
        batch = np.random.default_rng([seed, step, args.replica]).choice(len(y_train), batch_size)
        loss = nn.functional.cross_entropy(model(torch.from_numpy(x_train[batch])), torch.from_numpy(y_train[batch]))
        loss.backward()
        optimizer.step()
        if commits[-1]:
            done = manager.current_step() - 1
            first = done if first is None else first
            digest = hashlib.sha256()
            for parameter in module.parameters():
                digest.update(parameter.detach().numpy().tobytes())
            write(
                "step",
                step=done,
                member=args.replica,
                finished_at=time.time(),
                loss=loss.item(),
                parameters_sha256=digest.hexdigest(),
                ranks=manager.num_participants(),
            )
        else:
            write("uncommitted", step=step, at=time.time())
        if args.step_sleep:
            time.sleep(args.step_sleep)
    write("result", member=args.replica, first_step=first, received_bytes=sum(received))
    manager.shutdown(wait=False)
    del store


if __name__ == "__main__":
    main()
