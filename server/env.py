"""GRADQ_* environment variables of the aggregator: one table of names and meanings, one of parsers, one reader.

`gradq serve` (server/cli.py) and its container health check
(server/healthcheck.py) read their variables through ``read_variable`` only,
with the same parsing a worker's variables get: unset or blank leaves the
default, a value that cannot be parsed is refused as
``NAME='value' is invalid; expected ...``, and a boolean is exactly one of
1/true/yes/on or 0/false/no/off. A name means one thing on every side: the
aggregator binds to GRADQ_BIND_HOST and reads its token table from
GRADQ_TOKEN_TABLE, so a worker's GRADQ_HOST (its host group) and
GRADQ_TOKEN_FILE (its one bearer token) exported in the same shell change
nothing here. The server imports no client code (imports point qcore <- server).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gradq.qcore import Scheme
from gradq.server.shard_group import parse_shard_group

__all__ = [
    "HEALTHCHECK_ENVIRONMENT",
    "SERVE_ENVIRONMENT",
    "SERVER_PARSERS",
    "flag_type",
    "parse_auto_flag",
    "parse_flag",
    "parse_port",
    "parse_ports",
    "read_variable",
]

# Variable -> what it sets, for `gradq serve`, in a line: its --help shows each beside its flag
# (docs/operating.md explains each at length).
SERVE_ENVIRONMENT = {
    "GRADQ_BIND_HOST": "address to bind",
    "GRADQ_PORT": "port to bind; 0 picks a free one (see --port-file)",
    "GRADQ_WORLD_SIZE": "ranks per job, as the launcher counts them; 0: each job's first Join decides",
    "GRADQ_ROUND_TIMEOUT": "seconds from a round's first push until it fails, naming the missing ranks",
    "GRADQ_PARTIAL_QUORUM": "0: strict rounds; N: at its deadline a round of >= N ranks completes over them",
    "GRADQ_RETURN_SCHEME": "grid of the mean sent back: same (as the pushes), fp16, fp32 or a scheme",
    "GRADQ_RETURN_BITS": "bits of a quantized --return-scheme",
    "GRADQ_SERVER_ERROR_FEEDBACK": "carry each mean's rounding error into its next round (auto: on grids of <= 4 bits)",
    "GRADQ_RETAIN_STEPS": "completed steps kept to answer retried pushes",
    "GRADQ_MAX_STEPS_AHEAD": "how far a new round's step may run past the job's newest completed one",
    "GRADQ_MAX_OPEN_ROUNDS": "rounds of one job in flight at once",
    "GRADQ_MAX_MEMORY_BYTES": "budget for accumulators, retained means and residuals",
    "GRADQ_MAX_JOB_MEMORY_BYTES": "the most of --max-memory-bytes one job may hold",
    "GRADQ_MAX_JOBS": "jobs known at once; a new job's Join past it is refused",
    "GRADQ_MAX_JOBS_PER_PEER": "jobs one client host may have started that are still held",
    "GRADQ_MAX_WORLD_SIZE": "largest job a Join may ask for, in ranks",
    "GRADQ_JOB_IDLE_TIMEOUT": "seconds a job may go without a call before it is forgotten",
    "GRADQ_MAX_WAITING_PER_JOB": "pushes of one job waiting for their rounds at once",
    "GRADQ_MAX_WAITING_PER_PEER": "pushes from one client host waiting at once",
    "GRADQ_MAX_WAITING_CALLS": "pushes waiting at once in all (~25 KB each, no thread)",
    "GRADQ_MAX_WATCHES": "Watch streams open at once (one per joined rank)",
    "GRADQ_MAX_STREAMS_PER_PEER": "push streams one client host holds open, over all its connections",
    "GRADQ_MAX_MESSAGE_BYTES": "largest gRPC message accepted or sent",
    "GRADQ_MAX_WORKERS": "threads that decode, accumulate and average pushes",
    "GRADQ_NON_FINITE": "a rank's NaN/Inf gradients: reject fails the round, skip returns zeros marked skipped",
    "GRADQ_MAX_BUCKET_ELEMENTS": "largest bucket accepted, in elements (4 bytes each to accumulate)",
    "GRADQ_GRACE": "seconds rounds in flight get to finish after SIGTERM",
    "GRADQ_KEEPALIVE_TIMEOUT": "seconds a rank's heartbeat may be late before the rank is lost",
    "GRADQ_EXIT_AFTER_JOBS": "exit 0 once N jobs have finished (every rank left); 0: serve until SIGTERM",
    "GRADQ_LOG_LEVEL": "DEBUG, INFO, WARNING or ERROR",
    "GRADQ_LOG_FORMAT": "text, or json (one object per line, for log shippers)",
    "GRADQ_PORT_FILE": "write the bound port to this file once serving",
    "GRADQ_METRICS_PORT": "serve Prometheus /metrics and a /status page over HTTP on this port (unset: none)",
    "GRADQ_TLS_CERT": "PEM certificate chain: serve TLS (with --tls-key)",
    "GRADQ_TLS_KEY": "PEM private key of --tls-cert",
    "GRADQ_TLS_CLIENT_CA": "PEM CA bundle: require client certificates signed by it (mutual TLS)",
    "GRADQ_TOKEN_TABLE": "require bearer tokens, one a line: 'TOKEN job=JOB [rank=RANK]' scopes one",
    "GRADQ_SHARDS": "run N shard processes on consecutive ports from --port, restarting any that dies",
    "GRADQ_SHARD_PORTS": "each shard's port, comma-separated, instead of consecutive ones",
    "GRADQ_ADVERTISE_HOST": "host the workers reach the shards at (unset: the host each worker dialed)",
    "GRADQ_SHARD_GROUP": "every shard's host:port in this one's group, told to workers",
}

# Variable -> what it sets, for the health check alone (it reads GRADQ_PORT and GRADQ_TLS_CERT of the table above).
HEALTHCHECK_ENVIRONMENT = {
    "GRADQ_TLS_CA": "PEM CA of the aggregator's certificate: check over TLS",
    "GRADQ_TLS_CLIENT_CERT": "PEM client certificate, for mutual TLS",
    "GRADQ_TLS_CLIENT_KEY": "its PEM key",
}

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_flag(text: str) -> bool:
    """1/true/yes/on or 0/false/no/off."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}")


