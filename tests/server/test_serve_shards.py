"""`gradq serve --shards N` as real processes: N serving shards that report their group, a killed shard restarted on
its port, SIGTERM and --exit-after-jobs ending them all, and bad values refused before anything starts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from waiting import wait_until

from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc
from gradq.server.process import free_port, spawn_shards


class Shards:
    """A running `gradq serve --shards 2`: the parent, its shards' ports, and its log (a file, never a full pipe)."""

    def __init__(self, log_path: Path, *flags: str, port: int = 0) -> None:
        self.log_path = log_path
        self.log_file = log_path.open("w")
        self.process, self.ports = spawn_shards(2, *flags, port=port, stderr=self.log_file)
        self.metrics_port = 0

    def log(self) -> str:
        return self.log_path.read_text()

    def child_on(self, port: int) -> psutil.Process | None:
        """The parent's child process that serves ``port`` now (its command line names the port)."""
        for child in psutil.Process(self.process.pid).children():
            try:
                arguments = child.cmdline()
            except psutil.NoSuchProcess:
                continue
            # A child between fork and exec still shows the parent's command line, which names no --shard-ports.
            if "--shard-ports" in arguments and arguments[arguments.index("--shard-ports") + 1] == str(port):
                return child
        return None

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=30)
        self.log_file.close()


def serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def a_free_port_and_its_neighbour(avoid: tuple[int, ...] = ()) -> int:
    port = free_port()
    while port >= 65535 or listening(port + 1) or {port, port + 1} & set(avoid):
        port = free_port()
    return port


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shards]:
    port = a_free_port_and_its_neighbour()
    metrics = a_free_port_and_its_neighbour((port, port + 1))
    log = tmp_path_factory.mktemp("shards") / "serve.log"
    running = Shards(log, "--grace", "1", "--metrics-port", str(metrics), port=port)
    running.metrics_port = metrics
    yield running
    running.close()


def test_two_shards_serve_on_consecutive_ports_and_report_their_group(shards: Shards) -> None:
    first, second = shards.ports
    assert second == first + 1
    for port in shards.ports:
        assert serving(port)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            group = pb_grpc.AggregatorStub(channel).Shards(pb.ShardsRequest(), timeout=5)
        assert list(group.addresses) == [f":{first}", f":{second}"]  # no --advertise-host: the host dialed
    for metrics in (shards.metrics_port, shards.metrics_port + 1):  # consecutive metrics ports too
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as response:
            assert b"gradq_" in response.read()


def test_a_shard_killed_with_sigkill_comes_back_on_its_port(shards: Shards) -> None:
    port = shards.ports[1]
    victim = shards.child_on(port)
    assert victim is not None
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        before = pb_grpc.AggregatorStub(channel).Join(pb.JoinRequest(job_id="j", rank=0, world_size=1), timeout=5)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    replacement = wait_until(lambda: shards.child_on(port), f"a new shard process on port {port}", timeout_s=30)
    assert replacement is not None and replacement.pid != victim.pid
    wait_until(lambda: serving(port), f"the restarted shard serving on port {port}", timeout_s=60)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        after = pb_grpc.AggregatorStub(channel).Join(pb.JoinRequest(job_id="j", rank=0, world_size=1), timeout=5)
    assert after.server_id != before.server_id  # a new aggregator: the workers' Join tells them so
    assert serving(shards.ports[0])  # the other shard never stopped
    assert shards.process.poll() is None
    log = shards.log()
    assert f"shard 1 (port {port}) died (killed by SIGKILL); restarting it on port {port}" in log
    wait_until(lambda: f"shard 1 serving again on port {port} (restart 1)" in shards.log(), "the restart logged")


def test_sigterm_to_the_parent_stops_every_shard_and_exits_0(tmp_path: Path) -> None:
    running = Shards(tmp_path / "serve.log", "--grace", "1")
    children = psutil.Process(running.process.pid).children()
    assert len(children) == 2
    running.process.send_signal(signal.SIGTERM)
    assert running.process.wait(timeout=30) == 0
    for child in children:
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    for port in running.ports:
        assert not listening(port)
    running.close()
    assert "received SIGTERM: stopping 2 shards" in running.log()


