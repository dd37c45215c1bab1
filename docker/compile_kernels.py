"""Compile qcore's numba kernels into the image at build time: `python docker/compile_kernels.py`.

numba compiles a kernel on its first call and caches the machine code beside
the kernel's source (``cache=True``), where the image keeps it: a container
then loads it in well under a second instead of compiling for ~12 s with no
output. Every scheme and rounding runs once through what the aggregator and
the workers call: encode, decode, decode-accumulate, the relative error the aggregator reports,
encoding with an observer's qparams and error feedback, on
arrays as they arrive off the wire too (read-only views of the message: numba
compiles separately for those).
"""

from __future__ import annotations

import time

import numpy as np

from gradq.proto.convert import tensor_from_proto, tensor_to_proto
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.qcore import (
    ErrorFeedback,
    QuantConfig,
    Rounding,
    Scheme,
    decode,
    decode_accumulate,
    encode,
    observer_for,
    relative_error,
)
from gradq.qcore.codecs import codec_for
from gradq.qcore.codecs.uniform import UniformCodec


def compile_scheme(scheme: Scheme, rounding: Rounding) -> None:
    """Run one grid through every qcore entry point the server and the clients use."""
    values = np.linspace(-1.0, 1.0, 3000, dtype=np.float32)
    config = QuantConfig(scheme=scheme, bits=4, rounding=rounding, seed=0)
    encoded = encode(values, config)
    received = tensor_from_proto(pb.QuantizedTensor.FromString(tensor_to_proto(encoded).SerializeToString()))
    for q in (encoded, received):
        decode(q)
        decode(q, out=np.empty(values.size, np.float32))
        accumulator = np.zeros(values.size, np.float32)
        decode_accumulate(q, accumulator)
        decode_accumulate(q, accumulator, divide_by=2)
        relative_error(q, values)  # the aggregator's gradq_mean_relative_error, every round
    if isinstance(codec_for(scheme), UniformCodec):  # the grids an observer sets
        observer = observer_for(config)
        observer.observe(values)
        encode(values, config, qparams=observer.calculate_qparams())
    feedback = ErrorFeedback()
    for _ in range(2):  # the second call takes the residual path
        feedback.encode(0, values, config)


def main() -> int:
    """Compile every (scheme, rounding) pair, printing progress; returns 0."""
    started = time.perf_counter()
    print("compiling qcore's numba kernels into the image", flush=True)
    for scheme in Scheme:
        roundings = list(Rounding) if scheme.is_quantized else [Rounding.NEAREST]
        for rounding in roundings:
            begun = time.perf_counter()
            compile_scheme(scheme, rounding)
            name = f"{scheme.name.lower()}, {rounding.name.lower()} rounding"
            print(f"  {name:<45} {time.perf_counter() - begun:5.1f} s", flush=True)
    print(f"kernels compiled and cached in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
