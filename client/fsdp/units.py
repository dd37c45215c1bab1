"""What use_gradq checks of an FSDP2 model before it connects: its units, their mesh, and the hosts.

gradq takes FSDP2's ``set_all_reduce_hook`` slot, which exists only when a unit
is sharded over a 1-D mesh (the ranks of one host) and holds one parameter
group. Everything here is read off the model and refused with a message naming
the unit; nothing talks to the aggregator. The mesh, dtypes and gradients are
read from the sharded parameters (public DTensor API); what torch keeps
private is read through gradq.client.fsdp.torch_internals. ``find_hosts`` is
the one collective (over the default group): every rank says which ranks
share its shard group, and those groups are the job's hosts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from gradq.client.fsdp import torch_internals
from gradq.client.torch_support import require_torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

__all__ = ["Hosts", "Unit", "find_hosts", "units_of"]


@dataclass(frozen=True, slots=True)
class Unit:
    """One FSDP unit gradq reduces: its module, name and (single) parameter group."""

    index: int  # its place in the model's module order: the same on every host
    name: str  # its qualified name ("" for the root), for messages
    module: FSDPModule
    params: tuple[nn.Parameter, ...]  # the group's sharded parameters (DTensors), as the module holds them
    shard_numel: int  # elements of this rank's reduce-scattered shard: the padded shards of its trainable parameters
    group: Any  # torch's FSDPParamGroup (private type), read only through torch_internals

    @property
    def mesh(self) -> DeviceMesh:
        """The mesh the unit is sharded over: the host's ranks."""
        mesh: DeviceMesh = self.params[0].device_mesh  # type: ignore[attr-defined]  # a DTensor's
        return mesh

    @property
    def shard_ranks(self) -> tuple[int, ...]:
        """The global ranks this unit is sharded over: the host's."""
        return tuple(dist.get_process_group_ranks(self.mesh.get_group()))

    @property
    def device(self) -> torch.device:
        """The kind of device FSDP reduces on, the mesh's: where the shard, and so its residual, lives."""
        return torch.device(self.mesh.device_type)

    def fills_in_place(self, shard: torch.Tensor) -> bool:
        """Whether FSDP makes ``shard`` itself the parameters' gradients, untouched until the optimizer reads them.

        Then the mean may land after the hook returns (before backward ends).
        FSDP copies or reads the shard right after the hook when it casts to
        another dtype, divides after the reduction (fp16 reductions, forced
        sums), accumulates into an existing gradient, or runs post-accumulate-grad
        hooks; on a GPU the shard is another stream's (and CPU offload copies
        it). In those cases the hook waits for the mean instead.
        """
        if shard.device.type != "cpu" or shard.dtype not in (torch.float32, torch.bfloat16):
            return False
        if torch_internals.sums_after_hook(self.group):
            return False
        for param in self.params:
            grad_dtype = getattr(param, "grad_dtype", param.dtype)  # torch 2.15 casts to it, when set apart
            if param.requires_grad and (param.dtype != shard.dtype or grad_dtype != shard.dtype):
                return False
            if param.grad is not None or torch_internals.has_post_accumulate_grad_hooks(param):
                return False
        return True


@dataclass(frozen=True, slots=True)
class Hosts:
    """The job's hosts, found from the units' shard groups."""

    host: int  # this rank's host: its member id at the aggregator
    hosts: int  # hosts in the job
    local_rank: int  # this rank's place in its host's shard group: which shard of each unit it holds
    local_size: int  # ranks per host
    members: tuple[tuple[int, ...], ...]  # each host's global ranks, in host order


def units_of(model: nn.Module | FSDPModule) -> list[Unit]:
    """The FSDP units of ``model`` that hold parameters, in module order; refuses what gradq cannot serve.

    Raises:
        TorchTooOldError: the installed torch has no FSDP2 all-reduce hook (before 2.7).
        TypeError: ``model`` is not sharded with FSDP2's ``fully_shard``.
        ValueError: a unit is sharded over a 2-D mesh (native HSDP), holds
            several parameter groups, or shards over another group than the rest.
    """
    require_torch("fsdp")
    from torch.distributed.fsdp import FSDPModule  # public since torch 2.6

    if not isinstance(model, FSDPModule) or not isinstance(model, nn.Module):
        raise TypeError(
            f"model is {type(model).__name__}, not sharded with FSDP2; call "
            f"torch.distributed.fsdp.fully_shard(block, mesh=...) on its blocks and then on the root first"
        )
    units: list[Unit] = []
    shard_ranks: tuple[int, ...] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = torch_internals.parameter_groups(module)
        where = f"FSDP unit {name or '<root>'!r}"
        if len(groups) > 1:
            raise ValueError(
                f"{where} holds {len(groups)} parameter groups (a per-parameter mesh from shard_placement_fn); "
                f"expected 1: FSDP2's all-reduce hook, which gradq takes, serves one group per unit"
            )
        if not groups:
            continue  # no parameters of its own: FSDP reduces nothing for it
        group = groups[0]
        params = tuple(torch_internals.sharded_parameters(group))
        unit = Unit(len(units), name, module, params, torch_internals.padded_shard_numel(group), group)
        if unit.mesh.ndim != 1:
            raise ValueError(
                f"{where} is sharded over a {unit.mesh.ndim}-D mesh (native HSDP, which all-reduces across hosts "
                f'itself); expected the host\'s ranks only: fully_shard(..., mesh=mesh["shard"])'
            )
        ranks = unit.shard_ranks
        if shard_ranks is not None and ranks != shard_ranks:
            raise ValueError(
                f"{where} shards over ranks {list(ranks)}, the units before it over {list(shard_ranks)}; "
                f"expected every unit on the same mesh (the host's ranks)"
            )
        shard_ranks = ranks
        units.append(unit)
    if not units:
        raise ValueError("the model's FSDP units hold no parameters; there is nothing for gradq to reduce")
    return units


def find_hosts(unit: Unit) -> Hosts:
    """Agree with every rank on the hosts: each distinct shard group is one; collective over the default group.

    Raises:
        ValueError: the shard groups do not split the job's ranks into hosts of
            one size (FSDP shards every host's model the same way).
    """
    mine = unit.shard_ranks
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    members = tuple(sorted(set(gathered)))
    sizes = {len(ranks) for ranks in members}
    covered = sorted(rank for ranks in members for rank in ranks)
    if len(sizes) != 1 or covered != list(range(dist.get_world_size())):
        raise ValueError(
            f"the ranks' shard groups {[list(ranks) for ranks in members]} do not split the job's "
            f"{dist.get_world_size()} ranks into hosts of one size; expected a mesh (hosts, ranks per host) "
            f'and every unit sharded over its "shard" dimension'
        )
    return Hosts(members.index(mine), len(members), mine.index(dist.get_rank()), len(mine), members)
