"""GRADQ_* environment variables -> GradqHookState arguments, so a torchrun script and a Compose worker read one set.

The names are the ones `gradq worker` (the Compose worker) reads, so one
environment configures either: GRADQ_AGGREGATORS for the shards,
GRADQ_TLS_CLIENT_CERT/KEY for the worker's own certificate (GRADQ_TLS_CERT is
the aggregator's, in `gradq serve`). A variable left unset leaves the state's
own default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gradq.client.security import ChannelSecurity
from gradq.qcore import QuantConfig

__all__ = ["HOOK_ENVIRONMENT", "hook_arguments_from_env"]

# Variable -> what it sets; `gradq worker --help` names the same settings.
HOOK_ENVIRONMENT = {
    "GRADQ_AGGREGATORS": "host:port of the aggregator shard(s), comma-separated (required)",
    "GRADQ_BITS": "bits per gradient element, 1..8",
    "GRADQ_SCHEME": "quantization scheme, e.g. per_channel_affine",
    "GRADQ_ERROR_FEEDBACK": "1/0: carry each bucket's quantization error into its next step",
    "GRADQ_JOB_ID": "the aggregator job shared by all ranks (unset: rank 0 draws one per run)",
    "GRADQ_TLS_CA": "PEM CA of the aggregator's certificate: talk TLS",
    "GRADQ_TLS_CLIENT_CERT": "this worker's PEM certificate, for mutual TLS",
    "GRADQ_TLS_CLIENT_KEY": "its PEM key",
    "GRADQ_TOKEN_FILE": "file holding the bearer token to send",
}

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def hook_arguments_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The GradqHookState keyword arguments the GRADQ_* variables set.

    Args:
        environ: the variables to read; None reads ``os.environ``.

    Returns:
        ``addresses`` and whichever of ``config``, ``error_feedback``, ``job_id``
        and ``security`` the variables set.

    Raises:
        ValueError: GRADQ_AGGREGATORS is unset or empty, or a variable's value
            cannot be parsed; the message names the variable and the value.
    """
    env = {
        name: value for name, value in (os.environ if environ is None else environ).items() if name in HOOK_ENVIRONMENT
    }
    addresses = [address.strip() for address in env.get("GRADQ_AGGREGATORS", "").split(",") if address.strip()]
    if not addresses:
        raise ValueError(
            f"GRADQ_AGGREGATORS={env.get('GRADQ_AGGREGATORS', '')!r} is invalid; expected 'host:port[,host:port...]'"
        )
    arguments: dict[str, Any] = {"addresses": addresses}
    grid: dict[str, Any] = {}
    if "GRADQ_BITS" in env:
        try:
            grid["bits"] = int(env["GRADQ_BITS"])
        except ValueError:
            raise ValueError(f"GRADQ_BITS={env['GRADQ_BITS']!r} is invalid; expected an integer in 1..8") from None
    if "GRADQ_SCHEME" in env:
        grid["scheme"] = env["GRADQ_SCHEME"]
    if grid:
        try:
            arguments["config"] = QuantConfig(**grid)
        except ValueError as error:
            raise ValueError(f"GRADQ_BITS / GRADQ_SCHEME: {error}") from None
    if "GRADQ_ERROR_FEEDBACK" in env:
        arguments["error_feedback"] = _flag("GRADQ_ERROR_FEEDBACK", env["GRADQ_ERROR_FEEDBACK"])
    if env.get("GRADQ_JOB_ID"):
        arguments["job_id"] = env["GRADQ_JOB_ID"]
    files = {name: Path(env[name]) if env.get(name) else None for name in _SECURITY_FILES}
    for name, path in files.items():
        if path is not None and not path.is_file():
            raise ValueError(f"{name}={str(path)!r} is invalid; expected a readable file")
    if any(files.values()):
        token_file = files["GRADQ_TOKEN_FILE"]
        arguments["security"] = ChannelSecurity.from_files(
            files["GRADQ_TLS_CA"],
            files["GRADQ_TLS_CLIENT_CERT"],
            files["GRADQ_TLS_CLIENT_KEY"],
            token_file.read_text().strip() if token_file else None,
        )
    return arguments


_SECURITY_FILES = ("GRADQ_TLS_CA", "GRADQ_TLS_CLIENT_CERT", "GRADQ_TLS_CLIENT_KEY", "GRADQ_TOKEN_FILE")


def _flag(name: str, value: str) -> bool:
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in _FALSE:
        return False
    raise ValueError(f"{name}={value!r} is invalid; expected one of {', '.join(_TRUE + _FALSE)}")
