"""`gradq worker` and `gradq demo` as real processes: bad settings and a dead aggregator end in one line, exit 2."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from gradq.client.env import quantized_scheme_names
from gradq.server.app import AggregatorServer
from gradq.server.process import free_port

QUANTIZED = ", ".join(quantized_scheme_names())


def gradq(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `gradq ARGS` with no GRADQ_* variable but those in ``env``."""
    clean = {name: value for name, value in os.environ.items() if not name.startswith("GRADQ_")}
    return subprocess.run(
        [sys.executable, "-m", "gradq.cli", *args],
        capture_output=True,
        text=True,
        env={**clean, **(env or {})},
        timeout=timeout,
    )


def gradq_process(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """Start `gradq ARGS` like ``gradq``, output merged into stdout."""
    clean = {name: value for name, value in os.environ.items() if not name.startswith("GRADQ_")}
    command = [sys.executable, "-m", "gradq.cli", *args]
    environment = {**clean, "OMP_NUM_THREADS": "1", **env}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment)


def error_line(completed: subprocess.CompletedProcess[str]) -> str:
    """The one line on stderr that is not argparse's usage text."""
    lines = [line for line in completed.stderr.splitlines() if line and not line.startswith(("usage:", " "))]
    assert len(lines) == 1, completed.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ([], {"GRADQ_WORLD_SIZE": "three"}, "GRADQ_WORLD_SIZE='three' is invalid; expected an integer >= 1"),
        ([], {"GRADQ_WORLD_SIZE": "0"}, "GRADQ_WORLD_SIZE='0' is invalid; expected an integer >= 1"),
        ([], {"GRADQ_PEER_TIMEOUT": "-5"}, "GRADQ_PEER_TIMEOUT='-5' is invalid; expected a number > 0"),
        ([], {"GRADQ_MASTER_PORT": "99999"}, "GRADQ_MASTER_PORT='99999' is invalid; expected an integer in 1..65535"),
        ([], {"GRADQ_MIN_ACCURACY": "high"}, "GRADQ_MIN_ACCURACY='high' is invalid; expected a number >= 0 and <= 100"),
        ([], {"GRADQ_BITS": "9"}, "GRADQ_BITS='9' is invalid; expected an integer in 1..8"),
        (
            [],
            {"GRADQ_AGGREGATORS": "a:1"},
            "no world size: give --world-size N or GRADQ_WORLD_SIZE=N, the number of workers (>= 1)",
        ),
        (
            ["--world-size", "1"],
            {},
            "no aggregator: give --aggregator host:port (repeatable) or GRADQ_AGGREGATORS=host:port,...",
        ),
        (["--world-size", "three"], {}, "argument --world-size: 'three' is invalid; expected an integer >= 1"),
        (["--bits", "12"], {}, "argument --bits: '12' is invalid; expected an integer in 1..8"),
        (["--scheme", "fp16"], {}, f"argument --scheme: 'fp16' is invalid; expected one of: {QUANTIZED}"),
        (["--connect-timeout", "0"], {}, "argument --connect-timeout: '0' is invalid; expected a number > 0"),
        (["--master-port", "0"], {}, "argument --master-port: '0' is invalid; expected an integer in 1..65535"),
        ([], {"GRADQ_ELASTIC_HOSTS": "-1"}, "GRADQ_ELASTIC_HOSTS='-1' is invalid; expected an integer >= 0"),
        (
            ["--elastic-hosts", "2"],
            {"GRADQ_AGGREGATORS": "a:1"},
            "--elastic-hosts needs --job-id (GRADQ_JOB_ID): independent hosts find their job by it",
        ),
        (
            ["--elastic-hosts", "2", "--job-id", "j"],
            {"GRADQ_AGGREGATORS": "a:1,b:2"},
            "--elastic-hosts: an elastic job runs on one aggregator; got 2",
        ),
    ],
)
def test_gradq_worker_names_a_bad_flag_or_variable_and_exits_2(
    args: list[str], env: dict[str, str], message: str
) -> None:
    completed = gradq("worker", *args, env=env)
    assert completed.returncode == 2
    assert error_line(completed) == f"gradq worker: error: {message}"


