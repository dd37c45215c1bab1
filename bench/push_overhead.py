"""CPU per push: gradq's client and aggregator beside a bare gRPC-Python echo of the same bytes.

Run from the repository root with the virtualenv's interpreter::

    python bench/push_overhead.py                                  # 2^19 elements at 4 bits, 2^21 at 8 bits
    python bench/push_overhead.py --chunks 524288:4 --pushes 3000

Two ranks in this process push the same chunk round after round to a real
aggregator (``python -m gradq.server``, world 2), each keeping at most
``--in-flight`` rounds outstanding, as the DDP hook's window does. Then the
same two ranks send the same number of unary calls, with gradq's request
bytes, to a bare gRPC-Python server in its own process that answers with
gradq's response bytes and does nothing else. Both servers are the sync
grpc.server with a thread pool; both clients use ``future()`` calls.

CPU is user + system time of each process over the timed calls (this
process for the client side, psutil for the server), per push. The codec
column is what the client's encode and decode of one chunk cost on their own
(the aggregator's decode-accumulate and re-encode are inside its figure).
What is left of gradq's figures after the echo and the codec is gradq's own
Python: hook-free client bookkeeping, protobuf headers, the round table.
This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import resource
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
from server_throughput import running_server

from gradq.client import serde
from gradq.client.worker import WorkerClient
from gradq.proto.transport import channel_options, keep_large_buffers
from gradq.qcore import QuantConfig, decode, encode
from gradq.server.rounds import RoundResult
from gradq.server.serde import result_to_bytes

ECHO_METHOD = "/gradq.bench.Echo/Call"
WARMUP_PUSHES = 20
DEFAULT_CHUNKS = ("524288:4", "2097152:8")  # the slow-link chunk at 4 bits, the default chunk at 8 bits
START_TIMEOUT_S = 60.0
MS = 1e3


@dataclass(frozen=True, slots=True)
class Cpu:
    """CPU milliseconds per push, client and server side."""

    client_ms: float
    server_ms: float


@dataclass(frozen=True, slots=True)
class Row:
    """One chunk size and bit width, measured three ways."""

    numel: int
    bits: int
    request_bytes: int
    response_bytes: int
    echo: Cpu
    gradq: Cpu
    codec_ms: float  # the client's encode + decode of one chunk


def _process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _server_cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _paced(pushes: int, in_flight: int, start: Callable[[int], list[concurrent.futures.Future[Any]]]) -> None:
    """Start round i with ``start(i)``; before round i + in_flight, wait for round i's futures."""
    outstanding: deque[list[concurrent.futures.Future[Any]]] = deque()
    for index in range(pushes):
        if len(outstanding) == in_flight:
            for future in outstanding.popleft():
                future.result()
        outstanding.append(start(index))
    for round_futures in outstanding:
        for future in round_futures:
            future.result()


def _timed(process: psutil.Process, pushes: int, run: Callable[[], None]) -> Cpu:
    client, server = _process_cpu_s(), _server_cpu_s(process)
    run()
    ranks = 2
    return Cpu(
        client_ms=MS * (_process_cpu_s() - client) / (ranks * pushes),
        server_ms=MS * (_server_cpu_s(process) - server) / (ranks * pushes),
    )


def measure_gradq(values: np.ndarray, config: QuantConfig, pushes: int, in_flight: int) -> tuple[Cpu, int, int]:
    """Two WorkerClients against a real aggregator; returns (CPU per push, request bytes, response bytes)."""
    with running_server(2) as server:
        process = psutil.Process(server.popen.pid)
        clients = [
            WorkerClient(server.address, "push-overhead", rank, 2, config, chunk_elements=0, max_in_flight=in_flight)
            for rank in range(2)
        ]
        outputs = [np.empty_like(values) for _ in clients]
        try:
            for client in clients:
                client.join()

            def start(step: int) -> list[concurrent.futures.Future[Any]]:
                pairs = zip(clients, outputs, strict=True)
                return [client.push_pull_async(step, 0, values, out=out) for client, out in pairs]

            _paced(WARMUP_PUSHES, in_flight, start)
            cpu = _timed(process, pushes, lambda: _paced(pushes, in_flight, lambda i: start(WARMUP_PUSHES + i)))
        finally:
            for client in clients:
                client.close()
    tensor = encode(values, config)
    request = serde.push_pull_request("push-overhead", 0, 0, 0, tensor)
    # The aggregator answers on the pushers' grid: an encoded mean of the same size.
    response = result_to_bytes(RoundResult(tensor, contributors=(0, 1), ranks=2), "", 0, 0)
    return cpu, len(request), len(response)


@contextlib.contextmanager
def echo_server(response_bytes: int) -> Iterator[tuple[psutil.Process, str]]:
    """This script as a bare gRPC server in a child process, answering every call with ``response_bytes``."""
    with tempfile.TemporaryDirectory(prefix="gradq-echo-") as workdir:
        port_file = Path(workdir) / "port"
        argv = [sys.executable, __file__, "--serve-echo", str(response_bytes), "--port-file", str(port_file)]
        popen = subprocess.Popen(argv, start_new_session=True)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not (port_file.exists() and port_file.read_text().endswith("\n")):
                if popen.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the echo server did not start (exit code {popen.poll()})")
                time.sleep(0.05)
            yield psutil.Process(popen.pid), f"127.0.0.1:{int(port_file.read_text())}"
        finally:
            popen.terminate()
            popen.wait()


