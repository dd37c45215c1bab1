"""Token-weighted DiLoCo through a real aggregator: two host processes on different batch sizes, one outer round.

Each host (tests/client/diloco_weighted_host.py) counts its batch's rows as
tokens; the outer step (SGD lr 1, no momentum, fp32 on the wire) then moves
the global parameters by the token-weighted mean of the hosts' pseudo-gradients
(to 8-bit rounding both ways), which this test recomputes from what each host reports.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from gradq.server.app import AggregatorServer

HOST = Path(__file__).with_name("diloco_weighted_host.py")


def test_token_weighted_rounds_move_the_global_parameters_by_the_token_weighted_mean(
    aggregator: AggregatorServer, tmp_path: Path
) -> None:
    batches = [2, 14]  # host 1 trains on 7x the tokens of host 0
    processes = [
        subprocess.Popen(
            [sys.executable, str(HOST), f"127.0.0.1:{aggregator.port}", "tokens", str(host), str(batch), str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for host, (batch, out) in enumerate((batch, tmp_path / f"host{host}.pt") for host, batch in enumerate(batches))
    ]
    for process in processes:
        output, _ = process.communicate(timeout=180)
        assert process.returncode == 0, output.decode()[-3000:]
    hosts = [torch.load(tmp_path / f"host{host}.pt") for host in range(2)]

    tokens = [host["tokens"] for host in hosts]
    assert tokens == [2 * 3, 14 * 3]
    weighted = sum(t * host["pseudo_gradient"] for t, host in zip(tokens, hosts, strict=True)) / sum(tokens)
    plain = sum(host["pseudo_gradient"] for host in hosts) / 2
    before = hosts[0]["before"]
    assert torch.equal(before, hosts[1]["before"])
    for host in hosts:
        assert torch.equal(host["after"], hosts[0]["after"])  # bit-identical hosts
        assert host["matches_aggregator"]  # and the aggregator's copy is theirs
    moved = before - hosts[0]["after"]
    # 8 bits each way: within a few of the 255 steps of each channel's range of the exact weighted mean ...
    tolerance = 0.02 * float(weighted.abs().max())
    torch.testing.assert_close(moved, weighted, rtol=0.0, atol=tolerance)
    # ... and far from the plain mean, which counts the two hosts alike.
    assert float((moved - plain).abs().max()) > 5 * tolerance
