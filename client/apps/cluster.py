"""`gradq worker`: one training rank in a multi-host cluster (the Compose workers).

Ranks need no configuration: every worker resolves the peers' DNS name (a
Compose service resolves to all its replicas), waits until exactly
``--world-size`` addresses are there and have stayed so for ``--peer-settle``
seconds, and takes its place in their sorted order; the lowest address hosts
the gloo rendezvous. More addresses than ``--world-size`` fail every worker within seconds.

Every flag can also be set by a GRADQ_* environment variable, so a Compose
override adds settings (``environment`` merges key by key) without repeating
the command (``command`` is replaced whole). The variables the DDP hook reads
too are read by gradq.client.env, as ``GradqConfig.from_env()`` reads them:
one parser, one default, one error message each. The worker builds one
GradqConfig from them (a flag wins over its variable) and trains with it on
either path. Before it loads torch a worker checks its settings, then waits
up to ``--connect-timeout`` for its aggregator's health check; either failing
is one line and exit status 2.

A worker leaves on SIGTERM at once, even from inside a blocking collective,
with its verdict's exit status when it has one (``docker compose up
--exit-code-from worker`` stops the other workers when the first one ends and
reports the status of the last to stop), else 143.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gradq.client.apps.reachability import wait_for_aggregators
from gradq.client.bit_policy import BIT_POLICIES
from gradq.client.config import GradqConfig
from gradq.client.env import (
    HOOK_ENVIRONMENT,
    HOOK_PARSERS,
    HOST_GROUPINGS,
    flag_type,
    parse_integer,
    parse_number,
    quantized_scheme_names,
    read_variable,
)
from gradq.client.security import ChannelSecurity
from gradq.client.sending import AggregationError
from gradq.client.variable_names import warn_unknown_variables
from gradq.qcore import QuantConfig

if TYPE_CHECKING:
    from gradq.client.apps.training import TrainResult

__all__ = ["PeerDiscovery", "build_parser", "exit_on_sigterm", "main", "run"]

# The exit status of a worker stopped by SIGTERM before it has a verdict (128 + SIGTERM, as a shell reports it).
_STOPPED_STATUS = 128 + signal.SIGTERM
# An elastic host's epoch: about two passes over the training split (1437 digits) in its batches of 128.
_ELASTIC_STEPS_PER_EPOCH = 24
# The flags that set one GradqConfig field each: flag -> (its variable, the field, help). A flag is parsed as its
# variable is, defaults to it, else to the field's GradqConfig default. --bits and --scheme make the grid
# (GradqConfig.quant), --error-feedback is a switch, and the TLS files and token make GradqConfig.security.
_FIELD_FLAGS = {
    "--connect-timeout": (
        "GRADQ_CONNECT_TIMEOUT",
        "connect_timeout_s",
        "seconds to wait for each aggregator shard to answer, before training and at the first Join",
    ),
    "--fallback": (
        "GRADQ_FALLBACK",
        "fallback",
        "if the aggregator cannot be reached at the first Join: error, or train without it: allreduce or allgather "
        "(the check before training waits for it either way)",
    ),
    "--chunk-elements": ("GRADQ_CHUNK_ELEMENTS", "chunk_elements", "largest round a bucket is cut into"),
    "--host": ("GRADQ_HOST", "host", "this rank's host name: ranks with the same one reduce together first"),
    "--host-grouping": (
        "GRADQ_HOST_GROUPING",
        "host_grouping",
        f"{' or '.join(HOST_GROUPINGS)}: two-level where hosts hold several ranks, or every rank pushes alone",
    ),
    "--elastic-hosts": (
        "GRADQ_ELASTIC_HOSTS",
        "elastic_hosts",
        "0: one rank of a fixed DDP job (peers found by --peers); N: one host of an elastic job that starts "
        "once N hosts joined, survives lost hosts and lets new ones join (needs --job-id; no peers, one aggregator)",
    ),
    "--elastic-max-hosts": (
        "GRADQ_ELASTIC_MAX_HOSTS",
        "elastic_max_hosts",
        "elastic: the most hosts the job holds at once; a host past it is refused at its Join (0: no cap)",
    ),
    "--bit-policy": ("GRADQ_BIT_POLICY", "bit_policy", f"{' or '.join(BIT_POLICIES)}: bits per bucket piece"),
    "--average-bits": ("GRADQ_AVERAGE_BITS", "average_bits", "the adaptive policy's most bits per element on average"),
    "--job-id": ("GRADQ_JOB_ID", "job_id", "aggregator job shared by all ranks (unset: rank 0 draws one per run)"),
}
_SECURITY_FLAGS = {
    "--tls-ca": ("GRADQ_TLS_CA", "PEM CA of the aggregator's certificate: talk TLS"),
    "--tls-cert": ("GRADQ_TLS_CLIENT_CERT", "this worker's PEM certificate, for mutual TLS"),
    "--tls-key": ("GRADQ_TLS_CLIENT_KEY", "its PEM key"),
    "--token-file": ("GRADQ_TOKEN_FILE", "file holding the bearer token to send"),
}
_FIELD_DEFAULTS = {field.name: field.default for field in dataclasses.fields(GradqConfig)}


class PeerDiscovery:
    """This host's rank among the addresses a DNS name (``peers``) resolves to.

    Args:
        peers: DNS name of every worker (a Compose service name).
        world_size: how many workers the job has.
        timeout_s: how long ``wait`` waits for them.
        settle_s: how long the addresses must stay unchanged before ranks are
            taken, so that replicas starting a moment apart agree on them.
    """

    def __init__(self, peers: str, world_size: int, timeout_s: float, settle_s: float) -> None:
        self.peers = peers
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.settle_s = settle_s
        # The most addresses seen so far: a worker stopped while it waits still knows it was one too many.
        self.most_seen: list[str] = []

    def _resolve(self) -> list[str]:
        try:
            infos = socket.getaddrinfo(self.peers, None, socket.AF_INET)
        except socket.gaierror:
            return []
        found = sorted({str(info[4][0]) for info in infos}, key=ipaddress.ip_address)
        if len(found) > len(self.most_seen):
            self.most_seen = found
        return found

    def too_many(self) -> str | None:
        """The error message if more than ``world_size`` workers were ever seen, else None."""
        if len(self.most_seen) <= self.world_size:
            return None
        count = len(self.most_seen)
        return (
            f"--peers={self.peers!r} resolves to {count} workers {self.most_seen}, but --world-size="
            f"{self.world_size}; in Compose both come from GRADQ_WORKERS: run `GRADQ_WORKERS={count} docker "
            f"compose up` instead of `--scale worker={count}`"
        )

    def wait(self) -> tuple[int, str]:
        """Block until exactly ``world_size`` settled addresses include this host's.

        Returns:
            (this host's rank, the rank-0 address).

        Raises:
            RuntimeError: more than ``world_size`` addresses (after ``settle_s``), or not
                ``world_size`` settled ones including this host within ``timeout_s``.
        """
        mine = socket.gethostbyname(socket.gethostname())
        started = time.monotonic()
        found: list[str] = []
        changed_at = started
        while True:
            now = time.monotonic()
            seen = self._resolve()
            problem = self.too_many()
            if problem is not None:
                # Stay resolvable a while: workers that start later then see the surplus too and fail
                # alike, rather than waiting for peers that have gone (or being stopped with no verdict).
                time.sleep(self.settle_s)
                raise RuntimeError(problem)
            if seen != found:
                found, changed_at = seen, now
            if len(found) == self.world_size and mine in found and now - changed_at >= self.settle_s:
                return found.index(mine), found[0]
            if now - started > self.timeout_s:
                raise RuntimeError(
                    f"--peers={self.peers!r} resolved to {found} after {now - started:.0f} s (--peer-timeout); "
                    f"expected {self.world_size} addresses including this host's {mine}; in Compose, "
                    "GRADQ_WORKERS sets both the number of workers and --world-size"
                )
            time.sleep(0.25)


def exit_on_sigterm(status: Callable[[], int]) -> None:
    """On SIGTERM, print why and end the process with ``status()``, whatever the main thread is doing.

    A Python signal handler runs only when the main thread is back in the
    interpreter, which a gloo collective waiting for a dead peer never is; the
    wakeup fd is written by the C-level handler at once, and a thread acts on it.
    Call from the main thread.
    """
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.signal(signal.SIGTERM, lambda _signum, _frame: None)  # the wakeup fd below does the work
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

    def watch() -> None:
        while signal.SIGTERM not in os.read(read_end, 16):
            pass
        code = status()
        print(f"received SIGTERM: exiting with status {code}", flush=True)
        os._exit(code)

    threading.Thread(target=watch, name="gradq-sigterm", daemon=True).start()


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, but not None: those options say in words what being unset means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The `gradq worker` argument parser; defaults come from GRADQ_* environment variables, else from GradqConfig.

    The variables are read by gradq.client.env, the reader behind
    ``GradqConfig.from_env()``: the same names, parsing, errors and defaults.

    Args:
        environ: the variables (None: ``os.environ``).

    Raises:
        ValueError: a variable holds a bad value; the message names it, its value and what was expected.
    """
    parser = argparse.ArgumentParser(
        prog="gradq worker",
        description="Train the digits MLP as one DDP rank through a gradq aggregator (one process per host). "
        "Every flag can also be set by the environment variable shown; flags win.",
        formatter_class=_HelpFormatter,
    )

    def option(
        flag: str, env: str, help_text: str, default: Any = None, parse: Callable[[str], Any] | None = None
    ) -> None:
        parse = parse or HOOK_PARSERS[env]
        value = read_variable(environ, env, parse)
        parser.add_argument(
            flag, type=flag_type(parse), default=default if value is None else value, help=f"{help_text} [env {env}]"
        )

    warn_unknown_variables(environ, HOOK_ENVIRONMENT)
    read_variable(environ, "GRADQ_AGGREGATORS")  # checked now; read again where a flag may replace it
    parser.add_argument(
        "--aggregator",
        action="append",
        help="host:port of a shard (repeatable) [env GRADQ_AGGREGATORS: comma-separated, in shard order]",
    )
    option("--world-size", "GRADQ_WORLD_SIZE", "ranks in the job (required)", parse=parse_integer(1))
    option("--peers", "GRADQ_PEERS", "DNS name resolving to every worker's address", "worker", str)
    option("--master-port", "GRADQ_MASTER_PORT", "gloo rendezvous port on rank 0", 29500, parse_integer(1, 65535))
    option("--peer-timeout", "GRADQ_PEER_TIMEOUT", "seconds to wait for all peers", 60.0, parse_number(0, above=True))
    option("--peer-settle", "GRADQ_PEER_SETTLE", "seconds the peer addresses must stay unchanged", 3.0, parse_number(0))
    option("--epochs", "GRADQ_EPOCHS", "passes over the training split (elastic: 24 steps each)", 20, parse_integer(1))
    option("--min-accuracy", "GRADQ_MIN_ACCURACY", "exit 0 only at or above this accuracy", 90.0, parse_number(0, 100))
    option("--bits", "GRADQ_BITS", "bits per gradient element, 1..8", QuantConfig().bits)
    option(
        "--scheme",
        "GRADQ_SCHEME",
        f"quantization scheme: {', '.join(quantized_scheme_names())}",
        QuantConfig().scheme.name.lower(),
    )
    parser.add_argument(
        "--error-feedback",
        action=argparse.BooleanOptionalAction,
        default=read_variable(environ, "GRADQ_ERROR_FEEDBACK"),
        help="carry quantization error into the next step (unset: off, as in GradqConfig) [env GRADQ_ERROR_FEEDBACK]",
    )
    for flag, (env, field, help_text) in _FIELD_FLAGS.items():
        option(flag, env, help_text, _FIELD_DEFAULTS[field])
    for flag, (env, help_text) in _SECURITY_FLAGS.items():
        option(flag, env, help_text)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Train as one rank; exit status 0 at or above ``--min-accuracy``, 1 below it, 2 on bad settings.

    Ends the process itself once it has a status: during Python's own teardown
    (a second, with torch) SIGTERM has its default action again, and a stop
    then would turn this rank's verdict into 143.
    """
    try:
        status = run(argv)
    except SystemExit as stop:  # argparse: --help, or a configuration error
        status = stop.code if isinstance(stop.code, int) else 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _gradq_config(parser: argparse.ArgumentParser, args: argparse.Namespace, addresses: list[str]) -> GradqConfig:
    """The one GradqConfig both paths train with: each field from its flag, else its variable, else its default.

    A bad value or combination ends in argparse's error (exit 2), naming the field and value.
    """
    fields = {field: getattr(args, flag[2:].replace("-", "_")) for flag, (_, field, _) in _FIELD_FLAGS.items()}
    if args.error_feedback is not None:
        fields["error_feedback"] = args.error_feedback
    files = [getattr(args, flag[2:].replace("-", "_")) for flag in _SECURITY_FLAGS]
    try:
        if any(files):
            ca, cert, key, token_file = files
            token = token_file.read_text().strip() if token_file else None
            fields["security"] = ChannelSecurity.from_files(ca, cert, key, token)
        return GradqConfig.of(addresses, QuantConfig(scheme=args.scheme, bits=args.bits), **fields)
    except (ValueError, OSError) as error:
        parser.error(str(error))


def _train_elastic_host(args: argparse.Namespace, gradq: GradqConfig) -> int:
    """One host of an elastic job (see gradq.client.session.elastic): exit 0 at or above --min-accuracy."""
    try:
        wait_for_aggregators(list(gradq.addresses), gradq.connect_timeout_s, gradq.security)
    except AggregationError as error:
        print(f"gradq worker: error: {error}; check --aggregator (GRADQ_AGGREGATORS)", file=sys.stderr, flush=True)
        return 2
    print(f"elastic host of job {gradq.job_id!r}: aggregator {gradq.addresses[0]} serving; loading torch", flush=True)
    from gradq.client.apps.elastic_training import ElasticSpec, ElasticStep, train_elastic

    def report(step: ElasticStep) -> None:
        if step.step % _ELASTIC_STEPS_PER_EPOCH == 0:
            print(f"member {step.member}: step {step.step}  loss {step.loss:.4f}  ranks {step.ranks}", flush=True)

    spec = ElasticSpec(gradq, steps=args.epochs * _ELASTIC_STEPS_PER_EPOCH, on_step=report)
    try:
        result = train_elastic(spec)
    except AggregationError as error:
        print(f"gradq worker: error: {error}", file=sys.stderr, flush=True)
        return 1
    passed = result.accuracy >= args.min_accuracy
    print(
        f"member {result.member}: steps {result.first_step}..{result.first_step + result.steps}, held-out loss "
        f"{result.held_out_loss:.4f}, accuracy {result.accuracy:.1f}%; verdict: {'PASS' if passed else 'FAIL'}",
        flush=True,
    )
    return 0 if passed else 1


def run(argv: Sequence[str] | None = None) -> int:
    """Train as one rank (fixed or elastic, as the flags say) and return ``main``'s exit status; main ends the process.

    Args:
        argv: the flags (None: ``sys.argv[1:]``).

    Returns:
        0 at or above ``--min-accuracy``, 1 below it or when the aggregator fails, 2 on bad settings.

    Raises:
        SystemExit: argparse's ``--help`` or a configuration error (status 2).
    """
    try:
        parser = build_parser()
    except ValueError as error:  # a bad GRADQ_* variable
        print(f"gradq worker: error: {error}", file=sys.stderr, flush=True)
        return 2
    args = parser.parse_args(argv)
    aggregators = args.aggregator or read_variable(None, "GRADQ_AGGREGATORS")
    if not aggregators:
        parser.error("no aggregator: give --aggregator host:port (repeatable) or GRADQ_AGGREGATORS=host:port,...")
    if args.elastic_hosts:
        if args.job_id is None:
            parser.error("--elastic-hosts needs --job-id (GRADQ_JOB_ID): independent hosts find their job by it")
        if len(aggregators) != 1:
            parser.error(f"--elastic-hosts: an elastic job runs on one aggregator; got {len(aggregators)}")
        return _train_elastic_host(args, _gradq_config(parser, args, aggregators))
    if args.world_size is None:
        parser.error("no world size: give --world-size N or GRADQ_WORLD_SIZE=N, the number of workers (>= 1)")
    gradq = _gradq_config(parser, args, aggregators)
    discovery = PeerDiscovery(args.peers, args.world_size, args.peer_timeout, args.peer_settle)
    verdict: list[int] = []  # 0 or 1 once this rank has its result; 2 once it has reported a bad setting

    def stopped_status() -> int:
        # Stopped by SIGTERM: the verdict if there is one; a surplus worker's configuration error; else 143.
        problem = discovery.too_many()
        if problem is not None and not verdict:
            print(f"gradq worker: error: {problem}", flush=True)
            return 2
        return verdict[0] if verdict else _STOPPED_STATUS

    exit_on_sigterm(stopped_status)
    print(f"waiting for {args.world_size} workers behind {args.peers!r}", flush=True)
    try:
        rank, master = discovery.wait()
    except RuntimeError as error:
        # Reported here, once: a SIGTERM while this process exits (Compose stops the others as the first
        # fails) must end it with the same status and not print the error a second time.
        verdict.append(2)
        parser.error(str(error))
    print(
        f"rank {rank} of {args.world_size}; rendezvous {master}:{args.master_port}; waiting up to "
        f"{gradq.connect_timeout_s:g} s for the aggregator at {', '.join(aggregators)} (--connect-timeout)",
        flush=True,
    )
    try:
        wait_for_aggregators(aggregators, gradq.connect_timeout_s, gradq.security)
    except AggregationError as error:
        print(
            f"gradq worker: error: {error}; check --aggregator (GRADQ_AGGREGATORS), or wait longer with "
            "--connect-timeout (GRADQ_CONNECT_TIMEOUT)",
            file=sys.stderr,
            flush=True,
        )
        return 2
    print(f"rank {rank}: aggregator {', '.join(aggregators)} serving; loading torch", flush=True)
    loading = time.monotonic()
    # Imported only now (torch takes seconds): a misconfigured cluster fails on every worker at once.
    from gradq.client.apps.training import TrainSpec, train_digits

    print(f"rank {rank}: torch loaded in {time.monotonic() - loading:.1f} s; joining the DDP job", flush=True)

    def report_epoch(epoch: int, loss: float, accuracy: float) -> None:
        print(
            f"rank {rank}: epoch {epoch:>3}/{args.epochs}  loss {loss:.4f}  test accuracy {accuracy:5.1f}%", flush=True
        )

    def report_result(result: TrainResult) -> None:
        # Printed before this rank leaves the aggregator: the aggregator may exit on the last
        # Leave, and `--exit-code-from` then stops every worker.
        passed = result.accuracy >= args.min_accuracy
        pushes = result.stats.pushes if result.stats is not None else 0
        print(
            f"rank {rank}: accuracy {result.accuracy:.1f}% after {result.steps} steps, "
            f"{result.bytes_sent / max(result.steps, 1):,.0f} bytes sent per step "
            f"({result.bytes_sent / max(result.fp32_bytes, 1):.3f}x fp32), mode {result.mode}; "
            f"{pushes} pushes, {result.bytes_sent} bytes in all",
            flush=True,
        )
        print(
            f"rank {rank}: verdict: {'PASS' if passed else 'FAIL'} (accuracy {result.accuracy:.1f}% vs "
            f"--min-accuracy {args.min_accuracy:.1f}%)",
            flush=True,
        )
        verdict.append(0 if passed else 1)

    spec = TrainSpec(
        world_size=args.world_size,
        init_method=f"tcp://{master}:{args.master_port}",
        gradq=gradq,
        epochs=args.epochs,
        on_epoch=report_epoch,
        on_trained=report_result,
    )
    train_digits(rank, spec)
    return verdict[0]
