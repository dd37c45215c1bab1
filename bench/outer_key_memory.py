"""What one DiLoCo round key's global state costs the aggregator: its RSS against what the budget charges.

Run from the repository root with the virtualenv's interpreter::

    python bench/outer_key_memory.py                 # 20,000 one-element keys
    python bench/outer_key_memory.py --keys 5000 --elements 256

The aggregator runs in a process of its own (spawned). One elastic host of a
job with the outer step on the aggregator seeds ``--keys`` round keys of
``--elements`` float32 parameters each through a real channel (no momentum,
as a host's first seed sends), then asks the aggregator for its RSS and its
memory budget's use. Printed: both, per key, and their ratio; the charge must
not be below the RSS (gradq.server.outer_state.KEY_ENTRY_BYTES is set from
this). The RSS figure includes allocator slack, so it moves by a few percent
from run to run.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
from collections.abc import Sequence
from multiprocessing.connection import Connection

import numpy as np
import psutil

from gradq.qcore import QuantConfig, Scheme
from gradq.qcore.outer_step import OuterStep


def serve(pipe: Connection) -> None:
    """The aggregator's process: serve, and report RSS and the budget's use whenever asked."""
    from gradq.server.app import AggregatorServer, ServerOptions
    from gradq.server.limits import ServiceLimits
    from gradq.server.policy import RoundPolicy

    server = AggregatorServer(
        RoundPolicy(round_timeout_s=60.0),
        ServerOptions("127.0.0.1:0", grace_s=1.0),
        ServiceLimits(max_memory_bytes=8 << 30, max_job_memory_bytes=8 << 30),
    )
    server.start()
    pipe.send(server.port)
    me = psutil.Process()
    while pipe.recv() == "measure":
        gc.collect()
        pipe.send((me.memory_info().rss, server.table.budget.in_use))
    server.stop()


def run(keys: int, elements: int) -> dict[str, float]:
    """Seed ``keys`` keys of ``elements`` parameters; returns the server's RSS and charge per key."""
    from gradq.client import JobSpec, WorkerClient
    from gradq.client.elastic import ANY_RANK

    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    server = context.Process(target=serve, args=(child,), daemon=True)
    server.start()
    address = f"127.0.0.1:{parent.recv()}"
    step = OuterStep(lr=0.7, momentum=0.9, nesterov=True)
    client = WorkerClient(
        address,
        "keys",
        ANY_RANK,
        JobSpec(world_size=1, elastic=True, outer_step=step),
        QuantConfig(scheme=Scheme.FLOAT32),
        timeout_s=30,
    )
    client.join()
    parameters = np.ones(elements, np.float32)
    # The first key: the job's outer state exists from here on.
    client.membership.seed_outer(0, 0, keys, parameters, None)
    parent.send("measure")
    rss_before, charged_before = parent.recv()
    for key in range(1, keys):
        client.membership.seed_outer(0, key, keys, parameters, None)
    parent.send("measure")
    rss_after, charged_after = parent.recv()
    client.close()
    parent.send("stop")
    server.join()
    seeded = keys - 1
    return {
        "rss": (rss_after - rss_before) / seeded,
        "charged": (charged_after - charged_before) / seeded,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=20_000, help="round keys seeded (at most 65,536)")
    parser.add_argument("--elements", type=int, default=1, help="float32 parameters per key")
    args = parser.parse_args(argv)
    figures = run(args.keys, args.elements)
    print(
        f"{args.keys:,} keys of {args.elements} elements: RSS {figures['rss']:.0f} B per key, "
        f"charged {figures['charged']:.0f} B per key ({figures['charged'] / figures['rss']:.2f}x the RSS)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
