"""What gradq.client.fsdp.torch_internals reads of a real FSDP2 model on the installed torch; rank 0 prints JSON.

Run by tests/client/test_fsdp_internals.py as two processes (gloo, one host of
two ranks), so FSDP pads: the model's first layer has 3 output rows over 2 ranks.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from gradq.client.fsdp import torch_internals
from gradq.client.fsdp.units import units_of


class Wrapper(nn.Module):
    """A unit with no parameters of its own: FSDP reduces nothing for it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.inner(inputs)


def main() -> None:
    port, rank = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    inner = nn.Linear(3, 2)
    wrapper = Wrapper(inner)
    model = nn.Sequential(nn.Linear(4, 3), wrapper)
    fully_shard(inner, mesh=mesh)
    fully_shard(wrapper, mesh=mesh)
    fully_shard(model, mesh=mesh)
    found: dict[str, object] = {"torch": torch.__version__}
    found["groups"] = {
        name or "<root>": len(torch_internals.parameter_groups(module))
        for name, module in model.named_modules()
        if isinstance(module, FSDPModule)
    }
    units = units_of(model)
    root = units[0]  # in module order: the root (the first Linear's parameters), then model[1].inner
    own = [param for name, param in model.named_parameters() if name.startswith("0.")]
    found["root holds its own parameters"] = [id(p) for p in root.params] == [id(p) for p in own]
    found["shard_numel"] = [unit.shard_numel for unit in units]
    shards: dict[int, list[int]] = {}
    in_place: dict[int, list[bool]] = {}
    for index, unit in enumerate(units):

        def hook(shard: torch.Tensor, index: int = index) -> None:
            shards.setdefault(index, []).append(shard.numel())
            in_place.setdefault(index, []).append(units[index].fills_in_place(shard))

        unit.module.set_all_reduce_hook(hook)
    model(torch.ones(2, 4)).sum().backward()  # no gradients yet: the shards become them
    model(torch.ones(2, 4)).sum().backward()  # accumulates into the first backward's gradients
    found["hook shard numel"] = [shards[index][0] for index in range(len(units))]
    found["fills in place, then not"] = [in_place[index] for index in range(len(units))]
    found["sums after hook"] = torch_internals.sums_after_hook(root.group)
    if hasattr(root.module, "set_force_sum_reduction_for_comms"):  # torch 2.8 and newer
        root.module.set_force_sum_reduction_for_comms(True)
        found["sums after hook when forced"] = torch_internals.sums_after_hook(root.group)
    param = root.params[0]
    found["post-accumulate hooks"] = torch_internals.has_post_accumulate_grad_hooks(param)
    param.register_post_accumulate_grad_hook(lambda _: None)
    found["post-accumulate hooks once registered"] = torch_internals.has_post_accumulate_grad_hooks(param)
    if rank == 0:
        print(json.dumps(found), flush=True)
    # Both ranks past every collective, then out without tearing gloo down: its teardown (destroy_process_group
    # or the interpreter's exit) ended a rank in std::terminate on torch 2.15 on a busy host, even after this
    # barrier. What the script checks is printed by then; the teardown is not under test.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
