"""register_once and hook_state, shared by the integrations: the state from a state, a GradqConfig or the GRADQ_*
variables; once per DDP model, clear refusals (a world-1 gloo group, in process)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from gradq.client.config import GradqConfig
from gradq.client.ddp import GradqHookState
from gradq.client.integrations.registration import GradqIntegrationError, hook_state, register_once, registered_state
from gradq.qcore import QuantConfig


@pytest.fixture
def ddp_model() -> Iterator[DistributedDataParallel]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DistributedDataParallel(nn.Linear(4, 2))
    finally:
        dist.destroy_process_group()


def test_registering_again_with_the_same_state_keeps_the_hook(ddp_model: DistributedDataParallel) -> None:
    state = GradqHookState("127.0.0.1:1")
    assert registered_state(ddp_model) is None
    assert register_once(ddp_model, state, "prepare", "fix it") is ddp_model
    assert registered_state(ddp_model) is state
    assert register_once(ddp_model, state, "prepare", "fix it") is ddp_model  # a second train(): no error
    with pytest.raises(GradqIntegrationError, match="already trains through gradq with another GradqHookState"):
        register_once(ddp_model, GradqHookState("127.0.0.1:1"), "prepare", "fix it")


def test_a_model_with_another_comm_hook_is_refused(ddp_model: DistributedDataParallel) -> None:
    ddp_model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    with pytest.raises(GradqIntegrationError, match=r"already has a comm hook .*DistributedDataParallelKwargs"):
        register_once(ddp_model, GradqHookState("127.0.0.1:1"), "prepare", "fix it")


def test_a_bare_module_is_refused_naming_the_call_and_the_fix() -> None:
    with pytest.raises(GradqIntegrationError, match=r"^prepare returned a Linear, not a torch Distr.*; launch more$"):
        register_once(nn.Linear(2, 2), GradqHookState("127.0.0.1:1"), "prepare", "launch more")
    assert registered_state(nn.Linear(2, 2)) is None


def test_the_state_is_the_one_given_else_built_from_the_config_else_from_the_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = GradqHookState("127.0.0.1:1")
    assert hook_state(state, None, "use_gradq") is state
    config = GradqConfig.of("127.0.0.1:2", QuantConfig(bits=3), error_feedback=True)
    assert hook_state(None, config, "use_gradq").gradq_config is config
    monkeypatch.setenv("GRADQ_AGGREGATORS", "127.0.0.1:3")
    monkeypatch.setenv("GRADQ_BITS", "5")
    assert hook_state(None, None, "use_gradq").gradq_config == GradqConfig.from_env()
    assert hook_state(None, None, "use_gradq").gradq_config.quant.bits == 5
    with pytest.raises(GradqIntegrationError, match=r"^use_gradq\(x\) was given both state= and config=; pass one"):
        hook_state(state, config, "use_gradq(x)")
