"""The metrics port: Prometheus at /metrics and an HTML status page at /status, for an operator's browser.

The page is self-contained (inline CSS, no script, nothing fetched from the
network), refreshes itself, and escapes every string a client chose (job ids,
incarnations, the error messages that quote them); its Content-Security-Policy
forbids scripts too, so a missed escape still runs nothing.
"""

from __future__ import annotations

import html
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from gradq.server.status import ErrorRow, JobRow, StatusSnapshot

__all__ = ["REFRESH_S", "MetricsHttpServer", "render_status"]

# The page reloads itself this often (seconds).
REFRESH_S = 5
_SECURITY_HEADERS = [
    ("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'"),
    ("X-Content-Type-Options", "nosniff"),
    ("Cache-Control", "no-store"),
]
_STYLE = """
body { font: 12.5px/1.4 system-ui, sans-serif; margin: 16px; color: #1d2430; background: #f7f8fa; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 22px 0 6px; }
.summary { color: #4a5568; margin-bottom: 8px; }
table { border-collapse: collapse; background: #fff; box-shadow: 0 1px 2px #0002; }
th, td { padding: 4px 6px; border-bottom: 1px solid #e2e6ec; text-align: right; white-space: nowrap; }
th { background: #edf0f5; font-weight: 600; }
td.text, th.text { text-align: left; white-space: normal; min-width: 56px; max-width: 420px; overflow-wrap: anywhere; }
td.job { min-width: 110px; font-weight: 600; }
th { white-space: normal; vertical-align: bottom; overflow-wrap: normal !important; }
.lost { color: #b42318; font-weight: 600; } .bad { color: #b42318; } .muted { color: #8792a2; }
"""


