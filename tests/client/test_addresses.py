"""Aggregator addresses: a bad form is refused before any dial, and a first contact that fails says why, as it is."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import grpc
import pytest
from test_apps_cli import gradq
from test_reachability import Serve, Tls, serve, tls  # noqa: F401  (fixtures: aggregators on port 0, a CA for TLS)

from gradq.client import AggregationError, ChannelSecurity, WorkerClient
from gradq.client.apps.reachability import wait_for_aggregators
from gradq.client.config import GradqConfig
from gradq.client.contact import UnreachableError
from gradq.client.env import hook_arguments_from_env
from gradq.proto.address import Answer, split_address
from gradq.server.process import free_port

# An address -> what the refusal says is wrong with it (after "is invalid; ").
BAD_ADDRESSES = [
    ("localhost", "expected host:port; 'localhost' has no port, e.g. localhost:50051"),
    ("localhost:99999", "expected host:port with a port in 1..65535; 'localhost:99999' has port '99999'"),
    ("localhost:0", "expected host:port with a port in 1..65535; 'localhost:0' has port '0'"),
    ("localhost:grpc", "expected host:port with a port in 1..65535; 'localhost:grpc' has port 'grpc'"),
    ("http://localhost:50051", "expected host:port without a scheme: drop 'http://' and give 'localhost:50051'"),
    ("grpc://aggregator:50051/", "expected host:port without a scheme: drop 'grpc://' and give 'aggregator:50051'"),
    ("local host:50051", "expected host:port without spaces; got 'local host:50051'"),
    ("::1:50051", "expected an IPv6 host in brackets, e.g. [::1]:50051; got '::1:50051'"),
    (":50051", "expected host:port with a host before ':50051', e.g. localhost:50051"),
]


@pytest.mark.parametrize(("address", "expected"), BAD_ADDRESSES)
def test_a_bad_address_is_refused_by_the_config_naming_the_argument_and_its_variable(
    address: str, expected: str
) -> None:
    with pytest.raises(ValueError) as raised:
        GradqConfig((address,))
    assert str(raised.value) == f"addresses={address!r} (GRADQ_AGGREGATORS) is invalid; {expected}"


@pytest.mark.parametrize(("address", "expected"), BAD_ADDRESSES)
def test_a_bad_address_is_refused_by_the_environment_naming_the_variable(address: str, expected: str) -> None:
    text = f"127.0.0.1:50051,{address}"
    with pytest.raises(ValueError) as raised:
        hook_arguments_from_env({"GRADQ_AGGREGATORS": text})
    assert str(raised.value) == f"GRADQ_AGGREGATORS={text!r} is invalid; {expected}"


@pytest.mark.parametrize("blank", ["", "   ", " , "])
def test_an_empty_address_list_is_refused(blank: str) -> None:
    with pytest.raises(ValueError, match=rf"^GRADQ_AGGREGATORS={blank!r} is invalid; expected 'host:port\[,host:port"):
        hook_arguments_from_env({"GRADQ_AGGREGATORS": blank})
    with pytest.raises(ValueError, match=r"^addresses=\[''\] is invalid; expected at least one 'host:port'"):
        GradqConfig(("",))


def test_good_addresses_pass_ipv6_in_brackets_included() -> None:
    config = GradqConfig(("[::1]:50051", "aggregator-1.cluster.local:1", "10.0.0.5:65535"))
    assert [split_address(address) for address in config.addresses] == [
        ("[::1]", 50051),
        ("aggregator-1.cluster.local", 1),
        ("10.0.0.5", 65535),
    ]
    assert hook_arguments_from_env({"GRADQ_AGGREGATORS": " [::1]:50051 , b:2"})["addresses"] == ["[::1]:50051", "b:2"]


def join(address: str, security: ChannelSecurity | None = None, timeout_s: float = 0.5) -> UnreachableError:
    """The error a one-rank client's first Join to ``address`` ends in."""
    client = WorkerClient(address, "contact", 0, 1, timeout_s=timeout_s, security=security)
    try:
        with pytest.raises(UnreachableError) as raised:
            client.join()
    finally:
        client.close()
    assert "\n" not in str(raised.value)  # one line, whatever the launcher prints around it
    return raised.value


def test_a_name_that_does_not_resolve_fails_at_once() -> None:
    # The deadline is far off: an UNAVAILABLE (not DEADLINE_EXCEEDED) says nothing waited for it.
    error = join("no-such-aggregator.invalid:50051", timeout_s=600.0)
    assert error.code == grpc.StatusCode.UNAVAILABLE and error.reach.answer is Answer.UNRESOLVED
    assert str(error).startswith(
        "aggregator no-such-aggregator.invalid:50051: UNAVAILABLE: cannot resolve no-such-aggregator.invalid: "
    )
    assert str(error).endswith("; check the host name in addresses (GRADQ_AGGREGATORS)")


