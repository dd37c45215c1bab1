"""Aggregator throughput: rounds/s, GB/s of wire per aggregator CPU-second and peak RSS of S shards under W ranks.

Run from the repository root with the virtualenv's interpreter::

    python bench/server_throughput.py                       # W = 2 4 8 16, 8 and 4 bits, 1 shard, 10 rounds
    python bench/server_throughput.py --workers 4 --bits 8 --rounds 20 --numel 1000000
    python bench/server_throughput.py --workers 4 --bits 8 4 2 --shards 1 2 4 --numel 1048576 --rounds 100

Each aggregator shard runs as a real separate process (``python -m
gradq.server``), so it never shares the GIL with the simulated workers, its
CPU time is its own and its RSS can be sampled (psutil, every 20 ms, on a
background thread). The W ranks live in this one process, each with its own
channel and its own TCP connection to every shard (a local subchannel pool;
gRPC would otherwise share one connection between channels). Every round,
each rank pushes one bucket of ``--numel`` elements to every shard (bucket
key = shard index), so each shard carries the same load whatever S is. Each
rank's bucket is encoded once per configuration and pushed every round with
a new step number, as the client's own ``serialize_with_tensor`` builds it,
and the answers are read without parsing their payload, so the figures
measure the server (protobuf, digest, decode-accumulate, average, re-encode,
gRPC transport), not client-side quantization. All W x S pushes of a round
are in flight at once; the next round starts when every rank has its means,
as in a synchronous data-parallel step.

The headline figure is GB/s of wire per aggregator CPU-second: every push's
request plus its response, protobuf bytes without gRPC/HTTP2 framing, divided
by the user + system CPU seconds of all shard processes over the timed
rounds (psutil's ``cpu_times``, every thread of theirs: the event loop, the
pool and gRPC's own). Process CPU time, not wall time, is the measure because
the workers, the shards and whatever else runs on the machine share its
cores: wall-clock rates are a floor that moves with the load, CPU time per
byte much less.

The server is restarted for every (bits, W) configuration, so each row's peak
RSS belongs to that configuration alone and no earlier job's retained rounds
or allocator high-water mark leak into it. The restart costs a second or two
of start-up, outside the timed rounds. The server imports numba on its first
push, so its RSS after the warm-up rounds includes numba, its baseline does not.
The warm-up round's mean is checked against the exact mean of the pushes.
Ctrl-C stops the server (SIGTERM, then SIGKILL) before the script exits.

GB/s aggregated is W x S x 4 bytes x numel x rounds / seconds (1 GB = 1e9
bytes); wire MB (1 MB = 1e6 bytes) is one push's PushPullRequest plus its
PushPullResponse. This is a benchmark, not a test.
"""

from __future__ import annotations

import os

# One thread for numba/numpy here and, through the inherited environment, in the server.
for _variable in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_variable] = "1"

import argparse  # noqa: E402
import asyncio  # noqa: E402
import concurrent.futures  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import AsyncIterator, Callable, Iterator, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from types import TracebackType  # noqa: E402
from typing import Any  # noqa: E402

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402

from gradq.client.push_stream import PushStream, StreamedReply  # noqa: E402
from gradq.proto.convert import parse_with_tensor, serialize_with_tensor, tensor_from_proto  # noqa: E402
from gradq.proto.transport import channel_options, keep_large_buffers  # noqa: E402
from gradq.proto.v1 import aggregator_pb2 as pb  # noqa: E402
from gradq.proto.v1 import aggregator_pb2_grpc as pb_grpc  # noqa: E402
from gradq.qcore import QuantConfig, QuantizedArray, Scheme, decode, decode_accumulate, encode  # noqa: E402

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
# One aggregator core should move this much wire (in + out) at 4 bits with >= 4 pushers: about 1.25x
# BytePS's ~0.8 GB/s per core (4 cores for its C++ server at 25 Gbit/s).
TARGET_GB_PER_CPU_S = 1.0
MEAN_TOLERANCE_STEPS = 1.0  # the returned mean may be off the exact mean by at most one grid step
PUSH_PULL = "/gradq.v1.Aggregator/PushPull"
PUSH_PULL_STREAM = "/gradq.v1.Aggregator/PushPullStream"
TRANSPORTS = ("stream", "unary")
MB = 1e6
GB = 1e9
MS = 1e3


