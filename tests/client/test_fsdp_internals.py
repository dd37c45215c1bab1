"""torch_internals on the installed torch: each private read agrees with what FSDP2 really does (two real ranks).

tests/torch_matrix.sh runs this on the oldest supported torch and the newest
as well as the pin, so every release branch in torch_internals is exercised.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradq.client.apps.demo import free_port
from gradq.client.torch_support import MINIMUM_TORCH, torch_release

SCRIPT = Path(__file__).with_name("fsdp_internals.py")
REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    torch_release(torch.__version__) < MINIMUM_TORCH["fsdp"],
    reason=f"torch {torch.__version__} has no FSDP2 all-reduce hook (test_torch_support checks the refusal)",
)


def test_private_reads_match_what_fsdp_reduces() -> None:
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), port, str(rank)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO
        )
        for rank in range(2)
    ]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], "\n".join(err.decode()[-3000:] for _, err in outputs)
    found = json.loads(outputs[0][0].decode().strip().splitlines()[-1])

    # The wrapper holds no parameters of its own; the root and the inner layer one group each.
    assert found["groups"] == {"<root>": 1, "1": 0, "1.inner": 1}
    assert found["root holds its own parameters"]
    # 3x4 weight and 3 biases over 2 ranks: FSDP pads the 3 rows to 4, so each rank's shard holds 2x4 + 2.
    assert found["shard_numel"] == [10, 4]
    assert found["hook shard numel"] == found["shard_numel"]
    # fp32 shards of fp32 parameters become the gradients; once a gradient exists FSDP adds to it.
    assert found["fills in place, then not"] == [[True, False], [True, False]]
    assert found["sums after hook"] is False
    if torch_release(torch.__version__) >= (2, 8):
        assert found["sums after hook when forced"] is True
    assert found["post-accumulate hooks"] is False
    assert found["post-accumulate hooks once registered"] is True
