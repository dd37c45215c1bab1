"""GRADQ_* environment variables: the one reader of a worker's settings, for a torchrun script and `gradq worker` alike.

`GradqConfig.from_env()` (behind `GradqHookState.from_env()`) and `gradq worker` (the Compose worker) read the
same names through the functions here, so one environment configures either,
with the same parsing, the same defaults and the same errors (naming the
variable, its value and what was expected). A variable left unset (or empty)
leaves the GradqConfig default; a GRADQ_* name no part of gradq reads is
warned of, with the closest one that is (gradq.client.variable_names).
GRADQ_TLS_CLIENT_CERT/KEY are the worker's own certificate (GRADQ_TLS_CERT
is the aggregator's, in `gradq serve`).
Importing this module loads no torch, so `gradq worker` checks its environment
before it pays for torch.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gradq.client.bit_policy import BIT_POLICIES
from gradq.client.security import ChannelSecurity
from gradq.client.variable_names import warn_unknown_variables
from gradq.proto.address import split_address
from gradq.qcore import QuantConfig, Scheme

__all__ = [
    "CODECS",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "FALLBACKS",
    "HOST_GROUPINGS",
    "HOOK_ENVIRONMENT",
    "HOOK_PARSERS",
    "flag_type",
    "hook_arguments_from_env",
    "parse_addresses",
    "parse_file",
    "parse_flag",
    "parse_integer",
    "parse_number",
    "parse_scheme",
    "quantized_scheme_names",
    "read_variable",
]

# How long the first Join waits for each aggregator shard, and a push's rejoin for a shard that went away
# (GradqConfig.connect_timeout_s, GRADQ_CONNECT_TIMEOUT).
DEFAULT_CONNECT_TIMEOUT_S = 10.0

# GradqConfig.host_grouping: "auto" reduces inside hosts of several ranks first (see
# gradq.client.session.host_groups), "flat" pushes every rank's whole tensor.
HOST_GROUPINGS = ("auto", "flat")

# GradqConfig.fallback: what to do when the aggregator cannot be reached when training starts.
FALLBACKS = ("error", "allreduce", "allgather")

# GradqConfig.codec: "auto" uses the torch codec for tensors on an accelerator, numpy for CPU ones.
CODECS = ("auto", "torch", "numpy")

# Variable -> what it sets; `gradq worker --help` names the same settings.
HOOK_ENVIRONMENT = {
    "GRADQ_AGGREGATORS": "host:port of the aggregator shard(s), comma-separated (required); one shard of a group "
    "(gradq serve --shards N) names them all",
    "GRADQ_BITS": "bits per gradient element, 1..8",
    "GRADQ_SCHEME": "quantization scheme, e.g. per_channel_affine",
    "GRADQ_ERROR_FEEDBACK": "1/0: carry each bucket's quantization error into its next step",
    "GRADQ_JOB_ID": "the aggregator job shared by all ranks (unset: rank 0 draws one per run)",
    "GRADQ_CHUNK_ELEMENTS": "largest round a bucket is cut into, in elements",
    "GRADQ_CONNECT_TIMEOUT": "seconds the first Join waits for each aggregator shard",
    "GRADQ_FALLBACK": "if the aggregator cannot be reached at start: error, or train without it: allreduce or "
    "allgather (a fixed job's ranks; an elastic host cannot fall back)",
    "GRADQ_HOST": "this rank's host name: ranks with the same one reduce together first (unset: the launcher's)",
    "GRADQ_HOST_GROUPING": "auto (two-level where hosts hold several ranks) or flat",
    "GRADQ_ELASTIC_HOSTS": "0: a fixed job; N: an elastic job that starts once N hosts joined (needs GRADQ_JOB_ID)",
    "GRADQ_ELASTIC_MAX_HOSTS": "elastic: the most hosts the job holds at once; a host past it is refused (0: no cap)",
    "GRADQ_BIT_POLICY": "uniform (every bucket on GRADQ_BITS) or adaptive (more bits for 1-D and hard parameters)",
    "GRADQ_AVERAGE_BITS": "the adaptive policy's most bits per element on average, GRADQ_BITS..8",
    "GRADQ_TLS_CA": "PEM CA of the aggregator's certificate: talk TLS",
    "GRADQ_TLS_CLIENT_CERT": "this worker's PEM certificate, for mutual TLS",
    "GRADQ_TLS_CLIENT_KEY": "its PEM key",
    "GRADQ_TOKEN_FILE": "file holding the bearer token to send",
}

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_SECURITY_FILES = ("GRADQ_TLS_CA", "GRADQ_TLS_CLIENT_CERT", "GRADQ_TLS_CLIENT_KEY", "GRADQ_TOKEN_FILE")
# GradqConfig field -> the variable that sets it as it is (config and security combine several).
_HOOK_ARGUMENTS = {
    "error_feedback": "GRADQ_ERROR_FEEDBACK",
    "job_id": "GRADQ_JOB_ID",
    "chunk_elements": "GRADQ_CHUNK_ELEMENTS",
    "connect_timeout_s": "GRADQ_CONNECT_TIMEOUT",
    "fallback": "GRADQ_FALLBACK",
    "host": "GRADQ_HOST",
    "host_grouping": "GRADQ_HOST_GROUPING",
    "elastic_hosts": "GRADQ_ELASTIC_HOSTS",
    "elastic_max_hosts": "GRADQ_ELASTIC_MAX_HOSTS",
    "bit_policy": "GRADQ_BIT_POLICY",
    "average_bits": "GRADQ_AVERAGE_BITS",
}


def read_variable(environ: Mapping[str, str] | None, name: str, parse: Callable[[str], Any] | None = None) -> Any:
    """The value of one variable, parsed; None when it is unset or empty.

    Args:
        environ: the variables (None: ``os.environ``).
        name: e.g. ``"GRADQ_BITS"``.
        parse: how to read it, raising ValueError("expected ..."); None for a
            variable of HOOK_ENVIRONMENT uses its parser in HOOK_PARSERS.

    Raises:
        ValueError: ``NAME='value' is invalid; expected ...``.
    """
    text = (os.environ if environ is None else environ).get(name, "")
    if not text.strip():
        return None
    try:
        return (parse or HOOK_PARSERS[name])(text.strip())
    except ValueError as error:
        raise ValueError(f"{name}={text!r} is invalid; {error}") from None


def flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` from one of the parsers here: a flag is checked like its variable, and says so alike."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid; {error}") from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def parse_integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """A parser of whole numbers in ``minimum..maximum`` (no upper bound when None)."""
    expected = f"an integer in {minimum}..{maximum}" if maximum is not None else f"an integer >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"expected {expected}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError(f"expected {expected}")
        return value

    return parse


def parse_number(minimum: float, maximum: float | None = None, *, above: bool = False) -> Callable[[str], float]:
    """A parser of finite numbers from ``minimum`` (excluded when ``above``) up to ``maximum``."""
    expected = f"a number {'>' if above else '>='} {minimum:g}" + (
        f" and <= {maximum:g}" if maximum is not None else ""
    )

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"expected {expected}") from None
        low_ok = value > minimum if above else value >= minimum
        if not (low_ok and math.isfinite(value) and (maximum is None or value <= maximum)):
            raise ValueError(f"expected {expected}")
        return value

    return parse


def parse_flag(text: str) -> bool:
    """1/true/yes/on or 0/false/no/off."""
    if text.strip().lower() in _TRUE:
        return True
    if text.strip().lower() in _FALSE:
        return False
    raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}")


def quantized_scheme_names() -> list[str]:
    """The schemes a worker may push with, in the enum's order: those whose registered codec quantizes."""
    return [scheme.name.lower() for scheme in Scheme if scheme.is_quantized]


