"""Check the DDP adapter's CUDA path on a GPU: `python bench/cuda_check.py`.

1. Byte identity: the device quantizer (gradq.client.torch_codec) against
   gradq.qcore.encode on the same values, for every quantized scheme.
2. Cost: device quantize + copy of the packed bytes, against copying the fp32
   bucket to the host and encoding it there.
3. Training: two DDP ranks (gloo, both on GPU 0) train the digits MLP on the
   GPU through a local aggregator; their parameters must stay identical.

Exits 0 when every check passes, 1 when one fails, 2 when there is no CUDA device.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from gradq.client.torch_codec import quantize_tensor
from gradq.qcore import QuantConfig, Scheme, encode

CONFIGS = [
    QuantConfig(scheme=scheme, bits=bits)
    for scheme in (Scheme.PER_CHANNEL_AFFINE, Scheme.PER_CHANNEL_SYMMETRIC, Scheme.PER_TENSOR_AFFINE)
    for bits in (2, 4, 8)
]


def check_bytes(numel: int) -> bool:
    """Device payloads equal qcore's for random gradient-like buckets."""
    ok = True
    generator = torch.Generator(device="cuda").manual_seed(0)
    for config in CONFIGS:
        values = torch.randn(numel, device="cuda", generator=generator) * 1e-3
        device_encoded, _ = quantize_tensor(values, config)
        host_encoded = encode(values.cpu().numpy(), config)
        same = (
            device_encoded.payload.tobytes() == host_encoded.payload.tobytes()
            and np.array_equal(device_encoded.scale, host_encoded.scale)
            and np.array_equal(device_encoded.zero_point, host_encoded.zero_point)
        )
        print(f"  {config.scheme.name.lower():<24} {config.bits}-bit  {'identical' if same else 'DIFFERENT'}")
        ok &= same
    return ok


def _median_ms(action: object, repeats: int = 20) -> float:
    timings = []
    for _ in range(repeats + 2):
        torch.cuda.synchronize()
        started = time.perf_counter()
        action()  # type: ignore[operator]
        torch.cuda.synchronize()
        timings.append(time.perf_counter() - started)
    return 1000 * float(np.median(timings[2:]))


def report_cost(numel: int) -> None:
    """Device quantize vs host encode of the same bucket."""
    values = torch.randn(numel, device="cuda") * 1e-3
    config = QuantConfig(bits=8)
    device_ms = _median_ms(lambda: quantize_tensor(values, config))
    host_ms = _median_ms(lambda: encode(values.cpu().numpy(), config))
    print(
        f"  {numel:,} elements, 8-bit per-channel: device quantize + packed copy {device_ms:.2f} ms, "
        f"fp32 copy to host + qcore encode {host_ms:.2f} ms ({host_ms / device_ms:.2f}x)"
    )


def check_training(epochs: int) -> bool:
    """Two GPU ranks train through a local aggregator and agree on every parameter."""
    from gradq.client.demo import free_port, local_aggregator, run_job
    from gradq.client.training import TrainSpec

    with local_aggregator(2) as address:
        spec = TrainSpec(
            world_size=2,
            init_method=f"tcp://127.0.0.1:{free_port()}",
            aggregators=(address,),
            config=QuantConfig(bits=8),
            epochs=epochs,
            device="cuda",
        )
        results = run_job(spec)
    same = np.array_equal(results[0].parameters, results[1].parameters)
    print(
        f"  accuracy {results[0].accuracy:.1f}%, loss {results[0].first_loss:.3f} -> {results[0].last_loss:.3f}, "
        f"ranks identical: {same}, mode {results[0].mode}"
    )
    return same and results[0].last_loss < results[0].first_loss


def main() -> int:
    """Run the three checks; see the module docstring for exit codes."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=6_000_000)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        return 2
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print("byte identity (device vs qcore):")
    identical = check_bytes(args.numel)
    print("cost:")
    report_cost(args.numel)
    print("DDP training on the GPU through gradq:")
    trained = check_training(args.epochs)
    verdict = identical and trained
    print(f"verdict: {'PASS' if verdict else 'FAIL'}")
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
