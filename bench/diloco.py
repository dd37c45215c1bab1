"""DiLoCo over slow links: time to fp32 DDP's held-out loss, beside DDP allreduce and per-step gradq 4-bit + EF.

Run as root from the repository root with the virtualenv's interpreter::

    sudo .venv/bin/python bench/diloco.py                      # transformer and source-lm, 100 Mbit/s and 1 Gbit/s
    sudo .venv/bin/python bench/diloco.py --tasks transformer --rates 100mbit --steps 200
    sudo .venv/bin/python bench/diloco.py --tasks transformer --rates 1gbit --rtt 100   # 100 ms between hosts

Four hosts, each a network namespace whose one veth is shaped with tc's tbf in
both directions (bench/netns.py), one rank each; the aggregator in a namespace
of its own, shaped alike. Every row trains the same task (bench/convergence_tasks.py:
the character transformer gradq was tuned on, and the word-level language model
on the standard library's source it was not) with AdamW from the same weights, on
the same per-host batches:

- ``ddp``: DDP over all four hosts, gloo allreduce fp32 every step;
- ``gradq4ef``: the same DDP with gradq's comm hook, 4-bit + EF, every step;
- ``diloco10``, ``diloco50``: gradq's DiLoCo, H = 10 and 50 inner steps per
  outer round (4-bit + EF pseudo-gradients, Nesterov SGD outer step on the
  aggregator, the default);
- ``diloco10-hosts`` (not run unless named in ``--methods``): H = 10 with the
  outer step on the hosts, the aggregator only averaging;
- ``diloco10-stream``: Streaming DiLoCo at H = 10 (gradq.client.diloco.fragments):
  the model in 2 fragments, each round in flight for 2 inner steps while the
  host trains on, the host keeping half its own parameters where an update lands;
  ``diloco10-stream3`` (not run unless named) lands each round 3 inner steps
  after it is sent, for links whose round trip 2 steps of compute do not cover;
- ``compute-only`` (not run unless named): each host trains alone, nothing
  leaves it: the floor of ms per inner step (its loss is not the job's);
- ``torchft-diloco10`` and ``torchft-diloco10-stream`` (with ``--torchft-python``,
  an interpreter with torchft 0.2.0 and gradq itself, whose outer optimizer
  these rows share: ``pip install torchft==0.2.0`` and ``pip install -e .``
  without the torch extra, beside the torch torchft runs on): torchft's DiLoCo and Streaming DiLoCo on
  the same schedules and outer optimizer, fp32 pseudo-gradients all-reduced
  between the hosts over gloo (its quantized path needs CUDA and Triton), its
  lighthouse in the aggregator's namespace; the streaming row cuts the
  parameters into 2 fragments in order by size, as gradq does.

Besides the means, each host records every inner step's time and the bytes
through its link in that step: the report gives a host's longest stall (its
slowest step less its median one, the worst host's) and the peak bytes of one
inner step, beside the mean.

DDP runs ``--steps`` steps; its final held-out loss is the target. The other
rows run until they reach it, or ``--budget`` times the steps. Reported: ms per
inner step, bytes through a host's link per inner step (its device's tx + rx
counters), CPU seconds per inner step (the ranks' and the aggregator's), the
held-out loss at DDP's steps (equal tokens), and the training time to DDP's
final loss (evaluation excluded). The report goes to stdout and
``bench/results/diloco-<time>.md``. This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

import netns
from cpu_busy import read_process_cpu_s

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
AGGREGATOR_PORT = 50051
RENDEZVOUS_PORT = 29700
SEED = 0
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")
RUN_TIMEOUT_S = 3600.0
METHODS = {
    "ddp": "DDP allreduce fp32",
    "gradq4ef": "gradq per-step 4-bit + EF",
    "diloco10": "gradq DiLoCo H=10, 4-bit + EF",
    "diloco10-hosts": "gradq DiLoCo H=10, 4-bit + EF, outer step on the hosts",
    "diloco50": "gradq DiLoCo H=50, 4-bit + EF",
    "diloco10-stream": "gradq Streaming DiLoCo H=10, 2 fragments, delay 2, alpha 0.5, 4-bit + EF",
    "diloco10-stream3": "gradq Streaming DiLoCo H=10, 2 fragments, delay 3, alpha 0.5, 4-bit + EF",
    "compute-only": "compute only: each host alone, nothing sent",
    "torchft-diloco10": "torchft DiLoCo H=10, fp32 (peer all-reduce)",
    "torchft-diloco10-stream": "torchft Streaming DiLoCo H=10, 2 fragments, delay 2, alpha 0.5, fp32 (peer all-reduce)",
}
LIGHTHOUSE_PORT = 29510


@dataclass(frozen=True)
class RankSpec:
    """What one host's process runs (``--rank-main``)."""

    method: str
    task: str
    rank: int
    hosts: int
    rendezvous: str  # host 0's address: DDP's rendezvous
    address: str  # this host's
    aggregator: str
    job_id: str
    steps: int  # at least these
    budget: int  # at most these
    target: float  # stop once the held-out loss is at or below it (after ``steps``); inf: never
    eval_every: int
    output: str


