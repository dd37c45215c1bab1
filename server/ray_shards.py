"""Aggregator shards placed by Ray: ``start_shards(n)`` on the driver runs N shards as Ray actors, restarted by Ray.

Each shard is an actor that serves an ``AggregatorServer`` in its own process
(one CPU of the cluster's by default), on a port chosen up front: before an
actor is created, a task on the node it is pinned to picks a port free there,
and the port is an argument of the actor's constructor. When the actor's
process dies (a crash, the OOM killer, SIGKILL), Ray runs the constructor again
(``max_restarts=-1``: always) on the same node with the same arguments, so the
shard comes back on the same address and the workers' addresses stay true; the
workers' pushes to it are retried and rejoin it as after any aggregator
restart, and the next round goes on. Every shard reports the whole group
(gradq.server.shard_group), so the workers need only ``shards.address``.

A node that is lost takes its shards with it (they are pinned to it, so
their address cannot change); start the shards again for a new job.

Ray is imported when ``start_shards`` runs (``pip install 'gradq[ray]'``);
importing this module loads neither Ray nor torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from gradq.server.app import AggregatorServer, BindError, ServerOptions
from gradq.server.limits import ServiceLimits
from gradq.server.policy import RoundPolicy

__all__ = ["RayShards", "start_shards"]

log = logging.getLogger(__name__)

# How long a (re)started shard retries its port while the dead process's socket is let go.
_BIND_PATIENCE_S = 30.0


class ShardActor:
    """One shard: an AggregatorServer serving in this actor's process, on the port it was given.

    Args:
        index: the shard's place in the group.
        port: the port to serve on; the same at every restart.
        metrics_port: the port of its metrics and status page (None: none); the same at every restart.
        policy, options, limits: the aggregator's settings (``options.address``'s
            host is bound; its port is replaced by ``port``, its metrics port by ``metrics_port``).
    """

    def __init__(
        self,
        index: int,
        port: int,
        metrics_port: int | None,
        policy: RoundPolicy,
        options: ServerOptions,
        limits: ServiceLimits,
    ) -> None:
        host = options.address.rpartition(":")[0]
        self.index = index
        options = dataclasses.replace(options, address=f"{host}:{port}", metrics_port=metrics_port)
        deadline = time.monotonic() + _BIND_PATIENCE_S
        while True:
            try:
                self.server = AggregatorServer(policy, options, limits)
                self.server.start()
                break
            except BindError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def pid(self) -> int:
        """This actor's process id (a restart changes it)."""
        return os.getpid()

    def counters(self) -> dict[str, int]:
        """The shard's round counters (rounds completed, contributions, ...) since this process started."""
        return dict(self.server.table.counters)

    def stop(self) -> None:
        """Stop serving gracefully (the actor is killed after)."""
        self.server.stop()


def _node_ports(count: int) -> tuple[str, list[int]]:
    """On the node this task runs on: its IP address and ``count`` different ports free there a moment ago."""
    import ray

    with contextlib.ExitStack() as held:
        probes = [held.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("", 0))
        ports = [int(probe.getsockname()[1]) for probe in probes]
    return ray.util.get_node_ip_address(), ports


