"""Bearer-token authentication: a server interceptor that refuses a call before any work is done.

A token may be scoped to a job (or a job-id prefix) and to a rank; the
servicer refuses requests in which a token acts outside its scope
(``check_scope``). Health and reflection stay open so probes need no token.
"""

from __future__ import annotations

import contextvars
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gradq.server.errors import PermissionDeniedError

__all__ = [
    "TokenScope",
    "TokenTable",
    "TokenAuthInterceptor",
    "bind_scope",
    "check_scope",
    "scoped_rank",
    "OPEN_METHOD_PREFIXES",
]

# Methods anyone may call: health probes and grpcurl's service listing.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

_LINE_FORMS = "'TOKEN', 'TOKEN RANK' (any job), or 'TOKEN job=JOB [rank=RANK]' (JOB may end in '*', a prefix)"


@dataclass(frozen=True, slots=True)
class TokenScope:
    """What one token may act as: a job (exact, or a prefix ending in ``*``; None: any) and a rank (None: any)."""

    job: str | None = None
    rank: int | None = None

    def allows(self, job_id: str, rank: int) -> bool:
        """True when a request for (``job_id``, ``rank``) lies inside this scope."""
        if self.rank is not None and rank != self.rank:
            return False
        if self.job is None:
            return True
        if self.job.endswith("*"):
            return job_id.startswith(self.job[:-1])
        return job_id == self.job

    def describe(self) -> str:
        """``job 'x*', rank 1`` for messages."""
        job = (
            "any job"
            if self.job is None
            else f"job {self.job!r}"
            if not self.job.endswith("*")
            else (f"jobs starting with {self.job[:-1]!r}")
        )
        return job + ("" if self.rank is None else f", rank {self.rank}")


# The scope of the current call's token (None: no token table). Set for every
# authenticated call; asyncio.to_thread carries it into the executor.
_scope: contextvars.ContextVar[TokenScope | None] = contextvars.ContextVar("gradq_token_scope", default=None)


def _parse_line(path: Path, number: int, fields: list[str]) -> tuple[str, TokenScope]:
    token, rest = fields[0], fields[1:]
    where = f"{path}:{number}"
    if len(token) < 16:
        raise ValueError(f"{where}: token is {len(token)} characters; expected at least 16")
    if len(rest) == 1 and rest[0].isdigit():
        return token, TokenScope(rank=int(rest[0]))  # the original form: bound to a rank, any job
    settings: dict[str, str] = {}
    for item in rest:
        key, sep, value = item.partition("=")
        if not sep or key not in ("job", "rank") or not value or key in settings:
            raise ValueError(f"{where}: {item!r} is invalid; expected {_LINE_FORMS}")
        settings[key] = value
    if "rank" in settings and not settings["rank"].isdigit():
        raise ValueError(f"{where}: rank={settings['rank']!r} is invalid; expected an integer >= 0")
    if "rank" in settings and "job" not in settings:
        raise ValueError(f"{where}: rank= without job=; expected {_LINE_FORMS}")
    job = settings.get("job")
    return token, TokenScope(None if job == "*" else job, int(settings["rank"]) if "rank" in settings else None)


@dataclass(frozen=True, slots=True)
class TokenTable:
    """Accepted tokens, each with its scope."""

    tokens: Mapping[str, TokenScope]

    @classmethod
    def from_file(cls, path: Path) -> TokenTable:
        """Read one token per line (see ``_LINE_FORMS``); blank lines and ``#`` comments are skipped.

        Raises:
            ValueError: naming the file, line and what was expected.
        """
        tokens: dict[str, TokenScope] = {}
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            fields = line.split("#", 1)[0].split()
            if fields:
                token, scope = _parse_line(path, number, fields)
                tokens[token] = scope
        if not tokens:
            raise ValueError(f"{path}: no tokens; expected at least one line: {_LINE_FORMS}")
        return cls(tokens)

    def unscoped(self) -> int:
        """How many tokens may act for any job (the server warns about them at start)."""
        return sum(scope.job is None for scope in self.tokens.values())

    def lookup(self, presented: str) -> TokenScope | None:
        """The presented token's scope, or None if it is not accepted. Constant time per token."""
        found = None
        for token, scope in self.tokens.items():
            if hmac.compare_digest(token.encode(), presented.encode()):
                found = scope
        return found


