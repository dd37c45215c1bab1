"""`gradq serve` as a real process: help, flags and environment, SIGTERM shutdown."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from status_html import job_row
from waiting import wait_until

from gradq.proto.convert import tensor_to_proto
from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc
from gradq.qcore import QuantConfig, Scheme, encode
from gradq.server.cli import build_parser
from gradq.server.process import free_port, spawn_aggregator


def start_serve(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], int]:
    return spawn_aggregator(*args, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_help_lists_every_flag_with_its_environment_variable() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "gradq.cli", "serve", "--help"], capture_output=True, text=True, check=True
    )
    for action in build_parser()._actions:
        for flag in action.option_strings:
            assert flag in completed.stdout
    for env in (
        "GRADQ_PORT",
        "GRADQ_WORLD_SIZE",
        "GRADQ_ROUND_TIMEOUT",
        "GRADQ_RETURN_SCHEME",
        "GRADQ_SERVER_ERROR_FEEDBACK",
        "GRADQ_MAX_MESSAGE_BYTES",
        "GRADQ_PARTIAL_QUORUM",
        "GRADQ_LOG_LEVEL",
        "GRADQ_MAX_STEPS_AHEAD",
        "GRADQ_MAX_OPEN_ROUNDS",
        "GRADQ_MAX_MEMORY_BYTES",
        "GRADQ_MAX_JOB_MEMORY_BYTES",
        "GRADQ_MAX_JOBS",
        "GRADQ_MAX_WORLD_SIZE",
        "GRADQ_JOB_IDLE_TIMEOUT",
        "GRADQ_MAX_WAITING_PER_JOB",
        "GRADQ_MAX_WAITING_PER_PEER",
    ):
        assert env in completed.stdout


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--return-scheme", "per_row"], {}, "'per_row' is invalid; expected 'same', 'fp16', 'fp32' or a scheme"),
        (["--partial-quorum", "5", "--world-size", "2"], {}, "--partial-quorum=5 is invalid"),
        ([], {"GRADQ_ROUND_TIMEOUT": "soon"}, "GRADQ_ROUND_TIMEOUT='soon' is invalid"),
        (["--round-timeout", "0"], {}, "--round-timeout=0.0 is invalid"),
        (["--keepalive-timeout", "0.01"], {}, "--keepalive-timeout=0.01 is invalid; expected 0.1..3600 seconds"),
        (["--tls-cert", "/nonexistent.pem"], {}, "expected both or neither"),
        (["--tls-client-ca", "/ca.pem"], {}, "--tls-client-ca needs --tls-cert and --tls-key"),
        (["--token-file", "/nonexistent/tokens"], {}, "/nonexistent/tokens"),
    ],
)
def test_bad_configuration_exits_2_with_a_message(args: list[str], env: dict[str, str], message: str) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "gradq.server", "--port", "0", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
    )
    assert completed.returncode == 2
    assert message in completed.stderr


def test_json_logs_are_one_object_per_line(tmp_path: Path, processes: list[subprocess.Popen[str]]) -> None:
    import json

    process, _ = start_serve(tmp_path, "--log-format", "json")
    processes.append(process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=20) == 0
    lines = [json.loads(line) for line in (process.stderr.read() if process.stderr else "").splitlines() if line]
    assert any("serving on port" in line["message"] for line in lines)
    assert {line["level"] for line in lines} <= {"INFO", "WARNING"} and all("time" in line for line in lines)


def test_environment_configures_the_server(tmp_path: Path, processes: list[subprocess.Popen[str]]) -> None:
    process, port = start_serve(tmp_path, env={"GRADQ_WORLD_SIZE": "3"})
    processes.append(process)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.AggregatorStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.Join(pb.JoinRequest(job_id="j", rank=0, world_size=2), timeout=5)
        assert "--world-size=3" in (raised.value.details() or "")


def test_sigterm_goes_not_serving_finishes_round_in_flight_and_exits_0(
    tmp_path: Path, processes: list[subprocess.Popen[str]]
) -> None:
    metrics_port = free_port()  # its /status shows when the first push has opened its round
    process, port = start_serve(tmp_path, "--world-size", "2", "--grace", "10", "--metrics-port", str(metrics_port))
    processes.append(process)
    tensor = tensor_to_proto(encode(np.ones(16, np.float32), QuantConfig(scheme=Scheme.FLOAT32)))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.AggregatorStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        for rank in (0, 1):
            stub.Join(pb.JoinRequest(job_id="j", rank=rank, world_size=2), timeout=5)
        first = stub.PushPull.future(
            pb.PushPullRequest(job_id="j", step=0, bucket=0, rank=0, tensor=tensor), timeout=30
        )
        wait_until(lambda: job_row(metrics_port, "j").get("open rounds") == "1", "rank 0's push in its round")
        process.send_signal(signal.SIGTERM)
        wait_until(
            lambda: (
                health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
                == health_pb2.HealthCheckResponse.NOT_SERVING
            ),
            "the health check to say NOT_SERVING",
        )
        with pytest.raises(grpc.RpcError) as refused:  # no new rounds once stopping
            stub.PushPull(pb.PushPullRequest(job_id="j", step=1, bucket=0, rank=0, tensor=tensor), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        second = stub.PushPull(pb.PushPullRequest(job_id="j", step=0, bucket=0, rank=1, tensor=tensor), timeout=5)
        assert second.contributors == 2 and first.result().contributors == 2
    assert process.wait(timeout=20) == 0
    log = process.stderr.read() if process.stderr else ""
    assert "received SIGTERM" in log and "stopped" in log


def test_serve_with_tls_and_tokens_from_flags(tmp_path: Path, processes: list[subprocess.Popen[str]]) -> None:
    from certificates import issue, make_ca

    from gradq.client import ChannelSecurity, WorkerClient

    ca, ca_key, ca_certificate = make_ca()
    server_pem = issue(ca_key, ca_certificate, "localhost", server=True)
    files = {"cert": server_pem.certificate, "key": server_pem.key, "tokens": b"a-token-of-16-chars 0\n"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    process, port = start_serve(
        tmp_path,
        "--tls-cert",
        str(tmp_path / "cert"),
        "--tls-key",
        str(tmp_path / "key"),
        "--token-file",
        str(tmp_path / "tokens"),
        "--world-size",
        "1",
    )
    processes.append(process)
    security = ChannelSecurity(root_certificates=ca.certificate, token="a-token-of-16-chars")
    with WorkerClient(f"localhost:{port}", "tls", 0, 1, QuantConfig(scheme=Scheme.FLOAT32), security=security) as c:
        np.testing.assert_array_equal(c.push_pull(0, 0, np.arange(5, dtype=np.float32)), np.arange(5))


def run_serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradq.cli", "serve", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=60,
    )


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--port", "-1"], {}, "--port='-1' is invalid; expected a port in 0..65535"),
        (["--port", "99999"], {}, "--port='99999' is invalid; expected a port in 0..65535"),
        (["--port", "http"], {}, "--port='http' is invalid; expected a port in 0..65535"),
        (
            ["--metrics-port", "65536"],
            {},
            "--metrics-port='65536' is invalid; expected a port in 0..65535",
        ),
        ([], {"GRADQ_PORT": "-1"}, "GRADQ_PORT='-1' is invalid; expected a port in 0..65535"),
        ([], {"GRADQ_METRICS_PORT": "99999"}, "GRADQ_METRICS_PORT='99999' is invalid; expected a port in 0..65535"),
    ],
)
def test_a_port_out_of_range_is_refused_naming_flag_value_and_range(
    args: list[str], env: dict[str, str], message: str
) -> None:
    completed = run_serve("--host", "127.0.0.1", *args, env=env)
    assert completed.returncode == 2
    assert message in completed.stderr.splitlines()[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port some other program listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_a_busy_port_is_one_line_and_exit_2(busy_port: int, flag: str) -> None:
    args = ["--port", str(busy_port)] if flag == "--port" else ["--port", "0", "--metrics-port", str(busy_port)]
    completed = run_serve("--host", "127.0.0.1", *args)
    assert completed.returncode == 2
    assert completed.stderr.splitlines() == [
        f"gradq serve: error: cannot listen on 127.0.0.1:{busy_port}: the port is in use"
        f"{' (another aggregator?)' if flag == '--port' else ''}; pass another {flag} (0 picks a free one)"
    ]


def test_a_second_aggregator_on_the_same_port_is_refused(
    tmp_path: Path, processes: list[subprocess.Popen[str]]
) -> None:
    # gRPC's SO_REUSEPORT would let both serve and split one job's pushes between them.
    process, port = start_serve(tmp_path)
    processes.append(process)
    completed = run_serve("--host", "127.0.0.1", "--port", str(port))
    assert completed.returncode == 2
    assert completed.stderr.splitlines() == [
        f"gradq serve: error: cannot listen on 127.0.0.1:{port}: the port is in use (another aggregator?); "
        "pass another --port (0 picks a free one)"
    ]


def test_the_plaintext_warning_names_the_bound_port(tmp_path: Path, processes: list[subprocess.Popen[str]]) -> None:
    process, port = start_serve(tmp_path, "--host", "0.0.0.0")  # the last --host wins: --port 0 on every address
    processes.append(process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=20) == 0
    log = process.stderr.read() if process.stderr else ""
    assert f"serving plaintext on 0.0.0.0:{port}, which is not a loopback address" in log
    assert ":0," not in log
