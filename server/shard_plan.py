"""`gradq serve --shards N`: which ports N shard processes take, checked whole before any of them starts."""

from __future__ import annotations

import socket
from contextlib import ExitStack
from dataclasses import dataclass

__all__ = ["MAX_SHARDS", "ShardPlan", "plan_shards"]

# Shard processes one parent runs: each is a whole aggregator (a gRPC server, its threads and
# ~250 MB of its own), so past a few per core more of them only contend; more machines scale further.
MAX_SHARDS = 64


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Where each shard of one `gradq serve --shards N` serves.

    Args:
        ports: each shard's gRPC port, in shard order.
        metrics_ports: each shard's metrics port (0: a free one; None: no metrics).
        group: the ``--shard-group`` each shard reports, in shard order.
    """

    ports: tuple[int, ...]
    metrics_ports: tuple[int | None, ...]
    group: tuple[str, ...]


def plan_shards(
    shards: int | None,
    shard_ports: tuple[int, ...] | None,
    port: int,
    metrics_port: int | None,
    host: str,
    advertise_host: str | None,
    shard_group: tuple[str, ...] | None,
) -> ShardPlan | None:
    """The shards' ports for ``--shards`` / ``--shard-ports``; None when one process serves (the plain `gradq serve`).

    Args:
        shards: ``--shards`` (None: one, or one per ``shard_ports``).
        shard_ports: ``--shard-ports`` (None: consecutive ports from ``port``).
        port: ``--port``; 0 picks free ports, once: a restarted shard comes back on its own.
        metrics_port: ``--metrics-port``: shard i serves its metrics on ``metrics_port + i`` (0: each a free one).
        host: ``--host``, where free ports are looked for.
        advertise_host: ``--advertise-host``: the host the group names (None: the host each worker dialed).
        shard_group: ``--shard-group``, which ``--shards`` sets itself for its shards.

    Raises:
        ValueError: a flag's value, or two flags together, cannot be served; the message names them.
    """
    if shards is not None and not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"--shards={shards} is invalid; expected 1..{MAX_SHARDS} shard processes")
    count = shards if shards is not None else len(shard_ports) if shard_ports else 1
    if shard_ports is not None:
        listed = ",".join(map(str, shard_ports))
        if len(shard_ports) != count:
            raise ValueError(
                f"--shard-ports={listed} names {len(shard_ports)} port(s) but --shards={count}; "
                "expected one port per shard"
            )
        twice = sorted({p for p in shard_ports if shard_ports.count(p) > 1})
        if twice:
            raise ValueError(f"--shard-ports={listed} names port {twice[0]} twice; expected {count} different ports")
    if count == 1:
        return None
    if shard_group is not None:
        raise ValueError(
            f"--shard-group={','.join(shard_group)} with --shards={count}: --shards tells its own shards their group; "
            "expected one of the two"
        )
    if shard_ports is None and port + count - 1 > 65535:
        raise ValueError(
            f"--port={port} with --shards={count} needs ports {port}..{port + count - 1}; expected --port <= "
            f"{65536 - count}"
        )
    if metrics_port:
        metrics = range(metrics_port, metrics_port + count)
        if metrics.stop - 1 > 65535:
            raise ValueError(
                f"--metrics-port={metrics_port} with --shards={count} needs ports {metrics.start}..{metrics.stop - 1}; "
                f"expected --metrics-port <= {65536 - count}"
            )
        grpc_ports = shard_ports or (range(port, port + count) if port else ())
        taken = sorted(set(metrics) & set(grpc_ports))
        if taken:
            raise ValueError(
                f"--metrics-port={metrics_port} with --shards={count} takes ports {metrics.start}..{metrics.stop - 1}, "
                f"and port {taken[0]} is a shard's gRPC port too; expected metrics ports apart from the shards' ports"
            )
    if shard_ports is not None:
        ports = shard_ports
    elif port:
        ports = tuple(range(port, port + count))
    else:
        ports = _free_ports(host, count, set(range(metrics_port, metrics_port + count)) if metrics_port else set())
    metrics_ports = tuple(None if metrics_port is None else metrics_port and metrics_port + i for i in range(count))
    group = tuple(f"{advertise_host or ''}:{p}" for p in ports)
    return ShardPlan(ports, metrics_ports, group)


def _free_ports(host: str, count: int, avoid: set[int]) -> tuple[int, ...]:
    """``count`` ports free on ``host`` a moment ago, none in ``avoid``, held together so none repeats."""
    ports: list[int] = []
    with ExitStack() as held:
        while len(ports) < count:
            address = host.strip("[]")
            probe = held.enter_context(socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET))
            probe.bind(("" if address in ("", "0.0.0.0", "::") else address, 0))
            found = int(probe.getsockname()[1])
            if found not in avoid:
                ports.append(found)
    return tuple(ports)