def test_exit_after_jobs_ends_the_parent_once_every_shard_has_exited_by_itself(tmp_path: Path) -> None:
    running = Shards(tmp_path / "serve.log", "--exit-after-jobs", "1", "--grace", "1")
    for port in running.ports:  # one job, joined and left on both shards
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.AggregatorStub(channel)
            stub.Join(pb.JoinRequest(job_id="done", rank=0, world_size=1), timeout=5)
            stub.Leave(pb.LeaveRequest(job_id="done", rank=0), timeout=5)
    assert running.process.wait(timeout=30) == 0
    running.close()
    log = running.log()
    assert log.count(") exited by itself (status 0)") == 2 and "died" not in log
    assert "every shard exited by itself (status 0); stopping" in log


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--shards", "0"], {}, "--shards=0 is invalid; expected 1..64 shard processes"),
        (["--shards", "65"], {}, "--shards=65 is invalid; expected 1..64 shard processes"),
        ([], {"GRADQ_SHARDS": "0"}, "--shards=0 is invalid; expected 1..64 shard processes"),
        ([], {"GRADQ_SHARDS": "two"}, "GRADQ_SHARDS='two' is invalid; expected an integer"),
        (["--shards", "two"], {}, "--shards='two' is invalid; expected an integer"),
        (
            ["--shards", "3", "--shard-ports", "{p},{q}"],
            {},
            "--shard-ports={p},{q} names 2 port(s) but --shards=3; expected one port per shard",
        ),
        (
            ["--shards", "2", "--shard-ports", "{p},{p}"],
            {},
            "--shard-ports={p},{p} names port {p} twice; expected 2 different ports",
        ),
        (["--shard-ports", "{p},0"], {}, "--shard-ports='{p},0' is invalid; expected ports in 1..65535"),
        (
            ["--shards", "2", "--port", "65535"],
            {},
            "--port=65535 with --shards=2 needs ports 65535..65536; expected --port <= 65534",
        ),
        (
            ["--shards", "2", "--port", "{p}", "--metrics-port", "{q}"],
            {},
            "--metrics-port={q} with --shards=2 takes ports {q}..",
        ),
        (
            ["--shards", "2", "--shard-group", "a:1,b:2"],
            {},
            "--shard-group=a:1,b:2 with --shards=2: --shards tells its own shards their group; expected one of the two",
        ),
        (["--shard-group", "a:1,a:1"], {}, "--shard-group='a:1,a:1' is invalid; expected 'host:port"),
    ],
)
def test_bad_shard_settings_exit_2_naming_the_flag_before_anything_starts(
    args: list[str], env: dict[str, str], message: str
) -> None:
    port = a_free_port_and_its_neighbour()
    # {q} is the port after {p}: as metrics ports from it, the second shard's gRPC port would be taken twice.
    fill = {"p": str(port), "q": str(port + 1)}
    args = [arg.format(**fill) for arg in args]
    completed = subprocess.run(
        [sys.executable, "-m", "gradq.server", "--host", "127.0.0.1", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
    )
    assert completed.returncode == 2, completed.stderr
    assert message.format(**fill) in completed.stderr
    assert "starting" not in completed.stderr and "serving" not in completed.stderr
    assert not listening(port) and not listening(port + 1)


def test_the_health_check_under_gradq_shards_checks_every_shard(shards: Shards) -> None:
    def check(**env: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "gradq.server.healthcheck"]
        return subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env}, timeout=60)

    first, second = shards.ports
    healthy = check(GRADQ_SHARDS="2", GRADQ_PORT=str(first))
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert healthy.stdout.splitlines() == [f"localhost:{first}: SERVING", f"localhost:{second}: SERVING"]
    nobody = free_port()
    half = check(GRADQ_SHARDS="2", GRADQ_SHARD_PORTS=f"{first},{nobody}")
    assert half.returncode == 1
    assert half.stdout.splitlines()[0] == f"localhost:{first}: SERVING"
    assert half.stdout.splitlines()[1].startswith(f"localhost:{nobody}: not serving; connection refused at")


def a_port_whose_neighbour_is_held() -> tuple[int, socket.socket]:
    """A free port and a socket of this process listening on the next one (a port in use for the second shard)."""
    while True:
        port = a_free_port_and_its_neighbour()
        holder = socket.socket()
        try:  # the neighbour may be some connection's local port, or in TIME_WAIT: then another pair
            holder.bind(("127.0.0.1", port + 1))
            holder.listen()
        except OSError:
            holder.close()
            continue
        return port, holder


def test_a_shard_that_cannot_start_stops_the_others_and_the_parent_exits_with_its_status() -> None:
    port, holder = a_port_whose_neighbour_is_held()
    with holder:
        completed = subprocess.run(
            [sys.executable, "-m", "gradq.server", "--host", "127.0.0.1", "--shards", "2", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert completed.returncode == 2, completed.stderr
    assert f"cannot listen on 127.0.0.1:{port + 1}: the port is in use" in completed.stderr
    assert f"shard 1 (port {port + 1}) could not start (exit status 2); stopping the other shards" in completed.stderr
    assert not listening(port)


def test_the_plan_names_the_advertised_host_chosen_ports_and_consecutive_metrics_ports() -> None:
    from gradq.server.shard_plan import ShardPlan, plan_shards

    plan = plan_shards(None, (50051, 50061), 0, 9100, "0.0.0.0", "aggregator", None)
    assert plan == ShardPlan((50051, 50061), (9100, 9101), ("aggregator:50051", "aggregator:50061"))
    assert plan_shards(3, None, 7000, None, "0.0.0.0", None, None) == ShardPlan(
        (7000, 7001, 7002), (None, None, None), (":7000", ":7001", ":7002")
    )
    assert plan_shards(None, None, 50051, 9100, "0.0.0.0", None, None) is None  # one shard: the plain gradq serve