@dataclass(frozen=True, slots=True)
class Row:
    """One (bits, W, S) configuration's measurements."""

    bits: int  # bits per element of the pushed buckets (and of the mean sent back)
    transport: str  # "stream": one PushPullStream per rank and shard; "unary": a PushPull call per push
    world_size: int  # ranks pushing every round
    shards: int  # aggregator processes; every rank pushes one bucket to each every round
    numel: int  # float32 elements per bucket
    rounds: int  # timed rounds
    seconds: float  # wall time of the timed rounds
    request_bytes: int  # one push's PushPullRequest, protobuf bytes
    response_bytes: int  # its PushPullResponse
    baseline_rss: int  # the largest shard's RSS after the joins, before the first push
    warm_rss: int  # the largest shard's RSS after the warm-up rounds
    peak_rss: int  # the largest RSS any shard reached, warm-up included
    server_cpu_s: float  # user + system CPU seconds of all shards during the timed rounds
    client_cpu_s: float  # the same for this process (all W ranks), which shares the machine
    floor_cpu_s: float | None = None  # the same pushes' CPU on bare gRPC-Python servers (``serve_floor``)

    @property
    def floor_ms_per_push(self) -> float | None:
        """Bare gRPC-Python's CPU milliseconds per push of the same bytes, when measured."""
        return None if self.floor_cpu_s is None else MS * self.floor_cpu_s / self.pushes

    @property
    def pushes(self) -> int:
        """Pushes (each answered with a mean) over the timed rounds, all shards together."""
        return self.world_size * self.shards * self.rounds

    @property
    def wire_bytes(self) -> int:
        """Wire bytes in and out of the shards over the timed rounds (protobuf, without gRPC framing)."""
        return self.pushes * (self.request_bytes + self.response_bytes)

    @property
    def rounds_per_s(self) -> float:
        """Completed rounds (one per shard, all at once) per second."""
        return self.rounds / self.seconds

    @property
    def gbps(self) -> float:
        """GB of fp32 gradient averaged per second, all ranks and shards together."""
        return self.pushes * self.numel * FP32_BYTES / self.seconds / GB

    @property
    def wire_gbps(self) -> float:
        """GB of wire (in + out) per wall second, all shards together."""
        return self.wire_bytes / self.seconds / GB

    @property
    def wire_gb_per_cpu_s(self) -> float:
        """GB of wire (in + out) per CPU second of the shards: what one aggregator core moves."""
        return self.wire_bytes / self.server_cpu_s / GB

    @property
    def cpu_ms_per_push(self) -> float:
        """Aggregator CPU milliseconds per push, its share of the round's re-encode included."""
        return MS * self.server_cpu_s / self.pushes

    @property
    def server_cores(self) -> float:
        """Average number of cores the shards kept busy during the timed rounds."""
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
    """Samples processes' RSS every ``RSS_INTERVAL_S`` on a daemon thread and keeps the largest of any.

    Args:
        processes: the processes to watch (the shards).
    """

    def __init__(self, processes: Sequence[psutil.Process]) -> None:
        self._processes = list(processes)
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
        """The largest of the processes' RSS now, in bytes, counted towards the peak.

        Raises:
            psutil.Error: a process is gone.
        """
        rss = max(int(process.memory_info().rss) for process in self._processes)
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


