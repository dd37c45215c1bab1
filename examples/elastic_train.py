"""One host of an elastic gradq job: start it on every host; start another to replace a lost one.

    gradq serve --host 0.0.0.0 --port 50051 &
    python examples/elastic_train.py --aggregator HOST:50051 --job-id digits --hosts 3   # on each of 3 hosts

A host that dies is dropped by the aggregator and the others train on; a host
started later joins at a step boundary with the model and optimizer state of a
live host. The training loop is gradq.client.apps.elastic_training; the gradq
lines in it are::

    state = GradqHookState.from_config(GradqConfig.of(aggregator, job_id="digits", elastic_hosts=3))
    model.register_comm_hook(state, gradq_hook)
    state.share(model, optimizer)
    for step in state.steps(200):  # the job's steps: from 0, or from where it joined, to the job's end
        ...

A host dropped while it was silent (stopped, partitioned) joins again by itself
and takes the state at the step the others have reached; ``state.steps`` then
goes on from that step. A counted ``range(state.start(), 200)`` would go on
from its own count and train past the job's end, alone once the others left.

Under one torchrun per host (``torchrun --standalone --nproc_per_node=N
examples/elastic_train.py ...``) the host's ranks reduce together first.
``--report FILE`` appends one JSON line per step (step, time, loss, parameter
digest, ranks training) and one for the result, for tests and bench/elastic.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from gradq.client.apps.elastic_training import ElasticSpec, ElasticStep, train_elastic
from gradq.client.chunks import DEFAULT_CHUNK_ELEMENTS
from gradq.client.config import GradqConfig
from gradq.qcore import QuantConfig


def main() -> None:
    """Parse the flags, train this host, print (and report) its result."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--aggregator", required=True, help="host:port of the aggregator (several shards: comma-separated, in order)"
    )
    parser.add_argument("--job-id", required=True, help="the job every host of the run shares")
    parser.add_argument("--hosts", type=int, required=True, help="hosts the job starts with")
    parser.add_argument("--steps", type=int, default=200, help="train until this step")
    parser.add_argument("--bits", type=int, default=8, help="bits per gradient element")
    parser.add_argument("--error-feedback", action="store_true", help="carry quantization error into the next step")
    parser.add_argument("--seed", type=int, default=0, help="the same on every host")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to pause after each step")
    parser.add_argument("--hidden", type=int, default=64, help="the MLP's width: the same on every host")
    parser.add_argument(
        "--chunk-elements", type=int, default=DEFAULT_CHUNK_ELEMENTS, help="a bucket above this travels in chunks"
    )
    parser.add_argument("--report", type=Path, help="append JSON lines: one per step, then the result")
    parser.add_argument(
        "--join-when", type=Path, help="a standby host: load everything, then join once this file exists"
    )
    args = parser.parse_args()

    def write(kind: str, record: Any) -> None:
        if args.report is not None:
            with args.report.open("a") as report:
                report.write(json.dumps({"kind": kind, **dataclasses.asdict(record)}) + "\n")

    def on_step(step: ElasticStep) -> None:
        write("step", step)

    gradq = GradqConfig.of(
        args.aggregator.split(","),
        QuantConfig(bits=args.bits),
        error_feedback=args.error_feedback,
        job_id=args.job_id,
        elastic_hosts=args.hosts,
        chunk_elements=args.chunk_elements,
    )
    spec = ElasticSpec(
        gradq,
        steps=args.steps,
        seed=args.seed,
        step_sleep_s=args.step_sleep,
        hidden=args.hidden,
        on_step=on_step,
        join_when=args.join_when,
    )
    result = train_elastic(spec)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, the host's first rank reports for it
        write("result", result)
    print(
        f"member {result.member}: steps {result.first_step}..{result.first_step + result.steps}, "
        f"held-out loss {result.held_out_loss:.4f}, accuracy {result.accuracy:.1f}%",
        flush=True,
    )


if __name__ == "__main__":
    main()
