"""An aggregator address, ``host:port``: its form, checked before any dial, and why one gave no gRPC answer.

Both sides read it: a worker checks its aggregator addresses when its
configuration is made and, when its first contact fails, says what the
address answered; the aggregator's health check says the same of a probe.
gRPC itself accepts ``localhost`` (port 443), ``http://host:port`` or an
unresolvable name and reports each, after the whole connect timeout, as a bare
DEADLINE_EXCEEDED. ``probe_address`` opens a TCP connection of its own (and a
TLS handshake, verifying nothing) to tell the causes apart, and
``describe_no_answer`` says the one found in words, naming the settings of the
tool that asks.
"""

from __future__ import annotations

import enum
import socket
from dataclasses import dataclass

from gradq.proto.transport import speaks_tls

__all__ = ["Answer", "Reach", "describe_no_answer", "probe_address", "resolution_failure", "split_address"]

_EXAMPLE = "localhost:50051"


def split_address(text: str, *, host_required: bool = True) -> tuple[str, int]:
    """``(host, port)`` of ``host:port``, an IPv6 host in brackets (``[::1]:50051``).

    Args:
        text: the address as given.
        host_required: False accepts an empty host (``:50051``, a shard group's "the host dialed").

    Raises:
        ValueError: ``expected host:port ...``, saying what is wrong with ``text``.
    """
    if not text.strip():
        raise ValueError(f"expected host:port, e.g. {_EXAMPLE}")
    if any(character.isspace() for character in text):
        raise ValueError(f"expected host:port without spaces; got {text!r}")
    if "," in text:
        raise ValueError(f"expected one host:port; got {text!r} (a list of shards is several addresses)")
    scheme, separator, rest = text.partition("://")
    if separator:
        raise ValueError(f"expected host:port without a scheme: drop '{scheme}://' and give {rest.rstrip('/')!r}")
    host, colon, port = text.rpartition(":")
    if not colon or text.endswith("]"):  # "[::1]" is a host alone
        raise ValueError(f"expected host:port; {text!r} has no port, e.g. {text}:50051")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"expected an IPv6 host in brackets, e.g. [::1]:50051; got {text!r}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"expected host:port with a port in 1..65535; {text!r} has port {port!r}")
    if host_required and host.strip("[]") == "":
        raise ValueError(f"expected host:port with a host before ':{port}', e.g. localhost:{port}")
    return host, int(port)


class Answer(enum.Enum):
    """What an address answered a probe."""

    UNRESOLVED = "unresolved"  # the host name does not resolve
    REFUSED = "refused"  # the host refuses connections on that port: nothing listens there
    SILENT = "silent"  # the connection timed out: no host answers, or a firewall drops the packets
    UNREACHABLE = "unreachable"  # no route to the host (or another socket error, named in Reach.detail)
    TLS = "tls"  # it answers a TLS handshake
    PLAINTEXT = "plaintext"  # it accepts connections and answers, but not in TLS


@dataclass(frozen=True, slots=True)
class Reach:
    """A probe's finding: the answer, and the system's words for a failure ("" when there are none)."""

    answer: Answer
    detail: str = ""


def resolution_failure(address: str) -> Reach | None:
    """None when the host of ``address`` resolves; else an UNRESOLVED Reach with the resolver's words.

    Raises:
        ValueError: ``address`` is not host:port (see ``split_address``).
    """
    host, port = split_address(address)
    try:
        socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:  # UnicodeError: a label IDNA cannot encode
        return Reach(Answer.UNRESOLVED, str(getattr(error, "strerror", None) or error))
    return None


def probe_address(address: str, timeout_s: float = 2.0) -> Reach:
    """Resolve ``address``, connect to it over TCP and, if that works, start a TLS handshake.

    Args:
        address: ``host:port`` (an IPv6 host in brackets).
        timeout_s: for the connection and for the handshake.

    Raises:
        ValueError: ``address`` is not host:port (see ``split_address``).
    """
    unresolved = resolution_failure(address)
    if unresolved is not None:
        return unresolved
    host, port = split_address(address)
    try:
        socket.create_connection((host.strip("[]"), port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return Reach(Answer.REFUSED)
    except TimeoutError:
        return Reach(Answer.SILENT)
    except OSError as error:
        return Reach(Answer.UNREACHABLE, error.strerror or str(error))
    tls = speaks_tls(address, timeout_s)
    if tls is None:  # it took the connection a moment ago and refuses the next: it is going away
        return Reach(Answer.REFUSED)
    return Reach(Answer.TLS if tls else Answer.PLAINTEXT)


def describe_no_answer(address: str, reach: Reach, over_tls: bool, waited_s: float, ca: str, client_pair: str) -> str:
    """Why ``address`` gave no gRPC answer within ``waited_s``, in words naming the settings to change.

    Args:
        address: the ``host:port`` that was called.
        reach: what ``probe_address`` found there.
        over_tls: whether the call spoke TLS.
        waited_s: how long the call waited for an answer.
        ca: how the asking tool names the CA setting, e.g. ``"GRADQ_TLS_CA"``.
        client_pair: how it names the client certificate and key, for mutual TLS.
    """
    host = address.rpartition(":")[0]
    answer = reach.answer
    if answer is Answer.UNRESOLVED:
        return f"cannot resolve {host}: {reach.detail}; check the host name"
    if answer is Answer.REFUSED:
        return f"connection refused at {address}: is `gradq serve` running there, on that port?"
    if answer is Answer.SILENT:
        return (
            f"connecting to {address} timed out after {waited_s:g} s: no host answers there (the wrong address, or "
            "a firewall drops the connection)"
        )
    if answer is Answer.UNREACHABLE:
        return f"{address} cannot be reached from here: {reach.detail}"
    if answer is Answer.TLS and not over_tls:
        return (
            f"the aggregator at {address} speaks TLS; set {ca} to the CA that signed its certificate (and "
            f"{client_pair} under mutual TLS)"
        )
    if answer is Answer.PLAINTEXT and over_tls:
        return f"the aggregator at {address} speaks plaintext, not TLS; leave {ca} unset"
    if over_tls:
        return (
            f"the aggregator at {address} speaks TLS but no call got through in {waited_s:g} s: check that {ca} is the "
            f"CA that signed its certificate and, under mutual TLS, set {client_pair}"
        )
    return f"{address} accepts connections but gave no gRPC answer in {waited_s:g} s (not a gradq aggregator?)"
