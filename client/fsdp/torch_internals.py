"""What use_gradq reads of FSDP2 that torch has no public API for, per torch release: the one place that knows.

Everything else the adapter reads is public: the hook slot
(``FSDPModule.set_all_reduce_hook``), the sharded parameters' mesh, dtype and
gradients (DTensor, ``nn.Parameter``). Four things are not: which parameter
groups a unit holds and their sharded parameters, how many elements FSDP's
padding gives this rank's reduce-scattered shard, whether
``set_force_sum_reduction_for_comms`` made FSDP divide after the hook, and
whether a parameter has post-accumulate-grad hooks. Each is read here with a
branch per torch release that differs, and tests/torch_matrix.sh runs the
FSDP2 tests on the oldest supported release, the pinned one and the newest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gradq.client.torch_support import torch_release

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = [
    "TORCH",
    "has_post_accumulate_grad_hooks",
    "padded_shard_numel",
    "parameter_groups",
    "sharded_parameters",
    "sums_after_hook",
]

TORCH = torch_release(str(torch.__version__))  # (major, minor) of the torch these branches serve

_GROUPS_SINCE = (2, 12)  # FSDPState._fsdp_param_groups, a list (per-parameter meshes); before, one _fsdp_param_group
_FORCE_SUM_SINCE = (2, 8)  # FSDPParamGroup.force_sum_reduction_for_comms; before, FSDP had no such setting


def parameter_groups(module: FSDPModule) -> list[Any]:
    """The FSDPParamGroups of one FSDP unit (torch's private type): none when it holds no parameters of its own."""
    state = module._get_fsdp_state()
    if TORCH >= _GROUPS_SINCE:
        return list(state._fsdp_param_groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def sharded_parameters(group: Any) -> list[nn.Parameter]:
    """The group's parameters as the module holds them: this rank's shards, as DTensors."""
    return [param.sharded_param for param in group.fsdp_params]


def padded_shard_numel(group: Any) -> int:
    """Elements of this rank's reduce-scattered shard: each trainable parameter's shard, padded as FSDP pads it."""
    return sum(
        param.padded_sharded_param_size.numel() for param in group.fsdp_params if param.sharded_param.requires_grad
    )


def sums_after_hook(group: Any) -> bool:
    """Whether FSDP divides the shard after the hook because it was told to reduce by sums."""
    return TORCH >= _FORCE_SUM_SINCE and bool(group.force_sum_reduction_for_comms)


def has_post_accumulate_grad_hooks(param: torch.Tensor) -> bool:
    """Whether FSDP runs hooks registered with ``register_post_accumulate_grad_hook`` on ``param`` after the hook."""
    return bool(getattr(param, "_post_accumulate_grad_hooks", None))
