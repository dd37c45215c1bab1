"""Aggregator throughput: rounds/s, GB/s aggregated and peak RSS of one `gradq.server` process under W ranks.

Run from the repository root with the virtualenv's interpreter::

    python bench/server_throughput.py                       # W = 2 4 8 16, 8 and 4 bits, 10 rounds
    python bench/server_throughput.py --workers 4 --bits 8 --rounds 20 --numel 1000000

The aggregator runs as a real separate process (``python -m gradq.server``), so
it never shares the GIL with the simulated workers and its RSS can be sampled
(psutil, every 20 ms, on a background thread). The W ranks live in this one
process, each with its own channel and its own TCP connection (a local
subchannel pool; gRPC would otherwise share one connection between channels).
Each rank's bucket is encoded once per configuration and the same request is
pushed every round with a new step number, so the figures measure the server
(decode-accumulate, average, re-encode, protobuf and gRPC transport), not
client-side quantization. All W pushes of a round are in flight at once
(``PushPull.future``); the next round starts when every rank has its mean, as
in a synchronous data-parallel step.

The server is restarted for every (bits, W) configuration, so each row's peak
RSS belongs to that configuration alone and no earlier job's retained rounds
or allocator high-water mark leak into it. The restart costs a second or two
of start-up, outside the timed rounds. The server imports numba on its first
push, so its RSS after the warm-up rounds includes numba, its baseline does not.
The warm-up round's mean is checked against the exact mean of the pushes.
Ctrl-C stops the server (SIGTERM, then SIGKILL) before the script exits.

GB/s is W x 4 bytes x numel x rounds / seconds (1 GB = 1e9 bytes); wire MB
(1 MB = 1e6 bytes) is one rank's PushPullRequest plus PushPullResponse as
protobuf bytes per round, without gRPC/HTTP2 framing. Both the workers and the
server share this machine's cores, so on a small machine the server figures
are a floor. This is a benchmark, not a test.
"""

from __future__ import annotations

import os

# One thread for numba/numpy here and, through the inherited environment, in the server.
for _variable in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_variable] = "1"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from types import TracebackType  # noqa: E402

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402

from gradq.proto.convert import tensor_from_proto, tensor_to_proto  # noqa: E402
from gradq.proto.v1 import aggregator_pb2 as pb  # noqa: E402
from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc  # noqa: E402
from gradq.qcore import QuantConfig, Scheme, decode, decode_accumulate, encode  # noqa: E402

BUCKET_NUMEL = 6_553_600  # 25 MiB of float32, a typical DDP bucket
FP32_BYTES = 4
WARMUP_ROUNDS = 2
CLIENT_REPEATS = 5  # timed encode/decode runs for the worker-side figure
RSS_INTERVAL_S = 0.02
MAX_MESSAGE_BYTES = 1 << 30
JOB_ID = "bench-server-throughput"
START_TIMEOUT_S = 60.0  # for the server to write its port file
CALL_TIMEOUT_S = 120.0  # deadline of every RPC
STOP_TIMEOUT_S = 15.0  # after SIGTERM, before SIGKILL
SERVER_GRACE_S = 2.0  # the server's own --grace: rounds are normally all answered when we stop it
MEAN_TOLERANCE_STEPS = 1.0  # the returned mean may be off the exact mean by at most one grid step
MB = 1e6
GB = 1e9


