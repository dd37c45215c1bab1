"""`gradq serve`: run one aggregator (one shard) until SIGTERM, or with --shards N, N of them supervised."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from enum import Enum
from typing import Any, NamedTuple, NoReturn

from gradq.server.app import AggregatorServer, BindError, ServerOptions, TlsFiles
from gradq.server.auth import TokenTable
from gradq.server.env import SERVE_ENVIRONMENT, flag_type, read_variable
from gradq.server.limits import ServiceLimits
from gradq.server.policy import RoundPolicy
from gradq.server.shard_plan import plan_shards
from gradq.server.supervisor import ShardSupervisor

__all__ = ["main", "build_parser"]


# Each default lives once, in the dataclass that owns it.
_POLICY = RoundPolicy()
_SERVER = ServerOptions()
_LIMITS = ServiceLimits()
_HOST, _PORT = _SERVER.address.rsplit(":", 1)


class _Flag(NamedTuple):
    """One flag of `gradq serve`; its variable's meaning and parser are in gradq.server.env."""

    flag: str
    env: str
    default: Any
    metavar: str
    # The settings fields (RoundPolicy, ServerOptions, ServiceLimits) whose errors this flag answers for,
    # when not the flag's own name with underscores: an error says the flag, not the field.
    fields: tuple[str, ...] = ()
    # The default as --help says it, where the value alone would mislead (a -1 or None standing for a rule).
    shown: str = ""


# Every flag, grouped as --help shows them. Flags win over the environment.
_GROUPS: dict[str, list[_Flag]] = {
    "serving": [
        _Flag("--host", "GRADQ_BIND_HOST", _HOST, "HOST"),
        _Flag("--port", "GRADQ_PORT", int(_PORT), "PORT"),
        _Flag("--port-file", "GRADQ_PORT_FILE", None, "PATH"),
        _Flag("--max-workers", "GRADQ_MAX_WORKERS", _SERVER.max_workers, "N"),
        _Flag("--max-message-bytes", "GRADQ_MAX_MESSAGE_BYTES", _SERVER.max_message_bytes, "BYTES"),
        _Flag(
            "--keepalive-timeout",
            "GRADQ_KEEPALIVE_TIMEOUT",
            _SERVER.keepalive_timeout_s,
            "SECONDS",
            ("keepalive_timeout_s",),
        ),
        _Flag("--grace", "GRADQ_GRACE", _SERVER.grace_s, "SECONDS", ("grace_s",)),
        _Flag("--exit-after-jobs", "GRADQ_EXIT_AFTER_JOBS", _SERVER.exit_after_jobs, "N"),
    ],
    "rounds": [
        _Flag("--world-size", "GRADQ_WORLD_SIZE", _POLICY.world_size, "N"),
        _Flag("--round-timeout", "GRADQ_ROUND_TIMEOUT", _POLICY.round_timeout_s, "SECONDS", ("round_timeout_s",)),
        _Flag("--partial-quorum", "GRADQ_PARTIAL_QUORUM", _POLICY.partial_quorum, "N"),
        _Flag("--return-scheme", "GRADQ_RETURN_SCHEME", "same", "SCHEME"),
        _Flag("--return-bits", "GRADQ_RETURN_BITS", _POLICY.return_bits, "N", ("return_bits", "bits")),
        _Flag("--server-error-feedback", "GRADQ_SERVER_ERROR_FEEDBACK", "auto", "auto|true|false"),
        _Flag("--retain-steps", "GRADQ_RETAIN_STEPS", _POLICY.retain_steps, "N"),
        _Flag("--non-finite", "GRADQ_NON_FINITE", _POLICY.non_finite, "reject|skip"),
    ],
    "limits": [
        _Flag("--max-steps-ahead", "GRADQ_MAX_STEPS_AHEAD", _LIMITS.max_steps_ahead, "N"),
        _Flag("--max-open-rounds", "GRADQ_MAX_OPEN_ROUNDS", _LIMITS.max_open_rounds, "N"),
        _Flag("--max-memory-bytes", "GRADQ_MAX_MEMORY_BYTES", _LIMITS.max_memory_bytes, "BYTES", shown="half the RAM"),
        _Flag("--max-job-memory-bytes", "GRADQ_MAX_JOB_MEMORY_BYTES", -1, "BYTES", shown="a quarter of it"),
        _Flag("--max-jobs", "GRADQ_MAX_JOBS", _LIMITS.max_jobs, "N"),
        _Flag("--max-jobs-per-peer", "GRADQ_MAX_JOBS_PER_PEER", -1, "N", shown="--max-jobs"),
        _Flag("--max-world-size", "GRADQ_MAX_WORLD_SIZE", _LIMITS.max_world_size, "N"),
        _Flag(
            "--job-idle-timeout",
            "GRADQ_JOB_IDLE_TIMEOUT",
            _LIMITS.job_idle_timeout_s,
            "SECONDS",
            ("job_idle_timeout_s",),
        ),
        _Flag("--max-waiting-per-job", "GRADQ_MAX_WAITING_PER_JOB", _LIMITS.max_waiting_per_job, "N"),
        _Flag("--max-waiting-per-peer", "GRADQ_MAX_WAITING_PER_PEER", _LIMITS.max_waiting_per_peer, "N"),
        _Flag("--max-waiting-calls", "GRADQ_MAX_WAITING_CALLS", _LIMITS.max_waiting_calls, "N"),
        _Flag("--max-watches", "GRADQ_MAX_WATCHES", _LIMITS.max_watches, "N"),
        _Flag("--max-streams-per-peer", "GRADQ_MAX_STREAMS_PER_PEER", _LIMITS.max_streams_per_peer, "N"),
        _Flag("--max-bucket-elements", "GRADQ_MAX_BUCKET_ELEMENTS", _POLICY.max_bucket_elements, "N"),
    ],
    "security": [
        _Flag("--tls-cert", "GRADQ_TLS_CERT", None, "PEM"),
        _Flag("--tls-key", "GRADQ_TLS_KEY", None, "PEM"),
        _Flag("--tls-client-ca", "GRADQ_TLS_CLIENT_CA", None, "PEM"),
        _Flag("--token-file", "GRADQ_TOKEN_TABLE", None, "PATH"),
    ],
    "shards": [
        _Flag("--shards", "GRADQ_SHARDS", None, "N", shown="1, or one per --shard-ports"),
        _Flag("--shard-ports", "GRADQ_SHARD_PORTS", None, "PORT,..."),
        _Flag("--advertise-host", "GRADQ_ADVERTISE_HOST", None, "HOST"),
        _Flag("--shard-group", "GRADQ_SHARD_GROUP", None, "HOST:PORT,..."),
    ],
    "observability": [
        _Flag("--metrics-port", "GRADQ_METRICS_PORT", None, "PORT"),
        _Flag("--log-level", "GRADQ_LOG_LEVEL", "INFO", "LEVEL"),
        _Flag("--log-format", "GRADQ_LOG_FORMAT", "text", "text|json"),
    ],
}
_FLAGS = [option for options in _GROUPS.values() for option in options]
_HINT = "usage: gradq serve [FLAG VALUE]...; gradq serve --help lists the flags"


