"""`gradq worker`: one training rank in a multi-host cluster (the Compose workers).

Ranks need no configuration: every worker resolves the peers' DNS name (a
Compose service resolves to all its replicas), waits until all ``--world-size``
addresses are there, and takes its place in their sorted order; the lowest
address hosts the gloo rendezvous.
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from gradq.client.security import ChannelSecurity
from gradq.client.training import TrainSpec, train_digits
from gradq.qcore import QuantConfig, Scheme

__all__ = ["main", "discover_rank"]


def discover_rank(peers: str, world_size: int, timeout_s: float) -> tuple[int, str]:
    """(this host's rank, the rank-0 address) from the addresses ``peers`` resolves to.

    Raises:
        RuntimeError: fewer than ``world_size`` peers appeared within ``timeout_s``,
            or this host is not among them.
    """
    mine = socket.gethostbyname(socket.gethostname())
    deadline = time.monotonic() + timeout_s
    found: list[str] = []
    while time.monotonic() < deadline:
        try:
            found = sorted(
                {str(info[4][0]) for info in socket.getaddrinfo(peers, None, socket.AF_INET)}, key=ipaddress.ip_address
            )
        except socket.gaierror:
            found = []
        if len(found) >= world_size:
            break
        time.sleep(0.5)
    if len(found) != world_size or mine not in found:
        raise RuntimeError(
            f"--peers={peers!r} resolved to {found} after {timeout_s:g} s; expected {world_size} addresses "
            f"including this host's {mine}"
        )
    return found.index(mine), found[0]


def main(argv: Sequence[str] | None = None) -> int:
    """Train as one rank; exit status 0 when the test accuracy reaches ``--min-accuracy``."""
    parser = argparse.ArgumentParser(
        prog="gradq worker",
        description="Train the digits MLP as one DDP rank through a gradq aggregator (one process per host).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--aggregator", action="append", required=True, help="host:port of a shard (repeatable)")
    parser.add_argument("--world-size", type=int, required=True, help="ranks in the job")
    parser.add_argument("--peers", required=True, help="DNS name resolving to every worker's address")
    parser.add_argument("--master-port", type=int, default=29500, help="gloo rendezvous port on rank 0")
    parser.add_argument("--peer-timeout", type=float, default=120.0, help="seconds to wait for all peers")
    parser.add_argument("--bits", type=int, default=4, help="bits per gradient element, 1..8")
    parser.add_argument("--scheme", default="per_channel_affine", help="quantization scheme")
    parser.add_argument(
        "--error-feedback",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="carry quantization error into the next step",
    )
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training split")
    parser.add_argument("--min-accuracy", type=float, default=90.0, help="exit 0 only at or above this accuracy")
    parser.add_argument("--job-id", default="compose-digits", help="aggregator job shared by all ranks")
    parser.add_argument("--tls-ca", type=Path, help="PEM CA of the aggregator's certificate: talk TLS")
    parser.add_argument("--tls-cert", type=Path, help="this worker's PEM certificate, for mutual TLS")
    parser.add_argument("--tls-key", type=Path, help="its PEM key")
    parser.add_argument("--token-file", type=Path, help="file holding the bearer token to send")
    args = parser.parse_args(argv)
    try:
        config = QuantConfig(scheme=Scheme.parse(args.scheme), bits=args.bits)
        token = args.token_file.read_text().strip() if args.token_file else None
        security = ChannelSecurity.from_files(args.tls_ca, args.tls_cert, args.tls_key, token)
        rank, master = discover_rank(args.peers, args.world_size, args.peer_timeout)
    except (ValueError, RuntimeError, OSError) as error:
        parser.error(str(error))
    print(
        f"rank {rank} of {args.world_size}; rendezvous {master}:{args.master_port}; "
        f"aggregator {', '.join(args.aggregator)}",
        flush=True,
    )
    spec = TrainSpec(
        world_size=args.world_size,
        init_method=f"tcp://{master}:{args.master_port}",
        aggregators=tuple(args.aggregator),
        config=config,
        error_feedback=args.error_feedback,
        epochs=args.epochs,
        progress=True,
        job_id=args.job_id,
        connect_timeout_s=60.0,
        security=security,
    )
    result = train_digits(rank, spec)
    passed = result.accuracy >= args.min_accuracy
    print(
        f"rank {rank}: accuracy {result.accuracy:.1f}% after {result.steps} steps, "
        f"{result.bytes_sent / max(result.steps, 1):,.0f} bytes sent per step "
        f"({result.bytes_sent / max(result.fp32_bytes, 1):.3f}x fp32), mode {result.mode}",
        flush=True,
    )
    print(
        f"verdict: {'PASS' if passed else 'FAIL'} (accuracy {result.accuracy:.1f}% vs --min-accuracy "
        f"{args.min_accuracy:.1f}%)",
        flush=True,
    )
    return 0 if passed else 1