def _server_command(world_size: int, port_file: Path, metrics: bool = False) -> list[str]:
    """gradq's aggregator; ``metrics``: exporting Prometheus metrics on a free port, as deployments run it."""
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
        *(("--metrics-port", "0") if metrics else ()),
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
def running_server(world_size: int, command: Callable[[int, Path], list[str]] | None = None) -> Iterator[ServerProcess]:
    """Start ``python -m gradq.server`` on a free port; SIGTERM it (SIGKILL if it hangs) on the way out.

    Args:
        world_size: the server's ``--world-size``.
        command: (world size, port file) -> the server's argv; None runs gradq's aggregator.

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
                (command or _server_command)(world_size, port_file),
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
def running_shards(
    world_size: int, shards: int, command: Callable[[int, Path], list[str]] | None = None
) -> Iterator[list[ServerProcess]]:
    """``shards`` aggregators (``running_server``), each a process of its own; all stopped on the way out.

    Yields:
        The running shards, in shard order.
    """
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(running_server(world_size, command)) for _ in range(shards)]


def _floor_command(bits: int, numel: int) -> Callable[[int, Path], list[str]]:
    """The argv of this script as a bare gRPC-Python PushPull server (``serve_floor``)."""

    def command(world_size: int, port_file: Path) -> list[str]:
        return [
            sys.executable,
            __file__,
            "--serve-floor",
            str(world_size),
            "--bits",
            str(bits),
            "--numel",
            str(numel),
            "--port-file",
            str(port_file),
        ]

    return command


def serve_floor(world_size: int, bits: int, numel: int, port_file: Path) -> None:
    """Serve PushPull as bare gRPC-Python until SIGTERM: every ``world_size`` calls are one round.

    The floor under gradq's figure: the same grpc.aio server, message limits,
    raw-bytes handlers and allocator settings, with calls parked on a bare
    future until their round's last one arrives, then all answered with a
    canned mean of the pushes' size. No parsing, digest, decoding, averaging
    or encoding. A round is simply the next ``world_size`` calls: the bench
    starts a round only once the last one is answered.
    """
    keep_large_buffers()
    values = np.random.default_rng(0).normal(0, 1e-3, numel).astype(np.float32)
    mean = encode(values, QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=bits))
    answer = serialize_with_tensor(pb.PushPullResponse(contributors=world_size), "mean", mean)
    joined = pb.JoinResponse(world_size=world_size, joined=world_size).SerializeToString()
    asyncio.run(_serve_floor(world_size, answer, joined, port_file))


async def _serve_floor(world_size: int, answer: bytes, joined: bytes, port_file: Path) -> None:
    waiting: list[asyncio.Future[None]] = []
    # Each round's answer naming it, built once and written to its W waiters, as gradq's are: (step, bucket) ->
    # [the bytes, the waiters that took them].
    rounds: dict[tuple[int, int], list[Any]] = {}

    def round_answer(step: int, bucket: int) -> bytes:
        entry = rounds.get((step, bucket))
        if entry is None:
            named = answer + pb.PushPullResponse(step=step, bucket=bucket).SerializeToString()
            entry = rounds[(step, bucket)] = [named, 0]
        entry[1] += 1
        if entry[1] == world_size:
            del rounds[(step, bucket)]
        data: bytes = entry[0]
        return data

    async def push_pull(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        future = asyncio.get_running_loop().create_future()
        waiting.append(future)
        if len(waiting) == world_size:
            for parked in waiting:
                parked.set_result(None)
            waiting.clear()
        await future
        return answer

    async def push_pull_stream(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        # As gradq's: a task per push read, answers written as their rounds finish, each naming its round (the
        # same bytes for all its waiters) or, for a client that does not read those, its push's sequence.
        answers: asyncio.Queue[bytes | None] = asyncio.Queue()

        async def one(request: bytes) -> None:
            header = parse_with_tensor(request, pb.PushPullRequest, "tensor")[0]
            await push_pull(request, context)
            if header.round_answers:
                answers.put_nowait(round_answer(header.step, header.bucket))
            else:
                answers.put_nowait(answer + pb.PushPullResponse(sequence=header.sequence).SerializeToString())

        async def read() -> None:
            tasks = [asyncio.create_task(one(request)) async for request in requests]
            await asyncio.gather(*tasks)
            answers.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (data := await answers.get()) is not None:
                yield data
        finally:
            reader.cancel()

    def join(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return joined

    server = grpc.aio.server(options=channel_options())
    handlers = {
        "PushPull": grpc.unary_unary_rpc_method_handler(push_pull),
        "PushPullStream": grpc.stream_stream_rpc_method_handler(push_pull_stream),
        "Join": grpc.unary_unary_rpc_method_handler(join),
    }
    service = pb.DESCRIPTOR.services_by_name["Aggregator"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stopping = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set_result, None)
    port_file.write_text(f"{port}\n")
    await stopping
    await server.stop(None)


@contextlib.contextmanager
def rank_channels(addresses: Sequence[str], world_size: int) -> Iterator[list[list[grpc.Channel]]]:
    """One channel (and TCP connection) per rank and shard, closed on the way out.

    Args:
        addresses: every shard's host:port.
        world_size: how many ranks.

    Yields:
        ``channels[rank][shard]``.
    """
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        # Separate workers hold separate connections; without this all channels share one.
        ("grpc.use_local_subchannel_pool", 1),
    ]
    channels = [[grpc.insecure_channel(address, options=options) for address in addresses] for _ in range(world_size)]
    try:
        yield channels
    finally:
        for per_rank in channels:
            for channel in per_rank:
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


def join_ranks(channels: Sequence[Sequence[grpc.Channel]]) -> None:
    """Join every rank to ``JOB_ID`` on every shard, waiting for the shards to accept connections."""
    with interrupt_deferred():
        calls = [
            pb_grpc.AggregatorStub(channel).Join.future(
                pb.JoinRequest(job_id=JOB_ID, rank=rank, world_size=len(channels)),
                timeout=CALL_TIMEOUT_S,
                wait_for_ready=True,
            )
            for rank, per_rank in enumerate(channels)
            for channel in per_rank
        ]
    for call in calls:
        call.result()


def push_request(rank: int, shard: int, step: int, tensor: QuantizedArray) -> bytes:
    """Rank ``rank``'s push of ``tensor`` to ``shard`` (bucket key = shard) for ``step``, as the client builds it.

    The step is the push's sequence too: a rank has one push per shard and step. Like the client's, the push
    takes its round's answer, which names the round, as its own (``round_answers``).
    """
    header = pb.PushPullRequest(job_id=JOB_ID, step=step, bucket=shard, rank=rank, sequence=step, round_answers=True)
    return serialize_with_tensor(header, "tensor", tensor)


class UnaryPush:
    """One rank's pushes to one shard as unary PushPull calls."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._call = channel.unary_unary(PUSH_PULL)  # no serializers: bytes both ways

    def push(self, request: bytes, sequence: int) -> concurrent.futures.Future[bytes]:
        future: concurrent.futures.Future[bytes] = self._call.future(request, timeout=CALL_TIMEOUT_S)
        return future

    def close(self) -> None:
        """The channel's close ends the calls."""


