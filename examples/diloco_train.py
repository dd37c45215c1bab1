"""One host of a DiLoCo job through gradq: H local AdamW steps, then one outer round over the slow link.

Start the aggregator once, then this script once per host (a single process
here, with plain ``python`` and no process group; under torchrun, one torchrun per host, whose ranks train a DDP model
inside it, or with ``--inside fsdp`` an FSDP2 model sharded over them), every
host with the same job id::

    gradq serve --host 127.0.0.1 --port 50051 &
    export GRADQ_AGGREGATORS=127.0.0.1:50051 GRADQ_JOB_ID=diloco GRADQ_ELASTIC_HOSTS=3 \\
        GRADQ_BITS=4 GRADQ_ERROR_FEEDBACK=1
    for host in 0 1 2; do python examples/diloco_train.py --data-seed $host & done; wait

The gradq lines are the two that wrap the loop in ``DiLoCo`` and iterate
``diloco.steps(total)``, the job's inner steps. The job trains once
GRADQ_ELASTIC_HOSTS hosts have joined; a host started later joins at the next
outer round with the global state, and one dropped or late takes it at the
round the others reached: ``steps`` goes on from there and ends with the job.
``--checkpoint FILE --save-at-round K`` saves after round K and exits;
``--resume`` continues from FILE. ``--report DIR`` writes this host's losses,
figures and global parameters there. ``--batch N --token-weighted`` trains on
N windows per step and weighs this host's pseudo-gradient by its tokens (every
host of the job must pass ``--token-weighted``; the batches may differ).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from char_lm import BATCH, CharTransformer, text, windows
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from gradq.client.config import GradqConfig
from gradq.client.diloco import DEFAULT_BUCKET_ELEMENTS, OUTER_STEP_PLACES, DiLoCo


def main() -> None:
    """Train ``--rounds`` outer rounds of ``--sync-every`` inner steps (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="outer rounds in all (a resumed run included)")
    parser.add_argument("--sync-every", type=int, default=10, help="H: inner steps per outer round")
    parser.add_argument("--data-seed", type=int, default=0, help="this host's data: every host its own")
    parser.add_argument("--width", type=int, default=64, help="the model's width")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--lr", type=float, default=2e-3, help="the inner AdamW's learning rate")
    parser.add_argument("--checkpoint", type=Path, help="torch.save file of model, inner optimizer and DiLoCo")
    parser.add_argument("--save-at-round", type=int, default=-1, help="save after this round and exit; -1 never")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--die-in-round", type=int, default=-1, help="SIGKILL this host during that round's push")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds slept per inner step (slower compute)")
    parser.add_argument("--progress", type=Path, help="a file this host writes its outer round to after each round")
    parser.add_argument("--report", type=Path, help="this host writes <report>/host<seed>.json and .pt")
    parser.add_argument("--init-seed", type=int, default=0, help="the seed of this host's initial weights")
    parser.add_argument("--outer-step", choices=OUTER_STEP_PLACES, default="aggregator", help="where it runs")
    parser.add_argument("--quorum", type=int, default=0, help="semi-synchronous: hosts a round needs (0: all)")
    parser.add_argument("--inside", choices=("ddp", "fsdp"), default="ddp", help="a torchrun host's ranks train")
    parser.add_argument("--grace", type=float, default=1.0, help="semi-synchronous: the grace window, seconds")
    parser.add_argument("--fragments", type=int, default=1, help="Streaming DiLoCo: fragments synced apart")
    parser.add_argument("--fragment-delay", type=int, default=0, help="inner steps a fragment's round is in flight")
    parser.add_argument("--fragment-alpha", type=float, default=0.0, help="own share kept where an update lands")
    parser.add_argument("--batch", type=int, default=BATCH, help="windows per inner step (of this host's ranks each)")
    parser.add_argument("--token-weighted", action="store_true", help="weigh each host's pseudo-gradient by its tokens")
    parser.add_argument(
        "--bucket-elements",
        type=int,
        help=f"the most elements one round key carries (unset: {DEFAULT_BUCKET_ELEMENTS}, lowered to fit --fragments)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # hosts emulated on one machine share its cores
    if "RANK" in os.environ:  # under torchrun: the host's ranks train together over their process group
        dist.init_process_group("gloo")
    torch.manual_seed(args.init_seed)  # with the outer step on the aggregator, every host takes the first's
    model: nn.Module = CharTransformer(args.width, args.layers)
    # A host of one process started with plain `python` needs no process group.
    rank, ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if ranks > 1 and args.inside == "fsdp":  # sharded over the host's ranks: each holds a shard of every block
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block)
        fully_shard(model)
    elif ranks > 1:
        model = DistributedDataParallel(model)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train, held_out = text()
    losses: list[float] = []
    digests: dict[int, str] = {}  # outer round -> digest of the global parameters after it
    config = GradqConfig.from_env(os.environ)
    stalls: list[float] = []  # seconds each outer round held this host (the inner step that ran it, less its own)
    schedule = {
        "sync_every": args.sync_every,
        "outer_step": args.outer_step,
        "quorum": args.quorum,
        "grace_s": args.grace,
        "bucket_elements": args.bucket_elements,
        "fragments": args.fragments,
        "fragment_sync_delay": args.fragment_delay,
        "fragment_update_alpha": args.fragment_alpha,
        "token_weighted": args.token_weighted,
    }
    with DiLoCo(config, model, inner, **schedule) as diloco:
        if args.resume:
            saved = torch.load(args.checkpoint, weights_only=True)
            model.load_state_dict(saved["model"])
            inner.load_state_dict(saved["inner"])
            diloco.load_state_dict(saved["diloco"])
        if args.die_in_round >= 0:
            inner.register_step_post_hook(lambda *_: _die_during(diloco, args.die_in_round))
        joined_at = diloco.outer_round
        # The job's inner steps, not a count of this host's: after a rejoin or a late round it goes on from the job's.
        for step in diloco.steps(args.rounds * args.sync_every):
            inputs, targets = windows(train, np.random.default_rng([args.data_seed, rank, step]), args.batch)
            loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
            loss.backward()
            if args.token_weighted:
                diloco.count_tokens(inputs.numel())
            started = time.perf_counter()
            inner.step()  # every sync_every steps, DiLoCo's outer round runs here
            if diloco.inner_steps % args.sync_every == 0:
                stalls.append(time.perf_counter() - started)
            inner.zero_grad()
            losses.append(loss.item())
            time.sleep(args.step_delay)
            if diloco.outer_round not in digests and diloco.inner_steps % args.sync_every == 0:
                digests[diloco.outer_round] = _digest(diloco.global_parameters)
                if args.progress is not None:
                    args.progress.write_text(str(diloco.outer_round))
            if diloco.outer_round == args.save_at_round and args.checkpoint is not None:
                state = {"model": model.state_dict(), "inner": inner.state_dict(), "diloco": diloco.state_dict()}
                torch.save(state, args.checkpoint)
                break
        with torch.no_grad():
            inputs, targets = windows(held_out, np.random.default_rng(12345), 64)
            held_out_loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).item()
        report = f"host{args.data_seed}" + (f"-rank{rank}" if ranks > 1 else "")
        matches = diloco.matches_aggregator()  # collective over the host's ranks
        if args.report is not None:
            stats = diloco.stats()
            args.report.mkdir(parents=True, exist_ok=True)
            figures = {
                "losses": losses,
                "held_out_loss": held_out_loss,
                "joined_at_round": joined_at,
                "rejoins": diloco.rejoins,
                "late_rounds": diloco.late_rounds,
                "stalls": stalls,
                "outer_round": diloco.outer_round,
                "matches_aggregator": matches,
                "digests": digests,
                "bytes_sent": stats.bytes_sent if stats is not None else 0,
                "bytes_received": stats.bytes_received if stats is not None else 0,
            }
            (args.report / f"{report}.json").write_text(json.dumps(figures))
            torch.save(diloco.global_parameters, args.report / f"{report}.pt")
    print(f"host {args.data_seed}: round {diloco.outer_round}, held-out loss {held_out_loss:.4f}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def _die_during(diloco: DiLoCo, round_: int) -> None:
    """At the last inner step of ``round_``, SIGKILL this process while the round's pushes are in flight."""
    if diloco.outer_round == round_ and diloco.inner_steps % diloco.sync_every == diloco.sync_every - 1:
        threading.Thread(target=_kill_soon, daemon=True).start()


def _kill_soon() -> None:
    time.sleep(0.05)  # the next inner step ends the round: its pushes are about to go out
    os.kill(os.getpid(), signal.SIGKILL)


def _digest(tensors: list[torch.Tensor]) -> str:
    """sha256 of the tensors' bytes: equal digests, bit-identical tensors."""
    return hashlib.sha256(b"".join(tensor.detach().numpy().tobytes() for tensor in tensors)).hexdigest()


if __name__ == "__main__":
    main()