class _ServeParser(argparse.ArgumentParser):
    """Says a mistake in one line and a hint, not under the whole usage."""

    def error(self, message: str) -> NoReturn:
        # argparse's "argument --port: '70000' is invalid; ..." as the flag's own "--port='70000' is invalid; ...".
        found = re.fullmatch(r"argument (--[a-z-]+): ('.*' is invalid; .*)", message, re.DOTALL)
        self.exit(2, f"{self.prog}: error: {found[1] + '=' + found[2] if found else message}\n{_HINT}\n")


def _name_flags(message: str, argv: Sequence[str]) -> str:
    """``message`` with the settings fields it names said as flags (``round_timeout_s=-1`` as ``--round-timeout=-1``).

    A value that came from the environment is named by its variable instead: the setting the user wrote.
    """
    for option in _FLAGS:
        given = any(word == option.flag or word.startswith(option.flag + "=") for word in argv)
        name = option.env if not given and os.environ.get(option.env, "").strip() else option.flag
        for field in option.fields or (option.flag[2:].replace("-", "_"),):
            message = re.sub(rf"(?<![\w-]){field}=", f"{name}=", message)
            if "_" in field:  # a bare field name, e.g. "1..world_size"
                message = re.sub(rf"(?<![\w-]){field}\b", name, message)
    return message


def _show(value: Any, metavar: str) -> str:
    """A default as --help says it (``metavar``: the flag's, e.g. BYTES)."""
    if isinstance(value, Enum):
        return value.name.lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if metavar == "BYTES" and isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value >> 30} GiB" if value % (1 << 30) == 0 else f"{value >> 20} MiB"  # not 1073741824
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _tls_files(args: argparse.Namespace) -> TlsFiles | None:
    if args.tls_cert is None and args.tls_key is None:
        if args.tls_client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key: mutual TLS is TLS first")
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise ValueError(f"--tls-cert={args.tls_cert} --tls-key={args.tls_key}: expected both or neither")
    return TlsFiles.from_paths(args.tls_cert, args.tls_key, args.tls_client_ca)