def render_status(snapshot: StatusSnapshot) -> str:
    """The page for ``snapshot``: a summary, one row per live job, the last failed rounds.

    Args:
        snapshot: what to show (see gradq.server.status.take_snapshot).

    Returns:
        A complete HTML document.
    """
    shown = len(snapshot.jobs)
    jobs_line = f"{snapshot.jobs_total} live job(s)" + (
        f", the {shown} most recently active shown" if shown < snapshot.jobs_total else ""
    )
    summary = (
        f"aggregator {_e(snapshot.server_id[:8])} · up {_duration(snapshot.uptime_s)} · {jobs_line} · "
        f"{snapshot.rounds_in_flight} round(s) in flight · memory budget {_bytes(snapshot.memory_in_use)} of "
        f"{_bytes(snapshot.memory_limit)} ({_percent(snapshot.memory_in_use, snapshot.memory_limit)})"
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{REFRESH_S}">
<title>gradq aggregator status</title><style>{_STYLE}</style></head>
<body>
<h1>gradq aggregator</h1>
<div class="summary" id="summary">{summary}</div>
<div class="summary muted">As of {_clock(snapshot.taken_at)} UTC, reloads every {REFRESH_S} s. Round and byte
counts cover every run of a job id since the aggregator started, as /metrics counts them.</div>
<h2>Jobs</h2>
{_jobs_table(snapshot.jobs)}
<h2>Last failed rounds</h2>
{_errors_table(snapshot.errors)}
</body></html>
"""


def _jobs_table(jobs: tuple[JobRow, ...]) -> str:
    if not jobs:
        return '<p class="muted" id="no-jobs">No live jobs.</p>'
    head = (
        '<tr><th class="text">job</th><th class="text">incarnation</th><th>world</th><th class="text">joined</th>'
        '<th class="text">pending</th><th class="text">left</th><th class="text">lost</th><th>step</th>'
        "<th>open rounds</th><th>completed</th>"
        "<th>partial</th><th>skipped</th><th>failed</th><th>bytes in</th><th>bytes out</th><th>ratio</th>"
        "<th>memory</th><th>idle</th></tr>"
    )
    return f'<table id="jobs">{head}{"".join(_job_row(job) for job in jobs)}</table>'


def _job_row(job: JobRow) -> str:
    rounds = job.totals.rounds
    ratio = job.totals.compression_ratio
    failed = rounds.get("failed", 0)
    cells = [
        f'<td class="text job">{_e(job.job_id)}</td>',
        f'<td class="text">{_e(job.incarnation) or "<span class=muted>none</span>"}</td>',
        f"<td>{job.world_size}</td>",
        f'<td class="text">{_ranks(job.joined)} ({len(job.joined)} of {job.world_size})</td>',
        f'<td class="text">{_ranks(job.pending)}</td>',
        f'<td class="text">{_ranks(job.left)}</td>',
        f'<td class="text{" lost" if job.lost else ""}">{_ranks(job.lost)}</td>',
        f"<td>{job.step if job.step >= 0 else '-'}</td>",
        f"<td>{job.open_rounds}</td>",
        f'<td class="completed">{rounds.get("completed", 0)}</td>',
        f"<td>{rounds.get('partial', 0)}</td>",
        f"<td>{rounds.get('skipped', 0)}</td>",
        f'<td class="failed{" bad" if failed else ""}">{failed}</td>',
        f"<td>{_bytes(job.totals.received_bytes)}</td>",
        f"<td>{_bytes(job.totals.sent_bytes)}</td>",
        f"<td>{f'{ratio:.2f}x' if ratio is not None else '-'}</td>",
        f"<td>{_bytes(job.memory_in_use)} ({_percent(job.memory_in_use, job.memory_limit)})</td>",
        f"<td>{_duration(job.idle_s)}</td>",
    ]
    return f'<tr data-job="{_e(job.job_id)}">{"".join(cells)}</tr>'


def _errors_table(errors: tuple[ErrorRow, ...]) -> str:
    if not errors:
        return '<p class="muted" id="no-errors">No failed rounds.</p>'
    head = '<tr><th class="text">time (UTC)</th><th class="text">job</th><th class="text">reason</th>'
    head += '<th class="text">what the ranks were told</th></tr>'
    rows = "".join(
        f'<tr><td class="text">{_clock(row.at)}</td><td class="text">{_e(row.job_id)}</td>'
        f'<td class="text">{_e(row.reason)}</td><td class="text">{_e(row.message)}</td></tr>'
        for row in errors
    )
    return f'<table id="errors">{head}{rows}</table>'


def _e(text: str) -> str:
    return html.escape(text, quote=True)


def _ranks(ranks: Iterable[int]) -> str:
    """0-3,5,7-8: a world of 1024 ranks stays one short line."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) or "none"


def _bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 else "-"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def _clock(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at))


class _QuietHandler(WSGIRequestHandler):
    """No line per request on stderr (Prometheus scrapes every few seconds)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """One thread per request, so a slow reader of the page never holds up a scrape."""

    daemon_threads = True


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class MetricsHttpServer:
    """The metrics port's HTTP server: /status renders ``snapshot()``, anything else is Prometheus's answer.

    Args:
        port: TCP port (0 picks one; ``port`` holds the bound one).
        address: interface to bind (the gRPC server's host).
        registry: the Prometheus series.
        snapshot: takes the status page's snapshot (called once per page view).
    """

    def __init__(
        self, port: int, address: str, registry: CollectorRegistry, snapshot: Callable[[], StatusSnapshot]
    ) -> None:
        self._metrics = make_wsgi_app(registry)
        self._snapshot = snapshot
        server_class = _ThreadingServer6 if ":" in address else _ThreadingServer  # ":": an IPv6 literal
        self._server = make_server(address, port, self._app, server_class, handler_class=_QuietHandler)
        self.port = int(self._server.server_port)
        self._thread = threading.Thread(target=self._server.serve_forever, name="gradq-metrics-http", daemon=True)
        self._thread.start()

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterator[bytes] | list[bytes]:
        if environ.get("PATH_INFO") not in ("/status", "/status/"):
            return self._metrics(environ, start_response)
        body = render_status(self._snapshot()).encode()
        headers = [("Content-Type", "text/html; charset=utf-8"), ("Content-Length", str(len(body)))]
        start_response("200 OK", headers + _SECURITY_HEADERS)
        return [body]

    def close(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
