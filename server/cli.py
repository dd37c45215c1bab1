"""`gradq serve`: run one aggregator (one shard) until SIGTERM."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gradq.qcore import Scheme
from gradq.server.app import AggregatorServer, BindError, ServerOptions, TlsFiles
from gradq.server.auth import TokenTable
from gradq.server.limits import ServiceLimits
from gradq.server.policy import RoundPolicy

__all__ = ["main", "build_parser"]


def _flag_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean; expected true/false, 1/0, yes/no or on/off")


def _flag_auto(text: str) -> bool | None:
    """``auto`` (None: the policy decides) or a boolean."""
    if text.strip().lower() == "auto":
        return None
    try:
        return _flag_bool(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a boolean; expected auto, true/false, 1/0, yes/no or on/off"
        ) from None


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port; expected an integer in 0..65535") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is out of range; expected a port in 0..65535 (0 picks a free one)")
    return port


def _return_scheme(text: str) -> Scheme | None:
    if text.strip().lower() == "same":
        return None
    try:
        return Scheme.parse({"fp16": "float16", "fp32": "float32"}.get(text.strip().lower(), text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{error}, or 'same', 'fp16', 'fp32'") from None


# Each default lives once, in the dataclass that owns it.
_POLICY = RoundPolicy()
_SERVER = ServerOptions()
_LIMITS = ServiceLimits()
_HOST, _PORT = _SERVER.address.rsplit(":", 1)

# (flag, environment variable, type, default, help). Flags win over the environment.
_OPTIONS: list[tuple[str, str, Callable[[str], Any], Any, str]] = [
    ("--host", "GRADQ_HOST", str, _HOST, "address to bind"),
    ("--port", "GRADQ_PORT", _port, int(_PORT), "port to bind; 0 picks a free one (see --port-file)"),
    (
        "--world-size",
        "GRADQ_WORLD_SIZE",
        int,
        _POLICY.world_size,
        "ranks per job, as the launcher counts them (torchrun's WORLD_SIZE; under two-level aggregation a host's "
        "ranks count, not the host); a job of other ranks is refused as a configuration mismatch. 0 lets each "
        "job's first Join decide",
    ),
    (
        "--round-timeout",
        "GRADQ_ROUND_TIMEOUT",
        float,
        _POLICY.round_timeout_s,
        "seconds from a round's first contribution until it fails for every waiter, naming the missing ranks",
    ),
    (
        "--partial-quorum",
        "GRADQ_PARTIAL_QUORUM",
        int,
        _POLICY.partial_quorum,
        "0: strict rounds. N: at its deadline a round with >= N ranks completes over them (response says partial)",
    ),
    (
        "--return-scheme",
        "GRADQ_RETURN_SCHEME",
        _return_scheme,
        _POLICY.return_scheme,
        "grid of the mean sent back: 'same' as the pushes, 'fp16', 'fp32', or a scheme such as per_channel_affine",
    ),
    ("--return-bits", "GRADQ_RETURN_BITS", int, _POLICY.return_bits, "bits of a quantized --return-scheme"),
    (
        "--server-error-feedback",
        "GRADQ_SERVER_ERROR_FEEDBACK",
        _flag_auto,
        "auto",
        "carry the re-quantization error of each bucket's mean into its next round: auto (where the mean goes "
        "back on a uniform grid of 4 bits or fewer; without it such a mean is biased), true (any quantized grid, "
        "the scaled sign's too) or false",
    ),
    (
        "--retain-steps",
        "GRADQ_RETAIN_STEPS",
        int,
        _POLICY.retain_steps,
        "completed steps kept so that retried pushes get their answer; older steps are stale",
    ),
    (
        "--max-steps-ahead",
        "GRADQ_MAX_STEPS_AHEAD",
        int,
        _LIMITS.max_steps_ahead,
        "a new round's step may be at most this far past the job's newest completed step (covers pipelining)",
    ),
    (
        "--max-open-rounds",
        "GRADQ_MAX_OPEN_ROUNDS",
        int,
        _LIMITS.max_open_rounds,
        "rounds of one job in flight at once; past it, RESOURCE_EXHAUSTED",
    ),
    (
        "--max-memory-bytes",
        "GRADQ_MAX_MEMORY_BYTES",
        int,
        _LIMITS.max_memory_bytes,
        "budget for open rounds' fp32 accumulators, retained means and failures and server error-feedback "
        "residuals (default: half the machine's memory); "
        "a push past it gets RESOURCE_EXHAUSTED",
    ),
    (
        "--max-job-memory-bytes",
        "GRADQ_MAX_JOB_MEMORY_BYTES",
        int,
        -1,
        "the most of --max-memory-bytes one job may hold (-1: a quarter of it), so one job cannot starve the others",
    ),
    (
        "--max-jobs",
        "GRADQ_MAX_JOBS",
        int,
        _LIMITS.max_jobs,
        "jobs known at once; a Join for a new job past it is refused",
    ),
    (
        "--max-jobs-per-peer",
        "GRADQ_MAX_JOBS_PER_PEER",
        int,
        -1,
        "jobs one client host may have started that the aggregator still holds (-1: --max-jobs); set it lower "
        "where untrusted hosts share the aggregator; past it, RESOURCE_EXHAUSTED",
    ),
    (
        "--max-world-size",
        "GRADQ_MAX_WORLD_SIZE",
        int,
        _LIMITS.max_world_size,
        "largest job a Join may ask for, in ranks; it bounds a job's members, an elastic job's member ids and a "
        "job's Watch streams too",
    ),
    (
        "--job-idle-timeout",
        "GRADQ_JOB_IDLE_TIMEOUT",
        float,
        _LIMITS.job_idle_timeout_s,
        "seconds without a Join, PushPull or Leave after which a job is forgotten (its rounds fail)",
    ),
    (
        "--max-waiting-per-job",
        "GRADQ_MAX_WAITING_PER_JOB",
        int,
        _LIMITS.max_waiting_per_job,
        "PushPull calls of one job waiting for their rounds at once; past it, RESOURCE_EXHAUSTED",
    ),
    (
        "--max-waiting-per-peer",
        "GRADQ_MAX_WAITING_PER_PEER",
        int,
        _LIMITS.max_waiting_per_peer,
        "PushPull calls from one client host waiting at once; past it, RESOURCE_EXHAUSTED",
    ),
    (
        "--max-waiting-calls",
        "GRADQ_MAX_WAITING_CALLS",
        int,
        _LIMITS.max_waiting_calls,
        "PushPull calls waiting at once in all (each holds no thread, ~25 KB); past it, RESOURCE_EXHAUSTED",
    ),
    (
        "--max-watches",
        "GRADQ_MAX_WATCHES",
        int,
        _LIMITS.max_watches,
        "Watch streams open at once (one per joined rank, no thread each): past it a rank's loss is "
        "found at the round deadline",
    ),
    (
        "--max-message-bytes",
        "GRADQ_MAX_MESSAGE_BYTES",
        int,
        _SERVER.max_message_bytes,
        "largest gRPC message accepted or sent (default 1 GiB; gRPC's own default is 4 MiB)",
    ),
    (
        "--max-workers",
        "GRADQ_MAX_WORKERS",
        int,
        _SERVER.max_workers,
        "threads that decode, accumulate and average pushes; a waiting PushPull holds none (it waits on the "
        "event loop)",
    ),
    (
        "--non-finite",
        "GRADQ_NON_FINITE",
        str,
        _POLICY.non_finite,
        "a rank reporting NaN/Inf gradients: 'reject' fails the round for all, 'skip' returns zeros marked skipped",
    ),
    (
        "--max-bucket-elements",
        "GRADQ_MAX_BUCKET_ELEMENTS",
        int,
        _POLICY.max_bucket_elements,
        "largest bucket accepted, in elements (its fp32 accumulator is 4 bytes each)",
    ),
    ("--grace", "GRADQ_GRACE", float, _SERVER.grace_s, "seconds rounds in flight get to finish after SIGTERM"),
    (
        "--exit-after-jobs",
        "GRADQ_EXIT_AFTER_JOBS",
        int,
        _SERVER.exit_after_jobs,
        "stop gracefully and exit 0 once N jobs have finished (every rank of each has left, e.g. a Compose "
        "cluster's one job); 0 serves until SIGTERM",
    ),
    ("--log-level", "GRADQ_LOG_LEVEL", str, "INFO", "DEBUG, INFO, WARNING or ERROR"),
    ("--log-format", "GRADQ_LOG_FORMAT", str, "text", "'text' or 'json' (one JSON object per line, for log shippers)"),
    ("--port-file", "GRADQ_PORT_FILE", Path, None, "write the bound port to this file once serving"),
    (
        "--metrics-port",
        "GRADQ_METRICS_PORT",
        _port,
        None,
        "serve Prometheus metrics at http://HOST:PORT/metrics and a status page at /status",
    ),
    ("--tls-cert", "GRADQ_TLS_CERT", Path, None, "PEM certificate chain: serve TLS (with --tls-key)"),
    ("--tls-key", "GRADQ_TLS_KEY", Path, None, "PEM private key of --tls-cert"),
    (
        "--tls-client-ca",
        "GRADQ_TLS_CLIENT_CA",
        Path,
        None,
        "PEM CA bundle: require client certificates signed by it (mutual TLS)",
    ),
    (
        "--token-file",
        "GRADQ_TOKEN_FILE",
        Path,
        None,
        "require 'authorization: Bearer <token>'; one token per line: 'TOKEN job=JOB [rank=RANK]' scopes it to "
        "a job (JOB ending in '*': a job-id prefix) and a rank; 'TOKEN' or 'TOKEN RANK' leaves it any job",
    ),
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
        "sends the mean back. Run one process per shard. Every flag can also be set by the environment "
        "variable shown.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for flag, env, kind, default, text in _OPTIONS:
        raw = os.environ.get(env)
        if raw is not None:
            try:
                default = kind(raw)
            except (ValueError, argparse.ArgumentTypeError) as error:
                parser.error(f"environment variable {env}={raw!r} is invalid: {error}")
        parser.add_argument(flag, type=kind, default=default, help=f"{text} [env {env}]")
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
            f"{args.host}:{args.port}",
            args.max_message_bytes,
            args.max_workers,
            args.grace,
            tls=_tls_files(args),
            tokens=TokenTable.from_file(args.token_file) if args.token_file else None,
            metrics_port=args.metrics_port,
            exit_after_jobs=args.exit_after_jobs,
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
