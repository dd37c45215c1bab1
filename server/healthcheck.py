"""`python -m gradq.server.healthcheck [host:port] [--ca PEM]`: exit 0 when the aggregator reports SERVING.

For container health probes: asks the standard gRPC health service (no token
needed). Inside the aggregator's container it needs no arguments: it reads the
same environment as `gradq serve`, GRADQ_PORT for the port (under GRADQ_SHARDS
every shard's: GRADQ_SHARD_PORTS, else consecutive ports from GRADQ_PORT; all
must serve) and, when
GRADQ_TLS_CERT says the aggregator serves TLS, GRADQ_TLS_CA for the CA that
signed that certificate (GRADQ_TLS_CLIENT_CERT and GRADQ_TLS_CLIENT_KEY for a
client certificate under mutual TLS).
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gradq.proto.address import describe_no_answer, probe_address, split_address
from gradq.server.env import HEALTHCHECK_ENVIRONMENT, flag_type, read_variable

__all__ = ["is_serving", "main"]

# A probe's deadline: a container health check must answer well within its own timeout.
_TIMEOUT_S = 2.0
# How the check's TLS settings are named in what it says to change.
_CA = "--ca PEM (GRADQ_TLS_CA)"
_CLIENT_PAIR = "--cert and --key (GRADQ_TLS_CLIENT_CERT, GRADQ_TLS_CLIENT_KEY)"


def is_serving(
    address: str,
    timeout_s: float = _TIMEOUT_S,
    ca: bytes | None = None,
    certificate_chain: bytes | None = None,
    private_key: bytes | None = None,
) -> bool:
    """True when ``address`` answers the health check with SERVING within ``timeout_s``.

    Args:
        address: host:port of the aggregator.
        timeout_s: deadline of the check.
        ca: PEM CA of the aggregator's certificate: check over TLS; None checks plaintext.
        certificate_chain, private_key: PEM client certificate and key, for mutual TLS.
    """
    return _health(address, timeout_s, ca, certificate_chain, private_key) == health_pb2.HealthCheckResponse.SERVING


def _health(
    address: str, timeout_s: float, ca: bytes | None, certificate_chain: bytes | None, private_key: bytes | None
) -> int | None:
    """The status the health service answers, or None when the call failed."""
    if ca is None:
        channel = grpc.insecure_channel(address)
    else:
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, private_key, certificate_chain))
    with channel:
        try:
            return int(
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s).status
            )
        except grpc.RpcError:
            return None


def _why_no_answer(address: str, over_tls: bool) -> str:
    """What a failed check most likely means, in flags to pass; reached only when the call itself failed."""
    reach = probe_address(address, _TIMEOUT_S)
    return describe_no_answer(address, reach, over_tls, _TIMEOUT_S, _CA, _CLIENT_PAIR)


def main(argv: list[str] | None = None) -> int:
    """Check the address; exit status 0 if serving, 1 if not, 2 if the TLS settings are incomplete."""
    parser = argparse.ArgumentParser(
        prog="python -m gradq.server.healthcheck",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    try:
        port, serves_tls = read_variable(None, "GRADQ_PORT"), read_variable(None, "GRADQ_TLS_CERT")
        shards, shard_ports = read_variable(None, "GRADQ_SHARDS"), read_variable(None, "GRADQ_SHARD_PORTS")
        files = {name: read_variable(None, name) for name in HEALTHCHECK_ENVIRONMENT}
    except ValueError as error:
        parser.error(str(error))
    first = 50051 if port is None else port
    ports = shard_ports or range(first, first + (shards or 1))
    parser.add_argument(
        "address",
        nargs="?",
        help="host:port of the aggregator (default localhost:$GRADQ_PORT, else localhost:50051; under GRADQ_SHARDS "
        "every shard's port)",
    )
    for flag, env in (("--ca", "GRADQ_TLS_CA"), ("--cert", "GRADQ_TLS_CLIENT_CERT"), ("--key", "GRADQ_TLS_CLIENT_KEY")):
        parser.add_argument(
            flag, type=flag_type(env), default=files[env], help=f"{HEALTHCHECK_ENVIRONMENT[env]} [env {env}]"
        )
    args = parser.parse_args(argv)
    try:
        if args.address:
            split_address(args.address)
    except ValueError as error:
        parser.error(f"address={args.address!r} is invalid; {error}")
    if args.ca is None and serves_tls:
        parser.error(
            f"GRADQ_TLS_CERT={str(serves_tls)!r} says the aggregator serves TLS, but no CA is given; expected --ca PEM "
            "or GRADQ_TLS_CA=PEM, the CA that signed that certificate"
        )
    try:
        ca, cert, key = (path.read_bytes() if path else None for path in (args.ca, args.cert, args.key))
    except OSError as error:
        parser.error(str(error))
    addresses = [args.address] if args.address else [f"localhost:{shard_port}" for shard_port in ports]
    serving = True
    for address in addresses:
        status = _health(address, _TIMEOUT_S, ca, cert, key)
        serving &= status == health_pb2.HealthCheckResponse.SERVING
        verdict = "SERVING" if status == health_pb2.HealthCheckResponse.SERVING else "not serving"
        why = "" if status is not None else f"; {_why_no_answer(address, ca is not None)}"
        print(f"{address}: {verdict}{' (TLS)' if ca else ''}{why}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
