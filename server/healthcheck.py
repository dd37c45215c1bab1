"""`python -m gradq.server.healthcheck [host:port] [--ca PEM]`: exit 0 when the aggregator reports SERVING.

For container health probes; asks the standard gRPC health service, over TLS
when given the CA that signed the aggregator's certificate (no token needed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["is_serving", "main"]


def is_serving(address: str, timeout_s: float = 2.0, ca: bytes | None = None) -> bool:
    """True when ``address`` answers the health check with SERVING within ``timeout_s``."""
    if ca is None:
        channel = grpc.insecure_channel(address)
    else:
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(ca))
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    """Check the address (default ``localhost:50051``); exit status 0 if serving, 1 if not."""
    parser = argparse.ArgumentParser(prog="python -m gradq.server.healthcheck", description=__doc__)
    parser.add_argument("address", nargs="?", default="localhost:50051", help="host:port of the aggregator")
    parser.add_argument("--ca", type=Path, help="PEM CA of the aggregator's certificate: check over TLS")
    args = parser.parse_args(argv)
    serving = is_serving(args.address, ca=args.ca.read_bytes() if args.ca else None)
    print(f"{args.address}: {'SERVING' if serving else 'not serving'}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