def parse_scheme(text: str) -> Scheme:
    """A quantized scheme by name (the float pass-throughs are no compression: use plain DDP)."""
    try:
        scheme = Scheme.parse(text)
    except ValueError:
        scheme = None
    if scheme is None or not scheme.is_quantized:
        raise ValueError(f"expected one of: {', '.join(quantized_scheme_names())}")
    return scheme


def parse_host_grouping(text: str) -> str:
    """One of HOST_GROUPINGS."""
    if text not in HOST_GROUPINGS:
        raise ValueError(f"expected one of: {', '.join(HOST_GROUPINGS)}")
    return text


def parse_fallback(text: str) -> str:
    """One of FALLBACKS."""
    if text not in FALLBACKS:
        raise ValueError(f"expected one of: {', '.join(FALLBACKS)}")
    return text


def parse_bit_policy(text: str) -> str:
    """One of BIT_POLICIES."""
    if text not in BIT_POLICIES:
        raise ValueError(f"expected one of: {', '.join(BIT_POLICIES)}")
    return text


def parse_addresses(text: str) -> list[str]:
    """Comma-separated host:port, in shard order: each with a port in 1..65535, no scheme, an IPv6 host in brackets."""
    addresses = [address.strip() for address in text.split(",") if address.strip()]
    if not addresses:
        raise ValueError("expected 'host:port[,host:port...]'")
    for address in addresses:
        split_address(address)
    return addresses


