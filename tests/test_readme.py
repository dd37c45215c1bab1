"""The README's qcore example runs and prints what it claims."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_qcore_example_runs_and_its_comments_are_true() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    example = next(block for block in blocks if "from gradq.qcore import" in block)
    output = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, check=True).stdout
    sizes, error = output.splitlines()
    assert sizes.split() == ["500000", "515664"]
    assert 0 < float(error) < 1e-3


def test_the_gradq_variables_table_lists_every_variable_and_its_true_default() -> None:
    from gradq.client.bit_policy import BIT_POLICIES, DEFAULT_AVERAGE_BITS
    from gradq.client.chunks import DEFAULT_CHUNK_ELEMENTS
    from gradq.client.ddp.env import DEFAULT_CONNECT_TIMEOUT_S, HOOK_ENVIRONMENT, quantized_scheme_names
    from gradq.qcore import QuantConfig

    rows = dict(re.findall(r"^\| `(GRADQ_[A-Z_]+)` \| (.*) \|$", README.read_text(), flags=re.MULTILINE))
    table = {name: row.rsplit(" | ", 1) for name, row in rows.items() if name in HOOK_ENVIRONMENT}
    assert sorted(table) == sorted(HOOK_ENVIRONMENT)
    unset = {name: default for name, (_, default) in table.items()}
    assert unset["GRADQ_BITS"] == str(QuantConfig().bits)
    assert unset["GRADQ_SCHEME"] == f"`{QuantConfig().scheme.name.lower()}`"
    assert unset["GRADQ_CHUNK_ELEMENTS"] == str(DEFAULT_CHUNK_ELEMENTS)
    assert unset["GRADQ_CONNECT_TIMEOUT"] == f"{DEFAULT_CONNECT_TIMEOUT_S:g}"
    assert table["GRADQ_SCHEME"][0].count("`per_") == len(quantized_scheme_names())
    assert unset["GRADQ_BIT_POLICY"] == f"`{BIT_POLICIES[0]}`"
    assert unset["GRADQ_AVERAGE_BITS"] == f"{DEFAULT_AVERAGE_BITS:g}"