class StreamPush:
    """One rank's pushes to one shard as the messages of one PushPullStream: the client's own transport."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._stream = PushStream(channel.stream_stream(PUSH_PULL_STREAM), CALL_TIMEOUT_S)

    def push(self, request: bytes, sequence: int) -> concurrent.futures.Future[bytes]:
        done: concurrent.futures.Future[bytes] = concurrent.futures.Future()

        def settle(reply: StreamedReply) -> None:
            if reply.code() == grpc.StatusCode.OK:
                done.set_result(reply.result())
            else:
                done.set_exception(RuntimeError(f"push {sequence}: {reply.code()}: {reply.details()}"))

        self._stream.send(request, sequence).add_done_callback(settle)
        return done

    def close(self) -> None:
        self._stream.close()


Pusher = UnaryPush | StreamPush


def push_round(calls: Sequence[Sequence[Pusher]], tensors: Sequence[QuantizedArray], step: int) -> list[list[bytes]]:
    """Push every rank's bucket to every shard for ``step`` at once and wait for all the means.

    Args:
        calls: ``calls[rank][shard]``, each rank's pushes to each shard.
        tensors: each rank's encoded bucket.
        step: the round's step.

    Returns:
        ``responses[rank][shard]``, serialized PushPullResponses.

    Raises:
        grpc.RpcError: a push failed.
        RuntimeError: a round closed without every rank.
    """
    futures = []
    with interrupt_deferred():
        for rank, (per_rank, tensor) in enumerate(zip(calls, tensors, strict=True)):
            futures.append(
                [call.push(push_request(rank, shard, step, tensor), step) for shard, call in enumerate(per_rank)]
            )
    responses = [[future.result() for future in rank_futures] for rank_futures in futures]
    for rank_responses in responses:
        for data in rank_responses:
            response, _ = parse_with_tensor(data, pb.PushPullResponse, "mean")  # the payload stays unparsed
            if response.partial or response.contributors != len(tensors):
                raise RuntimeError(
                    f"step {step}: contributors={response.contributors}, partial={response.partial}; "
                    f"expected all {len(tensors)} ranks"
                )
    return responses


def check_mean(response: bytes, tensors: Sequence[QuantizedArray]) -> None:
    """Check a returned mean against the exact mean of the pushed buckets, in grid steps.

    Raises:
        RuntimeError: naming the worst element, when it is off by more than ``MEAN_TOLERANCE_STEPS``.
    """
    expected = np.zeros(tensors[0].numel, np.float32)
    for tensor in tensors:
        decode_accumulate(tensor, expected)
    expected /= np.float32(len(tensors))
    message, payload = parse_with_tensor(response, pb.PushPullResponse, "mean")
    mean = tensor_from_proto(message.mean, "mean", payload)
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
    calls: Sequence[Sequence[Pusher]],
    tensors: Sequence[QuantizedArray],
    steps: range,
    shards: Sequence[psutil.Process],
) -> tuple[float, float, float]:
    """Run one round per step, back to back.

    Returns:
        (wall seconds, CPU seconds of all ``shards``, CPU seconds of this process) over all the rounds.
    """
    client = psutil.Process()
    shards_before, client_before = sum(_cpu_seconds(process) for process in shards), _cpu_seconds(client)
    start = time.perf_counter()
    for step in steps:
        push_round(calls, tensors, step)
    seconds = time.perf_counter() - start
    shards_cpu = sum(_cpu_seconds(process) for process in shards) - shards_before
    return seconds, shards_cpu, _cpu_seconds(client) - client_before


@dataclass(frozen=True, slots=True)
class Timed:
    """One set of shards' timed rounds."""

    seconds: float  # wall time of the timed rounds
    server_cpu_s: float  # user + system CPU seconds of all shards
    client_cpu_s: float  # the same for this process
    baseline_rss: int  # the largest shard's RSS after the joins
    warm_rss: int  # the largest shard's RSS after the warm-up rounds
    peak_rss: int  # the largest RSS any shard reached
    response_bytes: int  # one push's PushPullResponse


