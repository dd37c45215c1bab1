"""DiLoCo as a newcomer meets it: a plain ``python train.py`` per host, small models with fragments, clear refusals.

A host of one process needs no torch.distributed; fragments=2 fits any model
of two tensors or more when the round keys are left to DiLoCo; where it cannot
fit, or the aggregator cannot be reached, the error says what to set or check.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gradq.client.config import GradqConfig
from gradq.client.diloco import DiLoCo
from gradq.client.diloco.fragments import choose_buckets
from gradq.client.sending import AggregationError
from gradq.client.session import GradqSession
from gradq.server.app import AggregatorServer
from gradq.server.policy import RoundPolicy
from gradq.server.process import free_port

HOST = Path(__file__).with_name("newcomer_diloco_host.py")
RUN_TIMEOUT_S = 240
# A launcher's variables, which a plain `python train.py` does not have.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def host_environment(address: str, job: str) -> dict[str, str]:
    """A plain process's environment: GRADQ_* for a 2-host job, no launcher variables."""
    environ = {name: value for name, value in os.environ.items() if name not in LAUNCHER_VARIABLES}
    return {
        **environ,
        "GRADQ_AGGREGATORS": address,
        "GRADQ_JOB_ID": job,
        "GRADQ_ELASTIC_HOSTS": "2",
        "GRADQ_BITS": "4",
        "GRADQ_ERROR_FEEDBACK": "1",
        "OMP_NUM_THREADS": "1",
    }


def run_hosts(address: str, job: str, out: Path, rounds: list[int], fragments: int) -> list[tuple[dict[str, Any], str]]:
    """Run one host per entry of ``rounds`` (its outer rounds) to the end; each one's report and stderr."""
    processes = [
        subprocess.Popen(
            [sys.executable, str(HOST), str(out / f"host{host}.pt"), str(count), str(fragments), str(host)],
            env=host_environment(address, job),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for host, count in enumerate(rounds)
    ]
    errors = [process.communicate(timeout=RUN_TIMEOUT_S)[1] for process in processes]
    for process, error in zip(processes, errors, strict=True):
        assert process.returncode == 0, error[-4000:]
    return [(torch.load(out / f"host{host}.pt"), error) for host, error in enumerate(errors)]


@pytest.fixture
def address(start_aggregator: Callable[..., AggregatorServer]) -> str:
    server = start_aggregator(RoundPolicy(round_timeout_s=60.0, server_error_feedback=False))
    return f"127.0.0.1:{server.port}"


# -- one process per host, no process group ---------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("fragments", [1, 2])
def test_plain_python_hosts_train_outer_rounds_to_identical_global_parameters(
    address: str, tmp_path: Path, fragments: int
) -> None:
    rounds = 3
    hosts = run_hosts(address, f"newcomer-{fragments}", tmp_path, [rounds, rounds], fragments)
    reports = [report for report, _ in hosts]
    assert [report["distributed"] for report in reports] == [False, False]  # never a process group
    assert [report["outer_round"] for report in reports] == [rounds, rounds]
    assert reports[0]["round_keys"] >= fragments  # the round keys were cut to fit the fragments
    for mine, theirs in zip(reports[0]["global_parameters"], reports[1]["global_parameters"], strict=True):
        assert torch.equal(mine, theirs)
    assert not torch.equal(reports[0]["global_parameters"][0], nn.Linear(8, 16).weight)  # they trained
    assert [report["matches_aggregator"] for report in reports] == [True, True]  # the aggregator holds the same


# -- round keys that fit the fragments ----------------------------------------------------------------


def test_unset_bucket_elements_cut_a_small_model_into_a_round_key_per_fragment() -> None:
    tiny = [128, 16, 32, 2]  # a 178-parameter MLP: one round key at the default size
    assert len(choose_buckets(tiny, 1, None)) == 1
    assert len(choose_buckets(tiny, 2, None)) >= 2
    assert choose_buckets(tiny, 4, None) == [(0, 1), (1, 2), (2, 3), (3, 4)]  # down to one tensor per key
    # Alternating sizes fill keys unevenly at total / fragments: it goes lower until there are enough.
    assert len(choose_buckets([1, 2, 1, 2, 1, 2], 4, None)) >= 4
    assert choose_buckets(tiny, 2, 64) == [(0, 1), (1, 4)]  # a size the user set is kept


def _diloco(model: nn.Module, **settings: Any) -> DiLoCo:
    config = GradqConfig.of("127.0.0.1:1", job_id="j", elastic_hosts=2)
    return DiLoCo(config, model, torch.optim.SGD(model.parameters()), sync_every=4, **settings)


def test_more_fragments_than_tensors_is_refused_with_the_model_size() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2))  # 4 tensors, 178 parameters
    assert len(_diloco(model, fragments=4).buckets) == 4  # one tensor per key fits
    single = nn.Linear(8, 2, bias=False)  # 1 tensor
    with pytest.raises(ValueError) as refused:
        _diloco(single, fragments=2)
    message = str(refused.value)
    assert "fragments=2 but the model has 1 trainable tensors (16 parameters)" in message
    assert "expected fragments <= 1" in message