def serve_echo(response_bytes: int, port_file: Path) -> None:
    """Serve ECHO_METHOD until terminated: raw bytes in, ``response_bytes`` bytes out."""
    keep_large_buffers()  # as gradq.server does, so both sides allocate alike
    response = bytes(response_bytes)

    def call(request: bytes, context: grpc.ServicerContext) -> bytes:
        return response

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), options=channel_options())
    identity = grpc.unary_unary_rpc_method_handler(call, request_deserializer=None, response_serializer=None)
    service, method = ECHO_METHOD.strip("/").split("/")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {method: identity}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_file.write_text(f"{port}\n")
    server.wait_for_termination()


def measure_echo(request_bytes: int, response_bytes: int, pushes: int, in_flight: int) -> Cpu:
    """Two channels sending ``request_bytes`` calls to the bare server, paced like the gradq ranks."""
    keep_large_buffers()
    request = bytes(request_bytes)
    with echo_server(response_bytes) as (process, address):
        channels = [grpc.insecure_channel(address, options=channel_options()) for _ in range(2)]
        calls = [channel.unary_unary(ECHO_METHOD) for channel in channels]
        try:

            def start(index: int) -> list[concurrent.futures.Future[Any]]:
                return [call.future(request) for call in calls]

            _paced(WARMUP_PUSHES, in_flight, start)
            return _timed(process, pushes, lambda: _paced(pushes, in_flight, start))
        finally:
            for channel in channels:
                channel.close()


def measure_codec(values: np.ndarray, config: QuantConfig, repeats: int) -> float:
    """Client CPU ms of one chunk's encode + decode."""
    out = np.empty_like(values)
    decode(encode(values, config), out=out)  # compile
    started = _process_cpu_s()
    for _ in range(repeats):
        decode(encode(values, config), out=out)
    return MS * (_process_cpu_s() - started) / repeats


def measure(numel: int, bits: int, pushes: int, in_flight: int) -> Row:
    """One row: gradq, then the bare echo with gradq's byte counts, then the codec alone."""
    values = np.random.default_rng(0).standard_normal(numel).astype(np.float32)
    config = QuantConfig(bits=bits)
    gradq, request_bytes, response_bytes = measure_gradq(values, config, pushes, in_flight)
    echo = measure_echo(request_bytes, response_bytes, pushes, in_flight)
    codec = measure_codec(values, config, min(pushes, 200))
    return Row(numel, bits, request_bytes, response_bytes, echo, gradq, codec)


def format_table(rows: Sequence[Row]) -> str:
    """The markdown table, one line per chunk configuration."""
    lines = [
        "| chunk elements | bits | request / response bytes | bare gRPC client / server ms [a] "
        "| gradq client / server ms [b] | client codec ms [c] | gradq's own client / server ms [d] |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        own_client = row.gradq.client_ms - row.echo.client_ms - row.codec_ms
        own_server = row.gradq.server_ms - row.echo.server_ms
        lines.append(
            f"| {row.numel:,} | {row.bits} | {row.request_bytes:,} / {row.response_bytes:,} "
            f"| {row.echo.client_ms:.3f} / {row.echo.server_ms:.3f} "
            f"| {row.gradq.client_ms:.3f} / {row.gradq.server_ms:.3f} "
            f"| {row.codec_ms:.3f} | {own_client:.3f} / {own_server:.3f} |"
        )
    return "\n".join(lines)


FOOTNOTES = """\
[a] CPU per call of a bare gRPC-Python unary call carrying gradq's request and response bytes.
[b] CPU per push of WorkerClient.push_pull_async against gradq.server (world 2), codec included.
[c] The client's encode + decode of one chunk, measured alone.
[d] gradq - bare gRPC (- codec on the client): what gradq's own code adds per push. The server
    side still includes its decode-accumulate and re-encode of the mean."""


def _chunk(text: str) -> tuple[int, int]:
    numel, _, bits = text.partition(":")
    try:
        parsed = int(numel), int(bits)
    except ValueError:
        raise argparse.ArgumentTypeError(f"chunk={text!r} is invalid; expected ELEMENTS:BITS, e.g. 524288:4") from None
    if parsed[0] < 1 or not 1 <= parsed[1] <= 8:
        raise argparse.ArgumentTypeError(f"chunk={text!r} is invalid; expected ELEMENTS >= 1 and BITS in 1..8")
    return parsed


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is invalid; expected an integer >= 1")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--chunks", nargs="+", type=_chunk, default=[_chunk(c) for c in DEFAULT_CHUNKS],
                        help="ELEMENTS:BITS of each chunk configuration")  # fmt: skip
    parser.add_argument("--pushes", type=_positive, default=1000, help="timed rounds per configuration")
    parser.add_argument("--in-flight", type=_positive, default=2, help="rounds outstanding per rank")
    parser.add_argument("--serve-echo", type=int, metavar="RESPONSE_BYTES", help=argparse.SUPPRESS)
    parser.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_echo is not None:
        serve_echo(args.serve_echo, args.port_file)
        return 0
    rows = []
    for numel, bits in args.chunks:
        print(f"{numel:,} elements at {bits} bits ...", file=sys.stderr, flush=True)
        rows.append(measure(numel, bits, args.pushes, args.in_flight))
    print(f"# CPU per push over loopback, {args.pushes} timed rounds of 2 ranks, {args.in_flight} rounds in flight\n")
    print(format_table(rows))
    print()
    print(FOOTNOTES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