def parse_auto_flag(text: str) -> bool | None:
    """``auto`` (None: the policy decides) or a boolean."""
    if text.strip().lower() == "auto":
        return None
    try:
        return parse_flag(text)
    except ValueError:
        raise ValueError(f"expected auto or one of {', '.join(_TRUE + _FALSE)}") from None


def parse_port(text: str) -> int:
    """A TCP port, 0..65535 (0 picks a free one)."""
    expected = "expected a port in 0..65535 (0 picks a free one)"
    try:
        port = int(text)
    except ValueError:
        raise ValueError(expected) from None
    if not 0 <= port <= 65535:
        raise ValueError(expected)
    return port


def parse_ports(text: str) -> tuple[int, ...]:
    """Comma-separated TCP ports, 1..65535 each (a restarted shard must come back on the same one, so no 0)."""
    expected = "expected ports in 1..65535, comma-separated (e.g. 50051,50061)"
    try:
        ports = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(expected) from None
    if not all(1 <= port <= 65535 for port in ports):
        raise ValueError(expected)
    return ports


def _parse_integer(text: str) -> int:
    """A whole number (the settings' dataclasses check its range and name the flag)."""
    try:
        return int(text)
    except ValueError:
        raise ValueError("expected an integer") from None


def _parse_number(text: str) -> float:
    """A finite number."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError("expected a number") from None
    if not math.isfinite(value):
        raise ValueError("expected a finite number")
    return value


def _parse_text(text: str) -> str:
    return text.strip()


def _parse_return_scheme(text: str) -> Scheme | None:
    """``same`` (None: the pushes' grid), ``fp16``, ``fp32`` or a scheme's name."""
    if text.strip().lower() == "same":
        return None
    try:
        return Scheme.parse({"fp16": "float16", "fp32": "float32"}.get(text.strip().lower(), text))
    except ValueError:
        names = ", ".join(scheme.name.lower() for scheme in Scheme)
        raise ValueError(f"expected 'same', 'fp16', 'fp32' or a scheme: {names}") from None


_INTEGERS = (
    "GRADQ_WORLD_SIZE",
    "GRADQ_PARTIAL_QUORUM",
    "GRADQ_RETURN_BITS",
    "GRADQ_RETAIN_STEPS",
    "GRADQ_MAX_STEPS_AHEAD",
    "GRADQ_MAX_OPEN_ROUNDS",
    "GRADQ_MAX_MEMORY_BYTES",
    "GRADQ_MAX_JOB_MEMORY_BYTES",
    "GRADQ_MAX_JOBS",
    "GRADQ_MAX_JOBS_PER_PEER",
    "GRADQ_MAX_WORLD_SIZE",
    "GRADQ_MAX_WAITING_PER_JOB",
    "GRADQ_MAX_WAITING_PER_PEER",
    "GRADQ_MAX_WAITING_CALLS",
    "GRADQ_MAX_WATCHES",
    "GRADQ_MAX_STREAMS_PER_PEER",
    "GRADQ_MAX_MESSAGE_BYTES",
    "GRADQ_MAX_WORKERS",
    "GRADQ_MAX_BUCKET_ELEMENTS",
    "GRADQ_EXIT_AFTER_JOBS",
    "GRADQ_SHARDS",
)
_NUMBERS = ("GRADQ_ROUND_TIMEOUT", "GRADQ_JOB_IDLE_TIMEOUT", "GRADQ_GRACE", "GRADQ_KEEPALIVE_TIMEOUT")
_TEXTS = ("GRADQ_BIND_HOST", "GRADQ_NON_FINITE", "GRADQ_LOG_LEVEL", "GRADQ_LOG_FORMAT", "GRADQ_ADVERTISE_HOST")
_PATHS = (
    "GRADQ_PORT_FILE",
    "GRADQ_TLS_CERT",
    "GRADQ_TLS_KEY",
    "GRADQ_TLS_CLIENT_CA",
    "GRADQ_TOKEN_TABLE",
    *HEALTHCHECK_ENVIRONMENT,
)

# How each variable of SERVE_ENVIRONMENT and HEALTHCHECK_ENVIRONMENT is read (and its flag, through flag_type).
SERVER_PARSERS: dict[str, Callable[[str], Any]] = {
    **dict.fromkeys(_INTEGERS, _parse_integer),
    **dict.fromkeys(_NUMBERS, _parse_number),
    **dict.fromkeys(_TEXTS, _parse_text),
    **dict.fromkeys(_PATHS, Path),
    "GRADQ_PORT": parse_port,
    "GRADQ_METRICS_PORT": parse_port,
    "GRADQ_RETURN_SCHEME": _parse_return_scheme,
    "GRADQ_SERVER_ERROR_FEEDBACK": parse_auto_flag,
    "GRADQ_SHARD_PORTS": parse_ports,
    "GRADQ_SHARD_GROUP": parse_shard_group,
}


def read_variable(environ: Mapping[str, str] | None, name: str) -> Any:
    """The value of one of the server's variables, parsed; None when it is unset or blank.

    Args:
        environ: the variables (None: ``os.environ``).
        name: a variable of SERVE_ENVIRONMENT or HEALTHCHECK_ENVIRONMENT, e.g. ``"GRADQ_PORT"``.

    Raises:
        ValueError: ``NAME='value' is invalid; expected ...``.
    """
    text = (os.environ if environ is None else environ).get(name, "")
    if not text.strip():
        return None
    try:
        return SERVER_PARSERS[name](text.strip())
    except ValueError as error:
        raise ValueError(f"{name}={text!r} is invalid; {error}") from None


def flag_type(name: str) -> Callable[[str], Any]:
    """An argparse ``type`` for the flag of variable ``name``: checked as the variable is, and said alike."""
    parse = SERVER_PARSERS[name]

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid; {error}") from None

    convert.__name__ = name.removeprefix("GRADQ_").lower()
    return convert
