"""What a bare grpc.aio server spends per message: one unary call per push, or pushes as messages of a stream.

Run from the repository root with the virtualenv's interpreter::

    python bench/call_vs_stream.py                       # 4 senders, 4-bit push of 2^20 elements
    python bench/call_vs_stream.py --senders 8 --request-bytes 1130000 --response-bytes 1130000

gradq's aggregator answers every push with one unary PushPull call. This asks
how much of the aggregator's CPU per push is the call itself, before any of
gradq's work, by sending the same bytes two ways to servers that do nothing
but answer: ``--senders`` clients each make ``--messages`` unary calls (at most
``--in-flight`` outstanding, as a rank's send window keeps them), then the same
clients each open one bidirectional stream and send as many messages on it,
each answered by one message of ``--response-bytes``, keeping as many
outstanding. Both servers are grpc.aio in their own process, with gradq's
channel options; CPU is user + system time of the server process over the
timed messages (psutil).
This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import multiprocessing.connection
import sys
import time
from collections.abc import AsyncIterator

import grpc
import psutil

from gradq.proto.transport import channel_options

UNARY = "/gradq.bench.Bare/Unary"
STREAM = "/gradq.bench.Bare/Stream"
WARMUP = 20
MS = 1e3


def _identity(data: bytes) -> bytes:
    return data


def _serve(port_out: multiprocessing.connection.Connection, response_bytes: int) -> None:
    answer = bytes(response_bytes)

    async def unary(_request: bytes, _context: grpc.aio.ServicerContext) -> bytes:
        return answer

    async def stream(requests: AsyncIterator[bytes], _context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for _request in requests:
            yield answer

    async def main() -> None:
        server = grpc.aio.server(options=channel_options())
        handlers = {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, _identity, _identity),
            "Stream": grpc.stream_stream_rpc_method_handler(stream, _identity, _identity),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("gradq.bench.Bare", handlers),))
        port_out.send(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


async def _unary_sender(channel: grpc.aio.Channel, request: bytes, count: int, in_flight: int) -> None:
    call = channel.unary_unary(UNARY, request_serializer=_identity, response_deserializer=_identity)
    window = asyncio.Semaphore(in_flight)

    async def one() -> None:
        async with window:
            await call(request)

    await asyncio.gather(*(one() for _ in range(count)))


async def _stream_sender(channel: grpc.aio.Channel, request: bytes, count: int, in_flight: int) -> None:
    call = channel.stream_stream(STREAM, request_serializer=_identity, response_deserializer=_identity)()
    window = asyncio.Semaphore(in_flight)

    async def write() -> None:
        for _ in range(count):
            await window.acquire()
            await call.write(request)
        await call.done_writing()

    async def read() -> None:
        for _ in range(count):
            await call.read()
            window.release()

    await asyncio.gather(write(), read())


async def _measure(port: int, server: psutil.Process, kind: str, args: argparse.Namespace) -> tuple[float, float]:
    sender = _unary_sender if kind == "unary" else _stream_sender
    request = bytes(args.request_bytes)
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) for _ in range(args.senders)]
    await asyncio.gather(*(sender(c, request, WARMUP, args.in_flight) for c in channels))
    before, started = server.cpu_times(), time.perf_counter()
    await asyncio.gather(*(sender(c, request, args.messages, args.in_flight) for c in channels))
    after, wall = server.cpu_times(), time.perf_counter() - started
    for channel in channels:
        await channel.close()
    messages = args.senders * args.messages
    cpu = (after.user - before.user) + (after.system - before.system)
    return cpu / messages * MS, wall / messages * MS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--senders", type=int, default=4, help="concurrent clients (pushers)")
    parser.add_argument("--messages", type=int, default=400, help="timed messages per sender")
    parser.add_argument(
        "--in-flight", type=int, default=2, help="messages each sender keeps outstanding (calls, or on its stream)"
    )
    parser.add_argument("--request-bytes", type=int, default=540_000, help="bytes of one push (4-bit 2^20: ~540 kB)")
    parser.add_argument("--response-bytes", type=int, default=540_000, help="bytes of one answer")
    parser.add_argument("--repeats", type=int, default=3, help="alternate unary and stream this many times")
    args = parser.parse_args(argv)
    for name in ("senders", "messages", "in_flight", "request_bytes", "response_bytes", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid; expected >= 1")

    rows: list[tuple[str, int, float, float]] = []
    for repeat in range(args.repeats):
        for kind in ("unary", "stream"):
            # A fresh server per run, so neither inherits the other's warm allocator or connections.
            receive, send = multiprocessing.Pipe(duplex=False)
            process = multiprocessing.get_context("spawn").Process(
                target=_serve, args=(send, args.response_bytes), daemon=True
            )
            process.start()
            try:
                port = receive.recv()
                assert process.pid is not None
                cpu_ms, wall_ms = asyncio.run(_measure(port, psutil.Process(process.pid), kind, args))
            finally:
                process.terminate()
                process.join()
            rows.append((kind, repeat, cpu_ms, wall_ms))

    wire_mb = (args.request_bytes + args.response_bytes) / 1e6
    print(
        f"bare grpc.aio server, {args.senders} senders, {args.request_bytes:,} B in and "
        f"{args.response_bytes:,} B out per message, {args.messages} timed messages per sender"
    )
    print("| run | kind | server CPU ms/message | GB/s of wire per server CPU-s | wall ms/message |")
    print("|---:|---|---:|---:|---:|")
    for kind, repeat, cpu_ms, wall_ms in rows:
        print(f"| {repeat + 1} | {kind} | {cpu_ms:.3f} | {wire_mb / cpu_ms:.3f} | {wall_ms:.3f} |")
    unary = sorted(cpu for kind, _, cpu, _ in rows if kind == "unary")
    stream = sorted(cpu for kind, _, cpu, _ in rows if kind == "stream")
    median_unary, median_stream = unary[len(unary) // 2], stream[len(stream) // 2]
    print(
        f"median server CPU per message: unary {median_unary:.3f} ms, stream {median_stream:.3f} ms "
        f"(stream / unary = {median_stream / median_unary:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
