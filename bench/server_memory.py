"""Aggregator memory under a GPT-2-sized job, against the memory model of docs/operating.md.

Run from the repository root with the virtualenv's interpreter::

    python bench/server_memory.py                  # 124,439,808 parameters (GPT-2 124M), 8 bits, 3 ranks
    python bench/server_memory.py --params 20000000 --workers 2 --steps 4

The aggregator runs in a process of its own (spawned), with a thread that
samples its RSS and its memory budget's use every 10 ms. W rank processes push
the model's gradient as DDP does: buckets of 25 MiB of float32, each cut into
rounds of the client's default chunk size, two pushes in flight per rank
(``max_in_flight=2``, the DDP hook's setting), every step's buckets before the
next step's. Gradients are random and encoded by the ranks every step, so the
figures include real encoding; the timing is not the point.

Printed: the server's baseline RSS (numba and the codecs loaded, before the
job), its peak RSS and the budget's peak, and what the memory model
predicts: the encoded means of ``retain_steps + 1`` steps plus one fp32
accumulator per round in flight, and, outside the budget, gRPC's buffers for
the pushes being received. This is a benchmark, not a test
(tests/server/test_memory_model.py checks the model's retained part exactly).
"""

from __future__ import annotations

import os

for _variable in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_variable] = "1"

import argparse  # noqa: E402
import multiprocessing as mp  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from multiprocessing.connection import Connection  # noqa: E402

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from gradq.client.chunks import DEFAULT_CHUNK_ELEMENTS, chunk_bounds  # noqa: E402
from gradq.qcore import QuantConfig, Scheme, codec_for  # noqa: E402

GPT2_PARAMS = 124_439_808
BUCKET_ELEMENTS = 25 * (1 << 20) // 4  # DDP's default bucket_cap_mb=25, in float32 elements
MAX_IN_FLIGHT = 2  # the DDP hook's pushes per shard on the wire
RETAIN_STEPS = 2  # gradq serve's default --retain-steps
SAMPLE_S = 0.01
MB = 1e6


def buckets_of(params: int) -> list[int]:
    """Element counts of the model's DDP buckets."""
    full, rest = divmod(params, BUCKET_ELEMENTS)
    return [BUCKET_ELEMENTS] * full + ([rest] if rest else [])


def serve(pipe: Connection) -> None:
    """The aggregator's process: serve, sample RSS and the budget, report the peaks when told to stop."""
    from gradq.qcore import decode, encode
    from gradq.server.app import AggregatorServer, ServerOptions
    from gradq.server.limits import ServiceLimits
    from gradq.server.policy import RoundPolicy

    me = psutil.Process()
    config = QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=8)
    decode(encode(np.ones(1024, np.float32), config))  # load numba's kernels before the baseline
    server = AggregatorServer(
        RoundPolicy(round_timeout_s=600.0, retain_steps=RETAIN_STEPS),
        ServerOptions("127.0.0.1:0", grace_s=1.0),
        ServiceLimits(max_memory_bytes=64 << 30, max_job_memory_bytes=64 << 30),
    )
    server.start()
    baseline = me.memory_info().rss
    peaks = {"rss": baseline, "budget": 0, "budget_and_pool": 0}
    stopped = threading.Event()

    def sample() -> None:
        while not stopped.wait(SAMPLE_S):
            in_use = server.table.budget.in_use
            peaks["rss"] = max(peaks["rss"], me.memory_info().rss)
            peaks["budget"] = max(peaks["budget"], in_use)
            peaks["budget_and_pool"] = max(peaks["budget_and_pool"], in_use + server.table.accumulators.free_bytes)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    pipe.send(server.port)
    pipe.recv()  # every rank has its last mean and has not left: the retained means alone remain
    retained = server.table.budget.in_use
    pipe.send(retained)
    pipe.recv()  # the ranks have left
    stopped.set()
    sampler.join()
    server.stop()
    pipe.send({"baseline": baseline, "retained": retained, **peaks})