def test_gradq_worker_with_a_dead_aggregator_says_where_it_waited_and_exits_2() -> None:
    address = f"127.0.0.1:{free_port()}"
    completed = gradq(
        "worker",
        "--world-size",
        "1",
        "--peers",
        socket.gethostname(),
        "--peer-settle",
        "0",
        env={"GRADQ_AGGREGATORS": address, "GRADQ_CONNECT_TIMEOUT": "0.5"},
        timeout=60,
    )
    assert completed.returncode == 2
    assert re.search(rf"waiting up to 0\.5 s for the aggregator at {address} \(--connect-timeout\)", completed.stdout)
    assert "loading torch" not in completed.stdout  # it fails before paying for torch
    assert completed.stderr.splitlines() == [
        f"gradq worker: error: aggregator {address}: DEADLINE_EXCEEDED: connection refused at {address}: is `gradq "
        "serve` running there, on that port?; check --aggregator (GRADQ_AGGREGATORS), or wait longer with "
        "--connect-timeout (GRADQ_CONNECT_TIMEOUT)"
    ]


def test_gradq_demo_with_a_dead_aggregator_is_one_line_and_exit_2() -> None:
    address = f"127.0.0.1:{free_port()}"
    completed = gradq("demo", "--aggregator", address, "--connect-timeout", "0.5")
    assert completed.returncode == 2
    assert f"waiting up to 0.5 s for the aggregator at {address}" in completed.stdout
    assert completed.stderr.splitlines() == [
        f"gradq demo: error: aggregator {address}: DEADLINE_EXCEEDED: connection refused at {address}: is `gradq "
        "serve` running there, on that port?; check --aggregator, or wait longer with --connect-timeout"
    ]


def test_gradq_demo_help_lists_the_schemes_its_error_lists() -> None:
    assert "per_channel_sign" in QUANTIZED and "float32" not in QUANTIZED  # from the codec registry
    assert f"quantization scheme: {QUANTIZED} " in " ".join(gradq("demo", "--help").stdout.split())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--scheme", "float32"], f"argument --scheme: 'float32' is invalid; expected one of: {QUANTIZED}"),
        (["--bits", "9"], "argument --bits: '9' is invalid; expected an integer in 1..8"),
        (["--connect-timeout", "0"], "argument --connect-timeout: '0' is invalid; expected a number > 0"),
    ],
)
def test_gradq_demo_names_a_bad_flag_and_exits_2(flags: list[str], message: str) -> None:
    completed = gradq("demo", *flags)
    assert completed.returncode == 2
    assert error_line(completed) == f"gradq demo: error: {message}"


def test_gradq_demo_reports_the_bits_the_codec_sends() -> None:
    # per_channel_sign ignores --bits: one bit per element on the wire, whatever was asked.
    completed = gradq(
        "demo",
        "--workers",
        "1",
        "--epochs",
        "1",
        "--no-compare",
        "--min-accuracy",
        "0",
        "--scheme",
        "per_channel_sign",
        "--bits",
        "4",
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "| gradq 1-bit per_channel_sign + EF " in completed.stdout
    assert "4-bit" not in completed.stdout


def test_gradq_worker_elastic_hosts_train_one_job_without_peers(aggregator: AggregatorServer) -> None:
    environment = {"GRADQ_AGGREGATORS": f"127.0.0.1:{aggregator.port}", "GRADQ_JOB_ID": "elastic-cli"}
    flags = ["--elastic-hosts", "2", "--epochs", "5", "--min-accuracy", "70"]
    hosts = [gradq_process("worker", *flags, env=environment) for _ in range(2)]
    outputs = [host.communicate(timeout=240)[0] for host in hosts]
    for host, output in zip(hosts, outputs, strict=True):
        assert host.returncode == 0, output
        verdict = r"member [01]: steps 0\.\.120, held-out loss [0-9.]+, accuracy [0-9.]+%; verdict: PASS"
        assert re.search(verdict, output)
    assert aggregator.table.counters["rounds_failed"] == 0
    assert aggregator.table.counters["rounds_completed"] >= 120
