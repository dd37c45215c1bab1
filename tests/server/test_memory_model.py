"""The memory model of docs/operating.md, checked: a shard holds for a job what the model says; the budget counts it.

The model: one fp32 accumulator (4 bytes per element) per round in flight;
the encoded means of the newest completed step and the ``--retain-steps``
steps before it, each kept once, in its wire form; 4 KiB and its message per
remembered failure; with ``--server-error-feedback`` a fp32 residual per round
key until the job ends. bench/server_memory.py measures the process's RSS
under a GPT-2-sized job against it.
"""

from __future__ import annotations

import gc
import logging
import threading
import tracemalloc

import numpy as np
import pytest
from round_calls import push, wait

from gradq.client import WorkerClient
from gradq.client.chunks import chunk_bounds
from gradq.qcore import QuantConfig, Scheme, codec_for, decode, encode
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.errors import ResourceExhaustedError
from gradq.server.job_spec import JobSpec
from gradq.server.limits import ServiceLimits
from gradq.server.policy import RoundPolicy
from gradq.server.rounds import RoundTable
from gradq.server.servicer import package_result
from gradq.server.step_window import GRID_ENTRY_BYTES

CONFIG = QuantConfig(scheme=Scheme.PER_CHANNEL_AFFINE, bits=8)
RETAIN_STEPS = 2
# What a PushPullResponse adds to the codec's wire size (its own fields, tags and lengths), at most.
FRAMING_BYTES = 32


def retained_model(bucket_sizes: list[int], chunk_elements: int) -> tuple[int, int]:
    """(rounds per step, bytes the model says the retained steps hold) for one shard holding every bucket."""
    codec = codec_for(CONFIG.scheme)
    chunks = [
        end - begin
        for size in bucket_sizes
        for begin, end in chunk_bounds(size, chunk_elements, codec.wire_channel_size(size, CONFIG.channel_size))
    ]
    return len(chunks), (RETAIN_STEPS + 1) * sum(codec.wire_size(numel, CONFIG) for numel in chunks)


def test_a_servers_retained_means_are_the_models_and_the_budget_counts_them() -> None:
    buckets, chunk_elements, world, steps = [300_000, 1 << 20, 70_000], 1 << 18, 2, 6
    server = AggregatorServer(
        # The means alone: the server error-feedback residuals are the next tests'.
        RoundPolicy(round_timeout_s=30.0, retain_steps=RETAIN_STEPS, server_error_feedback=False),
        ServerOptions("127.0.0.1:0", grace_s=0.5),
    )
    server.start()
    address = f"127.0.0.1:{server.port}"
    done = threading.Barrier(world + 1)
    measured: dict[str, int] = {}
    errors: list[BaseException] = []

    def rank(rank_id: int) -> None:
        try:
            rng = np.random.default_rng(rank_id)
            grads = [rng.standard_normal(size, np.float32) for size in buckets]
            with WorkerClient(
                address, "model", rank_id, world, CONFIG, chunk_elements=chunk_elements, max_in_flight=2
            ) as client:
                for step in range(steps):
                    for future in [client.push_pull_async(step, b, g) for b, g in enumerate(grads)]:
                        future.result()
                done.wait(30)  # every rank has its answers and has not left
                done.wait(30)  # the server has been measured
        except BaseException as error:  # reported by the test
            errors.append(error)
            done.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    try:
        for thread in threads:
            thread.start()
        done.wait(60)
        job = server.table.jobs.all()[0]
        measured["in_use"] = server.table.budget.in_use
        measured["packaged"] = sum(len(rnd.result.packaged or b"") for rnd in job.rounds.values() if rnd.result)
        measured["means_kept"] = sum(rnd.result.encoded is not None for rnd in job.rounds.values() if rnd.result)
        measured["steps"] = len({step for step, _ in job.rounds})
        done.wait(30)
        for thread in threads:
            thread.join(30)
    finally:
        server.stop()
    assert not errors, errors
    rounds, model = retained_model(buckets, chunk_elements)
    assert measured["steps"] == RETAIN_STEPS + 1
    assert measured["means_kept"] == 0  # the wire form is the only copy
    # The budget counts exactly the retained means (no round is open) and each round key's grid,
    # and the means are the model's.
    means = measured["in_use"] - rounds * GRID_ENTRY_BYTES
    assert means == measured["packaged"]
    assert model <= means <= model + (RETAIN_STEPS + 1) * rounds * FRAMING_BYTES


def test_a_retained_mean_is_held_once() -> None:
    """The Python heap the table keeps after its rounds is the budget's count, not twice it."""
    numel, steps = 1 << 20, 6
    decode(encode(np.ones(numel, np.float32), CONFIG))  # the kernels' first-call allocations happen before
    table = RoundTable(RoundPolicy(retain_steps=RETAIN_STEPS, server_error_feedback=False), package=package_result)
    table.join(JobSpec("job", 0, 1))
    gradient = np.random.default_rng(0).standard_normal(numel, np.float32)
    gc.collect()
    logging.disable(logging.WARNING)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for step in range(steps):
            wait(table, push(table, "job", step, 0, 0, encode(gradient, CONFIG)))  # the answer is dropped
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        logging.disable(logging.NOTSET)
    in_use = table.budget.in_use - GRID_ENTRY_BYTES  # the means, without bucket 0's remembered grid
    one_mean = codec_for(CONFIG.scheme).wire_size(numel, CONFIG)
    assert (RETAIN_STEPS + 1) * one_mean <= in_use <= (RETAIN_STEPS + 1) * (one_mean + FRAMING_BYTES)
    print(f"retained: budget {in_use} bytes, Python heap {held} bytes")
    assert held <= in_use + (256 << 10)  # twice would be 2 x in_use
    assert held <= (RETAIN_STEPS + 1) * (one_mean + FRAMING_BYTES) + (256 << 10)


def test_server_error_feedback_residuals_are_charged_until_the_job_ends() -> None:
    numel = 1000
    table = RoundTable(RoundPolicy(retain_steps=RETAIN_STEPS, server_error_feedback=True))
    table.join(JobSpec("job", 0, 1))
    for step in range(4):
        for bucket in (0, 1):
            wait(table, push(table, "job", step, bucket, 0, encode(np.ones(numel, np.float32), CONFIG)))
    job = table.jobs.all()[0]
    means = sum(rnd.charged for rnd in job.rounds.values())
    # One fp32 residual and one remembered grid per round key.
    assert table.budget.in_use == means + 2 * (4 * numel + GRID_ENTRY_BYTES)
    table.leave("job", 0)
    assert table.budget.in_use == 0


def test_a_job_inventing_round_keys_under_server_error_feedback_is_refused_at_its_share() -> None:
    numel, share = 1000, 1 << 20
    table = RoundTable(
        RoundPolicy(server_error_feedback=True),
        limits=ServiceLimits(max_job_memory_bytes=share, max_memory_bytes=8 * share),
    )
    table.join(JobSpec("job", 0, 1))
    with pytest.raises(ResourceExhaustedError, match=r"error-feedback residual.*--max-job-memory-bytes"):
        for bucket in range(share // (4 * numel) + 2):
            wait(table, push(table, "job", 0, bucket, 0, encode(np.ones(numel, np.float32), CONFIG)))
    assert table.budget.in_use <= share
