"""gradq's outer step against torch.optim.SGD, and the outer optimizers the aggregator takes or refuses."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from gradq.client.diloco.on_aggregator import outer_step_of
from gradq.qcore.outer_step import OuterStep, take_outer_step


# torch refuses Nesterov without momentum (gradq's equals plain SGD there).
@pytest.mark.parametrize(("nesterov", "momentum"), [(True, 0.9), (False, 0.9), (False, 0.0)])
def test_the_outer_step_is_torchs_sgd_to_float32_rounding(nesterov: bool, momentum: float) -> None:
    rng = np.random.default_rng(0)
    start = rng.normal(size=500).astype(np.float32)
    param = torch.nn.Parameter(torch.from_numpy(start.copy()))
    sgd = torch.optim.SGD([param], lr=0.7, momentum=momentum, nesterov=nesterov)
    step = outer_step_of(sgd)
    parameters, buffer = start.copy(), np.zeros_like(start)
    for _ in range(6):
        mean = rng.normal(size=500).astype(np.float32)
        param.grad = torch.from_numpy(mean.copy())
        sgd.step()
        take_outer_step(parameters, buffer, mean, step)
    np.testing.assert_allclose(parameters, param.detach().numpy(), rtol=1e-5, atol=1e-5)


def test_the_same_inputs_give_the_same_bits() -> None:
    rng = np.random.default_rng(1)
    arrays = [rng.normal(size=1000).astype(np.float32) for _ in range(3)]
    copies = [[a.copy() for a in arrays] for _ in range(2)]
    for parameters, buffer, mean in copies:
        take_outer_step(parameters, buffer, mean, OuterStep())
    assert copies[0][0].tobytes() == copies[1][0].tobytes() and copies[0][1].tobytes() == copies[1][1].tobytes()


def test_outer_settings_and_optimizers_the_aggregator_does_not_run_are_refused() -> None:
    param = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=re.escape("lr=0.0 is invalid; expected a finite outer learning rate > 0")):
        OuterStep(lr=0.0)
    with pytest.raises(ValueError, match=re.escape("momentum=1.0 is invalid; expected a number in")):
        OuterStep(momentum=1.0)
    with pytest.raises(ValueError, match=r"outer_optimizer is Adam; the aggregator runs SGD .* outer_step='hosts'"):
        outer_step_of(torch.optim.Adam([param]))
    with pytest.raises(ValueError, match=re.escape("dampening=0.1, weight_decay=0")):
        outer_step_of(torch.optim.SGD([param], lr=0.7, momentum=0.9, dampening=0.1))
    assert outer_step_of(torch.optim.SGD([param], lr=0.3, momentum=0.9, nesterov=True)) == OuterStep()
    with pytest.raises(ValueError, match=re.escape("outer_step='everywhere' is invalid; expected one of")):
        from gradq.client.config import GradqConfig
        from gradq.client.diloco import DiLoCo

        DiLoCo(
            GradqConfig.of("127.0.0.1:1", job_id="j", elastic_hosts=2),
            torch.nn.Linear(2, 2),
            torch.optim.SGD([param]),
            outer_step="everywhere",
        )


def test_semi_synchronous_rounds_need_the_outer_step_on_the_aggregator() -> None:
    from gradq.client.config import GradqConfig
    from gradq.client.diloco import DiLoCo

    config, model = GradqConfig.of("127.0.0.1:1", job_id="j", elastic_hosts=2), torch.nn.Linear(2, 2)
    inner = torch.optim.SGD(model.parameters())
    with pytest.raises(ValueError, match=re.escape("quorum=2 needs outer_step='aggregator'")):
        DiLoCo(config, model, inner, outer_step="hosts", quorum=2)
    with pytest.raises(ValueError, match=re.escape("quorum=-1 is invalid")):
        DiLoCo(config, model, inner, quorum=-1)
    with pytest.raises(ValueError, match=re.escape("grace_s=-0.5 is invalid; expected seconds in [0, 3600]")):
        DiLoCo(config, model, inner, quorum=2, grace_s=-0.5)


def test_the_default_outer_optimizer_is_sgd_at_lr_0_3_whatever_the_number_of_hosts() -> None:
    from gradq.client.config import GradqConfig
    from gradq.client.diloco import DiLoCo

    for hosts in (1, 2, 8):
        model = torch.nn.Linear(2, 2)
        diloco = DiLoCo(
            GradqConfig.of("127.0.0.1:1", job_id="j", elastic_hosts=hosts), model, torch.optim.SGD(model.parameters())
        )
        group = diloco.outer_optimizer.param_groups[0]
        assert (group["lr"], group["momentum"], group["nesterov"]) == (0.3, 0.9, True), group
        assert outer_step_of(diloco.outer_optimizer) == OuterStep(lr=0.3, momentum=0.9, nesterov=True)


def test_sparse_pseudo_gradients_need_error_feedback_and_default_to_the_sparse_outer_lr() -> None:
    from gradq.client.config import GradqConfig
    from gradq.client.diloco import DiLoCo
    from gradq.qcore import QuantConfig, Scheme

    model = torch.nn.Linear(2, 2)
    inner = torch.optim.SGD(model.parameters())
    sparse = QuantConfig(Scheme.SPARSE_TOPK)
    without = GradqConfig.of("127.0.0.1:1", job_id="j", elastic_hosts=2, quant=sparse)
    with pytest.raises(ValueError, match=re.escape("scheme=sparse_topk without error feedback: each round sends 64")):
        DiLoCo(without, model, inner)
    diloco = DiLoCo(
        GradqConfig.of("127.0.0.1:1", job_id="j", elastic_hosts=2, quant=sparse, error_feedback=True), model, inner
    )
    group = diloco.outer_optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.7, 0.9, True), group


def test_token_counts_are_checked_and_only_a_token_weighted_host_takes_them() -> None:
    from gradq.client.config import GradqConfig
    from gradq.client.diloco import DiLoCo

    config, model = GradqConfig.of("127.0.0.1:1", job_id="j", elastic_hosts=2), torch.nn.Linear(2, 2)
    inner = torch.optim.SGD(model.parameters())
    with pytest.raises(ValueError, match=re.escape("count_tokens: this DiLoCo is not token_weighted")):
        DiLoCo(config, model, inner).count_tokens(8)
    weighted = DiLoCo(config, model, inner, token_weighted=True)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=re.escape(f"tokens={bad!r} is invalid; expected an integer >= 0")):
            weighted.count_tokens(bad)  # type: ignore[arg-type]
    weighted.count_tokens(8)
    weighted.count_tokens(0)
    assert weighted.tokens == 8