@dataclass(frozen=True, slots=True)
class Row:
    """One (bits, W) configuration's measurements."""

    bits: int  # bits per element of the pushed buckets (and of the mean sent back)
    world_size: int  # ranks pushing every round
    numel: int  # float32 elements per bucket
    rounds: int  # timed rounds
    seconds: float  # wall time of the timed rounds
    wire_bytes: int  # one rank's request + response protobuf bytes per round
    baseline_rss: int  # server RSS after the joins, before the first push
    warm_rss: int  # server RSS after the warm-up rounds
    peak_rss: int  # largest server RSS sampled, warm-up included
    server_cpu_s: float  # server user + system CPU seconds during the timed rounds
    client_cpu_s: float  # the same for this process (all W ranks), which shares the machine

    @property
    def rounds_per_s(self) -> float:
        """Completed rounds per second."""
        return self.rounds / self.seconds

    @property
    def gbps(self) -> float:
        """GB of fp32 gradient averaged per second, all ranks together."""
        return self.world_size * self.numel * FP32_BYTES * self.rounds / self.seconds / GB

    @property
    def server_cores(self) -> float:
        """Average number of cores the server kept busy during the timed rounds."""
        return self.server_cpu_s / self.seconds

    @property
    def client_cores(self) -> float:
        """Average number of cores the W simulated ranks kept busy during the timed rounds."""
        return self.client_cpu_s / self.seconds


@dataclass(frozen=True, slots=True)
class ServerProcess:
    """A running aggregator: its process and the address it serves on."""

    popen: subprocess.Popen[bytes]
    address: str


class PeakRssSampler:
    """Samples a process's RSS every ``RSS_INTERVAL_S`` on a daemon thread and keeps the largest.

    Args:
        process: the process to watch.
    """

    def __init__(self, process: psutil.Process) -> None:
        self._process = process
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, name="rss-sampler", daemon=True)
        # Largest RSS seen; final once __exit__ has joined the thread and taken a last sample.
        self.peak_bytes = 0

    def __enter__(self) -> PeakRssSampler:
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stopped.set()
        self._thread.join()
        with contextlib.suppress(psutil.Error):
            self.sample()

    def sample(self) -> int:
        """The process's RSS now, in bytes, counted towards the peak.

        Raises:
            psutil.Error: the process is gone.
        """
        rss = int(self._process.memory_info().rss)
        self.peak_bytes = max(self.peak_bytes, rss)
        return rss

    def _sample_until_stopped(self) -> None:
        while True:
            try:
                self.sample()
            except psutil.Error:
                return
            if self._stopped.wait(RSS_INTERVAL_S):
                return


def _server_command(world_size: int, port_file: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gradq.server",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--world-size",
        str(world_size),
        "--log-level",
        "WARNING",
        "--grace",
        str(SERVER_GRACE_S),
    ]


def _wait_for_port(popen: subprocess.Popen[bytes], port_file: Path, log_path: Path) -> int:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        # The server writes "PORT\n" in one call; no newline yet means a partial read.
        text = port_file.read_text() if port_file.exists() else ""
        if text.endswith("\n"):
            return int(text)
        if popen.poll() is not None:
            raise RuntimeError(
                f"the server exited with code {popen.returncode} before serving:\n{log_path.read_text()}"
            )
        time.sleep(0.05)
    raise RuntimeError(f"the server wrote no port to {port_file} within {START_TIMEOUT_S:g} s:\n{log_path.read_text()}")


def _stop_server(popen: subprocess.Popen[bytes], log_path: Path) -> None:
    if popen.poll() is None:
        popen.terminate()
        try:
            popen.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()
            print(f"warning: the server ignored SIGTERM for {STOP_TIMEOUT_S:g} s and was killed", file=sys.stderr)
            return
    if popen.returncode != 0:
        print(f"warning: the server exited with code {popen.returncode}:\n{log_path.read_text()}", file=sys.stderr)


@contextlib.contextmanager
def running_server(world_size: int) -> Iterator[ServerProcess]:
    """Start ``python -m gradq.server`` on a free port; SIGTERM it (SIGKILL if it hangs) on the way out.

    Args:
        world_size: the server's ``--world-size``.

    Yields:
        The running server, once it has written its port file.

    Raises:
        RuntimeError: the server exited or wrote no port within ``START_TIMEOUT_S``.
    """
    with tempfile.TemporaryDirectory(prefix="gradq-bench-") as workdir:
        port_file = Path(workdir) / "port"
        log_path = Path(workdir) / "server.log"
        with log_path.open("wb") as log_file:
            # A session of its own: Ctrl-C reaches only this script, whose finally stops the server.
            popen = subprocess.Popen(
                _server_command(world_size, port_file),
                stdout=subprocess.DEVNULL,
                stderr=log_file,
                start_new_session=True,
            )
            try:
                port = _wait_for_port(popen, port_file, log_path)
                yield ServerProcess(popen, f"127.0.0.1:{port}")
            finally:
                _stop_server(popen, log_path)


