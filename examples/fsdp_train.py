"""A small transformer sharded with FSDP2 inside each host, its cross-host reduction through gradq; run with torchrun.

One torchrun per host, all meeting at one rendezvous (here two emulated hosts of two ranks on one machine)::

    gradq serve --host 127.0.0.1 --port 50051 &
    export GRADQ_AGGREGATORS=127.0.0.1:50051 GRADQ_JOB_ID=fsdp GRADQ_BITS=4 GRADQ_ERROR_FEEDBACK=1
    for host in 0 1; do
        torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \\
            examples/fsdp_train.py --hosts 2 &
    done; wait

The mesh is (hosts, ranks per host): every block and then the root are
sharded over its "shard" dimension (a host's ranks), and ``use_gradq`` makes
gradq the reduction across the "replicate" dimension. ``--native`` trains the
same model with native HSDP instead (the 2-D mesh, torch's all-reduce across
hosts), for comparison. ``--checkpoint DIR --save-at K`` saves model, optimizer
and gradq's state (steps, error feedback) with torch.distributed.checkpoint
after step K and exits; ``--resume DIR`` continues from it. ``--report DIR``
writes each rank's losses, figures and local shards there.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from char_lm import BATCH, CharTransformer, text, windows
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from gradq.client.config import GradqConfig
from gradq.client.fsdp import GradqFSDP, use_gradq


def shard(model: CharTransformer, mesh: DeviceMesh, reduce_dtype: torch.dtype | None) -> CharTransformer:
    """fully_shard every block, then the root (which takes the embeddings, norm and head); in place."""
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def main() -> None:
    """Train ``--steps`` optimizer steps and report (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, required=True, help="hosts in the job (torchrun --nnodes)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps in all (a resumed run included)")
    parser.add_argument("--micro-batches", type=int, default=1, help="backward passes per optimizer step")
    parser.add_argument("--native", action="store_true", help="native HSDP across hosts instead of gradq")
    parser.add_argument("--reduce-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--width", type=int, default=64, help="the model's width")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--activation-checkpointing", action="store_true", help="blocks recompute in backward")
    parser.add_argument("--checkpoint", type=Path, help="torch.distributed.checkpoint directory")
    parser.add_argument("--save-at", type=int, default=-1, help="save after this step and exit; -1 never")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--report", type=Path, help="each rank writes rank<R>.json and rank<R>.pt here")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (args.hosts, world // args.hosts), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)  # every host starts from the same weights
    model = shard(
        CharTransformer(args.width, args.layers, recompute=args.activation_checkpointing),
        mesh if args.native else mesh["shard"],
        getattr(torch, args.reduce_dtype),
    )
    reduction: GradqFSDP | None = None if args.native else use_gradq(model, GradqConfig.from_env(os.environ))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    train, held_out = text()
    start = 0
    if args.resume:
        start = resume(args.checkpoint, model, optimizer, reduction)
    losses, step_s, step_cpu_s = [], [], []
    started_at = time.time()
    for step in range(start, args.steps):
        began, began_cpu = time.perf_counter(), time.process_time()
        loss_sum = 0.0
        for micro in range(args.micro_batches):
            cast(FSDPModule, model).set_requires_gradient_sync(micro == args.micro_batches - 1)
            inputs, targets = windows(train, np.random.default_rng([rank, step, micro]), BATCH)
            loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
            (loss / args.micro_batches).backward()
            loss_sum += loss.item() / args.micro_batches
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss_sum)
        step_s.append(time.perf_counter() - began)
        step_cpu_s.append(time.process_time() - began_cpu)  # every thread of this rank: gRPC's and gloo's too
        if step + 1 == args.save_at and args.checkpoint is not None:
            save(args.checkpoint, step + 1, model, optimizer, reduction)
            break
    with torch.no_grad():
        inputs, targets = windows(held_out, np.random.default_rng(12345), 64)
        held_out_loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).item()
    if args.report is not None:
        times = {"started_at": started_at, "step_s": step_s, "step_cpu_s": step_cpu_s}
        report(args.report, rank, model, reduction, losses, held_out_loss, times)
    if rank == 0:
        print(f"{len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, held-out {held_out_loss:.4f}")
    if reduction is not None:
        reduction.close()
    dist.destroy_process_group()


def save(
    directory: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, reduction: GradqFSDP | None
) -> None:
    """Model, optimizer and gradq's steps and error feedback, every rank its own shards."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state, "loop": {"step": torch.tensor(step)}}
    if reduction is not None:
        state["gradq"] = reduction  # a Stateful: DCP calls its state_dict() / load_state_dict()
    dcp.save(state, checkpoint_id=str(directory))


def resume(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, reduction: GradqFSDP | None) -> int:
    """Load what ``save`` wrote; returns the step to continue from."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state, "loop": {"step": torch.tensor(0)}}
    if reduction is not None:
        state["gradq"] = reduction
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    return int(state["loop"]["step"])


def report(
    directory: Path,
    rank: int,
    model: nn.Module,
    reduction: GradqFSDP | None,
    losses: list[float],
    held_out_loss: float,
    times: dict[str, object],
) -> None:
    """rank<R>.json (losses, figures) and rank<R>.pt (this rank's local shards)."""
    directory.mkdir(parents=True, exist_ok=True)
    figures: dict[str, object] = {"losses": losses, "held_out_loss": held_out_loss, **times}
    if reduction is not None:
        stats = reduction.stats()
        traveled, waited = reduction.overlap()
        figures.update(
            host=reduction.hosts.host,
            local_rank=reduction.hosts.local_rank,
            mode=reduction.session.mode,
            bytes_sent=stats.bytes_sent if stats is not None else 0,
            traveled_s=traveled,
            waited_s=waited,
            shard_elements=[unit.shard_numel for unit in reduction.units],
        )
    (directory / f"rank{rank}.json").write_text(json.dumps(figures))
    # The root keeps its parameters gathered after a forward; its shards are what the hosts compare.
    cast(FSDPModule, model).reshard()
    shards = {name: cast(DTensor, param).to_local().detach().clone() for name, param in model.named_parameters()}
    torch.save(shards, directory / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
