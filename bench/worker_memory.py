"""A training rank's memory with gradq against plain allreduce: peak RSS side by side, and what the session holds.

Run from the repository root with the virtualenv's interpreter::

    python bench/worker_memory.py                      # GPT-2 124M, 2 ranks, 4-bit + EF, flat
    python bench/worker_memory.py --layers 4 --steps 4 # a smaller GPT-2 for a quick look

Each mode runs in fresh rank processes (gloo on loopback, one thread each) that
build the same randomly initialised GPT-2 (transformers' GPT2LMHeadModel, no
download), wrap it in DDP and train ``--steps`` steps of AdamW on random tokens.
A thread samples the rank's RSS every 5 ms. Printed per mode: RSS once the
model and optimizer exist and one step has run (the baseline every mode
shares), the peak RSS over the training steps, and, for gradq, the bytes the
session says it held at that peak (``GradqSession.held_bytes()``: residuals
and the encoded pushes in flight). The line "unaccounted" is the peak over
allreduce's minus what the session held and what loading qcore's compiled
kernels costs (measured in a process of its own). The aggregator runs in the
parent process, so its memory is not counted.
"""

from __future__ import annotations

import os

for _variable in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_variable] = "1"

import argparse  # noqa: E402
import threading  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from gradq.client.ddp import GradqHookState, gradq_hook  # noqa: E402
from gradq.qcore import QuantConfig  # noqa: E402
from gradq.server.app import AggregatorServer, ServerOptions  # noqa: E402
from gradq.server.policy import RoundPolicy  # noqa: E402
from gradq.server.process import free_port  # noqa: E402

MB = 1e6


@dataclass(frozen=True)
class Run:
    mode: str  # "allreduce" or "gradq"
    aggregator: str
    init_method: str
    layers: int
    steps: int
    bits: int
    error_feedback: bool


@dataclass
class Measured:
    params: int
    baseline: float  # bytes of RSS after the first step
    peak: float  # peak RSS over the steps after it
    held: dict[str, int]  # what the session held at the peak RSS (gradq only)


class PeakSampler:
    """Samples this process's RSS every 5 ms on a thread of its own, and what the session holds at the peak."""

    def __init__(self) -> None:
        self.peak = 0
        self.held_at_peak: dict[str, int] = {}
        self.holds: Callable[[], dict[str, int]] | None = None
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            held = self.holds() if self.holds is not None else {}
            rss = self._process.memory_info().rss
            if rss > self.peak:
                self.peak, self.held_at_peak = rss, held

    def reset(self, holds: Callable[[], dict[str, int]] | None) -> None:
        self.peak, self.holds = self._process.memory_info().rss, holds

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def train_rank(rank: int, world: int, run: Run, queue: mp.SimpleQueue) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=run.init_method, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DistributedDataParallel(GPT2LMHeadModel(GPT2Config(n_layer=run.layers, n_positions=256)))
    state = None
    if run.mode == "gradq":
        state = GradqHookState(
            run.aggregator,
            QuantConfig(bits=run.bits),
            error_feedback=run.error_feedback,
            job_id=f"memory-{run.layers}",
            host_grouping="flat",
        )
        model.register_comm_hook(state, gradq_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(rank))
    sampler = PeakSampler()
    baseline = 0.0
    for step in range(run.steps + 1):
        optimizer.zero_grad(set_to_none=False)
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()
        if step == 0:  # the model, the optimizer's state and DDP's buckets exist now
            baseline = psutil.Process().memory_info().rss
            session = state.session if state is not None else None
            sampler.reset(session.held_bytes if session is not None else None)
    peak = sampler.stop()
    held = sampler.held_at_peak
    params = sum(p.numel() for p in model.parameters())
    if state is not None:
        state.close()
    queue.put((rank, Measured(params, baseline, peak, held)))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def measure(run: Run, world: int) -> Measured:
    """Rank 0's figures (every rank holds the same)."""
    queue: mp.SimpleQueue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(train_rank, args=(world, run, queue), nprocs=world, join=True)
    results = dict(queue.get() for _ in range(world))
    return results[0]


def kernel_memory(queue: mp.SimpleQueue) -> None:
    """RSS that loading and first running qcore's compiled kernels adds to a process that has torch already."""
    import numpy as np

    from gradq.qcore import decode, encode
    from gradq.qcore.error_feedback import ErrorFeedback

    before = psutil.Process().memory_info().rss
    values = np.zeros(4096, np.float32)
    config = QuantConfig(bits=4)
    decode(encode(values, config))
    ErrorFeedback().encode(0, values, config)
    queue.put(psutil.Process().memory_info().rss - before)


def measure_kernels() -> int:
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    process = context.Process(target=kernel_memory, args=(queue,))
    process.start()
    process.join()
    return int(queue.get())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12, help="GPT-2 blocks (12: GPT-2 124M)")
    parser.add_argument("--steps", type=int, default=4, help="steps measured after the first")
    parser.add_argument("--world", type=int, default=2, help="ranks")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--no-error-feedback", action="store_true")
    args = parser.parse_args()

    server = AggregatorServer(RoundPolicy(round_timeout_s=120.0), ServerOptions("127.0.0.1:0"))
    server.start()
    try:
        rows = {}
        for mode in ("allreduce", "gradq"):
            run = Run(
                mode,
                f"127.0.0.1:{server.port}",
                f"tcp://127.0.0.1:{free_port()}",
                args.layers,
                args.steps,
                args.bits,
                not args.no_error_feedback,
            )
            rows[mode] = measure(run, args.world)
    finally:
        server.stop()
    base, gradq = rows["allreduce"], rows["gradq"]
    feedback = "" if args.no_error_feedback else " + EF"
    print(f"GPT-2 {base.params / 1e6:.1f}M parameters, {args.world} ranks, {args.bits}-bit{feedback} flat, AdamW")
    print(f"{'mode':<10} {'baseline MB':>12} {'peak MB':>9} {'peak - allreduce MB':>20}")
    for mode, row in rows.items():
        print(f"{mode:<10} {row.baseline / MB:12.0f} {row.peak / MB:9.0f} {(row.peak - base.peak) / MB:20.0f}")
    kernels = measure_kernels()
    held = sum(gradq.held.values())
    for name, value in gradq.held.items():
        print(f"  session holds {name}: {value / MB:.0f} MB")
    print(f"  qcore's compiled kernels, loaded: {kernels / MB:.0f} MB (measured in a process of their own)")
    print(f"  unaccounted: {(gradq.peak - base.peak - held - kernels) / MB:.0f} MB")
    print(f"  peak ratio gradq / allreduce: {gradq.peak / base.peak:.3f}")


if __name__ == "__main__":
    main()
