"""`python -m gradq.server.healthcheck` against real aggregators: the verdict, and why when it is not SERVING."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from certificates import issue, make_ca

from gradq.proto.transport import speaks_tls
from gradq.server.app import AggregatorServer, ServerOptions, TlsFiles
from gradq.server.policy import RoundPolicy
from gradq.server.process import free_port

Serve = Callable[[TlsFiles | None], int]


@pytest.fixture(scope="module")
def pem_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, a server certificate and key for localhost/127.0.0.1 signed by it, as files."""
    folder = tmp_path_factory.mktemp("pki")
    ca, ca_key, ca_certificate = make_ca()
    server = issue(ca_key, ca_certificate, "localhost", server=True)
    files = {"ca": ca.certificate, "cert": server.certificate, "key": server.key}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return {name: folder / name for name in files}


@pytest.fixture
def serve() -> Iterator[Serve]:
    servers: list[AggregatorServer] = []

    def start(tls: TlsFiles | None) -> int:
        server = AggregatorServer(RoundPolicy(), ServerOptions("127.0.0.1:0", grace_s=0.1, tls=tls))
        server.start()
        servers.append(server)
        return server.port

    yield start
    for server in servers:
        server.stop()


def check(*args: str) -> subprocess.CompletedProcess[str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("GRADQ_")}
    return subprocess.run(
        [sys.executable, "-m", "gradq.server.healthcheck", *args], capture_output=True, text=True, env=env, timeout=60
    )


def tls_files(pem_files: dict[str, Path]) -> TlsFiles:
    return TlsFiles.from_paths(pem_files["cert"], pem_files["key"])


def test_serving_over_plaintext_and_tls(serve: Serve, pem_files: dict[str, Path]) -> None:
    plain, secure = serve(None), serve(tls_files(pem_files))
    completed = check(f"127.0.0.1:{plain}")
    assert (completed.returncode, completed.stdout) == (0, f"127.0.0.1:{plain}: SERVING\n")
    completed = check(f"localhost:{secure}", "--ca", str(pem_files["ca"]))
    assert (completed.returncode, completed.stdout) == (0, f"localhost:{secure}: SERVING (TLS)\n")


def test_a_plaintext_probe_of_a_tls_aggregator_says_tls_is_the_cause(serve: Serve, pem_files: dict[str, Path]) -> None:
    port = serve(tls_files(pem_files))
    completed = check(f"127.0.0.1:{port}")
    assert completed.returncode == 1
    assert completed.stdout.splitlines() == [
        f"127.0.0.1:{port}: not serving; the aggregator at 127.0.0.1:{port} speaks TLS; set --ca PEM (GRADQ_TLS_CA) "
        "to the CA that signed its certificate (and --cert and --key (GRADQ_TLS_CLIENT_CERT, GRADQ_TLS_CLIENT_KEY) "
        "under mutual TLS)"
    ]


def test_a_tls_probe_of_a_plaintext_aggregator_says_so(serve: Serve, pem_files: dict[str, Path]) -> None:
    port = serve(None)
    completed = check(f"localhost:{port}", "--ca", str(pem_files["ca"]))
    assert completed.returncode == 1
    assert completed.stdout.splitlines() == [
        f"localhost:{port}: not serving (TLS); the aggregator at localhost:{port} speaks plaintext, not TLS; leave "
        "--ca PEM (GRADQ_TLS_CA) unset"
    ]


def test_nothing_listening_is_named() -> None:
    port = free_port()
    completed = check(f"127.0.0.1:{port}")
    assert completed.returncode == 1
    assert completed.stdout.splitlines() == [
        f"127.0.0.1:{port}: not serving; connection refused at 127.0.0.1:{port}: is `gradq serve` running there, on "
        "that port?"
    ]


def test_speaks_tls_tells_tls_from_plaintext_from_nothing(serve: Serve, pem_files: dict[str, Path]) -> None:
    mutual = TlsFiles.from_paths(pem_files["cert"], pem_files["key"], pem_files["ca"])
    assert speaks_tls(f"127.0.0.1:{serve(tls_files(pem_files))}") is True
    assert speaks_tls(f"127.0.0.1:{serve(mutual)}") is True  # it asks for a client certificate: still TLS
    assert speaks_tls(f"127.0.0.1:{serve(None)}") is False
    assert speaks_tls(f"127.0.0.1:{free_port()}") is None
    assert speaks_tls("unix:/tmp/socket") is None