# -- one host ------------------------------------------------------------------------------------------


def rank_main(spec: RankSpec) -> None:
    """Train one row on this host and write its curve and counters."""
    import torch
    import torch.distributed as dist
    from convergence_tasks import TASKS
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    task = TASKS[spec.task]
    if spec.method.startswith("torchft"):
        _torchft_main(spec, task)
        return

    from gradq.client.config import GradqConfig
    from gradq.client.ddp import GradqHookState, gradq_hook
    from gradq.client.diloco import DiLoCo
    from gradq.qcore import QuantConfig

    quant = QuantConfig(bits=4)
    # "diloco<H>" runs the outer step on the aggregator (the default), "diloco<H>-hosts" on the hosts.
    schedule, _, place = spec.method.removeprefix("diloco").partition("-")
    every = int(schedule) if spec.method.startswith("diloco") else 0
    streaming = place.startswith("stream")  # "stream" lands each fragment 2 inner steps after it is sent; "stream3", 3
    delay = int(place.removeprefix("stream") or 2) if streaming else 0
    outer_step = "hosts" if place == "hosts" else "aggregator"
    alone = spec.method == "compute-only"
    if every or alone:  # each host a process group of its own: only outer rounds leave it
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{RENDEZVOUS_PORT}", rank=0, world_size=1)
    else:
        init = f"tcp://{spec.rendezvous}:{RENDEZVOUS_PORT}"
        dist.init_process_group("gloo", init_method=init, rank=spec.rank, world_size=spec.hosts)
    torch.manual_seed(SEED)
    model = task.build_model()
    trained: torch.nn.Module = model
    if not every and not alone:
        trained = ddp = DistributedDataParallel(model)
        if spec.method == "gradq4ef":
            hook_state = GradqHookState([spec.aggregator], quant, error_feedback=True, job_id=spec.job_id)
            ddp.register_comm_hook(hook_state, gradq_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=task.learning_rates["adamw"], weight_decay=0.01)
    config = GradqConfig.of([spec.aggregator], quant, error_feedback=True, job_id=spec.job_id, elastic_hosts=4)
    # Streaming: 2 fragments of about half the model each (a fragment is whole round keys: 4 here).
    fragments: dict[str, Any] = (
        {
            "fragments": 2,
            "fragment_sync_delay": delay,
            "fragment_update_alpha": 0.5,
            "bucket_elements": sum(p.numel() for p in model.parameters()) // 4 + 1,
        }
        if streaming
        else {}
    )
    outer = (
        (lambda: DiLoCo(config, model, optimizer, sync_every=every, outer_step=outer_step, **fragments))
        if every
        else contextlib.nullcontext
    )
    _train(spec, task, trained, optimizer, every or spec.eval_every, outer)
    dist.destroy_process_group()


