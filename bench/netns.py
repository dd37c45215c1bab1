"""Emulated hosts for benchmarks: one network namespace per host, a bridge between them, tc-shaped links.

Everything lives inside namespaces this module creates (names ``gradq-sw``,
``gradq-w<K>``, ``gradq-a<K>``): the bridge sits in ``gradq-sw``, every host
namespace holds one end of a veth pair whose other end is a bridge port, and
the addresses come from 10.77.0.0/24, which exists nowhere else. Deleting the
namespaces deletes the links, the bridge and the addresses with them. Needs root.
``GRADQ_NETNS_RUN=<label>`` names them ``gradq-<label>-sw``, ... instead, so two
benchmarks can run at once without touching each other's namespaces.

With a round trip (``rtt_ms`` > 0) each host's link is instead a pair of TAP
devices (the host's ``gq0`` and its bridge port) joined by a delay-line process
(delay_line.py) that holds every frame for a quarter of the round trip in each
direction: host to host crosses two links each way, so any two hosts (worker to
aggregator, worker to worker) see the round trip asked for. Those links carry
frames of up to delay_line.DEFAULT_MTU bytes; tbf shapes the same devices.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import delay_line

__all__ = [
    "Host",
    "add_rtt_argument",
    "describe_rtt",
    "Topology",
    "build_topology",
    "leftover_namespaces",
    "namespace_pids",
    "parse_hosts",
    "parse_rate",
    "parse_rtt",
    "read_counters",
    "remove_namespaces",
]


def _run_label() -> str:
    label = os.environ.get("GRADQ_NETNS_RUN", "")
    if label and not re.fullmatch(r"[a-z0-9]{1,8}", label):
        raise ValueError(f"GRADQ_NETNS_RUN={label!r} is invalid; expected 1-8 lowercase letters or digits, or unset")
    return f"{label}-" if label else ""


# GRADQ_NETNS_RUN=<label> names a run's namespaces gradq-<label>-sw, ...: a second benchmark then runs beside
# another's (each namespace set is a separate network) and this run's checks and --cleanup see only its own.
PREFIX = f"gradq-{_run_label()}"
SWITCH = f"{PREFIX}sw"
BRIDGE = "br0"
SUBNET = "10.77.0"  # a /24 that exists only inside these namespaces
HOST_DEVICE = "gq0"  # the host's end of its veth, same name in every host namespace
WORKER_OFFSET = 10  # worker K is 10.77.0.(10+K)
AGGREGATOR_OFFSET = 100  # aggregator K is 10.77.0.(100+K)
# tbf settings of the emulated links (figures: bench/results/network-links.md).
TBF_BURST = "256kb"
TBF_LATENCY = "50ms"
_OURS = re.compile(rf"^{re.escape(PREFIX)}(sw|w\d+|a\d+)$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(k|m|g)bit$")
_RATE_SCALE = {"k": 1e3, "m": 1e6, "g": 1e9}


@dataclass(frozen=True, slots=True)
class Host:
    """One emulated machine: a namespace with one veth to the bridge."""

    namespace: str  # e.g. gradq-w0
    port: str  # the veth end on the bridge (in the switch namespace), e.g. w0
    address: str  # IPv4 address of HOST_DEVICE inside the namespace

    @property
    def device(self) -> str:
        """The host's network device, as named inside its namespace."""
        return HOST_DEVICE

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace (``ip netns exec`` also remounts /sys there)."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def parse_rate(rate: str) -> float:
    """Bits per second of a tc rate such as ``1gbit`` or ``100mbit``.

    Raises:
        ValueError: ``rate`` is not ``<number><k|m|g>bit``.
    """
    match = _RATE.match(rate.strip().lower())
    if match is None:
        raise ValueError(f"rate={rate!r} is invalid; expected a tc rate such as '1gbit' or '100mbit'")
    return float(match.group(1)) * _RATE_SCALE[match.group(2)]


def parse_rtt(text: str) -> float:
    """Milliseconds of a round trip such as ``50`` or ``12.5``.

    Raises:
        ValueError: ``text`` is not a number >= 0.
    """
    try:
        rtt_ms = float(text)
    except ValueError:
        rtt_ms = -1.0
    if not 0.0 <= rtt_ms < 10_000.0:
        raise ValueError(f"rtt={text!r} is invalid; expected a round trip in milliseconds, 0 <= rtt < 10000")
    return rtt_ms


