"""GradqHookState.state_dict() / load_state_dict() in real DDP (world size 1, gloo): resuming keeps error feedback."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradq.client.ddp import GradqHookState, gradq_hook
from gradq.qcore import QuantConfig
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.policy import RoundPolicy
from gradq.server.process import free_port

CONFIG = QuantConfig(bits=2, channel_size=16)  # coarse: every residual is far from zero


@pytest.fixture(scope="module")
def aggregator() -> Iterator[str]:
    server = AggregatorServer(RoundPolicy(round_timeout_s=30.0), ServerOptions("127.0.0.1:0", grace_s=0.5))
    server.start()
    yield f"127.0.0.1:{server.port}"
    server.stop()


@pytest.fixture
def group() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


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


# DDP's first layout lists the parameters in model order; the rebuilt one (from the second
# iteration on, and in the checkpoint) in gradient-ready order: same numel, other elements.
INITIAL = "float32[6, 8]+float32[6]+float32[3, 6]+float32[3]#0"
REBUILT = "float32[3]+float32[3, 6]+float32[6]+float32[6, 8]#0"


def test_a_resumed_state_restores_the_residuals_once_ddp_has_rebuilt_its_buckets(aggregator: str, group: None) -> None:
    original = GradqHookState(aggregator, CONFIG, error_feedback=True, job_id="ckpt-original")
    model = model_with(original)
    for step in range(3):
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
    assert list(checkpoint["residuals"]) == [REBUILT] and checkpoint["residuals"][REBUILT].abs().max() > 0
    reference = gradients(model, 7)  # what the original sends for inputs 7, with its residual

    resumed_state = GradqHookState(aggregator, job_id="ckpt-resumed")
    resumed_state.load_state_dict(checkpoint)
    assert resumed_state.config == CONFIG and resumed_state.error_feedback and resumed_state.step == 3
    resumed = model_with(resumed_state)
    fresh = model_with(GradqHookState(aggregator, CONFIG, error_feedback=True, job_id="ckpt-fresh"))
    # First iteration: the initial layout, which the checkpoint's residual does not fit (it waits).
    assert torch.equal(gradients(resumed, 3), gradients(fresh, 3))
    assert list(resumed_state.state_dict()["residuals"]) == [REBUILT, INITIAL]
    # Second: the rebuilt layout takes the checkpoint's residual, not the first iteration's.
    torch.testing.assert_close(gradients(resumed, 7), reference, rtol=0, atol=0)
    assert not torch.equal(gradients(fresh, 7), reference)
    assert list(resumed_state.state_dict()["residuals"]) == [REBUILT]


def test_load_state_dict_refuses_a_started_state_and_bad_checkpoints(aggregator: str, group: None) -> None:
    state = GradqHookState(aggregator, CONFIG, error_feedback=True, job_id="ckpt-late")
    checkpoint = state.state_dict()
    with pytest.raises(ValueError, match="state_dict lacks residuals"):
        state.load_state_dict({key: value for key, value in checkpoint.items() if key != "residuals"})
    with pytest.raises(ValueError, match=r"state_dict\['step'\]=-1 is invalid"):
        state.load_state_dict({**checkpoint, "step": -1})
    with pytest.raises(ValueError, match="bits=9 is out of range"):
        state.load_state_dict({**checkpoint, "config": {**checkpoint["config"], "bits": 9}})
    gradients(model_with(state), 0)
    with pytest.raises(RuntimeError, match="call it before training starts"):
        state.load_state_dict(checkpoint)
    state.close()
