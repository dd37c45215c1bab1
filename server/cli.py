"""`gradq serve`: run one aggregator (one shard) until SIGTERM, or with --shards N, N of them supervised."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

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

# (flag, environment variable, default); the variable's meaning and parser are in gradq.server.env.
# Flags win over the environment.
_OPTIONS: list[tuple[str, str, Any]] = [
    ("--host", "GRADQ_BIND_HOST", _HOST),
    ("--port", "GRADQ_PORT", int(_PORT)),
    ("--world-size", "GRADQ_WORLD_SIZE", _POLICY.world_size),
    ("--round-timeout", "GRADQ_ROUND_TIMEOUT", _POLICY.round_timeout_s),
    ("--partial-quorum", "GRADQ_PARTIAL_QUORUM", _POLICY.partial_quorum),
    ("--return-scheme", "GRADQ_RETURN_SCHEME", _POLICY.return_scheme),
    ("--return-bits", "GRADQ_RETURN_BITS", _POLICY.return_bits),
    ("--server-error-feedback", "GRADQ_SERVER_ERROR_FEEDBACK", "auto"),
    ("--retain-steps", "GRADQ_RETAIN_STEPS", _POLICY.retain_steps),
    ("--max-steps-ahead", "GRADQ_MAX_STEPS_AHEAD", _LIMITS.max_steps_ahead),
    ("--max-open-rounds", "GRADQ_MAX_OPEN_ROUNDS", _LIMITS.max_open_rounds),
    ("--max-memory-bytes", "GRADQ_MAX_MEMORY_BYTES", _LIMITS.max_memory_bytes),
    ("--max-job-memory-bytes", "GRADQ_MAX_JOB_MEMORY_BYTES", -1),
    ("--max-jobs", "GRADQ_MAX_JOBS", _LIMITS.max_jobs),
    ("--max-jobs-per-peer", "GRADQ_MAX_JOBS_PER_PEER", -1),
    ("--max-world-size", "GRADQ_MAX_WORLD_SIZE", _LIMITS.max_world_size),
    ("--job-idle-timeout", "GRADQ_JOB_IDLE_TIMEOUT", _LIMITS.job_idle_timeout_s),
    ("--max-waiting-per-job", "GRADQ_MAX_WAITING_PER_JOB", _LIMITS.max_waiting_per_job),
    ("--max-waiting-per-peer", "GRADQ_MAX_WAITING_PER_PEER", _LIMITS.max_waiting_per_peer),
    ("--max-waiting-calls", "GRADQ_MAX_WAITING_CALLS", _LIMITS.max_waiting_calls),
    ("--max-watches", "GRADQ_MAX_WATCHES", _LIMITS.max_watches),
    ("--max-message-bytes", "GRADQ_MAX_MESSAGE_BYTES", _SERVER.max_message_bytes),
    ("--max-workers", "GRADQ_MAX_WORKERS", _SERVER.max_workers),
    ("--non-finite", "GRADQ_NON_FINITE", _POLICY.non_finite),
    ("--max-bucket-elements", "GRADQ_MAX_BUCKET_ELEMENTS", _POLICY.max_bucket_elements),
    ("--grace", "GRADQ_GRACE", _SERVER.grace_s),
    ("--keepalive-timeout", "GRADQ_KEEPALIVE_TIMEOUT", _SERVER.keepalive_timeout_s),
    ("--exit-after-jobs", "GRADQ_EXIT_AFTER_JOBS", _SERVER.exit_after_jobs),
    ("--log-level", "GRADQ_LOG_LEVEL", "INFO"),
    ("--log-format", "GRADQ_LOG_FORMAT", "text"),
    ("--port-file", "GRADQ_PORT_FILE", None),
    ("--metrics-port", "GRADQ_METRICS_PORT", None),
    ("--tls-cert", "GRADQ_TLS_CERT", None),
    ("--tls-key", "GRADQ_TLS_KEY", None),
    ("--tls-client-ca", "GRADQ_TLS_CLIENT_CA", None),
    ("--token-file", "GRADQ_TOKEN_TABLE", None),
    ("--shards", "GRADQ_SHARDS", None),
    ("--shard-ports", "GRADQ_SHARD_PORTS", None),
    ("--advertise-host", "GRADQ_ADVERTISE_HOST", None),
    ("--shard-group", "GRADQ_SHARD_GROUP", None),
]


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
    """The `gradq serve` argument parser; defaults come from GRADQ_* environment variables."""
    parser = argparse.ArgumentParser(
        prog="gradq serve",
        description="Run a gradq aggregator: workers push quantized gradient buckets, it averages them and "
        "sends the mean back. One process is one shard; --shards N runs N, supervised. Every flag can also be set "
        "by the environment variable shown.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for flag, env, default in _OPTIONS:
        try:
            value = read_variable(None, env)
        except ValueError as error:
            parser.error(str(error))
        default = default if value is None else value
        parser.add_argument(flag, type=flag_type(env), default=default, help=f"{SERVE_ENVIRONMENT[env]} [env {env}]")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, serve until SIGTERM/SIGINT, exit 0 after a graceful stop."""
    parser = build_parser()
    args = parser.parse_args(argv)
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
        parser.error(str(error))
    if plan is not None:
        supervisor = ShardSupervisor(plan, sys.argv[1:] if argv is None else list(argv), args.port_file, args.grace)
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
        )
        server = AggregatorServer(policy, options, limits)
        server.stop_on_signals()
        server.start()
    except BindError as error:  # not a usage mistake: one line, no usage text
        flag = "--metrics-port" if error.option == "metrics_port" else "--port"
        print(f"{parser.prog}: error: {error}; pass another {flag} (0 picks a free one)", file=sys.stderr)
        return 2
    except (ValueError, OSError) as error:
        parser.error(str(error))
    if args.port_file is not None:
        args.port_file.write_text(f"{server.port}\n")
    server.wait()
    return 0