@contextlib.contextmanager
def rank_stubs(address: str, world_size: int) -> Iterator[list[pb_grpc.AggregatorStub]]:
    """One channel (and TCP connection) per rank, closed on the way out.

    Args:
        address: the server's host:port.
        world_size: how many ranks.

    Yields:
        One stub per rank, rank order.
    """
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        # Separate workers hold separate connections; without this all channels share one.
        ("grpc.use_local_subchannel_pool", 1),
    ]
    channels = [grpc.insecure_channel(address, options=options) for _ in range(world_size)]
    try:
        yield [pb_grpc.AggregatorStub(channel) for channel in channels]
    finally:
        for channel in channels:
            channel.close()


@contextlib.contextmanager
def interrupt_deferred() -> Iterator[None]:
    """Hold Ctrl-C while gRPC calls are being started; raise KeyboardInterrupt once they all are.

    A KeyboardInterrupt raised inside ``future()`` can leave a call registered with
    no thread to complete it, and closing its channel then never returns
    (grpc/grpc#19973), so the server would never be stopped either.
    """
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


def join_ranks(stubs: Sequence[pb_grpc.AggregatorStub]) -> None:
    """Join every rank to ``JOB_ID``, waiting for the server to accept connections."""
    with interrupt_deferred():
        calls = [
            stub.Join.future(
                pb.JoinRequest(job_id=JOB_ID, rank=rank, world_size=len(stubs)),
                timeout=CALL_TIMEOUT_S,
                wait_for_ready=True,
            )
            for rank, stub in enumerate(stubs)
        ]
    for call in calls:
        call.result()


def build_requests(gradients: Sequence[np.ndarray], config: QuantConfig) -> list[pb.PushPullRequest]:
    """Encode each rank's bucket once and wrap it in the request that rank pushes every round.

    Args:
        gradients: one float32 bucket per rank.
        config: the wire scheme.

    Returns:
        One request per rank (step 0; ``push_round`` sets the step).
    """
    return [
        pb.PushPullRequest(job_id=JOB_ID, step=0, bucket=0, rank=rank, tensor=tensor_to_proto(encode(bucket, config)))
        for rank, bucket in enumerate(gradients)
    ]


def push_round(
    stubs: Sequence[pb_grpc.AggregatorStub], requests: Sequence[pb.PushPullRequest], step: int
) -> list[pb.PushPullResponse]:
    """Push every rank's request for ``step`` at once and wait for all the means.

    Returns:
        One response per rank.

    Raises:
        grpc.RpcError: a push failed.
        RuntimeError: a round closed without every rank.
    """
    calls = []
    with interrupt_deferred():
        for stub, request in zip(stubs, requests, strict=True):
            # future() serializes the request before returning, so rewriting the step is safe.
            request.step = step
            calls.append(stub.PushPull.future(request, timeout=CALL_TIMEOUT_S))
    responses = [call.result() for call in calls]
    for response in responses:
        if response.partial or response.contributors != len(requests):
            raise RuntimeError(
                f"step {step}: contributors={response.contributors}, partial={response.partial}; "
                f"expected all {len(requests)} ranks"
            )
    return responses


