"""What refusing costs the aggregator: a call without a valid token that sends nothing, streams that read no answer.

Run from the repository root with the virtualenv's interpreter::

    python bench/refusal_costs.py                         # this checkout's aggregator
    git worktree add /tmp/before b5cb246
    python bench/refusal_costs.py --checkout /tmp/before  # that checkout's, run by this interpreter

Every row starts its own `gradq serve` process (its RSS is its own). Issue 41's items:

- 5, a token: each method of the service is opened with an invalid token as
  a stream that sends no message and never half-closes; the table gives the
  seconds until it is refused, and how (a call still open at the 10 s
  deadline is DEADLINE_EXCEEDED).
- 4, unread streams: a legitimate 2-rank job runs its first rounds, then
  ``--streams`` PushPullStreams, each on its own connection, send pushes to
  job ids nobody joined and read no answer, until the aggregator reads no
  more of them. The table gives the pushes it took, its RSS growth (the least
  and most of ``--runs`` runs), and whether the job then finished a round
  with the streams open. Job ids 64 KiB long (a Join refuses more than 256
  characters; a push's was not checked before commit f3eb629), and 200
  characters. The attack is the test's (tests/server/abuse_helpers.py), so
  these are the figures of what tests/server/test_stream_refusals.py bounds.

A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))
from abuse_helpers import LegitJob, UnreadStream, rss_bytes, wait_until_unread

from gradq.proto.v1 import aggregator_pb2 as pb
from gradq.server.process import spawn_aggregator

# How gradq's folders map to its packages (pyproject.toml's package-dir), for another checkout.
_PARTS = ("qcore", "server", "client", "proto", "cli")
_TOKEN = "a-valid-token-0123456789"
ROWS = {"64 KiB": 64 << 10, "200 characters": 200}


def _environment(checkout: Path | None, scratch: Path) -> dict[str, str]:
    """The server's environment: with ``checkout``, its folders linked as the gradq package, first on the path."""
    environment = dict(os.environ)
    if checkout is not None:
        package = scratch / "gradq"
        package.mkdir()
        for part in _PARTS:
            (package / part).symlink_to(checkout.resolve() / part)
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(scratch), environment.get("PYTHONPATH")]))
    return environment


def _server_source(environment: dict[str, str]) -> str:
    """Where the server's code is imported from under ``environment`` (proof of which checkout is measured)."""
    probe = [sys.executable, "-c", "import gradq.server.servicer as s; print(s.__file__)"]
    return subprocess.run(probe, env=environment, capture_output=True, text=True, check=True).stdout.strip()


def _silent_calls(environment: dict[str, str], scratch: Path) -> list[tuple[str, float, str]]:
    """(method, seconds until refused, status) for each method opened with an invalid token, sending nothing."""
    tokens = scratch / "tokens"
    tokens.write_text(f"{_TOKEN} job=*\n")
    process, port = spawn_aggregator(
        "--token-file", str(tokens), "--log-level", "ERROR", env=environment, stderr=subprocess.DEVNULL
    )
    silent = threading.Event()

    def nothing() -> Iterator[bytes]:
        silent.wait()
        yield from ()

    service = pb.DESCRIPTOR.services_by_name["Aggregator"]
    rows = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            for method in service.methods:
                call = channel.stream_stream(f"/{service.full_name}/{method.name}")
                started = time.monotonic()
                try:
                    next(call(nothing(), timeout=10, metadata=[("authorization", "Bearer not-a-valid-token")]))
                    status = "answered"
                except grpc.RpcError as error:
                    status = error.code().name
                rows.append((method.name, time.monotonic() - started, status))
    finally:
        silent.set()
        process.terminate()
        process.wait(timeout=30)
    return rows


def _unread_streams(environment: dict[str, str], job_id_chars: int, streams: int, pushes: int) -> tuple[int, int, bool]:
    """(pushes the server took, its RSS growth in bytes, whether the job then finished a round)."""
    process, port = spawn_aggregator("--log-level", "ERROR", env=environment, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    legit = LegitJob(address, "legit", 2)
    attackers: list[UnreadStream] = []
    try:
        legit.run(range(2))
        before = rss_bytes(process.pid)
        for stream in range(streams):
            job_ids = [f"{stream}-{index}".ljust(job_id_chars, "x") for index in range(8)]
            attackers.append(UnreadStream(address, job_ids, pushes))
        sent = wait_until_unread(attackers, quiet_s=2.0)
        growth = rss_bytes(process.pid) - before
        try:
            legit.run(range(2, 3))
            finished = True
        except AssertionError:
            finished = False
        return sent, growth, finished
    finally:
        for attacker in attackers:
            attacker.close()
        legit.close()
        process.terminate()
        process.wait(timeout=30)


def main() -> None:
    """Run both parts and print their tables."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", type=Path, help="run the aggregator of this checkout (default: this one's)")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--pushes", type=int, default=4096, help="at most this many pushes per stream")
    parser.add_argument("--runs", type=int, default=3, help="runs of each row of unread streams")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        environment = _environment(args.checkout, Path(scratch))
        print(f"aggregator: {_server_source(environment)}\n")
        print("| method, invalid token, nothing sent | refused after | status |\n|---|---:|---|")
        for method, seconds, status in _silent_calls(environment, Path(scratch)):
            print(f"| {method} | {seconds:.3f} s | {status} |")
        print(f"\n| {args.streams} streams reading no answer, job ids | pushes taken | RSS growth | round after |")
        print("|---|---:|---:|---|")
        for name, chars in ROWS.items():
            runs = [_unread_streams(environment, chars, args.streams, args.pushes) for _ in range(args.runs)]
            taken = sorted(sent for sent, _, _ in runs)
            growth = sorted(growth / 2**20 for _, growth, _ in runs)
            finished = sum(finished for _, _, finished in runs)
            print(
                f"| {name} | {taken[0]}-{taken[-1]} | {growth[0]:+.0f} to {growth[-1]:+.0f} MiB "
                f"| {finished} of {len(runs)} |"
            )


if __name__ == "__main__":
    main()