def _rtt_argument(text: str) -> float:
    try:
        return parse_rtt(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_rtt_argument(parser: argparse.ArgumentParser) -> None:
    """``--rtt MS`` on a benchmark's command line (default 0: plain veth links, as before delay lines existed)."""
    parser.add_argument(
        "--rtt",
        type=_rtt_argument,
        default=0.0,
        metavar="MS",
        help="round trip between any two hosts, in milliseconds: every host's link gets a delay line "
        "(bench/delay_line.py) holding each frame MS/4 per direction besides its rate; 0 keeps plain veth links",
    )


def describe_rtt(rtt_ms: float) -> str:
    """The round trip's sentence for a report's setup."""
    if rtt_ms <= 0.0:
        return "no added propagation delay (veth links)"
    return (
        f"a round trip of {rtt_ms:g} ms between any two hosts (a TAP delay line on every host link, "
        f"{rtt_ms / 4:g} ms each way, MTU {delay_line.DEFAULT_MTU})"
    )


def parse_hosts(text: str) -> tuple[int, int]:
    """(hosts, ranks per host) of a topology such as ``2x4``.

    Raises:
        ValueError: ``text`` is not ``<hosts>x<ranks>`` with both >= 1.
    """
    hosts, _, ranks = text.strip().lower().partition("x")
    if not (hosts.isdigit() and ranks.isdigit() and int(hosts) >= 1 and int(ranks) >= 1):
        raise ValueError(f"hosts={text!r} is invalid; expected HOSTSxRANKS such as '2x2', both >= 1")
    return int(hosts), int(ranks)


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed with status {result.returncode}: {result.stderr.strip()}")
    return result


def _host(kind: str, index: int, offset: int) -> Host:
    return Host(f"{PREFIX}{kind}{index}", f"{kind}{index}", f"{SUBNET}.{offset + index}")


class Topology:
    """The namespaces of one benchmark run; ``close()`` (idempotent) deletes them all.

    Args:
        workers: hosts gradq-w0.. in rank order.
        aggregators: hosts gradq-a0.. in shard order.
    """

    def __init__(self, workers: Sequence[Host], aggregators: Sequence[Host], rtt_ms: float = 0.0) -> None:
        self.workers = list(workers)
        self.aggregators = list(aggregators)
        self.rtt_ms = rtt_ms  # round trip between any two hosts; 0: plain veth links
        self.delay_lines: list[delay_line.DelayLineProcess] = []  # one per host when rtt_ms > 0
        self._namespaces = [SWITCH, *(host.namespace for host in self.hosts)]

    @property
    def hosts(self) -> list[Host]:
        """Workers then aggregators."""
        return [*self.workers, *self.aggregators]

    def shape(self, hosts: Sequence[Host], rate: str | None) -> None:
        """Limit both directions of each host's link to ``rate`` (None: no limit).

        The host's own device shapes what it sends; its bridge port shapes what it receives.
        """
        for host in hosts:
            for namespace, device in ((host.namespace, host.device), (SWITCH, host.port)):
                if rate is None:
                    _run(["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"], check=False)
                else:
                    tbf = ["tbf", "rate", rate, "burst", TBF_BURST, "latency", TBF_LATENCY]
                    _run(["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", *tbf])

    def close(self) -> None:
        """Stop the delay lines and anything still running in the namespaces, and delete them."""
        for line in self.delay_lines:
            line.stop()
        self.delay_lines.clear()
        remove_namespaces(self._namespaces)


def build_topology(workers: int, aggregators: int, rtt_ms: float = 0.0, delay_lines: bool | None = None) -> Topology:
    """Create the switch namespace, its bridge and one namespace per host, links up and unshaped.

    Args:
        workers: worker hosts (gradq-w0..).
        aggregators: aggregator hosts (gradq-a0..).
        rtt_ms: round trip between any two hosts; 0 keeps veth links with no delay of their own,
            more puts a delay line (rtt_ms / 4 each way) on every host's link.
        delay_lines: True puts delay lines on the links even at rtt_ms 0 (to measure what they cost);
            None: only when rtt_ms > 0.

    Raises:
        RuntimeError: a namespace of ours already exists (run with --cleanup) or a command failed;
            whatever was created before the failure has been deleted.
    """
    leftovers = leftover_namespaces()
    if leftovers:
        raise RuntimeError(f"namespaces {', '.join(leftovers)} already exist; remove them with --cleanup first")
    if not 0.0 <= rtt_ms < 10_000.0:
        raise ValueError(f"rtt_ms={rtt_ms!r} is invalid; expected 0 <= rtt_ms < 10000")
    topology = Topology(
        [_host("w", index, WORKER_OFFSET) for index in range(workers)],
        [_host("a", index, AGGREGATOR_OFFSET) for index in range(aggregators)],
        rtt_ms,
    )
    try:
        _run(["ip", "netns", "add", SWITCH])
        _run(["ip", "-n", SWITCH, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", SWITCH, "link", "set", BRIDGE, "up"])
        for host in topology.hosts:
            if delay_lines or (delay_lines is None and rtt_ms > 0.0):
                topology.delay_lines.append(_add_delayed_host(host, rtt_ms / 4e3))
            else:
                _add_host(host)
    except BaseException:
        topology.close()
        raise
    return topology


def _add_host(host: Host) -> None:
    _run(["ip", "netns", "add", host.namespace])
    # Both ends are created directly in their namespaces: nothing appears in the caller's namespace.
    peer = ["peer", "name", host.device, "netns", host.namespace]
    _run(["ip", "-n", SWITCH, "link", "add", host.port, "type", "veth", *peer])
    _run(["ip", "-n", SWITCH, "link", "set", host.port, "master", BRIDGE])
    _run(["ip", "-n", SWITCH, "link", "set", host.port, "up"])
    _run(["ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.device])
    _run(["ip", "-n", host.namespace, "link", "set", host.device, "up"])
    _run(["ip", "-n", host.namespace, "link", "set", "lo", "up"])


def _add_delayed_host(host: Host, delay_s: float) -> delay_line.DelayLineProcess:
    _run(["ip", "netns", "add", host.namespace])
    line = delay_line.start_delay_line((SWITCH, host.port), (host.namespace, host.device), delay_s)
    try:
        mtu = str(delay_line.DEFAULT_MTU)
        _run(["ip", "-n", SWITCH, "link", "set", host.port, "mtu", mtu, "master", BRIDGE])
        _run(["ip", "-n", SWITCH, "link", "set", host.port, "up"])
        _run(["ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.device])
        _run(["ip", "-n", host.namespace, "link", "set", host.device, "mtu", mtu, "up"])
        _run(["ip", "-n", host.namespace, "link", "set", "lo", "up"])
    except BaseException:
        line.stop()
        raise
    return line


def leftover_namespaces() -> list[str]:
    """Namespaces named like ours (gradq-sw, gradq-w<K>, gradq-a<K>) that exist now."""
    listed = _run(["ip", "netns", "list"]).stdout.splitlines()
    names = [line.split()[0] for line in listed if line.strip()]
    return sorted(name for name in names if _OURS.match(name))


def namespace_pids(name: str) -> list[int]:
    """Processes running in namespace ``name`` (none when it does not exist)."""
    return [int(pid) for pid in _run(["ip", "netns", "pids", name], check=False).stdout.split()]


def remove_namespaces(names: Sequence[str]) -> list[str]:
    """Kill the processes inside each of ``names`` (ours only) and delete it; returns those deleted."""
    existing = set(leftover_namespaces())
    removed = []
    for name in names:
        if not _OURS.match(name) or name not in existing:
            continue
        for pid in namespace_pids(name):
            _run(["kill", "-KILL", str(pid)], check=False)
        _run(["ip", "netns", "del", name], check=False)
        removed.append(name)
    return removed


def read_counters(device: str) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of ``device`` in the caller's namespace: every byte on the wire, headers included."""
    statistics = Path("/sys/class/net") / device / "statistics"
    return int((statistics / "tx_bytes").read_text()), int((statistics / "rx_bytes").read_text())