def scoped_rank(rank: int, any_rank: int) -> int:
    """``rank``, or the token's own rank when ``rank`` is ``any_rank`` (an elastic Join asking for any member id).

    A token bound to a rank thus joins as that member and no other; an unbound token lets the aggregator choose.
    """
    scope = _scope.get()
    return scope.rank if rank == any_rank and scope is not None and scope.rank is not None else rank


def check_scope(job_id: str, rank: int) -> None:
    """Refuse a request for a job or rank outside its token's scope.

    Raises:
        PermissionDeniedError: naming what the token is bound to and what the request says.
    """
    scope = _scope.get()
    if scope is not None and not scope.allows(job_id, rank):
        raise PermissionDeniedError(
            f"this token is bound to {scope.describe()}; the request says job_id={job_id[:64]!r}, rank={rank}"
        )


def _bearer(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value.removeprefix("Bearer ")
    return ""


async def _deny(_requests: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token; expected metadata 'authorization: Bearer <token>'"
    )


# The refusal of a call without a valid token, whatever its method. gRPC reads a unary request before it
# runs the handler, so a unary deny left a caller that sends nothing (any stream, or a unary method called
# as one) holding a call slot until its deadline; a handler that takes a request stream runs as soon as the
# call's headers arrive and reads nothing. gRPC's wire has no cardinality: every client sees the status.
_DENY_HANDLER = grpc.stream_stream_rpc_method_handler(_deny)


def _bound(behaviour: Callable[..., Awaitable[Any]], scope: TokenScope) -> Callable[..., Awaitable[Any]]:
    # Each call runs in its own asyncio task, with its own copy of the context variables.
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        reset = _scope.set(scope)
        try:
            return await behaviour(request, context)
        finally:
            _scope.reset(reset)

    return call


def _bound_stream(behaviour: Callable[..., AsyncIterator[Any]], scope: TokenScope) -> Callable[..., AsyncIterator[Any]]:
    # A streaming response is produced after the handler returns, so the scope stays set while it is.
    async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        reset = _scope.set(scope)
        try:
            async for item in behaviour(request, context):
                yield item
        finally:
            _scope.reset(reset)

    return call


def bind_scope(handler: grpc.RpcMethodHandler, scope: TokenScope) -> grpc.RpcMethodHandler:
    """``handler`` (a grpc.aio one) with ``scope`` bound around it, unary or streaming.

    Args:
        handler: the method's handler; its behaviour is a coroutine function,
            or for a streaming response an async generator function (a
            streaming handler that writes through ``context.write`` instead is
            not supported; health and reflection, the only ones, need no token).
        scope: the caller's token scope.

    Returns:
        A handler of the same kind.
    """
    codec = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_bound(handler.unary_unary, scope), **codec)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_bound(handler.stream_unary, scope), **codec)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_bound_stream(handler.unary_stream, scope), **codec)
    return grpc.stream_stream_rpc_method_handler(_bound_stream(handler.stream_stream, scope), **codec)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks ``authorization: Bearer <token>`` on every call except health and reflection."""

    def __init__(self, table: TokenTable) -> None:
        self.table = table

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method  # type: ignore[attr-defined]
        if method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        scope = self.table.lookup(_bearer(handler_call_details.invocation_metadata))  # type: ignore[attr-defined]
        if scope is None:
            return _DENY_HANDLER
        handler = await continuation(handler_call_details)
        return None if handler is None else bind_scope(handler, scope)
