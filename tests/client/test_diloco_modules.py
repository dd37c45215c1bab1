"""DiLoCo's parts on their own: its options' checks, token counts, the hosts' outer step and checkpoints."""

from __future__ import annotations

import re

import pytest
import torch

from gradq.client.config import GradqConfig
from gradq.client.diloco import DiLoCo
from gradq.client.diloco.checkpoint import SharedOuterState
from gradq.client.diloco.on_hosts import HostsOuterStep
from gradq.client.diloco.options import DiLoCoOptions
from gradq.client.diloco.tokens import TokenCount


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"sync_every": 0}, "sync_every=0 is invalid; expected an integer >= 1"),
        ({"sync_every": True}, "sync_every=True is invalid"),
        ({"bucket_elements": 0}, "bucket_elements=0 is invalid; expected an integer >= 1"),
        ({"outer_step": "both"}, "outer_step='both' is invalid; expected one of ['aggregator', 'hosts']"),
        ({"quorum": 1.5}, "quorum=1.5 is invalid"),
        ({"quorum": 2, "outer_step": "hosts"}, "quorum=2 needs outer_step='aggregator'"),
        ({"grace_s": 4000}, "grace_s=4000 is invalid; expected seconds in [0, 3600]"),
        ({"fragments": 3, "sync_every": 10}, "fragments=3 does not divide sync_every=10"),
        ({"fragments": 2, "sync_every": 10, "fragment_sync_delay": 5}, "fragment_sync_delay=5 is invalid"),
        ({"fragment_update_alpha": 2.0}, "fragment_update_alpha=2.0 is invalid; expected a number in [0, 1]"),
    ],
)
def test_an_option_out_of_range_is_named_with_what_was_expected(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        DiLoCoOptions(**fields)  # type: ignore[arg-type]


def test_options_are_checked_against_the_job() -> None:
    options = DiLoCoOptions(quorum=2, grace_s=0.5)
    assert options.semi_sync == (2, 0.5) and DiLoCoOptions().semi_sync is None
    with pytest.raises(ValueError, match=re.escape("elastic_hosts=0: DiLoCo's hosts are the members")):
        options.check_against(GradqConfig.of("127.0.0.1:1", job_id="j"), sharded=False)
    elastic = GradqConfig.of("127.0.0.1:1", job_id="j", elastic_hosts=2)
    with pytest.raises(ValueError, match=re.escape("outer_step='hosts' with an FSDP2 model")):
        DiLoCoOptions(outer_step="hosts").check_against(elastic, sharded=True)
    DiLoCoOptions(outer_step="hosts").check_against(elastic, sharded=False)


def test_token_counts_survive_a_checkpoint_and_restart_at_the_jobs_state() -> None:
    count = TokenCount(weighted=True, keys=3)
    count.count(5)
    count._at_push[1] = 2  # as if key 1 was pushed after 2 tokens
    saved = count.state_dict()
    assert saved == {"tokens": 5, "tokens_at_push": [0, 2, 0]}
    back = TokenCount(weighted=True, keys=3)
    back.load_state_dict(saved)
    assert back.state_dict() == saved
    back.restart()
    assert back.state_dict() == {"tokens": 5, "tokens_at_push": [5, 5, 5]}
    with pytest.raises(ValueError, match=re.escape("state['tokens_at_push'] holds 2 counts; expected one per round")):
        TokenCount(weighted=True, keys=3).load_state_dict({"tokens": 1, "tokens_at_push": [0, 0]})


def test_the_hosts_outer_step_applies_a_mean_as_its_optimizers_gradient() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())
    sgd = torch.optim.SGD(params, lr=0.5)
    step = HostsOuterStep(params, [(0, 1), (1, 2)], sgd)
    start = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.sub_(1.0)  # the host's inner steps moved every parameter by -1
    pseudo = step.pseudo_gradient(0)
    assert torch.equal(pseudo, torch.ones(6))  # global minus local, flat
    step.apply([0], [pseudo * 2], alpha=0.0)  # only round key 0 lands: the bias keeps its inner steps
    assert torch.allclose(params[0], start[0] - 1.0)  # start - lr * mean
    assert torch.equal(params[1], start[1] - 1.0)
    assert torch.equal(step.global_parameters[0], params[0].detach())
    with pytest.raises(ValueError, match=re.escape("state['global_parameters'] holds 1 tensors of shapes")):
        step.load_state_dict({"global_parameters": [torch.zeros(2)], "outer_optimizer": sgd.state_dict()})


@pytest.mark.parametrize("outer_step", ["aggregator", "hosts"])
def test_a_checkpoint_taken_before_start_loads_into_another_host(outer_step: str) -> None:
    config = GradqConfig.of("127.0.0.1:1", job_id="j", elastic_hosts=2)
    torch.manual_seed(1)
    first = torch.nn.Linear(4, 4)
    saving = DiLoCo(config, first, torch.optim.SGD(first.parameters()), outer_step=outer_step, token_weighted=True)
    saving.outer_round, saving.inner_steps = 3, 150
    saving.count_tokens(7)
    state = saving.state_dict()
    assert state["outer_round"] == 3 and state["tokens"] == 7 and state["residuals"] == {}
    second = torch.nn.Linear(4, 4)
    loading = DiLoCo(config, second, torch.optim.SGD(second.parameters()), outer_step=outer_step, token_weighted=True)
    loading.load_state_dict(state)
    assert (loading.outer_round, loading.inner_steps, loading.tokens) == (3, 150, 7)
    for mine, theirs in zip(loading.global_parameters, saving.global_parameters, strict=True):
        assert torch.equal(mine, theirs)
    missing = {key: value for key, value in state.items() if key != "inner_steps"}
    with pytest.raises(ValueError, match=re.escape("state lacks inner_steps; expected the output of DiLoCo")):
        SharedOuterState(loading).load_state_dict(missing)