@dataclass
class RayShards:
    """The shards ``start_shards`` started: where the workers reach them, and how to stop them.

    Attributes:
        addresses: ``ip:port`` of every shard, in shard order.
        actors: their Ray actor handles, in the same order.
        metrics_addresses: ``ip:port`` of every shard's /metrics and /status
            (empty unless ``options.metrics_port`` was set).
    """

    addresses: list[str]
    actors: list[Any]
    metrics_addresses: list[str] = dataclasses.field(default_factory=list)

    @property
    def address(self) -> str:
        """The first shard's address: enough for the workers, which learn the others from it."""
        return self.addresses[0]

    @property
    def aggregators(self) -> str:
        """Every shard's address, comma-separated: a GRADQ_AGGREGATORS value that names them all."""
        return ",".join(self.addresses)

    def pids(self, timeout_s: float = 60.0) -> list[int]:
        """Each shard actor's process id now (it changes when Ray restarts the actor)."""
        import ray

        return list(ray.get([actor.pid.remote() for actor in self.actors], timeout=timeout_s))

    def counters(self, timeout_s: float = 60.0) -> list[dict[str, int]]:
        """Each shard's round counters since its process started, in shard order."""
        import ray

        return list(ray.get([actor.counters.remote() for actor in self.actors], timeout=timeout_s))

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop every shard gracefully, then end its actor for good (no restart); idempotent."""
        import ray

        stopping = [actor.stop.remote() for actor in self.actors]
        try:
            ray.wait(stopping, num_returns=len(stopping), timeout=timeout_s)
        finally:
            for actor in self.actors:
                ray.kill(actor, no_restart=True)
            self.actors = []

    def __enter__(self) -> RayShards:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def start_shards(
    count: int,
    policy: RoundPolicy | None = None,
    options: ServerOptions | None = None,
    limits: ServiceLimits | None = None,
    *,
    num_cpus: float = 1.0,
    max_restarts: int = -1,
    timeout_s: float = 120.0,
) -> RayShards:
    """Start ``count`` aggregator shards as Ray actors on the cluster's CPU nodes; returns once all serve.

    Call it on the driver, after ``ray.init``. Shard i is pinned to the i-th
    alive node with ``num_cpus`` CPUs (round robin), on a port free there.

    Args:
        count: how many shards, 1 or more.
        policy: the round policy of every shard (None: RoundPolicy()).
        options: transport settings of every shard (None: ServerOptions()); the
            host of ``address`` is bound (default 0.0.0.0), its port is chosen
            per shard, and so is the metrics port when ``metrics_port`` is not
            None; ``shard_group`` is set to the group. ``exit_after_jobs``
            must be 0: Ray, not the job, ends these shards (``stop()``).
        limits: every shard's service limits (None: ServiceLimits()).
        num_cpus: CPUs each shard's actor takes from the cluster's resources.
        max_restarts: how often Ray restarts a shard that dies (-1: always).
        timeout_s: how long the shards may take to serve.

    Returns:
        The shards: ``address`` for the workers (``GRADQ_AGGREGATORS`` or the
        ``gradq_aggregators`` key), ``addresses``, ``stop()``.

    Raises:
        ValueError: ``count``, ``num_cpus`` or ``options`` cannot be served, or
            no alive node has ``num_cpus`` CPUs.
        ray.exceptions.RayError: a shard did not come up (its error says why).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count={count!r} is invalid; expected an integer >= 1 (shards to start)")
    if not num_cpus >= 0:
        raise ValueError(f"num_cpus={num_cpus!r} is invalid; expected >= 0 (CPUs each shard's actor takes)")
    options = options or ServerOptions()
    if options.exit_after_jobs:
        raise ValueError(
            f"options.exit_after_jobs={options.exit_after_jobs} is invalid here; expected 0: Ray restarts a shard "
            "that exits, so end them with RayShards.stop()"
        )
    nodes = sorted(
        (node for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU", 0) >= num_cpus),
        key=lambda node: node["NodeID"],
    )
    if not nodes:
        raise ValueError(f"num_cpus={num_cpus}: no alive node of the Ray cluster has that many CPUs for a shard")
    placed = [nodes[index % len(nodes)]["NodeID"] for index in range(count)]
    pinned = [NodeAffinitySchedulingStrategy(node_id=node, soft=False) for node in placed]
    metrics = options.metrics_port is not None
    probe = ray.remote(num_cpus=0)(_node_ports)
    found = ray.get(
        [probe.options(scheduling_strategy=pin).remote(2 if metrics else 1) for pin in pinned], timeout=timeout_s
    )
    ports = [(ip, port, spare[0] if spare else None) for ip, (port, *spare) in found]
    taken = [f"{ip}:{port}" for ip, *pair in ports for port in pair if port is not None]
    if len(set(taken)) != len(taken):  # two probes on one node drew the same port: draw again
        return start_shards(
            count, policy, options, limits, num_cpus=num_cpus, max_restarts=max_restarts, timeout_s=timeout_s
        )
    addresses = [f"{ip}:{port}" for ip, port, _ in ports]
    options = dataclasses.replace(options, shard_group=tuple(addresses))
    actor_class = ray.remote(ShardActor)
    actors = [
        actor_class.options(
            num_cpus=num_cpus, max_restarts=max_restarts, max_task_retries=-1, scheduling_strategy=pin
        ).remote(index, port, metrics_port, policy or RoundPolicy(), options, limits or ServiceLimits())
        for index, ((_, port, metrics_port), pin) in enumerate(zip(ports, pinned, strict=True))
    ]
    shards = RayShards(addresses, actors, [f"{ip}:{port}" for ip, _, port in ports if port is not None])
    try:
        shards.pids(timeout_s)  # every constructor has run: each shard serves
    except BaseException:
        with _quietly():
            shards.stop(timeout_s=5.0)
        raise
    log.info("%d gradq shards serving as Ray actors: %s", count, ",".join(addresses))
    return shards


@contextmanager
def _quietly() -> Iterator[None]:
    """Cleanup after a failure: its own error must not hide the first."""
    try:
        yield
    except Exception:
        log.debug("stopping the shards after a failed start failed too", exc_info=True)
