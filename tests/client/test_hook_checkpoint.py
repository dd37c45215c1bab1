"""GradqHookState.state_dict() / load_state_dict() in real DDP (world size 1, gloo): resuming keeps error feedback."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradq.client.ddp import GradqHookState, gradq_hook
from gradq.qcore import QuantConfig

CONFIG = QuantConfig(bits=2, channel_size=16)  # coarse: every residual is far from zero


def model_with(state: GradqHookState) -> DistributedDataParallel:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3)))
    model.register_comm_hook(state, gradq_hook)
    return model


def gradients(model: DistributedDataParallel, step: int) -> torch.Tensor:
    """The averaged gradient of one backward pass on step ``step``'s inputs (no optimizer: weights stay put)."""
    model.zero_grad()
    inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    model(inputs).square().sum().backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def per_parameter(model: nn.Module, flat: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.split(flat, [p.numel() for p in model.parameters()]))


def residuals_of(state: GradqHookState, model: nn.Module) -> list[torch.Tensor]:
    """Each parameter's residual from state_dict()'s pieces (serials follow model order in this model)."""
    found = [torch.zeros(p.numel()) for p in model.parameters()]
    for name, values in state.state_dict()["residuals"].items():
        serial, span = name.split(" ")[0].removeprefix("param"), name.split(" ")[-1]
        start, stop = (int(bound) for bound in span.strip("[]").split(":"))
        found[int(serial)][start:stop] = values
    return found


def test_a_resumed_state_puts_each_checkpointed_residual_back_on_its_parameter(
    exact_aggregator: str, group: None
) -> None:
    original = GradqHookState(exact_aggregator, CONFIG, error_feedback=True, job_id="ckpt-original")
    model = model_with(original)
    for step in range(3):  # the checkpoint is taken in DDP's rebuilt layout (gradient-ready order)
        gradients(model, step)
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    checkpoint = torch.load(io.BytesIO(buffer.getvalue()))
    assert checkpoint["step"] == 3 and checkpoint["error_feedback"] is True
    assert checkpoint["config"] == {
        "scheme": "per_channel_affine",
        "bits": 2,
        "channel_size": 16,
        "rounding": "nearest",
        "seed": None,
    }
    assert sorted(checkpoint["residuals"]) == [
        "param0 float32[6,8] [0:48]",
        "param1 float32[6] [0:6]",
        "param2 float32[3,6] [0:18]",
        "param3 float32[3] [0:3]",
    ]
    saved = residuals_of(original, model.module)
    assert all(residual.abs().max() > 0 for residual in saved)

    resumed_state = GradqHookState(exact_aggregator, job_id="ckpt-resumed")
    resumed_state.load_state_dict(checkpoint)
    assert resumed_state.config == CONFIG and resumed_state.error_feedback and resumed_state.step == 3
    resumed = model_with(resumed_state)
    plain = copy.deepcopy(resumed.module)
    # The first iteration runs in the initial layout (model order), not the checkpoint's: with a
    # float32 return and world 1, the mean is g + e_restored - e_new, parameter by parameter.
    mean = per_parameter(plain, gradients(resumed, 3))
    exact = per_parameter(plain, gradients(plain, 3))
    left = residuals_of(resumed_state, plain)
    for serial, (m, g, new, old) in enumerate(zip(mean, exact, left, saved, strict=True)):
        torch.testing.assert_close(m - g + new, old, rtol=0, atol=1e-5, msg=f"parameter {serial}")
    resumed_state.close()
    original.close()


def test_load_state_dict_refuses_a_started_state_and_bad_checkpoints(exact_aggregator: str, group: None) -> None:
    state = GradqHookState(exact_aggregator, CONFIG, error_feedback=True, job_id="ckpt-late")
    checkpoint = state.state_dict()
    with pytest.raises(ValueError, match="state_dict lacks residuals"):
        state.load_state_dict({key: value for key, value in checkpoint.items() if key != "residuals"})
    with pytest.raises(ValueError, match=r"state_dict\['step'\]=-1 is invalid"):
        state.load_state_dict({**checkpoint, "step": -1})
    with pytest.raises(ValueError, match=r"residuals key 'bucket0' is invalid; expected 'param<serial>"):
        state.load_state_dict({**checkpoint, "residuals": {"bucket0": torch.zeros(3)}})
    with pytest.raises(ValueError, match=r"expected a flat torch.Tensor of 3 elements"):
        state.load_state_dict({**checkpoint, "residuals": {"param0 float32[6,8] [0:3]": torch.zeros(4)}})
    with pytest.raises(ValueError, match="bits=9 is out of range"):
        state.load_state_dict({**checkpoint, "config": {**checkpoint["config"], "bits": 9}})
    gradients(model_with(state), 0)
    with pytest.raises(RuntimeError, match="call it before training starts"):
        state.load_state_dict(checkpoint)
    state.close()
