"""`python -m gradq.server.healthcheck [host:port]`: exit 0 when the aggregator reports SERVING.

For container health probes; asks the standard gRPC health service.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["is_serving", "main"]


def is_serving(address: str, timeout_s: float = 2.0) -> bool:
    """True when ``address`` answers the health check with SERVING within ``timeout_s``."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    """Check ``argv[0]`` (default ``localhost:50051``); exit status 0 if serving, 1 if not."""
    args = sys.argv[1:] if argv is None else argv
    address = args[0] if args else "localhost:50051"
    serving = is_serving(address)
    print(f"{address}: {'SERVING' if serving else 'not serving'}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