def check_mean(response: pb.PushPullResponse, requests: Sequence[pb.PushPullRequest]) -> None:
    """Check the returned mean against the exact mean of the pushed buckets, in grid steps.

    Raises:
        RuntimeError: naming the worst element, when it is off by more than ``MEAN_TOLERANCE_STEPS``.
    """
    pushed = [tensor_from_proto(request.tensor) for request in requests]
    expected = np.zeros(pushed[0].numel, np.float32)
    for tensor in pushed:
        decode_accumulate(tensor, expected)
    expected /= np.float32(len(pushed))
    mean = tensor_from_proto(response.mean)
    values = decode(mean)
    grid_step = np.repeat(mean.scale, mean.channel_size)[: mean.numel]
    error = np.abs(values - expected) / grid_step
    worst = int(np.argmax(error))
    if error[worst] > MEAN_TOLERANCE_STEPS:
        raise RuntimeError(
            f"mean[{worst}]={values[worst]!r} is {error[worst]:.2f} grid steps from the exact mean "
            f"{expected[worst]!r}; expected <= {MEAN_TOLERANCE_STEPS:g}"
        )


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def time_rounds(
    stubs: Sequence[pb_grpc.AggregatorStub],
    requests: Sequence[pb.PushPullRequest],
    steps: range,
    processes: Sequence[psutil.Process],
) -> tuple[float, list[float]]:
    """Run one round per step, back to back.

    Returns:
        (wall seconds, CPU seconds of each of ``processes``) over all the rounds.
    """
    cpu_before = [_cpu_seconds(process) for process in processes]
    start = time.perf_counter()
    for step in steps:
        push_round(stubs, requests, step)
    seconds = time.perf_counter() - start
    return seconds, [_cpu_seconds(process) - before for process, before in zip(processes, cpu_before, strict=True)]


def measure_config(bits: int, gradients: Sequence[np.ndarray], rounds: int) -> Row:
    """Start a server, warm it up, time ``rounds`` rounds of ``len(gradients)`` ranks, stop it.

    Args:
        bits: bits per element, per-channel affine.
        gradients: one float32 bucket per rank.
        rounds: timed rounds after ``WARMUP_ROUNDS`` untimed ones.

    Returns:
        The configuration's row.
    """
    world_size = len(gradients)
    requests = build_requests(gradients, QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=bits))
    with running_server(world_size) as server, rank_stubs(server.address, world_size) as stubs:
        process = psutil.Process(server.popen.pid)
        join_ranks(stubs)
        baseline_rss = process.memory_info().rss
        with PeakRssSampler(process) as sampler:
            for step in range(WARMUP_ROUNDS):
                responses = push_round(stubs, requests, step)
            check_mean(responses[0], requests)
            warm_rss = sampler.sample()
            steps = range(WARMUP_ROUNDS, WARMUP_ROUNDS + rounds)
            seconds, (server_cpu_s, client_cpu_s) = time_rounds(stubs, requests, steps, [process, psutil.Process()])
    return Row(
        bits=bits,
        world_size=world_size,
        numel=gradients[0].size,
        rounds=rounds,
        seconds=seconds,
        wire_bytes=requests[0].ByteSize() + responses[0].ByteSize(),
        baseline_rss=baseline_rss,
        warm_rss=warm_rss,
        peak_rss=sampler.peak_bytes,
        server_cpu_s=server_cpu_s,
        client_cpu_s=client_cpu_s,
    )


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``call`` over ``repeats`` runs, after one untimed warm-up run."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def client_round_trip_seconds(bucket: np.ndarray, config: QuantConfig) -> tuple[float, float]:
    """What one worker pays per bucket outside the server: encode its gradient, decode the mean.

    Returns:
        (encode seconds, decode seconds), medians of ``CLIENT_REPEATS`` runs.
    """
    encoded = encode(bucket, config)
    return (
        median_seconds(lambda: encode(bucket, config), CLIENT_REPEATS),
        median_seconds(lambda: decode(encoded), CLIENT_REPEATS),
    )