def parse_file(text: str) -> Path:
    """The path of a file that exists."""
    path = Path(text)
    if not path.is_file():
        raise ValueError("expected a readable file")
    return path


# How each variable of HOOK_ENVIRONMENT is read, by GradqHookState.from_env() and `gradq worker` alike.
HOOK_PARSERS: dict[str, Callable[[str], Any]] = {
    "GRADQ_AGGREGATORS": parse_addresses,
    "GRADQ_BITS": parse_integer(1, 8),
    "GRADQ_SCHEME": parse_scheme,
    "GRADQ_ERROR_FEEDBACK": parse_flag,
    "GRADQ_JOB_ID": str,
    "GRADQ_CHUNK_ELEMENTS": parse_integer(1),
    "GRADQ_CONNECT_TIMEOUT": parse_number(0, above=True),
    "GRADQ_FALLBACK": parse_fallback,
    "GRADQ_HOST": str,
    "GRADQ_HOST_GROUPING": parse_host_grouping,
    "GRADQ_ELASTIC_HOSTS": parse_integer(0),
    "GRADQ_ELASTIC_MAX_HOSTS": parse_integer(0),
    "GRADQ_BIT_POLICY": parse_bit_policy,
    "GRADQ_AVERAGE_BITS": parse_number(1, 8),
    "GRADQ_TLS_CA": parse_file,
    "GRADQ_TLS_CLIENT_CERT": parse_file,
    "GRADQ_TLS_CLIENT_KEY": parse_file,
    "GRADQ_TOKEN_FILE": parse_file,
}


def hook_arguments_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The GradqHookState keyword arguments the GRADQ_* variables set.

    Args:
        environ: the variables to read; None reads ``os.environ``.

    Returns:
        ``addresses`` and whichever of ``config``, ``error_feedback``, ``job_id``,
        ``chunk_elements``, ``connect_timeout_s``, ``fallback``, ``host``,
        ``host_grouping``, ``elastic_hosts``, ``elastic_max_hosts``, ``bit_policy``,
        ``average_bits`` and ``security`` the variables set.

    Logs a warning (once per process and name) for each GRADQ_* variable set
    that no part of gradq reads, naming the closest one that is.

    Raises:
        ValueError: GRADQ_AGGREGATORS is unset or empty, or a variable's value
            cannot be parsed; the message names the variable and the value.
    """
    warn_unknown_variables(environ, HOOK_ENVIRONMENT)
    env = {
        name: value for name, value in (os.environ if environ is None else environ).items() if name in HOOK_ENVIRONMENT
    }
    addresses = read_variable(env, "GRADQ_AGGREGATORS")
    if addresses is None:
        raise ValueError(
            f"GRADQ_AGGREGATORS={env.get('GRADQ_AGGREGATORS', '')!r} is invalid; expected 'host:port[,host:port...]'"
        )
    arguments: dict[str, Any] = {"addresses": addresses}
    grid = {field: read_variable(env, name) for field, name in (("bits", "GRADQ_BITS"), ("scheme", "GRADQ_SCHEME"))}
    grid = {field: value for field, value in grid.items() if value is not None}
    if grid:
        try:
            arguments["config"] = QuantConfig(**grid)
        except ValueError as error:
            raise ValueError(f"GRADQ_BITS / GRADQ_SCHEME: {error}") from None
    for argument, name in _HOOK_ARGUMENTS.items():
        value = read_variable(env, name)
        if value is not None:
            arguments[argument] = value
    files = {name: read_variable(env, name) for name in _SECURITY_FILES}
    if any(files.values()):
        token_file = files["GRADQ_TOKEN_FILE"]
        try:
            arguments["security"] = ChannelSecurity.from_files(
                files["GRADQ_TLS_CA"],
                files["GRADQ_TLS_CLIENT_CERT"],
                files["GRADQ_TLS_CLIENT_KEY"],
                token_file.read_text().strip() if token_file else None,
            )
        except ValueError as error:
            raise ValueError(f"GRADQ_TLS_CA / GRADQ_TLS_CLIENT_CERT / GRADQ_TLS_CLIENT_KEY: {error}") from None
    return arguments