def build_parser() -> argparse.ArgumentParser:
    """The `gradq serve` argument parser, its flags in groups; defaults come from GRADQ_* environment variables."""
    parser = _ServeParser(
        prog="gradq serve",
        usage="%(prog)s [FLAG VALUE]...",
        description="Run a gradq aggregator: workers push quantized gradient buckets, it averages them and "
        "sends the mean back. One process is one shard; --shards N runs N. Each flag can also be set by the "
        "environment variable shown; docs/operating.md explains them at length.",
        formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=28),
        allow_abbrev=False,  # an error names the flag as written: no abbreviations to tell apart
    )
    for title, options in _GROUPS.items():
        group = parser.add_argument_group(title)
        for option in options:
            try:
                value = read_variable(None, option.env)
            except ValueError as error:
                parser.error(str(error))
            default = option.default if value is None else value
            shown = (
                _show(value, option.metavar)
                if value is not None
                else option.shown or _show(option.default, option.metavar)
            )
            said = "" if value is None and option.default is None and not option.shown else f" (default {shown})"
            group.add_argument(
                option.flag,
                type=flag_type(option.env),
                default=default,
                metavar=option.metavar,
                help=f"{SERVE_ENVIRONMENT[option.env]}{said} [env {option.env}]",
            )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, serve until SIGTERM/SIGINT, exit 0 after a graceful stop."""
    arguments = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(arguments)
    level = getattr(logging, str(args.log_level).upper(), None)
    if not isinstance(level, int):
        parser.error(f"--log-level={args.log_level!r} is invalid; expected DEBUG, INFO, WARNING or ERROR")
    if args.log_format not in ("text", "json"):
        parser.error(f"--log-format={args.log_format!r} is invalid; expected 'text' or 'json'")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if args.log_format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=level, handlers=[handler])
    try:
        plan = plan_shards(
            args.shards,
            args.shard_ports,
            args.port,
            args.metrics_port,
            args.host,
            args.advertise_host,
            args.shard_group,
        )
    except ValueError as error:
        parser.error(_name_flags(str(error), arguments))
    if plan is not None:
        supervisor = ShardSupervisor(plan, arguments, args.port_file, args.grace)
        supervisor.stop_on_signals()
        return supervisor.run()
    port = args.shard_ports[0] if args.shard_ports else args.port
    try:
        policy = RoundPolicy(
            world_size=args.world_size,
            round_timeout_s=args.round_timeout,
            partial_quorum=args.partial_quorum,
            return_scheme=args.return_scheme,
            return_bits=args.return_bits,
            server_error_feedback=args.server_error_feedback,
            retain_steps=args.retain_steps,
            max_bucket_elements=args.max_bucket_elements,
            non_finite=args.non_finite,
        )
        options = ServerOptions(
            f"{args.host}:{port}",
            args.max_message_bytes,
            args.max_workers,
            args.grace,
            tls=_tls_files(args),
            tokens=TokenTable.from_file(args.token_file) if args.token_file else None,
            metrics_port=args.metrics_port,
            exit_after_jobs=args.exit_after_jobs,
            keepalive_timeout_s=args.keepalive_timeout,
            shard_group=args.shard_group or (),
        )
        limits = ServiceLimits(
            max_steps_ahead=args.max_steps_ahead,
            max_open_rounds=args.max_open_rounds,
            max_jobs=args.max_jobs,
            max_jobs_per_peer=args.max_jobs_per_peer,
            max_world_size=args.max_world_size,
            job_idle_timeout_s=args.job_idle_timeout,
            max_memory_bytes=args.max_memory_bytes,
            max_job_memory_bytes=args.max_job_memory_bytes,
            max_waiting_per_job=args.max_waiting_per_job,
            max_waiting_per_peer=args.max_waiting_per_peer,
            max_waiting_calls=args.max_waiting_calls,
            max_watches=args.max_watches,
            max_streams_per_peer=args.max_streams_per_peer,
        )
        server = AggregatorServer(policy, options, limits)
        server.stop_on_signals()
        server.start()
    except BindError as error:  # not a usage mistake: one line, no usage text
        flag = "--metrics-port" if error.option == "metrics_port" else "--port"
        print(f"{parser.prog}: error: {error}; pass another {flag} (0 picks a free one)", file=sys.stderr)
        return 2
    except (ValueError, OSError) as error:
        parser.error(_name_flags(str(error), arguments))
    if args.port_file is not None:
        args.port_file.write_text(f"{server.port}\n")
    server.wait()
    return 0