def test_a_bucket_size_too_large_for_the_fragments_says_what_to_set() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2))  # 128 + 16 + 32 + 2 = 178 parameters
    with pytest.raises(ValueError) as refused:
        _diloco(model, fragments=2, bucket_elements=4_194_304)
    message = str(refused.value)
    assert "fragments=2 but bucket_elements=4,194,304 cuts the model's 178 parameters (4 tensors) into 1 round key" in (
        message
    )
    assert "set bucket_elements <= 177, or leave it unset and DiLoCo chooses" in message  # 177: [128, 16, 32] | [2]
    assert len(_diloco(model, fragments=2, bucket_elements=177).buckets) == 2  # the size it names fits
    with pytest.raises(ValueError, match=re.escape("bucket_elements=178 cuts")):  # and is the largest that does
        _diloco(model, fragments=2, bucket_elements=178)


# -- an aggregator out of reach --------------------------------------------------------------------------


def test_a_diloco_host_that_cannot_reach_the_aggregator_is_told_what_it_can_do() -> None:
    port = free_port()
    config = GradqConfig.of(f"127.0.0.1:{port}", job_id="j", elastic_hosts=2, connect_timeout_s=0.5)
    model = nn.Linear(4, 2)
    diloco = DiLoCo(config, model, torch.optim.SGD(model.parameters()), sync_every=2)
    with pytest.raises(AggregationError) as refused:
        diloco.start()
    message = str(refused.value)
    assert "choose fallback" not in message and "fallback='allreduce'" not in message
    assert f"check that an aggregator runs at 127.0.0.1:{port}" in message
    assert f"gradq serve --port {port}" in message
    assert "connect_timeout_s=0.5 (GRADQ_CONNECT_TIMEOUT, seconds)" in message
    assert "An elastic or DiLoCo host trains only through the aggregator: it has no fallback" in message


@pytest.mark.usefixtures("group")
def test_a_ddp_rank_that_cannot_reach_the_aggregator_is_offered_the_fallback_by_argument_and_variable() -> None:
    port = free_port()
    config = GradqConfig.of(f"127.0.0.1:{port}", job_id="j", connect_timeout_s=0.5)
    with pytest.raises(AggregationError) as refused:
        GradqSession.connect(config)
    message = str(refused.value)
    assert f"gradq serve --port {port}" in message
    assert "fallback='allreduce' or 'allgather' (GRADQ_FALLBACK), now fallback='error'" in message


def test_a_launched_rank_without_a_process_group_is_told_to_initialize_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    diloco = _diloco(nn.Linear(4, 2))
    with pytest.raises(RuntimeError, match=re.escape("WORLD_SIZE='2': a launcher started this process as one of 2")):
        diloco.start()
    with pytest.raises(RuntimeError, match=re.escape("expected torch.distributed.init_process_group()")):
        diloco.start()
