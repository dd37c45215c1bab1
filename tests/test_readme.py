"""The README's qcore example runs and prints what it claims."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_qcore_example_runs_and_its_comments_are_true() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    example = next(block for block in blocks if "from gradq.qcore import" in block and "encode(" in block)
    output = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, check=True).stdout
    sizes, error = output.splitlines()
    assert sizes.split() == ["500000", "515664"]
    assert 0 < float(error) < 1e-3
