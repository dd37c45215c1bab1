"""A client's CPU per streamed message: gRPC-Python's sync stream (as gradq's PushStream) beside grpc.aio.

Run from the repository root with the virtualenv's interpreter::

    python bench/client_stream_cpu.py                          # 512 KiB messages, 2000 of them, both ways
    python bench/client_stream_cpu.py --message-bytes 65536 --messages 4000

Two bare grpc.aio echo servers (one per shard, each in its own process)
answer every message of a bidirectional stream with one of the same size.
A client in a fresh process opens one stream to each and sends
``--messages`` messages round-robin, keeping ``--in-flight`` unanswered, in
one of two ways:

- sync: the stream gradq's client uses (gradq.client.push_stream): a
  request iterator fed from a queue, a thread reading the answers, gRPC's own
  threads behind them;
- aio: one asyncio loop in a thread of its own, a writer and a reader task per
  stream, messages handed to it with ``call_soon_threadsafe``.

CPU is user + system time of the client process over the timed messages.
The question it answers: would moving the client's streams onto one event
loop per process cut its CPU per message? This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import multiprocessing
import multiprocessing.connection
import queue
import resource
import threading
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from gradq.proto.transport import channel_options

SERVICE = "gradq.bench.Echo"
STREAM = f"/{SERVICE}/Stream"
WARMUP = 20
Waiting = queue.SimpleQueue[concurrent.futures.Future[bytes]]


def _identity(data: bytes) -> bytes:
    return data


def _serve(port_out: multiprocessing.connection.Connection, message_bytes: int) -> None:
    answer = bytes(message_bytes)

    async def stream(requests: AsyncIterator[bytes], _context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for _request in requests:
            yield answer

    async def main() -> None:
        server = grpc.aio.server(options=channel_options())
        handler = grpc.stream_stream_rpc_method_handler(stream, _identity, _identity)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Stream": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_out.send(port)
        await server.wait_for_termination()

    asyncio.run(main())


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(send: Callable[[int], concurrent.futures.Future[bytes]], messages: int, in_flight: int) -> float:
    """CPU ms per message of ``messages`` sends, at most ``in_flight`` unanswered."""

    def run(count: int) -> None:
        waiting: list[concurrent.futures.Future[bytes]] = []
        for index in range(count):
            waiting.append(send(index))
            if len(waiting) >= in_flight:
                waiting.pop(0).result()
        for future in waiting:
            future.result()

    run(WARMUP)
    began = _cpu_s()
    run(messages)
    return (_cpu_s() - began) / messages * 1e3


def sync_client(ports: Sequence[int], messages: int, message_bytes: int, in_flight: int) -> float:
    """CPU ms per message over sync gRPC streams, a reader thread each (as gradq.client.push_stream)."""
    request = bytes(message_bytes)
    streams = []
    for port in ports:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
        outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        waiting: Waiting = queue.SimpleQueue()
        call = channel.stream_stream(STREAM, _identity, _identity)(iter(outbox.get, None))

        def read(
            call: grpc.Call = call, waiting: queue.SimpleQueue[concurrent.futures.Future[bytes]] = waiting
        ) -> None:
            for answer in call:
                waiting.get().set_result(answer)

        threading.Thread(target=read, daemon=True).start()
        streams.append((outbox, waiting))

    def send(index: int) -> concurrent.futures.Future[bytes]:
        outbox, waiting = streams[index % len(streams)]
        future: concurrent.futures.Future[bytes] = concurrent.futures.Future()
        waiting.put(future)
        outbox.put(request)
        return future

    return _timed(send, messages, in_flight)


def aio_client(ports: Sequence[int], messages: int, message_bytes: int, in_flight: int) -> float:
    """CPU ms per message over grpc.aio streams on one event loop thread."""
    request = bytes(message_bytes)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    tasks: list[asyncio.Task[None]] = []  # kept referenced: the loop holds tasks weakly

    async def open_streams() -> list[tuple[asyncio.Queue[bytes], list[concurrent.futures.Future[bytes]]]]:
        streams = []
        for port in ports:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
            call = channel.stream_stream(STREAM, _identity, _identity)()
            outbox: asyncio.Queue[bytes] = asyncio.Queue()
            waiting: list[concurrent.futures.Future[bytes]] = []

            async def read(call: grpc.aio.StreamStreamCall = call, waiting: list = waiting) -> None:  # type: ignore[type-arg]
                async for answer in call:
                    waiting.pop(0).set_result(answer)

            async def write(call: grpc.aio.StreamStreamCall = call, outbox: asyncio.Queue[bytes] = outbox) -> None:  # type: ignore[type-arg]
                while True:  # grpc.aio takes one write at a time
                    await call.write(await outbox.get())

            tasks.extend((asyncio.ensure_future(read()), asyncio.ensure_future(write())))
            streams.append((outbox, waiting))
        return streams

    streams = asyncio.run_coroutine_threadsafe(open_streams(), loop).result()

    def enqueue(index: int, future: concurrent.futures.Future[bytes]) -> None:
        outbox, waiting = streams[index % len(streams)]
        waiting.append(future)
        outbox.put_nowait(request)

    def send(index: int) -> concurrent.futures.Future[bytes]:
        future: concurrent.futures.Future[bytes] = concurrent.futures.Future()
        loop.call_soon_threadsafe(enqueue, index, future)
        return future

    cpu_ms = _timed(send, messages, in_flight)

    async def close() -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run_coroutine_threadsafe(close(), loop).result()
    return cpu_ms


CLIENTS = {"sync": sync_client, "aio": aio_client}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--message-bytes", type=int, default=1 << 19, help="each message, both ways")
    parser.add_argument("--messages", type=int, default=2000, help="timed messages per client")
    parser.add_argument("--in-flight", type=int, default=4, help="unanswered messages at most")
    parser.add_argument("--shards", type=int, default=2, help="echo servers, one stream each")
    parser.add_argument("--repeats", type=int, default=2, help="alternated runs of each client")
    args = parser.parse_args(argv)
    if min(args.message_bytes, args.messages, args.in_flight, args.shards, args.repeats) < 1:
        parser.error("every option takes a positive number")

    ports = []
    for _ in range(args.shards):
        ours, theirs = multiprocessing.Pipe()
        multiprocessing.Process(target=_serve, args=(theirs, args.message_bytes), daemon=True).start()
        ports.append(ours.recv())
    spawn = multiprocessing.get_context("spawn")
    results: dict[str, list[float]] = {name: [] for name in CLIENTS}
    for _ in range(args.repeats):
        for name, client in CLIENTS.items():
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:  # a fresh process each
                job = pool.submit(client, ports, args.messages, args.message_bytes, args.in_flight)
                results[name].append(job.result())
    print(f"{args.message_bytes} B messages, {args.shards} streams, {args.in_flight} in flight; client CPU ms/message:")
    for name, values in results.items():
        print(f"  {name:5} " + ", ".join(f"{v:.3f}" for v in values))
    ratio = min(results["aio"]) / min(results["sync"])
    print(f"  aio / sync (best of each): {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
