"""Build, start and stop an aggregator: the servicer plus health, reflection and message limits."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import signal
import socket
import threading
import time
from collections.abc import Coroutine
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gradq.proto.transport import DEFAULT_MAX_MESSAGE_BYTES, channel_options, keep_large_buffers
from gradq.server.auth import TokenAuthInterceptor, TokenTable
from gradq.server.budget import return_free_memory
from gradq.server.limits import ServiceLimits
from gradq.server.liveness import Liveness
from gradq.server.metrics import DEFAULT_FINISHED_JOB_SERIES_S, RoundMetrics
from gradq.server.policy import RoundPolicy
from gradq.server.reports import RoundObservers
from gradq.server.rounds import RoundTable
from gradq.server.servicer import SERVICE_NAME, AggregatorServicer, add_aggregator_to_server, package_result
from gradq.server.shard_group import shards_handler
from gradq.server.status import RecentErrors, StatusSnapshot, take_snapshot
from gradq.server.status_page import MetricsHttpServer
from gradq.server.waiting import WaitingCalls

__all__ = [
    "AggregatorServer",
    "BindError",
    "ServerOptions",
    "ServiceLimits",
    "TlsFiles",
    "SERVICE_NAME",
    "DEFAULT_MAX_MESSAGE_BYTES",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# After the rounds are settled, time for their answers to leave before the port closes.
_ANSWER_GRACE_S = 2.0
# Calls gRPC admits beyond the waiting PushPulls, so Join, Leave, health probes and
# pushes that do not wait always get in, however many calls are parked.
_RESERVED_CALLS = 64
# A rank's liveness is its Watch stream's heartbeat (gradq.server.liveness): one late by more than
# --keepalive-timeout (KEEPALIVE_TIMEOUT_S by default) loses the rank, so a stopped process, a hung host
# or a partition is found within a heartbeat and that. A process that dies is found at once (its
# kernel closes its connections).
KEEPALIVE_S = 1.0
KEEPALIVE_TIMEOUT_S = 1.5  # the default of ServerOptions.keepalive_timeout_s (--keepalive-timeout)
# HTTP/2 pings on every connection, answered by gRPC's own threads, close a connection whose peer is
# gone without a word (power loss, a cut cable) and watch a client that promises no heartbeat. Their
# answers queue behind the bytes the peer has in flight on that connection: across a 4-8 Mbit/s link
# the megabytes of pushes a host keeps in flight delay them by seconds, so a timeout that finds a
# stopped host quickly would cut healthy ones (tests/reliability/test_slow_link_liveness.py). An
# unanswered ping therefore closes a connection only after this long.
CONNECTION_TIMEOUT_S = 60.0


def _keepalive(timeout_s: float) -> tuple[tuple[str, int], ...]:
    timeout_ms = int(max(CONNECTION_TIMEOUT_S, timeout_s) * 1000)
    return (
        ("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # Every ping's answer, a bandwidth probe's too: one ping is in flight at a time, so a probe
        # sent just as the peer fell silent would otherwise hold back the keepalive.
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.http2.max_pings_without_data", 0),
        # gRPC's floor between pings on a connection without data frames (minutes by default in
        # some versions), which would let a silent peer that sends nothing go unpinged.
        ("grpc.http2.min_time_between_pings_ms", int(KEEPALIVE_S * 1000)),
    )


# How often the sweeper closes rounds past their deadline that nobody waits for and expires idle jobs.
_SWEEP_PERIOD_S = 0.25
# Return freed heap to the OS once the budget's use has fallen by this much since the last time.
_TRIM_AFTER_BYTES = 16 << 20
# ... and at least this often (malloc_trim takes well under a millisecond here).
_TRIM_EVERY_S = 5.0


class BindError(OSError):
    """A port the aggregator was told to serve on cannot be bound (in use, or not an address of this host).

    Args:
        option: the ServerOptions field that named it: "address" or "metrics_port".
        address: host:port that could not be bound.
        reason: why, in words.
    """

    def __init__(self, option: str, address: str, reason: str) -> None:
        super().__init__(f"cannot listen on {address}: {reason}")
        self.option = option
        self.address = address
        self.reason = reason


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM bytes for a TLS aggregator; ``client_ca`` turns on mutual TLS."""

    certificate_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None

    @classmethod
    def from_paths(cls, cert: Path, key: Path, client_ca: Path | None = None) -> TlsFiles:
        """Read the PEM files (server certificate chain, its key, optional client CA)."""
        return cls(cert.read_bytes(), key.read_bytes(), client_ca.read_bytes() if client_ca else None)

    def credentials(self) -> grpc.ServerCredentials:
        """gRPC server credentials; clients must present a certificate when ``client_ca`` is set."""
        return grpc.ssl_server_credentials(
            [(self.private_key, self.certificate_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """Transport settings of one aggregator process.

    Args:
        address: host:port to bind; port 0 picks a free port.
        max_message_bytes: largest request or response accepted, in bytes.
        max_workers: threads that join, decode and accumulate pushes, average
            and leave. A PushPull waits for its round on the event loop and
            holds none while it waits, so a few per core suffice.
        grace_s: on stop, rounds in flight get this long to finish.
        tls: serve TLS (and mutual TLS with a client CA); None serves plaintext.
        tokens: require a bearer token on every call but health and reflection.
        metrics_port: serve Prometheus metrics (/metrics) and the status page
            (/status) over HTTP on this port (0 picks one; None serves none).
        exit_after_jobs: stop by itself once this many jobs have finished (every
            rank of each has left); 0 serves until stopped.
        keepalive_timeout_s: how late a rank's heartbeat (on its Watch stream)
            may be before the rank is lost; a connection that leaves HTTP/2
            pings unanswered is closed after the longer of this and
            CONNECTION_TIMEOUT_S.
        finished_job_series_s: with metrics, how long a job that ended (every
            rank left, or it expired) keeps its series on /metrics, with their
            final values, before they are removed.
        shard_group: host:port of every shard of this one's group, in shard
            order, answered to the Shards RPC so a worker given one address
            learns the others (see gradq.server.shard_group); () is a shard alone.
    """

    address: str = "0.0.0.0:50051"
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_workers: int = 8
    grace_s: float = 10.0
    tls: TlsFiles | None = None
    tokens: TokenTable | None = None
    metrics_port: int | None = None
    exit_after_jobs: int = 0
    keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S
    shard_group: tuple[str, ...] = ()
    finished_job_series_s: float = DEFAULT_FINISHED_JOB_SERIES_S

    def __post_init__(self) -> None:
        if not 0.1 <= self.keepalive_timeout_s <= 3600:
            raise ValueError(
                f"keepalive_timeout_s={self.keepalive_timeout_s} is invalid; expected 0.1..3600 seconds: how late a "
                "rank's heartbeat may be before the rank is lost"
            )


class AggregatorServer:
    """One aggregator process: start(), wait(), stop(); `port` is the bound port."""

    def __init__(self, policy: RoundPolicy, options: ServerOptions, limits: ServiceLimits | None = None) -> None:
        if options.exit_after_jobs < 0:
            raise ValueError(
                f"exit_after_jobs={options.exit_after_jobs} is invalid; expected 0 (serve until stopped) or >= 1"
            )
        if options.max_workers < 1:
            raise ValueError(f"max_workers={options.max_workers} is invalid; expected >= 1")
        self.policy = policy
        self.options = options
        self.limits = limits or ServiceLimits()
        self.metrics = (
            RoundMetrics(max_jobs=self.limits.max_jobs, finished_job_series_s=options.finished_job_series_s)
            if options.metrics_port is not None
            else None
        )
        self.recent_errors = RecentErrors()  # the status page's list of failed rounds
        self.metrics_port: int | None = None
        self._metrics_http: MetricsHttpServer | None = None
        self._started_at = time.time()
        self._jobs_finished = 0
        self._jobs_finished_lock = threading.Lock()  # not _stop_lock: a stop holds that while Leaves finish
        self.table = RoundTable(
            policy,
            package=package_result,
            observer=RoundObservers(self.metrics, self.recent_errors) if self.metrics is not None else None,
            limits=self.limits,
            job_finished=self._count_finished_job,
        )
        if self.metrics is not None:
            self.metrics.watch_budget(self.table.budget)
        keep_large_buffers()  # halves gRPC's CPU per multi-megabyte call; see gradq.proto.transport
        waiting = WaitingCalls(
            self.limits.max_waiting_per_job,
            self.limits.max_waiting_per_peer,
            self.limits.max_waiting_calls,
            self.limits.max_streams_per_peer,
        )
        membership = self.metrics.membership_changed if self.metrics is not None else None
        liveness = Liveness(self.table, self.limits, self.options.keepalive_timeout_s)
        self.servicer = AggregatorServicer(self.table, waiting, liveness, membership)
        self.health = health.aio.HealthServicer()
        # grpc.aio serves every call on one event loop, run by its own thread so this
        # class keeps a blocking API; round work of large pushes goes to the loop's default executor.
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(
            futures.ThreadPoolExecutor(max_workers=options.max_workers, thread_name_prefix="gradq-rounds")
        )
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="gradq-loop", daemon=True)
        self._loop_thread.start()
        try:
            self._server, self.port = self._on_loop(self._build())
        except BaseException:
            self._close_loop()
            raise
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self._sweeper = threading.Thread(target=self._sweep, name="gradq-sweeper", daemon=True)

    async def _build(self) -> tuple[grpc.aio.Server, int]:
        """The gRPC server with every service, bound to its port (on the loop: grpc.aio needs it)."""
        interceptors = [TokenAuthInterceptor(self.options.tokens)] if self.options.tokens else []
        server = grpc.aio.server(
            interceptors=interceptors,
            # Without SO_REUSEPORT a second aggregator on a port in use fails to bind, rather than
            # sharing it and splitting one job's pushes between two processes.
            options=[
                *channel_options(self.options.max_message_bytes),
                *_keepalive(self.options.keepalive_timeout_s),
                ("grpc.so_reuseport", 0),
            ],
            # Past this gRPC answers RESOURCE_EXHAUSTED itself: a flood of calls that never
            # reach a handler (stalled or slow) is bounded too. Watch streams have their own share.
            maximum_concurrent_rpcs=self.limits.max_waiting_calls + self.limits.max_watches + _RESERVED_CALLS,
        )
        add_aggregator_to_server(self.servicer, server)
        server.add_generic_rpc_handlers((shards_handler(self.options.shard_group),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
        )
        host, port = _host_and_port(self.options.address)
        if port and _port_in_use(host, port):  # before gRPC's own attempt, which logs a line of its own
            raise BindError("address", self.options.address, "the port is in use (another aggregator?)")
        try:
            if self.options.tls is not None:
                bound = server.add_secure_port(self.options.address, self.options.tls.credentials())
            else:
                bound = server.add_insecure_port(self.options.address)
        except RuntimeError:  # grpc's "Failed to bind to address ..."
            bound = 0
        if bound == 0:
            raise BindError("address", self.options.address, "cannot bind it (in use, or not an address of this host)")
        return server, bound

    def _on_loop(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` on the server's event loop and wait for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(work, self._loop).result()

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join()
        self._loop.run_until_complete(self._loop.shutdown_default_executor())
        self._loop.close()

    def start(self) -> None:
        """Start serving and mark the aggregator healthy.

        Raises:
            BindError: the metrics port cannot be bound (nothing is served then).
        """
        if self.metrics is not None and self.options.metrics_port is not None:
            host = _host_and_port(self.options.address)[0] or "0.0.0.0"
            try:
                self._metrics_http = MetricsHttpServer(
                    self.options.metrics_port, host, self.metrics.registry, self.status_snapshot
                )
            except OSError as error:
                self._close_loop()
                reason = "the port is in use" if error.errno == errno.EADDRINUSE else error.strerror or str(error)
                raise BindError("metrics_port", f"{host}:{self.options.metrics_port}", reason) from None
            self.metrics_port = self._metrics_http.port
            log.info("metrics on http://%s:%d/metrics, status page on /status", host, self.metrics_port)
        self._on_loop(self._server.start())
        self._sweeper.start()
        for service in ("", SERVICE_NAME):
            self._on_loop(self.health.set(service, health_pb2.HealthCheckResponse.SERVING))
        log.info(
            "aggregator %s serving on port %d (%s%s, world_size=%s, round timeout %.1f s)",
            self.servicer.server_id[:8],
            self.port,
            "plaintext" if self.options.tls is None else "mutual TLS" if self.options.tls.client_ca else "TLS",
            ", token auth" if self.options.tokens else "",
            self.policy.world_size or "per job",
            self.policy.round_timeout_s,
        )
        if self.options.shard_group:
            group = self.options.shard_group
            log.info("one of a group of %d shards, reported to workers: %s", len(group), ",".join(group))
        self._warn_about_exposure()

    def status_snapshot(self) -> StatusSnapshot:
        """What /status shows now (requires ``metrics_port``)."""
        assert self.metrics is not None, "the status page needs the metrics (ServerOptions.metrics_port)"
        return take_snapshot(self.table, self.metrics, self.recent_errors, self.servicer.server_id, self._started_at)

    def _warn_about_exposure(self) -> None:
        host = _host_and_port(self.options.address)[0]
        if self.options.tls is None and not _is_loopback(host):
            log.warning(
                "serving plaintext on %s:%d, which is not a loopback address: gradients and tokens cross the "
                "network unencrypted; pass --tls-cert and --tls-key (or bind --host 127.0.0.1)",
                host or "0.0.0.0",
                self.port,
            )
        unscoped = self.options.tokens.unscoped() if self.options.tokens else 0
        if unscoped:
            log.warning(
                "%d token(s) in the token file are not scoped to a job: each may join, push to and leave any "
                "job; write 'TOKEN job=JOB [rank=RANK]' lines to confine them",
                unscoped,
            )

    def _sweep(self) -> None:
        """Close rounds nobody waits for at their deadline, expire idle jobs, drop ended jobs' series, free memory."""
        peak = 0  # the most bytes in use since memory was last given back
        trimmed_at = time.monotonic()
        while not self._stopped.wait(_SWEEP_PERIOD_S):
            self.table.sweep()
            if self.metrics is not None:
                self.metrics.drop_ended(self._live_jobs)
            in_use = self.table.budget.in_use
            peak = max(peak, in_use)
            # Also now and then: gRPC's buffers and parsed requests are heap the budget does not see.
            if in_use < peak - _TRIM_AFTER_BYTES or time.monotonic() - trimmed_at > _TRIM_EVERY_S:
                return_free_memory()
                peak, trimmed_at = in_use, time.monotonic()

    def _live_jobs(self) -> set[str]:
        """The ids of the jobs the table holds now."""
        with self.table.jobs.lock:
            return {job.job_id for job in self.table.jobs.all()}

    def stop(self) -> None:
        """Go NOT_SERVING, let rounds in flight finish within the grace period, then stop."""
        with self._stop_lock:
            if not self._stopped.is_set():
                self._stop_once()

    def _stop_once(self) -> None:
        log.info(
            "stopping: NOT_SERVING, %d job(s) joined, %d round(s) in flight, grace %.1f s",
            len(self.table.active_jobs()),
            self.table.in_flight(),
            self.options.grace_s,
        )
        self._on_loop(self.health.enter_graceful_shutdown())
        # Keep accepting pushes for rounds already started so they can complete;
        # the table refuses new jobs and rounds from here on.
        self.table.close()
        self._on_loop(self.servicer.end_watches())
        deadline = time.monotonic() + self.options.grace_s
        while self.table.in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.table.fail_in_flight("the aggregator shut down before the round completed; retry after restart")
        if left:
            log.warning("%d round(s) still incomplete after the grace period were failed with UNAVAILABLE", left)
        self._on_loop(self._server.stop(_ANSWER_GRACE_S))
        self._close_loop()
        if self._metrics_http is not None:
            self._metrics_http.close()
        self._stopped.set()
        log.info("stopped")

    def _count_finished_job(self, job_id: str) -> None:
        """Stop once ``exit_after_jobs`` jobs have finished (called by the table, on a handler thread)."""
        with self._jobs_finished_lock:
            self._jobs_finished += 1
            finished = self._jobs_finished
        log.info("job %r finished: every rank left (%d job(s) finished)", job_id, finished)
        if self.options.exit_after_jobs and finished == self.options.exit_after_jobs:
            log.info("stopping: --exit-after-jobs=%d reached", self.options.exit_after_jobs)
            # Not on this thread: stop() waits for handlers, this Leave among them.
            threading.Thread(target=self.stop, name="gradq-stop", daemon=True).start()

    def wait(self) -> None:
        """Block until stop() has finished."""
        self._stopped.wait()

    def stop_on_signals(self) -> None:
        """Stop gracefully on SIGTERM or SIGINT (call from the main thread)."""

        def handle(signum: int, _frame: FrameType | None) -> None:
            log.info("received %s", signal.Signals(signum).name)
            threading.Thread(target=self.stop, name="gradq-stop", daemon=True).start()

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, handle)


def _host_and_port(address: str) -> tuple[str, int]:
    """("0.0.0.0", 50051) from "0.0.0.0:50051" (brackets of an IPv6 host dropped); port 0 if it is no number."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port) if port.isdigit() else 0


def _port_in_use(host: str, port: int) -> bool:
    """True when a listening socket holds ``port`` on every address ``host`` resolves to (gRPC needs one)."""
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False  # gRPC reports the name itself
    for family, kind, proto, _, sockaddr in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: TIME_WAIT is no obstacle
            try:
                probe.bind(sockaddr)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    continue
            return False
    return bool(addresses)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
