"""`gradq demo`: a local aggregator and N DDP workers train a real model, then a short report."""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch.multiprocessing as mp

from gradq.client.apps.reachability import wait_for_aggregators
from gradq.client.apps.training import TrainResult, TrainSpec, train_digits
from gradq.client.config import GradqConfig
from gradq.client.env import (
    DEFAULT_CONNECT_TIMEOUT_S,
    flag_type,
    parse_integer,
    parse_number,
    parse_scheme,
    quantized_scheme_names,
)
from gradq.client.sending import AggregationError
from gradq.qcore import QuantConfig
from gradq.qcore.codecs import codec_for
from gradq.server.process import free_port, spawn_aggregator

__all__ = ["main", "run_job", "local_aggregator", "free_port"]


@contextlib.contextmanager
def local_aggregator(world_size: int, *extra: str) -> Iterator[str]:
    """Run `gradq serve` on a free loopback port for the duration; yields its address."""
    process, port = spawn_aggregator("--world-size", str(world_size), "--log-level", "WARNING", *extra)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def _rank_main(rank: int, spec: TrainSpec, results: mp.SimpleQueue) -> None:
    results.put(train_digits(rank, spec))


def run_job(spec: TrainSpec) -> list[TrainResult]:
    """Spawn ``spec.world_size`` ranks, train, and return their results in rank order."""
    queue: mp.SimpleQueue = mp.get_context("spawn").SimpleQueue()
    ranks = mp.spawn(_rank_main, args=(spec, queue), nprocs=spec.world_size, join=False)
    results: list[TrainResult] = []
    # Drain while waiting: a rank blocks on a full pipe until its result is read.
    while True:
        while not queue.empty():
            results.append(queue.get())
        if ranks.join(timeout=0.2):  # raises if a rank failed
            break
    while not queue.empty():
        results.append(queue.get())
    return sorted(results, key=lambda result: result.rank)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradq demo",
        description="Start a local gradq aggregator and N DDP worker processes (gloo) that train an MLP on "
        "scikit-learn's digits through it, then compare with the same run on plain fp32 allreduce. The 'vs "
        "uncompressed' column compares the bytes sent with what the buckets weigh in their own dtype (named). "
        "For your own script under torchrun, see examples/torchrun_train.py.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--workers", type=int, default=2, help="DDP ranks (processes)")
    parser.add_argument("--bits", type=flag_type(parse_integer(1, 8)), default=4, help="bits per gradient element")
    parser.add_argument(
        "--scheme",
        type=flag_type(parse_scheme),
        default="per_channel_affine",
        help=f"quantization scheme: {', '.join(quantized_scheme_names())}",
    )
    parser.add_argument(
        "--error-feedback",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="carry each bucket's quantization error into its next step",
    )
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training split")
    parser.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also train with plain fp32 allreduce and report both",
    )
    parser.add_argument(
        "--min-accuracy",
        type=float,
        default=90.0,
        help="exit status 0 only if gradq's test accuracy (percent) reaches this",
    )
    parser.add_argument(
        "--aggregator",
        action="append",
        default=[],
        help="use this running aggregator (host:port; repeat for shards) instead of a local one",
    )
    parser.add_argument(
        "--connect-timeout",
        type=flag_type(parse_number(0, above=True)),
        default=DEFAULT_CONNECT_TIMEOUT_S,
        help="seconds to wait for each --aggregator to answer, before training and at the first Join",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; exit status 0 when gradq reaches ``--min-accuracy``."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers={args.workers} is invalid; expected >= 1")
    if args.epochs < 1:
        parser.error(f"--epochs={args.epochs} is invalid; expected >= 1")
    try:
        config = QuantConfig(scheme=args.scheme, bits=args.bits)
    except ValueError as error:
        parser.error(str(error))
    codec = codec_for(config.scheme)
    label = f"gradq {codec.wire_bits(config)}-bit {codec.name}{' + EF' if args.error_feedback else ''}"
    base = TrainSpec(world_size=args.workers, init_method="", epochs=args.epochs, progress=True)
    print(f"gradq demo: {args.workers} workers, MLP 64-128-128-10 on scikit-learn digits, {args.epochs} epochs")
    if args.aggregator:
        print(f"waiting up to {args.connect_timeout:g} s for the aggregator at {', '.join(args.aggregator)}")
        try:
            wait_for_aggregators(args.aggregator, args.connect_timeout)
        except (AggregationError, ValueError) as error:  # ValueError: an address that is not host:port
            print(
                f"gradq demo: error: {error}; check --aggregator, or wait longer with --connect-timeout",
                file=sys.stderr,
            )
            return 2
    with contextlib.ExitStack() as stack:
        addresses = args.aggregator or [stack.enter_context(local_aggregator(args.workers))]
        print(f"{label} via aggregator {', '.join(addresses)}")
        gradq = GradqConfig.of(
            addresses, config, error_feedback=args.error_feedback, connect_timeout_s=args.connect_timeout
        )
        gradq_runs = run_job(replace(base, init_method=f"tcp://127.0.0.1:{free_port()}", gradq=gradq))
    rows = [(label, gradq_runs)]
    if args.compare:
        print("fp32 allreduce (for comparison)")
        rows.append(("fp32 allreduce", run_job(replace(base, init_method=f"tcp://127.0.0.1:{free_port()}"))))
    _report(rows)
    accuracy = gradq_runs[0].accuracy
    verdict = accuracy >= args.min_accuracy
    print(
        f"verdict: {'PASS' if verdict else 'FAIL'} (gradq accuracy {accuracy:.1f}% vs --min-accuracy "
        f"{args.min_accuracy:.1f}%)"
    )
    return 0 if verdict else 1


def _report(rows: list[tuple[str, list[TrainResult]]]) -> None:
    print()
    # "vs uncompressed": against what the buckets weigh in their own dtype (named), i.e. what DDP would send.
    print(f"| {'run':<46} | accuracy | final loss | ms/step | bytes sent/worker/step | vs uncompressed  |")
    print(f"|{'-' * 48}|---------:|-----------:|--------:|-----------------------:|-----------------:|")
    for label, results in rows:
        first, stats = results[0], results[0].stats
        per_step = first.bytes_sent / max(first.steps, 1)
        if stats is not None and stats.bytes_sent:
            sent, ratio = f"{per_step:,.0f}", f"{1 / stats.compression_ratio:.3f}x {stats.dtype}"
        else:
            sent, ratio = f"{first.fp32_bytes / max(first.steps, 1):,.0f} (fp32)", "1.000x float32"
        print(
            f"| {label:<46} | {first.accuracy:7.1f}% | {first.last_loss:10.4f} | "
            f"{1000 * first.seconds_per_step:7.2f} | {sent:>22} | {ratio:>16} |"
        )
    for label, results in rows:
        stats = results[0].stats
        if stats is not None:
            print(f"{label} (rank 0, per push): {stats.line()}")
    print()
