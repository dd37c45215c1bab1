"""The image compiles every numba kernel qcore calls from Python, so no container writes a cache file.

``docker/compile_kernels.py`` runs at image build time; a kernel it misses is
compiled (~10 s, silently) in every container on first call and its cache
file lands in the image's site-packages, which the Compose test refuses. This
test finds the miss without Docker: it compiles into an empty cache directory
and expects an index file for every cached kernel that is not inlined.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNEL_SOURCES = [ROOT / "qcore" / "_kernels.py", ROOT / "qcore" / "codecs" / "_sign_kernels.py"]


def _called_kernels(source: Path) -> set[str]:
    """Names of the ``@njit(cache=True)`` functions of ``source`` that are compiled on their own (not inlined)."""
    names = set()
    for node in ast.parse(source.read_text()).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            if not (isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == "njit"):
                continue
            options = {k.arg: ast.literal_eval(k.value) for k in decorator.keywords}
            if options.get("cache") and options.get("inline") != "always":
                names.add(f"{source.stem}.{node.name}")
    return names


def test_compile_kernels_caches_every_kernel_that_is_not_inlined(tmp_path: Path) -> None:
    expected = set().union(*(_called_kernels(source) for source in KERNEL_SOURCES))
    assert "_kernels.dequantize_error" in expected and "_sign_kernels.decode_signs" in expected, expected

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "docker" / "compile_kernels.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr

    # numba names an index file "<module>.<function>-<line>.py<version>.nbi"
    cached = {path.name.split("-")[0] for path in tmp_path.rglob("*.nbi")}
    missing = expected - cached
    assert not missing, f"docker/compile_kernels.py never calls {sorted(missing)}; containers would compile them"
