"""Bearer-token authentication: a server interceptor that refuses a call before any work is done.

A token may be bound to a rank; the servicer then refuses requests in which
that token claims another rank (``check_rank``). Health and reflection stay
open so probes need no token.
"""

from __future__ import annotations

import contextvars
import hmac
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gradq.server.errors import PermissionDeniedError

__all__ = ["TokenTable", "TokenAuthInterceptor", "check_rank", "OPEN_METHOD_PREFIXES"]

# Methods anyone may call: health probes and grpcurl's service listing.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

# The rank the current call's token is bound to (None: any rank). Set for
# every authenticated call, so a pooled handler thread never sees a stale one.
_bound_rank: contextvars.ContextVar[int | None] = contextvars.ContextVar("gradq_bound_rank", default=None)


@dataclass(frozen=True, slots=True)
class TokenTable:
    """Accepted tokens, each optionally bound to one rank."""

    tokens: Mapping[str, int | None]

    @classmethod
    def from_file(cls, path: Path) -> TokenTable:
        """Read ``TOKEN`` or ``TOKEN RANK`` per line; blank lines and ``#`` comments are skipped.

        Raises:
            ValueError: naming the file, line and what was expected.
        """
        tokens: dict[str, int | None] = {}
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) > 2 or (len(fields) == 2 and not fields[1].isdigit()):
                raise ValueError(f"{path}:{number}: expected 'TOKEN' or 'TOKEN RANK' (RANK an integer >= 0)")
            if len(fields[0]) < 16:
                raise ValueError(f"{path}:{number}: token is {len(fields[0])} characters; expected at least 16")
            tokens[fields[0]] = int(fields[1]) if len(fields) == 2 else None
        if not tokens:
            raise ValueError(f"{path}: no tokens; expected at least one 'TOKEN [RANK]' line")
        return cls(tokens)

    def lookup(self, presented: str) -> tuple[bool, int | None]:
        """(accepted, bound rank). Compares against every token in constant time per token."""
        accepted, bound = False, None
        for token, rank in self.tokens.items():
            if hmac.compare_digest(token.encode(), presented.encode()):
                accepted, bound = True, rank
        return accepted, bound


def check_rank(rank: int) -> None:
    """Refuse a request whose rank differs from the one its token is bound to.

    Raises:
        PermissionDeniedError: the token belongs to another rank.
    """
    bound = _bound_rank.get()
    if bound is not None and bound != rank:
        raise PermissionDeniedError(f"this token is bound to rank {bound}; the request says rank={rank}")


def _bearer(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value.removeprefix("Bearer ")
    return ""


def _deny(_request: Any, context: grpc.ServicerContext) -> None:
    context.abort(
        grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token; expected metadata 'authorization: Bearer <token>'"
    )


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Checks ``authorization: Bearer <token>`` on every call except health and reflection."""

    def __init__(self, table: TokenTable) -> None:
        self.table = table

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method  # type: ignore[attr-defined]
        if method.startswith(OPEN_METHOD_PREFIXES):
            return continuation(handler_call_details)
        accepted, rank = self.table.lookup(_bearer(handler_call_details.invocation_metadata))  # type: ignore[attr-defined]
        if not accepted:
            return grpc.unary_unary_rpc_method_handler(_deny)
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        behaviour = handler.unary_unary

        def bound(request: Any, context: grpc.ServicerContext) -> Any:
            reset = _bound_rank.set(rank)
            try:
                return behaviour(request, context)
            finally:
                _bound_rank.reset(reset)

        return grpc.unary_unary_rpc_method_handler(
            bound, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