def format_table(rows: Sequence[Row]) -> str:
    """Render the rows as a markdown table."""
    lines = [
        "| bits | W | rounds/s | GB/s fp32 aggregated | wire MB/worker/round (push+pull) | "
        "server RSS before 1st push MB | RSS after warm-up MB | peak RSS MB | server CPU (cores) | "
        "workers CPU (cores) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.bits} | {row.world_size} | {row.rounds_per_s:.2f} | {row.gbps:.2f} | {row.wire_bytes / MB:.2f} | "
            f"{row.baseline_rss / MB:.0f} | {row.warm_rss / MB:.0f} | {row.peak_rss / MB:.0f} | "
            f"{row.server_cores:.2f} | {row.client_cores:.2f} |"
        )
    return "\n".join(lines)


def format_verdict(rows: Sequence[Row], encode_s: float, decode_s: float) -> str:
    """Compare the server's W=4, 8-bit round rate with the rate one worker produces buckets at.

    Args:
        rows: measured rows.
        encode_s: one worker's 8-bit encode time per bucket.
        decode_s: one worker's 8-bit decode time per bucket.

    Returns:
        Two lines: both rates side by side, then the verdict.
    """
    worker_rate = 1.0 / (encode_s + decode_s)
    worker = (
        f"one worker: {worker_rate:.2f} buckets/s (encode {encode_s * 1e3:.2f} ms + decode {decode_s * 1e3:.2f} ms)"
    )
    row = next((r for r in rows if (r.world_size, r.bits) == (4, 8)), None)
    if row is None:
        return f"{worker}\nverdict: not measured (needs --workers 4 and --bits 8)"
    server = f"server: {row.rounds_per_s:.2f} rounds/s at W=4, 8-bit"
    if row.rounds_per_s > worker_rate:
        verdict = "aggregator not the bottleneck of a 4-worker job"
    else:
        verdict = "aggregator IS the bottleneck of a 4-worker job (it completes rounds slower than a worker codes)"
    return f"{server} | {worker}\nverdict: {verdict}"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; expected an integer >= 1")
    return value


def _bits(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 8:
        raise argparse.ArgumentTypeError(f"bits={text!r} is out of range; expected 1..8")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=_positive, nargs="+", default=[2, 4, 8, 16], help="world sizes W")
    parser.add_argument("--bits", type=_bits, nargs="+", default=[8, 4], help="bits per element, per-channel affine")
    parser.add_argument("--rounds", type=_positive, default=10, help=f"timed rounds after {WARMUP_ROUNDS} warm-up")
    parser.add_argument("--numel", type=_positive, default=BUCKET_NUMEL, help="float32 elements per bucket")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    """Measure the worker-side cost, then every (bits, W) configuration, and print the report."""
    numel = args.numel
    gradients = [
        np.random.default_rng(rank).normal(0, 1e-3, numel).astype(np.float32) for rank in range(max(args.workers))
    ]
    encode_s, decode_s = client_round_trip_seconds(gradients[0], QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=8))
    print(
        f"# aggregator throughput: {numel:,} float32 elements per bucket ({numel * FP32_BYTES / MB:.1f} MB), "
        f"per_channel_affine, {WARMUP_ROUNDS} warm-up + {args.rounds} timed rounds, server restarted per row, "
        f"{os.cpu_count()} CPU cores shared by server and workers\n",
        flush=True,
    )
    rows = []
    for bits in args.bits:
        for world_size in args.workers:
            rows.append(measure_config(bits, gradients[:world_size], args.rounds))
            print(f"measured bits={bits} W={world_size}", file=sys.stderr, flush=True)
    print(format_table(rows), flush=True)
    print(
        "\nGB/s = W x 4 B x numel x rounds / s (1e9 B). Wire MB = one rank's request + response protobuf bytes "
        "(1e6 B). CPU = user+system seconds / wall seconds over the timed rounds, of the server process and of "
        "this one (all W workers).\n"
    )
    print(format_verdict(rows, encode_s, decode_s))


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags and run the benchmark.

    Args:
        argv: command-line arguments; None reads ``sys.argv``.

    Returns:
        0, or 130 when interrupted (the server is stopped either way).
    """
    args = parse_args(argv)
    try:
        run(args)
    except KeyboardInterrupt:
        print("interrupted; server stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