def timed_shards(
    tensors: Sequence[QuantizedArray],
    shards: int,
    rounds: int,
    transport: str,
    command: Callable[[int, Path], list[str]] | None = None,
    metrics: bool = False,
) -> Timed:
    """Start ``shards`` servers, warm them up, time ``rounds`` rounds of ``len(tensors)`` ranks, stop them.

    Args:
        tensors: each rank's encoded bucket.
        shards: server processes, each pushed one bucket per rank and round.
        rounds: timed rounds after ``WARMUP_ROUNDS`` untimed ones.
        transport: "stream" or "unary" (see ``Row.transport``).
        command: the servers' argv (``running_server``); None runs gradq's aggregator, whose means are checked.
        metrics: gradq's aggregators export metrics (``--metrics-port``), so every round also reports its error.
    """
    world_size = len(tensors)
    with (
        running_shards(world_size, shards, command or functools.partial(_server_command, metrics=metrics)) as servers,
        rank_channels([server.address for server in servers], world_size) as channels,
    ):
        processes = [psutil.Process(server.popen.pid) for server in servers]
        join_ranks(channels)
        # Requests go as the client's bytes, answers come back as bytes.
        pusher = StreamPush if transport == "stream" else UnaryPush
        calls = [[pusher(channel) for channel in per_rank] for per_rank in channels]
        baseline_rss = max(process.memory_info().rss for process in processes)
        try:
            with PeakRssSampler(processes) as sampler:
                for step in range(WARMUP_ROUNDS):
                    responses = push_round(calls, tensors, step)
                if command is None:  # the floor answers a canned mean
                    for response in responses[0]:
                        check_mean(response, tensors)
                warm_rss = sampler.sample()
                steps = range(WARMUP_ROUNDS, WARMUP_ROUNDS + rounds)
                seconds, server_cpu_s, client_cpu_s = time_rounds(calls, tensors, steps, processes)
        finally:
            for per_rank in calls:
                for call in per_rank:
                    call.close()
    return Timed(seconds, server_cpu_s, client_cpu_s, baseline_rss, warm_rss, sampler.peak_bytes, len(responses[0][0]))


