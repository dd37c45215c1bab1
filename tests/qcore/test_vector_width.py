"""qcore's bytes do not depend on the vector width numba compiles its kernels for.

``gradq.qcore._numba_target`` lets LLVM use 512-bit vectors on some CPUs; a
client on one host and an aggregator on another must still agree byte for
byte. Two fresh interpreters encode and decode the same inputs, one with the
host's own feature string (LLVM's 256-bit preference kept) and one as qcore
chooses; every payload, scale, zero point, residual and decoded value must hash
the same.
"""

from __future__ import annotations

import os
import subprocess
import sys

_SCRIPT = r"""
import hashlib, sys
import numpy as np
from gradq.qcore import ErrorFeedback, QuantConfig, Scheme, decode, decode_accumulate, encode

digest = hashlib.sha256()
rng = np.random.default_rng(7)
for numel in (1, 511, 8192 + 77, 300_003):
    x = (rng.standard_normal(numel) * 10.0 ** rng.uniform(-6, 1)).astype(np.float32)
    x[rng.random(numel) < 0.2] = 0.0
    for scheme in (Scheme.PER_TENSOR_AFFINE, Scheme.PER_CHANNEL_AFFINE, Scheme.PER_CHANNEL_SYMMETRIC,
                   Scheme.PER_CHANNEL_SIGN):
        for bits in {Scheme.PER_CHANNEL_SIGN: (1,), Scheme.PER_CHANNEL_SYMMETRIC: (2, 4, 8)}.get(scheme, (1, 2, 4, 8)):
            for rounding in ("nearest", "stochastic"):
                if scheme == Scheme.PER_CHANNEL_SIGN and rounding == "stochastic":
                    continue
                config = QuantConfig(scheme=scheme, bits=bits, channel_size=128, rounding=rounding, seed=3)
                q = encode(x, config)
                feedback = ErrorFeedback()
                compensated = [feedback.encode("b", x * k, config) for k in (1.0, -0.5)]
                accumulator = np.ones(numel, np.float32)
                decode_accumulate(q, accumulator, divide_by=3)
                for part in (q, *compensated):
                    digest.update(part.payload.tobytes() + part.scale.tobytes() + part.zero_point.tobytes())
                    digest.update(decode(part).tobytes())
                digest.update(feedback.residual("b").tobytes() + accumulator.tobytes())
print(digest.hexdigest())
"""


def _digest(extra_env: dict[str, str]) -> str:
    env = {key: value for key, value in os.environ.items() if not key.startswith("NUMBA_CPU")}
    env.update(extra_env)
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_bytes_are_the_same_at_the_host_default_and_the_chosen_vector_width() -> None:
    from llvmlite import binding

    host_features = binding.get_host_cpu_features().flatten()
    as_llvm_tunes = _digest({"NUMBA_CPU_FEATURES": host_features})
    as_qcore_chooses = _digest({})
    narrowest = _digest({"NUMBA_CPU_FEATURES": host_features.replace("+avx512f", "-avx512f")})
    assert len(as_llvm_tunes) == 64
    assert as_qcore_chooses == as_llvm_tunes == narrowest


def test_a_feature_string_the_user_set_is_left_alone() -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("NUMBA_CPU")}
    env["NUMBA_CPU_FEATURES"] = "+sse2"
    script = "import os; from gradq.qcore import _kernels; print(os.environ['NUMBA_CPU_FEATURES'])"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "+sse2"
