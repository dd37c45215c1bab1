"""/status on the metrics port: a running job's row and counts, client strings as text, bounded, /metrics beside it."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Callable

import numpy as np
import pytest
from status_html import cells

from gradq.client import AggregationError, WorkerClient
from gradq.qcore import QuantConfig
from gradq.server.app import AggregatorServer
from gradq.server.job_spec import JobSpec
from gradq.server.membership import ANY_RANK
from gradq.server.metrics import JobTotals
from gradq.server.policy import RoundPolicy
from gradq.server.status import ErrorRow, JobRow, StatusSnapshot
from gradq.server.status_page import render_status

StartAggregator = Callable[..., AggregatorServer]
HOSTILE = "<script>alert('job')</script>"


def fetch(port: int, path: str = "/status") -> tuple[str, dict[str, str]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
        return answer.read().decode(), dict(answer.headers)


def train(address: str, job_id: str, steps: int, leave: bool) -> list[WorkerClient]:
    """Two ranks of ``job_id`` finish ``steps`` rounds of one 4,096-element bucket; joined still unless ``leave``."""
    clients = [WorkerClient(address, job_id, rank, 2, QuantConfig(bits=8)) for rank in range(2)]
    gradient = np.random.default_rng(0).normal(size=4096).astype(np.float32)

    def work(client: WorkerClient) -> None:
        client.join()
        for step in range(steps):
            client.push_pull(step, 0, gradient)

    threads = [threading.Thread(target=work, args=(client,)) for client in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    if leave:
        for client in clients:
            client.close()
    return clients


def test_a_running_job_has_its_row_and_counts(start_aggregator: StartAggregator) -> None:
    server = start_aggregator(RoundPolicy(round_timeout_s=0.5), metrics_port=0)
    address = f"127.0.0.1:{server.port}"
    clients = train(address, "resnet-a", 3, leave=False)
    try:
        with WorkerClient(address, HOSTILE, 0, 2) as lonely:
            with pytest.raises(AggregationError):
                lonely.push_pull(0, 0, np.ones(10, np.float32))  # its partner never comes: the round fails
            assert server.metrics_port is not None
            page, headers = fetch(server.metrics_port)
    finally:
        for client in clients:
            client.close()

    assert headers["Content-Type"] == "text/html; charset=utf-8"
    assert (
        "script-src" not in headers["Content-Security-Policy"]
        and "default-src 'none'" in headers["Content-Security-Policy"]
    )
    assert '<meta http-equiv="refresh"' in page
    assert "http://" not in page.replace(f"127.0.0.1:{server.metrics_port}", "") and "https://" not in page
    jobs = cells(page, "jobs")
    row = jobs["resnet-a"]
    assert (row["world"], row["joined"], row["left"], row["lost"]) == ("2", "0-1 (2 of 2)", "none", "none")
    assert (row["step"], row["open rounds"]) == ("2", "0")  # the newest step
    assert [row[outcome] for outcome in ("completed", "partial", "skipped", "failed")] == ["3", "0", "0", "0"]
    sent = sum(client.bytes_sent for client in clients)
    assert row["bytes in"] == f"{sent / 1024:.1f} KiB"
    assert 3.8 < float(row["ratio"].rstrip("x")) < 4.0  # 8-bit against float32
    # The hostile job id is text everywhere: in its row and in the failed round's message.
    assert "<script" not in page and "&lt;script&gt;" in page
    assert jobs[HOSTILE]["failed"] == "1"
    (failure,) = cells(page, "errors").values()
    assert failure["job"] == HOSTILE and failure["reason"] == "deadline"
    assert "ranks [1] missing" in failure["what the ranks were told"]


def test_an_elastic_jobs_pending_joiner_and_lost_member_are_shown_as_such(start_aggregator: StartAggregator) -> None:
    server = start_aggregator(metrics_port=0)
    assert server.metrics_port is not None
    table, liveness = server.table, server.servicer.liveness
    for member in (0, 1, 2):
        table.join(JobSpec("grow", member, 3, "run-1", elastic=True))  # three members: the job is formed
    assert table.join(JobSpec("grow", ANY_RANK, 3, "run-1", elastic=True)).catch_up  # member 3 waits for the state
    liveness.close(liveness.open("grow", 1, "run-1"))  # member 1's Watch ends without a Leave
    table.leave("grow", 2, "run-1")
    page, _ = fetch(server.metrics_port)
    row = cells(page, "jobs")["grow"]
    assert (row["joined"], row["pending"], row["left"], row["lost"]) == ("0 (1 of 3)", "3", "2", "1")


def test_the_metrics_are_still_served_beside_the_page(start_aggregator: StartAggregator) -> None:
    server = start_aggregator(metrics_port=0)
    assert server.metrics_port is not None
    train(f"127.0.0.1:{server.port}", "m", 1, leave=True)
    metrics, headers = fetch(server.metrics_port, "/metrics")
    assert 'gradq_rounds_total{job="m",outcome="completed",reason="none"} 1.0' in metrics
    assert "text/html" not in headers["Content-Type"]
    page, _ = fetch(server.metrics_port)
    assert cells(page, "jobs") == {} and 'id="no-jobs"' in page  # its ranks left: the job is gone


def job_row(**fields: object) -> JobRow:
    values: dict[str, object] = {
        "job_id": "j",
        "incarnation": "inc-1",
        "world_size": 8,
        "joined": (0, 1, 2, 3, 5),
        "pending": (9,),
        "left": (6,),
        "lost": (4, 7),
        "step": 12,
        "open_rounds": 1,
        "memory_in_use": 3 << 20,
        "memory_limit": 12 << 20,
        "idle_s": 0.2,
        "totals": JobTotals({"completed": 40, "partial": 2, "failed": 1}, 1 << 20, 2 << 20, 7.5),
    }
    return JobRow(**{**values, **fields})  # type: ignore[arg-type]


def snapshot(jobs: tuple[JobRow, ...], total: int, errors: tuple[ErrorRow, ...] = ()) -> StatusSnapshot:
    return StatusSnapshot(0.0, "abcdef0123", 3600.0, jobs, total, 1, 3 << 20, 1 << 30, errors)


def test_lost_and_left_ranks_and_the_budget_are_shown() -> None:
    page = render_status(snapshot((job_row(),), 1))
    row = cells(page, "jobs")["j"]
    assert (row["joined"], row["pending"], row["left"], row["lost"]) == ("0-3,5 (5 of 8)", "9", "6", "4,7")
    assert row["memory"] == "3.0 MiB (25.0%)" and row["ratio"] == "7.50x"
    assert "memory budget 3.0 MiB of 1.0 GiB (0.3%)" in page


@pytest.mark.parametrize("field", ["job_id", "incarnation"])
def test_every_client_string_is_escaped(field: str) -> None:
    row = job_row(**{field: '"><img src=x onerror=alert(1)>'})
    error = ErrorRow(0.0, "<b>j</b>", "deadline&", "round (job='<i>') failed")
    page = render_status(snapshot((row,), 1, (error,)))
    assert "<img" not in page and "<b>" not in page and "<i>" not in page
    assert "&quot;&gt;&lt;img" in page and "deadline&amp;" in page


def test_an_idle_aggregator_says_so() -> None:
    page = render_status(snapshot((), 0))
    assert "No live jobs." in page and "No failed rounds." in page


def test_the_page_is_bounded_however_many_jobs_clients_start(start_aggregator: StartAggregator) -> None:
    server = start_aggregator(metrics_port=0)
    for index in range(60):
        server.table.join(JobSpec(f"job-{index}", 0, 2))
    page, _ = fetch(server.metrics_port or 0)
    assert len(cells(page, "jobs")) == 50
    assert "60 live job(s), the 50 most recently active shown" in page