def _train(spec: RankSpec, task: Any, model: Any, optimizer: Any, eval_every: int, outer: Any) -> None:
    """The timed loop every row shares: ``outer()`` wraps it (DiLoCo's context, or nothing)."""
    import torch

    held_inputs, held_targets = task.held_out(SEED)
    curve: list[tuple[int, float, float]] = []  # (inner steps, training seconds, held-out loss)
    before = netns.read_counters(netns.HOST_DEVICE)
    trained_s = cpu_s = 0.0
    step = 0
    step_s: list[float] = []  # each inner step's time
    step_bytes: list[int] = []  # the bytes through the host's link during each inner step
    with outer():
        while step < spec.budget:
            began, began_cpu = time.perf_counter(), time.process_time()
            counted = sum(netns.read_counters(netns.HOST_DEVICE))
            inputs, targets = task.batch(spec.rank, step, SEED)
            loss = task.loss(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()  # a DiLoCo's outer round runs inside every H-th step
            step_s.append(time.perf_counter() - began)
            step_bytes.append(sum(netns.read_counters(netns.HOST_DEVICE)) - counted)
            trained_s += step_s[-1]
            cpu_s += time.process_time() - began_cpu
            step += 1
            # Every host holds the same parameters here (DDP's, or the new global ones after an outer round),
            # so every host computes the same held-out loss and stops at the same step without asking the others.
            if step % eval_every == 0:
                with torch.no_grad():
                    curve.append((step, trained_s, float(task.loss(model(held_inputs), held_targets))))
                if step >= spec.steps and curve[-1][2] <= spec.target:
                    break
    tx, rx = netns.read_counters(netns.HOST_DEVICE)
    result = {
        "curve": curve,
        "steps": step,
        "trained_s": trained_s,
        "cpu_s": cpu_s,
        "link_bytes": tx - before[0] + rx - before[1],
        # The first steps wait for the job to form and the kernels to load: not a stall of training.
        "stall_s": max(step_s[5:], default=0.0) - statistics.median(step_s[5:] or [0.0]),
        "peak_step_bytes": max(step_bytes[5:], default=0),
    }
    Path(spec.output).write_text(json.dumps(result))


def _torchft_main(spec: RankSpec, task: Any) -> None:
    """torchft's DiLoCo on the same schedule: a Manager per host, fp32 pseudo-gradients all-reduced over gloo."""
    from datetime import timedelta

    import torch
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    from gradq.client.diloco import default_outer_optimizer

    schedule, _, place = spec.method.removeprefix("torchft-diloco").partition("-")
    sync_every = int(schedule)
    torch.manual_seed(SEED)
    model = task.build_model()
    # Streaming: torchft takes fragments as modules, so the model's top-level children are cut in 2 runs of about
    # half the parameters each, as gradq's fragments cut its parameters in order; plain DiLoCo is one fragment.
    fragments = _module_fragments(model, 2) if place == "stream" else [model]
    streaming = {"fragment_sync_delay": 2, "fragment_update_alpha": 0.5} if place == "stream" else {}
    inner = torch.optim.AdamW(model.parameters(), lr=task.learning_rates["adamw"], weight_decay=0.01)
    outer = default_outer_optimizer(model.parameters())  # gradq's own default, so the rows differ in transport only
    # A replica group of one process still needs its own store; the other hosts reach it for the cross-host group.
    store = torch.distributed.TCPStore(spec.address, RENDEZVOUS_PORT, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=60)),
        load_state_dict=lambda state: (model.load_state_dict(state["model"]), inner.load_state_dict(state["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        min_replica_size=spec.hosts,
        use_async_quorum=False,  # DiLoCo requires it
        replica_id=f"host{spec.rank}",
        lighthouse_addr=f"http://{spec.aggregator.rsplit(':', 1)[0]}:{LIGHTHOUSE_PORT}",
        store_addr=spec.address,
        store_port=RENDEZVOUS_PORT,
        rank=0,
        world_size=1,
        hostname=spec.address,
        init_sync=False,  # every host builds the seed's model
        timeout=timedelta(seconds=60),
    )
    # One outer optimizer per fragment (torchft steps each fragment's on its own), all gradq's default.
    outers = [default_outer_optimizer(fragment.parameters()) for fragment in fragments] if place == "stream" else outer
    _train(
        spec,
        task,
        model,
        inner,
        sync_every,
        lambda: TorchftDiLoCo(manager, fragments, inner, outers, sync_every, **streaming),
    )
    manager.shutdown()
    del store


def _module_fragments(model: Any, count: int) -> list[Any]:
    """``model``'s parameters, in order, cut into ``count`` runs of about equal size, each held by a module of its own.

    gradq cuts its fragments the same way (parameters in order, by size); torchft takes each fragment as a module,
    so each run's parameters (the model's own objects, which torchft updates in place) are registered on an empty one.
    """
    import torch

    named = list(model.named_parameters())
    total = sum(param.numel() for _, param in named)
    holders = [torch.nn.Module() for _ in range(count)]
    seen = 0
    for name, param in named:
        index = min(count - 1, seen * count // total)
        holders[index].register_parameter(name.replace(".", "_"), param)
        seen += param.numel()
    return holders


# -- the driver ----------------------------------------------------------------------------------------


@dataclass
class Row:
    task: str
    rate: str
    method: str
    steps: int
    step_ms: float
    link_bytes_per_step: float
    rank_cpu_s_per_step: float
    aggregator_cpu_s_per_step: float
    loss_at_target_steps: float | None
    time_to_target_s: float | None
    stall_ms: float = 0.0  # the worst host's slowest inner step less its median one
    peak_step_bytes: float = 0.0  # the most bytes through a host's link in one inner step (the worst host's)


def _environment(**extra: str) -> dict[str, str]:
    environment = {name: value for name, value in os.environ.items() if "proxy" not in name.lower()}
    environment.update(dict.fromkeys(THREAD_VARIABLES, "1"), PYTHONUNBUFFERED="1", **extra)
    return environment


def run_row(
    topology: netns.Topology, task: str, rate: str, method: str, target: float, args: argparse.Namespace, work: Path
) -> tuple[Row, list[tuple[int, float, float]]]:
    out = work / f"{task}-{rate}-{method}"
    out.mkdir()
    processes: list[subprocess.Popen[bytes]] = []
    server = topology.aggregators[0]
    try:
        python = args.torchft_python if method.startswith("torchft") else sys.executable
        if method.startswith("torchft"):  # its lighthouse where gradq's aggregator would be
            lighthouse = str(Path(python).with_name("torchft_lighthouse"))
            argv = [lighthouse, "--min_replicas", str(args.hosts), "--bind", f"{server.address}:{LIGHTHOUSE_PORT}"]
            port = LIGHTHOUSE_PORT
        else:
            argv = [sys.executable, "-m", "gradq.server", "--host", server.address, "--port", str(AGGREGATOR_PORT)]
            argv += ["--log-level", "WARNING", "--grace", "1"]
            port = AGGREGATOR_PORT
        with (out / "aggregator.log").open("wb") as log:
            processes.append(subprocess.Popen(server.command(argv), stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 120
        probe = server.command(["bash", "-c", f"echo > /dev/tcp/{server.address}/{port}"])
        while subprocess.run(probe, capture_output=True, check=False).returncode != 0:
            if time.monotonic() > deadline or processes[0].poll() is not None:
                raise RuntimeError(f"{argv[0]} did not start:\n{(out / 'aggregator.log').read_text()[-2000:]}")
            time.sleep(0.1)
        aggregator_pids = netns.namespace_pids(server.namespace)
        aggregator_cpu = read_process_cpu_s(aggregator_pids)
        # torchft's streaming hosts differ where a fragment mixes in their own parameters, so each would stop at
        # its own step and leave the others waiting in a quorum: they all run the budget (the curve still gives
        # the time to the target). gradq's hosts may stop apart: a host that leaves ends its membership.
        stop_at = math.inf if method.startswith("torchft") and method.endswith("-stream") else target
        for rank in range(args.hosts):
            host = topology.workers[rank]
            spec = RankSpec(
                method,
                task,
                rank,
                args.hosts,
                topology.workers[0].address,
                host.address,
                f"{server.address}:{AGGREGATOR_PORT}",
                f"diloco-{out.name}-{os.getpid()}",
                args.steps,
                args.steps if method in ("ddp", "compute-only") else args.steps * args.budget,
                stop_at,
                args.eval_every,
                str(out / f"rank{rank}.json"),
            )
            command = host.command([python, str(Path(__file__).resolve()), "--rank-main", json.dumps(asdict(spec))])
            with (out / f"rank{rank}.log").open("wb") as log:
                environment = _environment(GLOO_SOCKET_IFNAME=host.device)
                processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment))
        for rank, process in enumerate(processes[1:]):
            if process.wait(timeout=RUN_TIMEOUT_S) != 0:
                raise RuntimeError(f"{method} rank {rank} failed:\n{(out / f'rank{rank}.log').read_text()[-3000:]}")
        aggregator_cpu = read_process_cpu_s(aggregator_pids) - aggregator_cpu
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=30)
    results = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(args.hosts)]
    curve = [tuple(point) for point in results[0]["curve"]]
    steps = results[0]["steps"]
    at_steps = next((loss for step, _, loss in curve if step >= args.steps), None)
    reached = next((seconds for _, seconds, loss in curve if loss <= target), None)
    if method == "compute-only":  # each host's own model: no loss of the job's
        at_steps = reached = None
    row = Row(
        task,
        rate,
        method,
        steps,
        statistics.mean(result["trained_s"] for result in results) / steps * 1000,
        statistics.mean(result["link_bytes"] for result in results) / steps,
        sum(result["cpu_s"] for result in results) / steps,
        aggregator_cpu / steps,
        at_steps,
        reached,
        max(result["stall_s"] for result in results) * 1000,
        max(result["peak_step_bytes"] for result in results),
    )
    return row, curve  # type: ignore[return-value]


def render(rows: Sequence[Row], args: argparse.Namespace) -> str:
    lines = [
        "# DiLoCo over slow links",
        "",
        f"{args.hosts} hosts, one rank each, each host's link and the aggregator's shaped in both directions; "
        f"{netns.describe_rtt(args.rtt)}; "
        f"AdamW; DDP fp32 trains {args.steps} steps and sets the target (its final held-out loss); the other rows "
        f"train until they reach it or {args.budget}x the steps. {os.cpu_count()} cores shared by all.",
        "",
    ]
    for task, rate in dict.fromkeys((row.task, row.rate) for row in rows):
        group = [row for row in rows if (row.task, row.rate) == (task, rate)]
        ddp = next(row for row in group if row.method == "ddp")
        lines += [f"## {task}, {rate} per link", ""]
        lines += [
            "| method | ms/inner step | longest stall ms | host-link bytes/inner step: mean / peak | x DDP bytes "
            f"| CPU s/step: ranks / aggregator | held-out loss at {args.steps} steps | vs DDP | time to DDP's loss "
            "| sooner than DDP |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in group:
            loss = f"{row.loss_at_target_steps:.4f}" if row.loss_at_target_steps is not None else "-"
            versus = (
                f"{(row.loss_at_target_steps / ddp.loss_at_target_steps - 1) * 100:+.2f}%"
                if row.loss_at_target_steps is not None and ddp.loss_at_target_steps
                else "-"
            )
            reached = f"{row.time_to_target_s:.1f} s" if row.time_to_target_s is not None else "never"
            sooner = (
                f"{ddp.time_to_target_s / row.time_to_target_s:.1f}x"
                if row.time_to_target_s and ddp.time_to_target_s
                else "-"
            )
            lines.append(
                f"| {METHODS[row.method]} | {row.step_ms:.1f} | {row.stall_ms:.0f} "
                f"| {row.link_bytes_per_step:,.0f} / {row.peak_step_bytes:,.0f} "
                f"| {row.link_bytes_per_step / ddp.link_bytes_per_step:.4f} "
                f"| {row.rank_cpu_s_per_step:.3f} / {row.aggregator_cpu_s_per_step:.3f} | {loss} | {versus} "
                f"| {reached} | {sooner} |"
            )
        lines.append("")
    return "\n".join(lines)


def _raise_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank-main", help=argparse.SUPPRESS)
    parser.add_argument(
        "--tasks", nargs="+", default=["transformer", "source-lm"], help="bench/convergence_tasks.py keys"
    )
    parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"], help="link rates (tc syntax)")
    gradq_rows = [
        key
        for key in METHODS
        if not key.startswith("torchft") and key not in ("compute-only", "diloco10-hosts", "diloco10-stream3")
    ]
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=gradq_rows, help="rows (ddp first)")
    parser.add_argument("--hosts", type=int, default=4, help="hosts, one rank each")
    netns.add_rtt_argument(parser)
    parser.add_argument("--steps", type=int, default=300, help="DDP's steps: the target's")
    parser.add_argument("--budget", type=float, default=2.0, help="the others' most steps, times --steps")
    parser.add_argument(
        "--torchft-python",
        help="an interpreter with torch, torchft and gradq (pip install -e . without extras): the torchft rows' "
        "(adds torchft-diloco10 unless a torchft row is named; torchft is not a gradq dependency)",
    )
    parser.add_argument("--work-dir", help="keep every process's log here (default: a temporary directory)")
    parser.add_argument("--eval-every", type=int, default=10, help="per-step rows: steps between evaluations")
    args = parser.parse_args(argv)
    if args.methods[0] != "ddp":
        parser.error("--methods must start with ddp: its final loss is the others' target")
    if args.torchft_python and not any(method.startswith("torchft") for method in args.methods):
        args.methods.append("torchft-diloco10")
    if any(method.startswith("torchft") for method in args.methods) and not args.torchft_python:
        parser.error("the torchft rows need --torchft-python")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank_main:
        rank_main(RankSpec(**json.loads(args.rank_main)))
        return 0
    if os.geteuid() != 0:
        print("bench/diloco.py needs root (network namespaces and tc); run it with sudo", file=sys.stderr)
        return 2
    args.budget = int(args.budget) if float(args.budget).is_integer() else args.budget
    topology = netns.build_topology(args.hosts, 1, args.rtt)
    atexit.register(topology.close)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_on_signal)
    rows: list[Row] = []
    curves: dict[str, Any] = {}
    try:
        with contextlib.ExitStack() as stack:
            work = args.work_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="gradq-diloco-"))
            for task in args.tasks:
                for rate in args.rates:
                    topology.shape(topology.hosts, rate)
                    target = float("inf")
                    for method in args.methods:
                        print(f"{task} {rate} {method} ...", file=sys.stderr, flush=True)
                        row, curve = run_row(topology, task, rate, method, target, args, Path(work))
                        if method == "ddp":  # its final loss is the target, reached when it ends
                            target, row.time_to_target_s = curve[-1][2], curve[-1][1]
                        rows.append(row)
                        curves[f"{task}/{rate}/{method}"] = curve
    finally:
        topology.close()
    report = render(rows, args)
    print(report)
    RESULTS.mkdir(exist_ok=True)
    stamp = f"{datetime.now():%Y%m%d-%H%M%S}"
    (RESULTS / f"diloco-{stamp}.md").write_text(report + "\n")
    (RESULTS / f"diloco-{stamp}.json").write_text(json.dumps({"rows": [asdict(row) for row in rows], "curves": curves}))
    print(f"saved {RESULTS / f'diloco-{stamp}.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
