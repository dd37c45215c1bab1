"""What use_gradq refuses, tried in one process (world size 1, gloo); prints each case's error as JSON.

Run by tests/client/test_fsdp.py with the aggregator's address: the last case
connects once, trains a step, then calls use_gradq a second time.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_common
from torch.distributed.tensor import Shard

from gradq.client.config import GradqConfig
from gradq.client.fsdp import use_gradq
from gradq.qcore import QuantConfig


def refusal(attempt: Callable[[], object]) -> str:
    try:
        attempt()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


def several_parameter_groups(mesh: DeviceMesh, config: GradqConfig) -> str:
    """use_gradq on a unit with a per-parameter mesh (torch 2.12 and newer; before, a unit has one group)."""
    placement = getattr(_fsdp_common, "ShardPlacementResult", None)
    if placement is None:
        return f"not possible on torch {torch.__version__}"
    split = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    other = _fsdp_common.FSDPMeshInfo(DeviceMesh.from_group(dist.new_group([0]), "cpu"), shard_mesh_dim=0)
    fully_shard(
        split, mesh=mesh, shard_placement_fn=lambda p: placement(Shard(0), other) if p is split[1].weight else None
    )
    return refusal(lambda: use_gradq(split, config))


def main() -> None:
    address, port = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    config = GradqConfig.of([address], QuantConfig(bits=8), job_id="refusals")
    mesh = init_device_mesh("cpu", (1,))
    found = {"not sharded": refusal(lambda: use_gradq(nn.Linear(4, 4), config))}
    native = fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")))
    found["2-D mesh"] = refusal(lambda: use_gradq(native, config))
    found["parameter groups"] = several_parameter_groups(mesh, config)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    fully_shard(model, mesh=mesh)
    found["not a config"] = refusal(lambda: use_gradq(model, {"bits": 8}))
    adaptive = config.replace(quant=QuantConfig(bits=4), bit_policy="adaptive", average_bits=6.0)
    found["adaptive"] = refusal(lambda: use_gradq(model, adaptive))
    handle = use_gradq(model, config)
    model(torch.ones(3, 4)).sum().backward()
    found["trained"] = str(handle.steps)
    found["twice"] = refusal(lambda: use_gradq(model, config))
    handle.close()
    print(json.dumps(found))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
