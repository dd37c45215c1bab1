"""Check the device path on a GPU: `python bench/cuda_check.py` (`--device cpu` runs the same checks on the CPU).

1. Byte identity: every codec's torch twin on the device against
   gradq.qcore.encode on the same values (nearest and stochastic rounding),
   and device decoding against qcore's.
2. Cost: device quantize + copy of the packed bytes, against copying the fp32
   bucket to the host and encoding it there.
3. End to end: two DDP ranks (gloo, both on the device) train a small MLP
   through two real aggregator shards with the hook's torch codec, buckets
   chunked across both; per step, what crossed the host-device boundary
   against the fp32 gradient bytes, and whether both ranks' parameters agree.

Exits 0 when every check passes, 1 when one fails, 2 when there is no CUDA device.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradq.client.ddp import GradqHookState, gradq_hook
from gradq.qcore import QuantConfig, Rounding, Scheme, decode, encode
from gradq.qcore.torch_codec import crossings, decode_tensor, encode_tensor
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.policy import RoundPolicy
from gradq.server.process import free_port


def check_bytes(device: str, numel: int) -> bool:
    """Every codec's device payload and device decode equal qcore's."""
    ok = True
    for scheme in Scheme:
        for bits in (2, 4, 8) if scheme.is_quantized else (8,):
            for rounding in Rounding:
                config = QuantConfig(scheme=scheme, bits=bits, rounding=rounding)
                values = torch.randn(numel, device=device) * 1e-3
                on_device = encode_tensor(values, config, rng=np.random.default_rng(1))
                on_host = encode(values.cpu().numpy(), config, rng=np.random.default_rng(1))
                decoded = decode_tensor(on_host, torch.empty(numel, device=device)).cpu().numpy()
                same = (
                    on_device.payload.tobytes() == on_host.payload.tobytes()
                    and np.array_equal(on_device.scale, on_host.scale)
                    and np.array_equal(on_device.zero_point, on_host.zero_point)
                    and np.array_equal(decoded, decode(on_host))
                )
                name = f"{scheme.name.lower()} {bits}-bit {rounding.name.lower()}"
                print(f"  {name:<42} {'identical' if same else 'DIFFERENT'}")
                ok &= same
    return ok


def _median_ms(action: Callable[[], object], synchronize: Callable[[], None], repeats: int = 20) -> float:
    timings = []
    for _ in range(repeats + 2):
        synchronize()
        started = time.perf_counter()
        action()
        synchronize()
        timings.append(time.perf_counter() - started)
    return 1000 * float(np.median(timings[2:]))


def report_cost(device: str, numel: int) -> None:
    """Device quantize + packed copy vs fp32 copy + host encode of the same bucket."""
    values = torch.randn(numel, device=device) * 1e-3
    config = QuantConfig(bits=8)
    synchronize = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    device_ms = _median_ms(lambda: encode_tensor(values, config), synchronize)
    host_ms = _median_ms(lambda: encode(values.cpu().numpy(), config), synchronize)
    print(
        f"  {numel:,} elements, 8-bit per-channel: device quantize + packed copy {device_ms:.2f} ms, "
        f"fp32 copy to host + qcore encode {host_ms:.2f} ms ({host_ms / device_ms:.2f}x)"
    )


def train_rank(
    rank: int, device: str, init_method: str, addresses: list[str], steps: int, queue: mp.SimpleQueue
) -> None:
    """One DDP rank on ``device``: train, report per-step crossings and the final parameters."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)).to(device)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.25)
    # Small chunks: every bucket is cut into rounds that alternate between the two shards.
    # codec="torch" is what "auto" picks for a GPU bucket; it also runs the device path with --device cpu.
    state = GradqHookState(addresses, QuantConfig(bits=8), error_feedback=True, chunk_elements=1 << 15, codec="torch")
    ddp.register_comm_hook(state, gradq_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    # One batch per rank, seen every step: the loss must fall.
    generator = torch.Generator(device=device).manual_seed(rank)
    inputs = torch.randn(64, 256, device=device, generator=generator)
    labels = torch.arange(64, device=device) % 10
    gradient_bytes = 4 * sum(p.numel() for p in model.parameters())
    rows = []
    for step in range(steps):
        before = crossings.snapshot()
        loss = nn.functional.cross_entropy(ddp(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        after = crossings.snapshot()
        rows.append((step, gradient_bytes, *(a - b for a, b in zip(after, before, strict=True)), loss.item()))
    stats = state.stats()
    parameters = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy()
    queue.put((rank, rows, parameters, stats.line() if stats else "", state.mode))
    state.close()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # see tests/client/ddp_probe.py: nothing left to finalize under gloo's exiting threads


def check_training(device: str, steps: int) -> bool:
    """Two ranks train on the device through two shards; print crossings per step; parameters must agree."""
    servers = [AggregatorServer(RoundPolicy(), ServerOptions("127.0.0.1:0", grace_s=0.5)) for _ in range(2)]
    for server in servers:
        server.start()
    try:
        queue: mp.SimpleQueue = mp.get_context("spawn").SimpleQueue()
        addresses = [f"127.0.0.1:{server.port}" for server in servers]
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ranks = mp.spawn(train_rank, args=(device, init_method, addresses, steps, queue), nprocs=2, join=False)
        # Read while the ranks run: a rank blocks on a full pipe until its result is read.
        results = {}
        for _ in range(2):
            rank, *rest = queue.get()
            results[rank] = rest
        ranks.join()
        rounds = [server.table.counters["rounds_completed"] for server in servers]
    finally:
        for server in servers:
            server.stop()
    rows, parameters, stats, mode = results[0]
    print("  step  fp32 gradients  to host (bytes)  to device (bytes)  copies   loss")
    for step, gradient_bytes, to_host, to_device, copies, loss in rows:
        print(f"  {step:>4}  {gradient_bytes:>14,}  {to_host:>15,}  {to_device:>17,}  {copies:>6}  {loss:.3f}")
    same = np.array_equal(parameters, results[1][1])
    print(f"  rank 0 client: {stats}")
    print(f"  rounds per shard: {rounds}; mode {mode}; ranks' parameters identical: {same}")
    last = rows[-1]
    packed = 0 < last[2] < last[1] / 2 and 0 < last[3] < last[1] / 2  # 8-bit: about a quarter of fp32 each way
    return same and mode == "gradq" and min(rounds) > 0 and packed and rows[-1][-1] < rows[0][-1]


def main() -> int:
    """Run the three checks; see the module docstring for exit codes."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=6_000_000)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="'cuda' (exits 2 without one) or 'cpu'")
    args = parser.parse_args()
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("no CUDA device: nothing checked")
            return 2
        print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print("byte identity (device vs qcore):")
    identical = check_bytes(args.device, args.numel)
    print("cost:")
    report_cost(args.device, args.numel)
    print("DDP through two gradq shards, torch codec on the device:")
    trained = check_training(args.device, args.steps)
    verdict = identical and trained
    print(f"verdict: {'PASS' if verdict else 'FAIL'}")
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
