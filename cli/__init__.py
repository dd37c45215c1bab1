"""The `gradq` command: one entry point whose subcommands live with the layer they run."""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main"]

# Subcommand -> module with a `main(argv)`; imported only when chosen, so
# `gradq serve` never loads torch and `gradq --help` loads nothing.
_SUBCOMMANDS = {
    "serve": ("gradq.server.cli", "run the aggregator (one process per shard)"),
    "demo": (
        "gradq.client.apps.demo",
        "train a real model through a local aggregator and N workers (gradq[demo])",
    ),
    "worker": (
        "gradq.client.apps.cluster",
        "train as one rank of a multi-host job, e.g. a Compose worker",
    ),
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``gradq <subcommand> ...``; returns the process exit status."""
    args = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="gradq",
        description="Quantized gradient aggregation for PyTorch DDP.",
        epilog="In your own training script: model.register_comm_hook(GradqHookState.from_env(), gradq_hook) "
        "(gradq.client.ddp.hook), configured by GRADQ_AGGREGATORS, GRADQ_JOB_ID, GRADQ_BITS, ...; launch it with "
        "torchrun --standalone --nproc_per_node=N against a running `gradq serve`. Each rank leaves its job when its "
        "process exits, and a rerun or a torchrun restart with the same GRADQ_JOB_ID starts the job afresh. "
        "See examples/torchrun_train.py and docs/integrations.md, 'With torchrun'.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, summary) in _SUBCOMMANDS.items():
        sub.add_parser(name, help=summary, add_help=False)
    if not args or args[0] not in _SUBCOMMANDS:
        parser.print_help(sys.stderr if args and args[0] not in ("-h", "--help") else sys.stdout)
        return 0 if args and args[0] in ("-h", "--help") else 2
    module = importlib.import_module(_SUBCOMMANDS[args[0]][0])
    return int(module.main(args[1:]) or 0)
