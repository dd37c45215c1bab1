"""/status in a real headless browser (Debian's chromium) while a job trains: its row and counts as rendered.

Set GRADQ_STATUS_SCREENSHOT=docs/status-page.png to refresh docs/operating.md's screenshot (1200x800) from this test.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from dependencies import require_program
from status_html import cells
from waiting import wait_until

from gradq.client import AggregationError, WorkerClient
from gradq.client import serde as client_serde
from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc
from gradq.qcore import QuantConfig
from gradq.server.app import AggregatorServer
from gradq.server.policy import RoundPolicy
from gradq.server.status import JobRow

pytestmark = pytest.mark.e2e  # a slow end-to-end run: deselected unless --e2e

StartAggregator = Callable[..., AggregatorServer]
HOSTILE = "<script>document.title='owned'</script>"


def browse(chromium: str, url: str, profile: Path, *arguments: str) -> str:
    """Run headless chromium on ``url`` with ``arguments``; returns its stdout (the DOM for --dump-dom)."""
    command = [
        chromium,
        "--headless",
        "--no-sandbox",  # CI runs as root, where chromium's sandbox refuses to start
        "--disable-gpu",
        "--no-first-run",
        f"--user-data-dir={profile}",
        *arguments,
        url,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture
def chromium() -> str:
    """Debian's chromium (.ci/run installs it)."""
    return require_program("chromium", "chromium-browser", install="apt-get install -y chromium (.ci/run does)")


@pytest.fixture
def running_job(start_aggregator: StartAggregator) -> Iterator[tuple[AggregatorServer, list[WorkerClient]]]:
    """An aggregator whose job 'resnet-a' trains (2 ranks, a round every ~20 ms) until the test ends.

    Its rounds may wait 5 s: chromium starting on a shared CI machine can stall the ranks for
    over a second, and a failed round would show on the page (CI once saw one fail at 0.5 s).
    """
    server = start_aggregator(RoundPolicy(round_timeout_s=5.0), metrics_port=0)
    address = f"127.0.0.1:{server.port}"
    clients = [WorkerClient(address, "resnet-a", rank, 2, QuantConfig(bits=4)) for rank in range(2)]
    stop = threading.Event()
    gradient = np.random.default_rng(0).normal(size=1 << 16).astype(np.float32)

    def work(client: WorkerClient) -> None:
        client.join()
        step = 0
        while not stop.is_set():
            client.push_pull(step, 0, gradient)
            step += 1
            stop.wait(0.02)

    threads = [threading.Thread(target=work, args=(client,), daemon=True) for client in clients]
    for thread in threads:
        thread.start()
    yield server, clients
    stop.set()
    for thread in threads:
        thread.join(timeout=30)
    for client in clients:
        client.close()


def status_of(server: AggregatorServer, job_id: str) -> JobRow | None:
    """``job_id``'s row as the page would show it now (None: not a live job)."""
    return next((row for row in server.status_snapshot().jobs if row.job_id == job_id), None)


def completed(server: AggregatorServer, job_id: str) -> int:
    """Rounds of ``job_id`` completed so far."""
    row = status_of(server, job_id)
    return row.totals.rounds.get("completed", 0) if row is not None else 0


def test_the_status_page_in_a_real_browser(
    chromium: str, running_job: tuple[AggregatorServer, list[WorkerClient]], tmp_path: Path
) -> None:
    server, _ = running_job
    address = f"127.0.0.1:{server.port}"
    # A job with a lost rank: rank 1's Watch stream ends without a Leave.
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.AggregatorStub(channel)
        for rank in range(2):
            stub.Join(client_serde.join_request("bert-b", rank, 2), timeout=5)
        watch = stub.Watch(iter([client_serde.watch_request("bert-b", 1)]))
        next(watch)  # its first event: the aggregator holds the stream
        watch.cancel()
    # A job whose id is markup, with a failed round that quotes it.
    lonely = WorkerClient(address, HOSTILE, 0, 2)
    with pytest.raises(AggregationError):
        lonely.push_pull(0, 0, np.ones(10, np.float32))
    wait_until(
        lambda: completed(server, "resnet-a") >= 3 and getattr(status_of(server, "bert-b"), "lost", ()),
        "3 rounds of resnet-a completed and bert-b's rank lost",
        60,  # the first rounds may wait for numba to compile the 4-bit kernels
    )
    url = f"http://127.0.0.1:{server.metrics_port}/status"
    try:
        before = completed(server, "resnet-a")
        dom = browse(chromium, url, tmp_path / "profile", "--dump-dom")
        after = completed(server, "resnet-a")
        screenshot = tmp_path / "status.png"
        browse(chromium, url, tmp_path / "profile", f"--screenshot={screenshot}", "--window-size=1200,800")
    finally:
        lonely.close()

    jobs = cells(dom, "jobs")
    row = jobs["resnet-a"]
    assert (row["joined"], row["left"], row["lost"]) == ("0-1 (2 of 2)", "none", "none")
    assert 0 < before <= int(row["completed"]) <= after  # as the page was rendered, during training
    assert row["failed"] == "0" and 7.0 < float(row["ratio"].rstrip("x")) < 8.0  # 4-bit against float32
    assert (jobs["bert-b"]["joined"], jobs["bert-b"]["lost"]) == ("0 (1 of 2)", "1")
    # The markup in the job id is text in the rendered DOM: no script element, the title untouched.
    assert jobs[HOSTILE]["failed"] == "1"
    assert "<script" not in dom and "<title>gradq aggregator status</title>" in dom
    assert cells(dom, "errors")  # the failed round is listed
    png = screenshot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (1200, 800)
    if os.environ.get("GRADQ_STATUS_SCREENSHOT"):
        shutil.copyfile(screenshot, os.environ["GRADQ_STATUS_SCREENSHOT"])
