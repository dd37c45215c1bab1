"""What gradq tells a user who configured no logging: a line per event and a summary at the end, on stderr.

Real trainings in subprocesses (a DDP hook, two DiLoCo hosts of one process
each) against an in-process aggregator; their stderr is read as a user would.
The events a survivor sees and the fallback run in-process with caplog.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
from test_newcomer_diloco import HOST, RUN_TIMEOUT_S, host_environment

from gradq.client.config import GradqConfig
from gradq.client.elastic import JobWorld
from gradq.client.session import GradqSession
from gradq.client.session.training_log import SessionEvents, TrainingSummary
from gradq.client.stats import ClientStats
from gradq.client.worker import WorkerClient
from gradq.server.app import AggregatorServer
from gradq.server.policy import RoundPolicy
from gradq.server.process import free_port

DDP_SCRIPT = Path(__file__).with_name("training_log_ddp.py")
# "sent 4.2 kB for 31.5 kB of float32 (0.133x of float32, 7.5x smaller)"
SIZE = r"[\d.]+ (?:B|kB|MB|GB)"
SENT = re.compile(rf"sent {SIZE} for {SIZE} of float32 \((?P<share>[\d.]+)x of float32, [\d.]+x smaller\)")


@pytest.fixture
def address(start_aggregator: Callable[..., AggregatorServer]) -> str:
    server = start_aggregator(RoundPolicy(round_timeout_s=60.0, server_error_feedback=False))
    return f"127.0.0.1:{server.port}"


def summaries(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "training summary of job" in line]


@pytest.mark.e2e
def test_a_ddp_script_that_configures_no_logging_sees_the_connection_and_one_summary(
    address: str, tmp_path: Path
) -> None:
    environ = {**os.environ, "GRADQ_AGGREGATORS": address, "GRADQ_JOB_ID": "told", "GRADQ_BITS": "4"}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        environ.pop(name, None)
    done = subprocess.run(
        [sys.executable, str(DDP_SCRIPT), "5"], env=environ, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (
        f"gradq INFO: connected to aggregator {address}: job told (fixed, 1 member(s)), per_channel_affine at 4 bits"
        in (done.stderr)
    )
    [summary] = summaries(done.stderr)  # once, though the script never closed the hook state
    assert "training summary of job told (DDP hook): 5 steps;" in summary
    sent = SENT.search(summary)
    assert sent is not None, summary
    assert 0.1 < float(sent["share"]) < 0.2  # 4 bits of 32, with the per-channel scales
    assert "rejoins 0, failed rounds 0, skipped rounds 0, partial rounds 0" in summary

    # A program that configures logging itself keeps its own setup: nothing of gradq's below WARNING.
    quiet = subprocess.run(
        [sys.executable, str(DDP_SCRIPT), "2", "--configure-logging"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert quiet.returncode == 0, quiet.stderr[-4000:]
    assert "connected to aggregator" not in quiet.stderr and not summaries(quiet.stderr)


@pytest.mark.e2e
def test_diloco_hosts_say_they_connected_a_survivor_sees_the_other_leave_and_each_sums_up(
    address: str, tmp_path: Path
) -> None:
    rounds = [5, 2]  # host 1 ends after 2 outer rounds and leaves; host 0 trains on alone
    processes = [
        subprocess.Popen(
            [sys.executable, str(HOST), str(tmp_path / f"host{host}.pt"), str(count), "1", str(host)],
            env=host_environment(address, "told-diloco"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for host, count in enumerate(rounds)
    ]
    errors = [process.communicate(timeout=RUN_TIMEOUT_S)[1] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], "\n".join(error[-3000:] for error in errors)

    for error in errors:
        assert re.search(
            rf"connected to aggregator {address}: job told-diloco \(elastic, member \d, starts with 2 hosts\), "
            r"per_channel_affine at 4 bits, error feedback on",
            error,
        ), error
    lost = re.search(r"job told-diloco lost host\(s\) (\d) \(dropped or left\); 1 host\(s\) train now", errors[0])
    assert lost is not None, errors[0]
    assert f"member {lost[1]}" in errors[1]  # the host that left is the one host 0 reports lost
    for error, count in zip(errors, rounds, strict=True):
        [summary] = summaries(error)
        assert f"training summary of job told-diloco (DiLoCo): {count} outer rounds, {count * 2} inner steps;" in (
            summary
        )
        sent = SENT.search(summary)
        assert sent is not None, summary
        assert float(sent["share"]) < 0.25  # 4-bit pseudo-gradients against float32
        assert "rejoins 0, late rounds 0, failed rounds 0" in summary


def test_a_survivor_is_told_which_hosts_left_and_joined(caplog: pytest.LogCaptureFixture) -> None:
    events = SessionEvents("job", None, speaks=True)
    with caplog.at_level(logging.INFO, logger="gradq"):
        events.see_world(JobWorld((0, 1, 2), 3, (), 0))  # the first look says nothing: nothing changed yet
        events.see_world(JobWorld((0, 1, 2), 3, (), 0))
        events.see_world(JobWorld((0, 2), 2, (), 0))
        events.see_world(JobWorld((0, 2, 3), 3, (), 0))
    assert [record.getMessage() for record in caplog.records] == [
        "job job lost host(s) 1 (dropped or left); 2 host(s) train now: members [0, 2]",
        "host(s) 3 joined job job; 3 host(s) train now: members [0, 2, 3]",
    ]
    caplog.clear()
    silent = SessionEvents("job", None, speaks=False)  # a host's other ranks say nothing
    with caplog.at_level(logging.INFO, logger="gradq"):
        silent.see_world(JobWorld((0, 1), 2, (), 0))
        silent.see_world(JobWorld((0,), 1, (), 0))
    assert caplog.records == []


@pytest.mark.usefixtures("group")
def test_a_fallback_taken_is_said_with_why(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    config = GradqConfig.of(f"127.0.0.1:{port}", job_id="j", fallback="allreduce", connect_timeout_s=0.5)
    with caplog.at_level(logging.INFO, logger="gradq"):
        session = GradqSession.connect(config)
    session.close()
    assert session.mode == "allreduce"
    [warning] = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warning.startswith(f"aggregator unreachable (aggregator 127.0.0.1:{port}")
    assert warning.endswith("falling back to allreduce: training goes on without gradq")
    summary = TrainingSummary(config, "DDP hook")
    summary.attach(session.events)
    assert summary.line().startswith(
        "training summary of job j (DDP hook): 0 steps; no bytes through gradq (fallback allreduce);"
    )


class _StatsOf:
    """A worker client as a summary reads it: its figures alone."""

    def __init__(self, stats: ClientStats) -> None:
        self._stats = stats

    def stats(self) -> ClientStats:
        return self._stats


def _stats(sent: int, uncompressed: int, skipped: int) -> ClientStats:
    return ClientStats(3, 0.1, 0.2, 0.3, sent, sent // 2, uncompressed, "float32", 0.01, skipped, 0)


def test_the_summary_sums_every_session_of_the_run_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    class Loop:  # an adapter: the summary ends with it
        pass

    loop = Loop()
    summary = TrainingSummary(loop, "DiLoCo")
    # A rejoin connects a second session, whose worker client counts from zero.
    for sent, skipped in ((1_000, 1), (3_000, 0)):
        events = SessionEvents("run", cast(WorkerClient, _StatsOf(_stats(sent, 8 * sent, skipped))), speaks=True)
        summary.attach(events)
    events.failed_rounds = 2
    summary.steps, summary.rounds, summary.rejoins = 40, 4, 1
    with caplog.at_level(logging.INFO, logger="gradq"):
        summary.close()
        summary.close()
        del loop  # collected after close: nothing more
    assert [record.getMessage() for record in caplog.records] == [
        "training summary of job run (DiLoCo): 4 outer rounds, 40 inner steps; sent 4.0 kB for 32.0 kB of float32 "
        "(0.125x of float32, 8.0x smaller), received 2.0 kB, 6 pushes; rejoins 1, late rounds 0, failed rounds 2, "
        "skipped rounds 1, partial rounds 0"
    ]


def test_a_run_that_never_connected_logs_no_summary(caplog: pytest.LogCaptureFixture) -> None:
    class Loop:
        pass

    loop = Loop()
    summary = TrainingSummary(loop, "DDP hook")
    with caplog.at_level(logging.INFO, logger="gradq"):
        del loop
    assert summary.line().startswith("training summary of job ? (DDP hook): 0 steps; no bytes through gradq")
    assert caplog.records == []
