"""wait_for_aggregators against real aggregators: it returns once they serve, else names the address and the cause."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

from gradq.client import AggregationError, ChannelSecurity
from gradq.client.apps.reachability import wait_for_aggregators
from gradq.server.app import AggregatorServer, ServerOptions, TlsFiles
from gradq.server.policy import RoundPolicy
from gradq.server.process import free_port

Serve = Callable[..., str]
Tls = tuple[TlsFiles, bytes]


def certificates() -> ModuleType:
    """tests/server/certificates.py: the throwaway CA the server's TLS tests use."""
    spec = importlib.util.spec_from_file_location(
        "certificates", Path(__file__).parents[1] / "server" / "certificates.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("certificates", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tls() -> Tls:
    """A server certificate for localhost/127.0.0.1 and the CA that signed it."""
    pki = certificates()
    ca, ca_key, ca_certificate = pki.make_ca()
    server = pki.issue(ca_key, ca_certificate, "localhost", server=True)
    return TlsFiles(server.certificate, server.key), ca.certificate


@pytest.fixture
def serve() -> Iterator[Serve]:
    servers: list[AggregatorServer] = []

    def start(tls: TlsFiles | None = None) -> str:
        server = AggregatorServer(RoundPolicy(), ServerOptions("127.0.0.1:0", grace_s=0.1, tls=tls))
        server.start()
        servers.append(server)
        return f"127.0.0.1:{server.port}"

    yield start
    for server in servers:
        server.stop()


def test_returns_once_every_shard_serves(serve: Serve) -> None:
    wait_for_aggregators([serve(), serve()], timeout_s=5.0)


def test_nothing_listening_names_the_address_and_how_long_it_was_tried() -> None:
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(AggregationError) as raised:
        wait_for_aggregators([address], timeout_s=0.5)
    assert raised.value.address == address
    assert str(raised.value) == (
        f"aggregator {address}: DEADLINE_EXCEEDED: connection refused at {address}: is `gradq serve` running there, "
        "on that port?"
    )


def test_plaintext_to_a_tls_aggregator_says_tls_is_the_likely_cause(serve: Serve, tls: Tls) -> None:
    address = serve(tls[0])
    with pytest.raises(AggregationError, match=r"speaks TLS; set GRADQ_TLS_CA to the CA that signed"):
        wait_for_aggregators([address], timeout_s=0.5)
    wait_for_aggregators([f"localhost:{address.rsplit(':', 1)[1]}"], 5.0, ChannelSecurity(root_certificates=tls[1]))


def test_tls_to_a_plaintext_aggregator_says_so(serve: Serve, tls: Tls) -> None:
    with pytest.raises(AggregationError, match="speaks plaintext, not TLS; leave GRADQ_TLS_CA unset"):
        wait_for_aggregators([serve()], timeout_s=0.5, security=ChannelSecurity(root_certificates=tls[1]))
