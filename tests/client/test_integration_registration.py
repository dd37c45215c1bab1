"""register_once, shared by the integrations: once per DDP model, clear refusals (a world-1 gloo group, in process)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from gradq.client.ddp import GradqHookState
from gradq.client.integrations.registration import GradqIntegrationError, register_once, registered_state


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
