"""Streaming DiLoCo: fragments synced at their own inner steps, rounds in flight while the hosts train on.

The schedule and its refusals run here directly; the rounds through a real
aggregator with hosts as real processes (examples/diloco_train.py), with the
outer step on the aggregator and on the hosts, a fragment's round in flight
for two inner steps and the host keeping half of its own parameters where an
update lands.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from test_diloco import (
    RUN_TIMEOUT_S,
    STREAMING,
    SYNC_EVERY,
    aggregator,
    assert_identical,
    finish,
    start,
    wait_for_round,
)

from gradq.client.config import GradqConfig
from gradq.client.diloco import DiLoCo
from gradq.client.diloco.fragments import FragmentSchedule, split_buckets
from gradq.server.app import AggregatorServer

__all__ = ["aggregator"]  # the module's aggregator fixture, shared with test_diloco


def test_each_fragment_starts_and_lands_at_its_own_inner_step() -> None:
    schedule = FragmentSchedule(sync_every=12, fragments=3, delay=2, alpha=0.5)
    events = [(n, schedule.starts(n), schedule.lands(n)) for n in range(1, 25)]
    started = {n: fragment for n, fragment, _ in events if fragment is not None}
    landed = {n: fragment for n, _, fragment in events if fragment is not None}
    assert started == {2: 0, 6: 1, 10: 2, 14: 0, 18: 1, 22: 2}
    assert landed == {4: 0, 8: 1, 12: 2, 16: 0, 20: 1, 24: 2}  # the last lands at the outer round's end
    plain = FragmentSchedule(sync_every=10)
    assert [n for n in range(1, 31) if plain.starts(n) is not None] == [10, 20, 30]
    assert [n for n in range(1, 31) if plain.lands(n) is not None] == [10, 20, 30]


def test_fragments_split_the_round_keys_by_size_one_at_least_each() -> None:
    assert split_buckets([10] * 6, 3) == [[0, 1], [2, 3], [4, 5]]
    assert split_buckets([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert split_buckets([1, 1, 1, 100], 2) == [[0, 1, 2], [3]]
    assert split_buckets([5, 5, 5], 3) == [[0], [1], [2]]
    with pytest.raises(
        ValueError, match=re.escape("fragments=4 but there are 3 round keys; expected at least one per fragment")
    ):
        split_buckets([5, 5, 5], 4)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"fragments": 0}, "fragments=0 is invalid; expected an integer >= 1"),
        ({"fragments": 3}, "fragments=3 does not divide sync_every=10"),
        ({"fragments": 2, "fragment_sync_delay": 5}, "fragment_sync_delay=5 is invalid; expected an integer in [0, 4]"),
        ({"fragments": 2, "fragment_update_alpha": 1.5}, "fragment_update_alpha=1.5 is invalid; expected a number"),
        ({"fragments": 5}, "fragments=5 but the model has 4 trainable tensors (144 parameters)"),
    ],
)
def test_bad_fragment_settings_are_refused_naming_the_field(settings: dict[str, float], message: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    config = GradqConfig.of("127.0.0.1:1", job_id="j", elastic_hosts=2)
    with pytest.raises(ValueError, match=re.escape(message)):
        DiLoCo(
            config,
            model,
            torch.optim.SGD(model.parameters()),
            sync_every=10,
            bucket_elements=72,
            **settings,  # type: ignore[arg-type]
        )


# -- through a real aggregator ----------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("outer_step", ["aggregator", "hosts"])
def test_streamed_fragments_leave_the_hosts_bit_identical_every_round(
    aggregator: AggregatorServer, tmp_path: Path, outer_step: str
) -> None:
    rounds = 4
    init = ("--init-seed", "{seed}") if outer_step == "aggregator" else ("--init-seed", "0")
    processes = [
        start(
            aggregator,
            f"streaming-{outer_step}",
            seed,
            tmp_path,
            "--rounds",
            str(rounds),
            "--outer-step",
            outer_step,
            *STREAMING,
            *(part.format(seed=seed) for part in init),
            hosts=2,
        )
        for seed in range(2)
    ]
    hosts = finish(processes, tmp_path, range(2))
    digests = [host.figures["digests"] for host in hosts]
    assert sorted(digests[0], key=int) == [str(round_) for round_ in range(1, rounds + 1)]
    assert digests[0] == digests[1] and len(set(digests[0].values())) == rounds
    assert_identical(hosts)
    losses = hosts[0].figures["losses"]
    assert sum(losses[-SYNC_EVERY:]) < sum(losses[:SYNC_EVERY])  # it learns
    # Still one 4-bit copy of the model each way per outer round, in two fragments.
    parameters = sum(values.numel() for values in hosts[0].global_parameters)
    per_round = hosts[0].figures["bytes_sent"] / rounds
    assert parameters * 4 / 8 <= per_round <= parameters * 4 / 8 * 1.25
    assert [host.figures["matches_aggregator"] for host in hosts] == [outer_step == "aggregator"] * 2


@pytest.mark.e2e
def test_a_joiner_enters_streamed_rounds_at_an_outer_round_boundary_and_is_identical(
    aggregator: AggregatorServer, tmp_path: Path
) -> None:
    rounds = 30  # the survivor trains on alone: long enough for the joiner's start-up
    common = ("--rounds", str(rounds), "--step-delay", "0.03", *STREAMING)
    progress = tmp_path / "progress"
    processes = [
        start(aggregator, "streaming-joiner", 0, tmp_path, *common, "--progress", str(progress), hosts=2),
        start(aggregator, "streaming-joiner", 1, tmp_path, *common, "--die-in-round", "2", hosts=2),
    ]
    assert processes[1].wait(timeout=RUN_TIMEOUT_S) == -9  # SIGKILLed during round 2
    wait_for_round(progress, 4, processes[0], tmp_path / "host0.log")
    joiner = start(aggregator, "streaming-joiner", 2, tmp_path, *common, hosts=2)
    hosts = finish([processes[0], joiner], tmp_path, (0, 2))
    joined_at = hosts[1].figures["joined_at_round"]
    assert 4 <= joined_at < rounds
    after = {key: value for key, value in hosts[0].figures["digests"].items() if int(key) > joined_at}
    assert hosts[1].figures["digests"] == after
    assert_identical(hosts)
    assert [host.figures["matches_aggregator"] for host in hosts] == [True, True]