def test_a_refused_connection_is_called_refused() -> None:
    address = f"127.0.0.1:{free_port()}"
    error = join(address)
    assert error.reach.answer is Answer.REFUSED
    assert str(error) == (
        f"aggregator {address}: DEADLINE_EXCEEDED: connection refused at {address}: is `gradq serve` running there, "
        "on that port?"
    )


@pytest.fixture
def silent_address() -> Iterator[str]:
    """A port whose connections time out: a listener whose accept queue is full drops new connections' SYNs."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    queued: list[socket.socket] = []
    while True:  # fill the queue until a connection no longer completes
        try:
            queued.append(socket.create_connection(("127.0.0.1", listener.getsockname()[1]), timeout=0.5))
        except TimeoutError:
            break
    yield address
    for connection in queued:
        connection.close()
    listener.close()


def test_a_silent_host_is_called_timed_out(silent_address: str) -> None:
    error = join(silent_address, timeout_s=0.5)
    assert error.reach.answer is Answer.SILENT
    assert str(error) == (
        f"aggregator {silent_address}: DEADLINE_EXCEEDED: connecting to {silent_address} timed out after 0.5 s: no "
        "host answers there (the wrong address, or a firewall drops the connection)"
    )


def test_a_plaintext_client_of_a_tls_aggregator_is_told_to_set_the_ca(serve: Serve, tls: Tls) -> None:  # noqa: F811 (fixtures)
    address = serve(tls[0])
    error = join(address)
    assert error.reach.answer is Answer.TLS
    assert str(error) == (
        f"aggregator {address}: FAILED_PRECONDITION: the aggregator at {address} speaks TLS; set GRADQ_TLS_CA to the "
        "CA that signed its certificate (and GRADQ_TLS_CLIENT_CERT and GRADQ_TLS_CLIENT_KEY under mutual TLS)"
    )
    assert "unreachable" not in str(error)
    # With the CA it joins.
    port = address.rsplit(":", 1)[1]
    with WorkerClient(f"localhost:{port}", "contact", 0, 1, timeout_s=5.0, security=ChannelSecurity(tls[1])):
        pass


def test_a_tls_client_of_a_plaintext_aggregator_is_told_to_leave_the_ca_unset(serve: Serve, tls: Tls) -> None:  # noqa: F811 (fixtures)
    address = serve()
    error = join(address, ChannelSecurity(root_certificates=tls[1]))
    assert str(error) == (
        f"aggregator {address}: FAILED_PRECONDITION: the aggregator at {address} speaks plaintext, not TLS; leave "
        "GRADQ_TLS_CA unset"
    )


def test_gradq_worker_s_health_wait_says_the_same(serve: Serve, tls: Tls) -> None:  # noqa: F811 (fixtures)
    address = serve(tls[0])
    with pytest.raises(UnreachableError, match=rf"^aggregator {address}: .* speaks TLS; set GRADQ_TLS_CA to the CA"):
        wait_for_aggregators([address], timeout_s=0.5)
    with pytest.raises(UnreachableError, match=r": cannot resolve no-such-aggregator\.invalid: "):
        wait_for_aggregators([address, "no-such-aggregator.invalid:50051"], timeout_s=600.0)


def test_a_refusal_of_the_aggregator_itself_is_left_as_it_is(serve: Serve) -> None:  # noqa: F811 (a fixture)
    # A Join the aggregator answers (here: a job id it refuses) is no contact failure: nothing is probed or renamed.
    client = WorkerClient(serve(), "", 0, 1, timeout_s=5.0)
    try:
        with pytest.raises(AggregationError) as raised:
            client.join()
    finally:
        client.close()
    assert not isinstance(raised.value, UnreachableError)
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_training_session_of_a_plaintext_rank_against_tls_says_tls_and_does_not_fall_back(
    serve: Serve,  # noqa: F811 (a fixture)
    tls: Tls,  # noqa: F811 (a fixture)
    group: None,
) -> None:
    from gradq.client.session import GradqSession  # torch: the session is the adapters' side

    address = serve(tls[0])
    config = GradqConfig((address,), fallback="allreduce", connect_timeout_s=0.5, job_id="tls-mismatch")
    with pytest.raises(UnreachableError) as raised:
        GradqSession.connect(config)
    # TLS against plaintext is a setting to fix, not an aggregator that is down: no fallback, no "unreachable".
    assert str(raised.value) == (
        f"aggregator {address}: FAILED_PRECONDITION: the aggregator at {address} speaks TLS; set GRADQ_TLS_CA to the "
        "CA that signed its certificate (and GRADQ_TLS_CLIENT_CERT and GRADQ_TLS_CLIENT_KEY under mutual TLS)"
    )


def test_gradq_demo_refuses_a_bad_address_in_one_line() -> None:
    completed = gradq("demo", "--aggregator", "localhost", "--connect-timeout", "60")
    assert completed.returncode == 2
    assert completed.stderr.splitlines() == [
        "gradq demo: error: addresses='localhost' (GRADQ_AGGREGATORS) is invalid; expected host:port; 'localhost' "
        "has no port, e.g. localhost:50051; check --aggregator, or wait longer with --connect-timeout"
    ]