def rank(address: str, rank_id: int, world: int, params: int, steps: int, pipe: Connection) -> None:
    """One rank: every step, push each bucket (chunked, two in flight) and wait for all of them."""
    from gradq.client import WorkerClient

    config = QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=8)
    rng = np.random.default_rng(rank_id)
    grads = [rng.standard_normal(size, np.float32) for size in buckets_of(params)]
    with WorkerClient(address, "memory", rank_id, world, config, max_in_flight=MAX_IN_FLIGHT) as client:
        for step in range(steps):
            started = time.perf_counter()
            pending = [client.push_pull_async(step, b, g, out=g) for b, g in enumerate(grads)]
            for future in pending:
                future.result()
            if rank_id == 0:
                print(f"step {step}: {time.perf_counter() - started:.2f} s", flush=True)
        pipe.send("done")
        pipe.recv()  # leave once the server has been measured


def model(params: int, world: int) -> dict[str, int]:
    """The memory model (docs/operating.md) for one shard holding every bucket of the job."""
    config = QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=8)
    codec = codec_for(config.scheme)
    chunks = [
        end - begin
        for size in buckets_of(params)
        for begin, end in chunk_bounds(size, DEFAULT_CHUNK_ELEMENTS, codec.wire_channel_size(size, config.channel_size))
    ]
    largest = max(chunks)
    mean_step = sum(codec.wire_size(numel, config) for numel in chunks)
    in_flight = MAX_IN_FLIGHT + 1  # two per rank on the wire, ranks a push apart: about one more round open
    return {
        "rounds_per_step": len(chunks),
        "retained": (RETAIN_STEPS + 1) * mean_step,
        "accumulators": in_flight * 4 * largest,
        "receiving": world * MAX_IN_FLIGHT * codec.wire_size(largest, config),
    }


def run(params: int, world: int, steps: int) -> None:
    context = mp.get_context("spawn")
    server_pipe, child_pipe = context.Pipe()
    server = context.Process(target=serve, args=(child_pipe,), daemon=True)
    server.start()
    address = f"127.0.0.1:{server_pipe.recv()}"
    pipes, ranks = [], []
    for rank_id in range(world):
        parent, child = context.Pipe()
        process = context.Process(target=rank, args=(address, rank_id, world, params, steps, child), daemon=True)
        process.start()
        pipes.append(parent)
        ranks.append(process)
    for pipe in pipes:
        pipe.recv()
    server_pipe.send("measure")
    server_pipe.recv()
    for pipe in pipes:
        pipe.send("leave")
    for process in ranks:
        process.join()
    server_pipe.send("stop")
    measured = server_pipe.recv()
    server.join()
    predicted = model(params, world)
    budget = predicted["retained"] + predicted["accumulators"]
    total = measured["baseline"] + budget + predicted["receiving"]
    rows = [
        ("baseline RSS", measured["baseline"], None),
        ("retained means", measured["retained"], predicted["retained"]),
        ("budget peak", measured["budget"], budget),
        ("budget + free accumulators peak", measured["budget_and_pool"], None),
        ("receive buffers", None, predicted["receiving"]),
        ("peak RSS (model: baseline + budget + buffers)", measured["rss"], total),
    ]
    print(
        f"{params:,} parameters, 8 bits per channel, {world} ranks, {steps} steps, "
        f"{predicted['rounds_per_step']} rounds per step; MB measured / model"
    )
    for name, seen, expected in rows:
        shown = [f"{value / MB:8.0f}" if value is not None else " " * 8 for value in (seen, expected)]
        print(f"  {name:46s} {shown[0]} {shown[1]}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=GPT2_PARAMS, help="float32 gradient elements per rank")
    parser.add_argument("--workers", type=int, default=3, help="ranks")
    parser.add_argument("--steps", type=int, default=6, help="training steps")
    args = parser.parse_args(argv)
    run(args.params, args.workers, args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
