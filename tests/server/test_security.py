"""TLS, mutual TLS and bearer tokens on a real aggregator: who gets in, and proof that outsiders add nothing."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from certificates import Pem, issue, make_ca
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gradq.client import AggregationError, ChannelSecurity, WorkerClient
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.qcore import QuantConfig, Scheme
from gradq.server.app import AggregatorServer, ServerOptions, TlsFiles
from gradq.server.auth import TokenScope, TokenTable, bind_scope, check_scope
from gradq.server.errors import PermissionDeniedError
from gradq.server.policy import RoundPolicy

EXACT = QuantConfig(scheme=Scheme.FLOAT32)
TOKENS = {
    "rank-zero-token-0000": TokenScope(rank=0),
    "rank-one-token-11111": TokenScope(rank=1),
    "any-rank-token-22222": TokenScope(),
}


@dataclass(frozen=True)
class Pki:
    ca: Pem
    server: Pem
    client: Pem
    stranger_ca: Pem
    stranger_client: Pem


@pytest.fixture(scope="module")
def pki() -> Pki:
    ca, ca_key, ca_certificate = make_ca()
    stranger_ca, stranger_key, stranger_certificate = make_ca("someone else's CA")
    return Pki(
        ca=ca,
        server=issue(ca_key, ca_certificate, "localhost", server=True),
        client=issue(ca_key, ca_certificate, "worker", server=False),
        stranger_ca=stranger_ca,
        stranger_client=issue(stranger_key, stranger_certificate, "intruder", server=False),
    )


Serve = Callable[..., str]


@pytest.fixture
def serve() -> Iterator[Serve]:
    servers: list[AggregatorServer] = []

    def start(tls: TlsFiles | None = None, tokens: TokenTable | None = None) -> str:
        server = AggregatorServer(
            RoundPolicy(round_timeout_s=3.0, return_scheme=Scheme.FLOAT32),
            ServerOptions("127.0.0.1:0", grace_s=0.5, tls=tls, tokens=tokens),
        )
        server.start()
        servers.append(server)
        return f"localhost:{server.port}"

    yield start
    for server in servers:
        server.stop()


def exact_mean(address: str, securities: list[ChannelSecurity], job: str = "job") -> list[np.ndarray]:
    """Ranks 0..n-1 push k * arange(6); returns what each got back."""
    results: list[np.ndarray] = [np.empty(0)] * len(securities)
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            with WorkerClient(address, job, rank, len(securities), EXACT, timeout_s=5, security=securities[rank]) as c:
                results[rank] = c.push_pull(0, 0, np.arange(6, dtype=np.float32) * (rank + 1))
        except BaseException as error:  # asserted by the caller
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(securities))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    if errors:
        raise errors[0]
    return results


def test_tls_round_works_and_plaintext_or_untrusted_clients_are_refused(serve: Serve, pki: Pki) -> None:
    address = serve(tls=TlsFiles(pki.server.certificate, pki.server.key))
    trusted = ChannelSecurity(root_certificates=pki.ca.certificate)
    for result in exact_mean(address, [trusted, trusted]):
        np.testing.assert_array_equal(result, np.arange(6, dtype=np.float32) * 1.5)
    # A plaintext client is told what the aggregator speaks; an untrusted CA gets no answer it could trust.
    plaintext = ChannelSecurity()
    with pytest.raises(
        AggregationError, match=r"FAILED_PRECONDITION: the aggregator at \S+ speaks TLS; set GRADQ_TLS_CA"
    ):
        WorkerClient(address, "other", 0, 1, timeout_s=1, security=plaintext).join()
    untrusted = ChannelSecurity(root_certificates=pki.stranger_ca.certificate)
    with pytest.raises(AggregationError, match=r"UNAVAILABLE|DEADLINE_EXCEEDED"):
        WorkerClient(address, "other", 0, 1, timeout_s=1, security=untrusted).join()


def test_mutual_tls_requires_a_client_certificate_from_the_configured_ca(serve: Serve, pki: Pki) -> None:
    address = serve(tls=TlsFiles(pki.server.certificate, pki.server.key, client_ca=pki.ca.certificate))
    member = ChannelSecurity(pki.ca.certificate, pki.client.certificate, pki.client.key)
    for result in exact_mean(address, [member, member]):
        np.testing.assert_array_equal(result, np.arange(6, dtype=np.float32) * 1.5)
    no_certificate = ChannelSecurity(root_certificates=pki.ca.certificate)
    foreign = ChannelSecurity(pki.ca.certificate, pki.stranger_client.certificate, pki.stranger_client.key)
    for outsider in (no_certificate, foreign):
        with pytest.raises(AggregationError, match=r"UNAVAILABLE|DEADLINE_EXCEEDED"):
            WorkerClient(address, "other", 0, 1, timeout_s=1, security=outsider).join()


def test_tokens_gate_every_call_but_health(serve: Serve) -> None:
    address = serve(tokens=TokenTable(TOKENS))
    with grpc.insecure_channel(address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    for token in (None, "not-a-valid-token-at-all", "rank-zero-token-000"):
        with pytest.raises(AggregationError, match=r"UNAUTHENTICATED: missing or invalid token") as raised:
            WorkerClient(address, "job", 0, 2, timeout_s=5, security=ChannelSecurity(token=token)).join()
        assert "rank-zero-token" not in str(raised.value)  # never echo secrets


def test_a_call_without_a_valid_token_is_refused_at_once_though_it_sends_nothing(serve: Serve) -> None:
    # Every method, whatever its kind, opened as a stream that sends no message and never half-closes:
    # a refusal that waited for a request would hold the call (and one of gRPC's call slots) until its deadline.
    address = serve(tokens=TokenTable(TOKENS))
    service = pb.DESCRIPTOR.services_by_name["Aggregator"]
    assert {"PushPullStream", "PutState", "Watch"} <= {method.name for method in service.methods}
    silent = threading.Event()

    def nothing() -> Iterator[bytes]:
        silent.wait()  # until the test ends
        yield from ()

    try:
        with grpc.insecure_channel(address) as channel:
            for method in service.methods:
                for metadata in (None, [("authorization", "Bearer not-a-valid-token-at-all")]):
                    started = time.monotonic()
                    call = channel.stream_stream(f"/{service.full_name}/{method.name}")
                    with pytest.raises(grpc.RpcError) as raised:
                        next(call(nothing(), timeout=10, metadata=metadata))
                    elapsed = time.monotonic() - started
                    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method.name, metadata)
                    assert elapsed < 1.0, f"{method.name} was refused after {elapsed:.2f} s"
    finally:
        silent.set()


def test_wrong_or_borrowed_credentials_contribute_nothing(serve: Serve) -> None:
    address = serve(tokens=TokenTable(TOKENS))
    rank_zero = ChannelSecurity(token="rank-zero-token-0000")
    rank_one = ChannelSecurity(token="rank-one-token-11111")
    # Rank 0's token replayed as rank 1 is refused before anything is counted ...
    with pytest.raises(AggregationError, match=r"PERMISSION_DENIED: this token is bound to any job, rank 0; .*rank=1"):
        WorkerClient(address, "job", 1, 2, EXACT, timeout_s=5, security=rank_zero).join()
    impostor = WorkerClient(address, "job", 1, 2, EXACT, timeout_s=5, security=ChannelSecurity(token="x" * 20))
    with pytest.raises(AggregationError, match="UNAUTHENTICATED"):
        impostor.push_pull(0, 0, np.full(6, 1000.0, np.float32))
    # ... so the real round is the exact mean of the real ranks' values.
    for result in exact_mean(address, [rank_zero, rank_one]):
        np.testing.assert_array_equal(result, np.arange(6, dtype=np.float32) * 1.5)
    unbound = ChannelSecurity(token="any-rank-token-22222")
    for result in exact_mean(address, [unbound, unbound], job="open"):
        np.testing.assert_array_equal(result, np.arange(6, dtype=np.float32) * 1.5)


def test_token_file_format_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# comment\nabcdefghijklmnop 0\nshort\n")
    with pytest.raises(ValueError, match=r"tokens:3: token is 5 characters; expected at least 16"):
        TokenTable.from_file(path)
    path.write_text("abcdefghijklmnop zero\n")
    with pytest.raises(ValueError, match=r"tokens:1: 'zero' is invalid; expected 'TOKEN', 'TOKEN RANK'"):
        TokenTable.from_file(path)
    path.write_text("abcdefghijklmnop 3  # rank three\nqrstuvwxyzabcdef\n")
    assert TokenTable.from_file(path).tokens == {
        "abcdefghijklmnop": TokenScope(rank=3),
        "qrstuvwxyzabcdef": TokenScope(),
    }


def test_token_file_scopes_tokens_to_a_job_a_prefix_and_a_rank(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("abcdefghijklmnop job=resnet rank=1\nqrstuvwxyzabcdef job=team-*\nponmlkjihgfedcba job=*\n")
    tokens = TokenTable.from_file(path).tokens
    assert tokens == {
        "abcdefghijklmnop": TokenScope("resnet", 1),
        "qrstuvwxyzabcdef": TokenScope("team-*"),
        "ponmlkjihgfedcba": TokenScope(),
    }
    assert tokens["abcdefghijklmnop"].allows("resnet", 1) and not tokens["abcdefghijklmnop"].allows("resnet-2", 1)
    assert tokens["qrstuvwxyzabcdef"].allows("team-b", 7) and not tokens["qrstuvwxyzabcdef"].allows("other", 0)
    path.write_text("abcdefghijklmnop rank=1\n")
    with pytest.raises(ValueError, match=r"tokens:1: rank= without job="):
        TokenTable.from_file(path)


def test_the_scope_is_bound_around_streaming_handlers_too() -> None:
    seen: list[str] = []

    async def stream(request: object, context: object) -> AsyncIterator[str]:
        try:
            check_scope("other", 0)
        except PermissionDeniedError as error:
            seen.append(str(error))
        yield "done"

    async def drain() -> list[str]:
        handler = bind_scope(grpc.unary_stream_rpc_method_handler(stream), TokenScope("mine", 0))
        return [item async for item in handler.unary_stream(None, None)]

    assert asyncio.run(drain()) == ["done"]
    assert seen == ["this token is bound to job 'mine', rank 0; the request says job_id='other', rank=0"]
    check_scope("other", 0)  # outside the call no scope is bound


def test_unscoped_tokens_and_plaintext_off_loopback_are_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    server = AggregatorServer(RoundPolicy(), ServerOptions("0.0.0.0:0", grace_s=0.1, tokens=TokenTable(TOKENS)))
    with caplog.at_level(logging.WARNING, logger="gradq.server.app"):
        server.start()
        server.stop()
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    bound = f"serving plaintext on 0.0.0.0:{server.port}, which is not a loopback address"  # the port bound, not 0
    assert server.port != 0 and any(bound in text for text in warnings)
    assert any("3 token(s) in the token file are not scoped to a job" in text for text in warnings)
