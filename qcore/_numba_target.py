"""Let numba's LLVM use 512-bit vectors on CPUs where they do not slow the clock.

LLVM tunes every AVX-512 CPU from Skylake-SP on to prefer 256-bit vectors
(``prefer-256-bit``), because 512-bit instructions lowered the clock of the
first of them. On the later cores named below they do not, and qcore's
kernels, one streaming loop each, run up to twice as fast with them: one
elementwise quantize loop 8 -> 14 GB/s in one run on an Emerald Rapids host
(``bench/qcore_kernels.py`` has the whole picture). The kernels do no float
reduction out of order (no fast-math), so the bytes they produce do not
depend on the vector width.

numba reads its target's features once, from ``NUMBA_CPU_FEATURES``, when it
first compiles or loads a function, so this must run before that; it leaves
alone a process that imported numba already or set the variable itself. The
variable is inherited by child processes, which run on the same host.
"""

import os
import sys

# LLVM CPU names of cores whose 512-bit instructions run at the 256-bit clock.
_WIDE_VECTOR_CPUS = frozenset(
    {"icelake-server", "sapphirerapids", "emeraldrapids", "graniterapids", "graniterapids-d", "znver4", "znver5"}
)
_FEATURES_VARIABLE = "NUMBA_CPU_FEATURES"


def prefer_wide_vectors() -> bool:
    """Set ``NUMBA_CPU_FEATURES`` to the host's features without ``prefer-256-bit``, where it helps.

    Returns:
        True when the variable was set here.
    """
    if "numba" in sys.modules or _FEATURES_VARIABLE in os.environ or "NUMBA_CPU_NAME" in os.environ:
        return False
    from llvmlite import binding

    if binding.get_host_cpu_name() not in _WIDE_VECTOR_CPUS:
        return False
    features = binding.get_host_cpu_features()
    if not features.get("avx512f"):
        return False
    os.environ[_FEATURES_VARIABLE] = features.flatten() + ",-prefer-256-bit"
    return True