def measure_config(
    bits: int,
    transport: str,
    gradients: Sequence[np.ndarray],
    shards: int,
    rounds: int,
    floor: bool,
    metrics: bool = False,
) -> Row:
    """Time ``rounds`` rounds of ``len(gradients)`` ranks on ``shards`` aggregators, then (``floor``) on bare gRPC.

    Args:
        bits: bits per element, per-channel affine.
        transport: "stream" or "unary" (see ``Row.transport``).
        gradients: one float32 bucket per rank.
        shards: aggregator processes, each pushed one bucket per rank and round.
        rounds: timed rounds after ``WARMUP_ROUNDS`` untimed ones.
        floor: also time the same pushes against ``serve_floor`` servers, right after.
        metrics: the aggregators export Prometheus metrics (``--metrics-port``).

    Returns:
        The configuration's row.
    """
    config = QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=bits)
    tensors = [encode(bucket, config) for bucket in gradients]
    gradq = timed_shards(tensors, shards, rounds, transport, metrics=metrics)
    bare = timed_shards(tensors, shards, rounds, transport, _floor_command(bits, tensors[0].numel)) if floor else None
    return Row(
        bits=bits,
        transport=transport,
        world_size=len(tensors),
        shards=shards,
        numel=tensors[0].numel,
        rounds=rounds,
        seconds=gradq.seconds,
        request_bytes=len(push_request(0, 0, WARMUP_ROUNDS + rounds, tensors[0])),
        response_bytes=gradq.response_bytes,
        baseline_rss=gradq.baseline_rss,
        warm_rss=gradq.warm_rss,
        peak_rss=gradq.peak_rss,
        server_cpu_s=gradq.server_cpu_s,
        client_cpu_s=gradq.client_cpu_s,
        floor_cpu_s=bare.server_cpu_s if bare is not None else None,
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
        "| bits | transport | W | shards | rounds/s | wire MB/push (in+out) | aggregator CPU ms/push | "
        "**GB/s of wire per aggregator CPU-s** | bare gRPC floor ms/push | gradq's own ms/push | "
        "GB/s of wire (wall) | GB/s fp32 aggregated | aggregator cores busy | workers cores busy | "
        "workers CPU ms/push | RSS before 1st push MB | RSS after warm-up MB | peak RSS MB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        floor = row.floor_ms_per_push
        floor_cells = "| - | - |" if floor is None else f"| {floor:.3f} | {row.cpu_ms_per_push - floor:.3f} |"
        lines.append(
            f"| {row.bits} | {row.transport} | {row.world_size} | {row.shards} | {row.rounds_per_s:.2f} | "
            f"{(row.request_bytes + row.response_bytes) / MB:.3f} | {row.cpu_ms_per_push:.3f} | "
            f"**{row.wire_gb_per_cpu_s:.3f}** {floor_cells} {row.wire_gbps:.3f} | {row.gbps:.2f} | "
            f"{row.server_cores:.2f} | {row.client_cores:.2f} | {MS * row.client_cpu_s / row.pushes:.3f} | "
            f"{row.baseline_rss / MB:.0f} | "
            f"{row.warm_rss / MB:.0f} | {row.peak_rss / MB:.0f} |"
        )
    return "\n".join(lines)


def format_verdict(rows: Sequence[Row], encode_s: float, decode_s: float) -> str:
    """Compare the server's W=4, 8-bit, 1-shard round rate with the rate one worker produces buckets at.

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
    row = next((r for r in rows if (r.world_size, r.bits, r.shards, r.transport) == (4, 8, 1, "stream")), None)
    if row is None:
        return f"{worker}\nverdict: not measured (needs --workers 4, --bits 8 and --shards 1)"
    server = f"server: {row.rounds_per_s:.2f} rounds/s at W=4, 8-bit"
    if row.rounds_per_s > worker_rate:
        verdict = "aggregator not the bottleneck of a 4-worker job"
    else:
        verdict = "aggregator IS the bottleneck of a 4-worker job (it completes rounds slower than a worker codes)"
    return f"{server} | {worker}\nverdict: {verdict}"


def format_target(rows: Sequence[Row]) -> str:
    """One PASS/FAIL line per 4-bit row with 4 or more pushers against ``TARGET_GB_PER_CPU_S``."""
    lines = []
    for row in rows:
        if row.bits == 4 and row.world_size >= 4:
            verdict = "PASS" if row.wire_gb_per_cpu_s >= TARGET_GB_PER_CPU_S else "FAIL"
            lines.append(
                f"{verdict}: 4 bits, {row.transport}, W={row.world_size}, {row.shards} shard(s): "
                f"{row.wire_gb_per_cpu_s:.3f} GB/s of "
                f"wire per aggregator CPU-second; target >= {TARGET_GB_PER_CPU_S:g}"
            )
    return "\n".join(lines) or f"target (>= {TARGET_GB_PER_CPU_S:g} GB/s per CPU-s at 4 bits, W >= 4): not measured"


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
    parser.add_argument("--shards", type=_positive, nargs="+", default=[1], help="aggregator processes S")
    parser.add_argument("--rounds", type=_positive, default=10, help=f"timed rounds after {WARMUP_ROUNDS} warm-up")
    parser.add_argument("--numel", type=_positive, default=BUCKET_NUMEL, help="float32 elements per bucket")
    parser.add_argument(
        "--transport",
        choices=TRANSPORTS,
        nargs="+",
        default=list(TRANSPORTS),
        help="how ranks push: one PushPullStream per rank and shard (the client's default), or a unary call per push",
    )
    parser.add_argument(
        "--floor", action="store_true", help="after each row, time the same pushes on bare gRPC-Python servers"
    )
    parser.add_argument(
        "--metrics",
        action="store_true",
        help="start the aggregators with --metrics-port 0, as deployments that export Prometheus metrics run them",
    )
    parser.add_argument("--serve-floor", type=_positive, metavar="WORLD_SIZE", help=argparse.SUPPRESS)
    parser.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    """Measure the worker-side cost, then every (bits, W, S) configuration, and print the report."""
    numel = args.numel
    gradients = [
        np.random.default_rng(rank).normal(0, 1e-3, numel).astype(np.float32) for rank in range(max(args.workers))
    ]
    encode_s, decode_s = client_round_trip_seconds(gradients[0], QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=8))
    print(
        f"# aggregator throughput: {numel:,} float32 elements per bucket ({numel * FP32_BYTES / MB:.1f} MB), "
        f"per_channel_affine, {WARMUP_ROUNDS} warm-up + {args.rounds} timed rounds, shards restarted per row, "
        f"{os.cpu_count()} CPU cores shared by shards and workers"
        f"{', aggregators exporting metrics' if args.metrics else ''}\n",
        flush=True,
    )
    rows = []
    for bits in args.bits:
        for world_size in args.workers:
            for shards in args.shards:
                for transport in args.transport:  # side by side, minutes apart at most
                    rows.append(
                        measure_config(
                            bits, transport, gradients[:world_size], shards, args.rounds, args.floor, args.metrics
                        )
                    )
                    print(
                        f"measured bits={bits} W={world_size} shards={shards} transport={transport}",
                        file=sys.stderr,
                        flush=True,
                    )
    print(format_table(rows), flush=True)
    print(
        "\nWire = each push's request + response protobuf bytes (1 MB = 1e6 B, 1 GB = 1e9 B), without gRPC/HTTP2 "
        "framing. Aggregator CPU = user + system seconds of all shard processes over the timed rounds (process CPU "
        "time, not wall time: the machine's cores are shared); GB/s of wire per aggregator CPU-s = wire bytes / "
        "those seconds. Cores busy = CPU seconds / wall seconds, of the shards and of this process (all W workers); "
        "workers CPU ms/push = this process's CPU per push (sending, receiving, no codec work). "
        "GB/s fp32 = W x S x 4 B x numel x rounds / wall s. Bare gRPC floor (--floor): the same pushes, timed "
        "right after, on grpc.aio servers that only park each round's calls and answer a canned mean; gradq's own "
        "= aggregator - floor: parsing, checks, digest, round table, decode-accumulate, re-encode, hops.\n"
    )
    print(format_target(rows))
    print(format_verdict(rows, encode_s, decode_s))


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags and run the benchmark.

    Args:
        argv: command-line arguments; None reads ``sys.argv``.

    Returns:
        0, or 130 when interrupted (the shards are stopped either way).
    """
    args = parse_args(argv)
    if args.serve_floor is not None:
        serve_floor(args.serve_floor, args.bits[0], args.numel, args.port_file)
        return 0
    try:
        run(args)
    except KeyboardInterrupt:
        print("interrupted; server stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
