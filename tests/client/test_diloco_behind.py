"""A DiLoCo host behind the job's outer round (real host processes): it is told at once and takes the job's state.

Two hosts resume one job from checkpoints of different outer rounds (2 and
4), as after an aggregator restart with hosts that saved at different times.
The newest round is the job's: the host at 2 has its first push refused
(BEHIND), takes the aggregator's copy at the next boundary as a late host
does, and from there both hosts train the same rounds bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_diloco import SYNC_EVERY, aggregator, finish, start

from gradq.server.app import AggregatorServer

pytestmark = pytest.mark.e2e  # a slow end-to-end run: deselected unless --e2e
__all__ = ["aggregator"]  # the module's aggregator fixture, shared with test_diloco


def test_a_host_resumed_from_an_older_round_is_refused_at_once_and_takes_the_jobs_state(
    aggregator: AggregatorServer, tmp_path: Path
) -> None:
    checkpoint = {seed: tmp_path / f"checkpoint{seed}.pt" for seed in range(2)}
    first = tmp_path / "first"
    first.mkdir()
    saving = [
        start(aggregator, "diloco-saved", seed, first, "--save-at-round", "2", "--checkpoint", str(path), hosts=2)
        for seed, path in checkpoint.items()
    ]
    finish(saving, first, range(2))
    # Host 0 goes on alone to round 4 (a job of one host), and saves again.
    ahead = tmp_path / "ahead"
    ahead.mkdir()
    resumed = ("--resume", "--save-at-round", "4", "--checkpoint", str(checkpoint[0]))
    finish([start(aggregator, "diloco-ahead", 0, ahead, *resumed, hosts=1)], ahead, [0])
    # Both come back to one job: host 0 at outer round 4, host 1 at 2. Host 0's steps are slow, so host 1's
    # refusal and its wait for the state come before host 0's round 4 closes (the boundary it then takes).
    out = tmp_path / "behind"
    out.mkdir()
    both = ("--rounds", "6", "--resume", "--checkpoint")
    hosts = finish(
        [
            start(aggregator, "diloco-behind", 0, out, *both, str(checkpoint[0]), "--step-delay", "0.5", hosts=2),
            start(aggregator, "diloco-behind", 1, out, *both, str(checkpoint[1]), hosts=2),
        ],
        out,
        range(2),
    )
    ahead_host, behind_host = hosts
    log = (out / "host1.log").read_text()
    assert ahead_host.figures["late_rounds"] == 0 and behind_host.figures["late_rounds"] == 1, log[-3000:]
    assert "is behind job 'diloco-behind'" in log or "past this round's outer round 2" in log
    # Host 1 trained its own round 2, then the job's rounds from the one it was sent the state at.
    caught_up_at = min(int(r) for r in behind_host.figures["digests"])
    assert caught_up_at == 5, log[-3000:]
    assert len(behind_host.figures["losses"]) == SYNC_EVERY * (1 + 6 - caught_up_at)
    assert len(ahead_host.figures["losses"]) == 2 * SYNC_EVERY
    for outer_round, digest in behind_host.figures["digests"].items():
        assert ahead_host.figures["digests"][outer_round] == digest
    for mine, theirs in zip(ahead_host.global_parameters, behind_host.global_parameters, strict=True):
        assert torch.equal(mine, theirs)
    assert ahead_host.figures["matches_aggregator"] and behind_host.figures["matches_aggregator"]
