"""Streams whose client never reads an answer hold a bounded part of a real `gradq serve` process's memory.

Issue 41, item 4: each such stream once had the aggregator read twice
--max-waiting-per-peer pushes and keep all their refusals, each quoting a
64 KiB job id; 4 streams grew it by 593-729 MiB (bench/stream_refusal_memory.py
on the code before commit f3eb629). Now a refusal quotes at most a line, and a
stream reads at most 32 pushes past those in their rounds before it waits for
its client to read; what it holds beyond that is gRPC's flow-control window of
requests it has not read (measured 4-37 MiB a stream on loopback, figures in
docs/operating.md).
"""

from __future__ import annotations

import subprocess

from abuse_helpers import LegitJob, UnreadStream, rss_bytes, wait_until_unread

from gradq.server.process import spawn_aggregator

STREAMS = 4
PUSHES = 4096  # a stream's pushes: more than the 2 x 1024 refusals a stream held before
# What the 4 streams may add to the server's RSS: gRPC's window (measured at most 37 MiB a stream)
# and at most 32 refusals of at most ~2 KiB each, 64 MiB a stream. Before: about 150 MiB a stream.
BOUND = STREAMS * (64 << 20)


def test_streams_that_never_read_their_answers_hold_bounded_memory_and_the_job_goes_on() -> None:
    process, port = spawn_aggregator("--log-level", "ERROR", stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    legit = LegitJob(address, "legit", 2)
    attackers: list[UnreadStream] = []
    try:
        legit.run(range(2))  # its rounds, and the server's threads, before the baseline
        before = rss_bytes(process.pid)
        # Long job ids (a Join refuses over 256 characters; a push's was not checked before quoting it)
        # and ids of a valid length that no job has, in turn.
        job_ids = [f"{index}".ljust(64 << 10, "x") for index in range(3)] + ["no-job-of-a-valid-length"]
        attackers = [UnreadStream(address, job_ids, PUSHES) for _ in range(STREAMS)]
        sent = wait_until_unread(attackers)
        growth = rss_bytes(process.pid) - before
        assert sent < STREAMS * PUSHES, "the aggregator read every push of streams whose client reads no answer"
        assert growth < BOUND, f"{STREAMS} unread streams grew the server by {growth >> 20} MiB ({sent} pushes)"
        legit.run(range(2, 4))  # the streams still open: the legitimate job's rounds are exact
    finally:
        for attacker in attackers:
            attacker.close()
        legit.close()
        process.terminate()
        process.wait(timeout=30)
