"""Two-level aggregation with real processes: emulated hosts of several ranks on loopback, a real aggregator.

Each spawned rank is told its host through torchrun's variables (GROUP_RANK,
LOCAL_RANK, LOCAL_WORLD_SIZE), so the hook finds the hosts as it does under
torchrun; the probe model makes each rank's gradient exactly what the test chose.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import host_ranks
import numpy as np
import pytest
from aggregator_metrics import received_bytes

from gradq.client.apps.demo import free_port
from gradq.qcore import QuantConfig
from gradq.server.app import AggregatorServer, ServerOptions
from gradq.server.policy import RoundPolicy

pytestmark = pytest.mark.e2e  # a slow end-to-end run: deselected unless --e2e

NUMEL = 3 * 4096 + 100  # several channels per piece, and a short last channel


@pytest.fixture(scope="module")
def aggregator() -> Iterator[AggregatorServer]:
    # The clients' residuals are what these tests follow; the aggregator's own (its error feedback on
    # low-bit means) is not in a client's checkpoint, so a resumed job would restart it from zero.
    policy = RoundPolicy(round_timeout_s=60.0, server_error_feedback=False)
    server = AggregatorServer(policy, ServerOptions("127.0.0.1:0", metrics_port=0))
    server.start()
    yield server
    server.stop()


def job(server: AggregatorServer, hosts: tuple[int, ...], job_id: str, **options: object) -> host_ranks.HostJob:
    return host_ranks.HostJob(
        hosts=hosts,
        aggregator=f"127.0.0.1:{server.port}",
        job_id=job_id,
        init_method=f"tcp://127.0.0.1:{free_port()}",
        **{"config": QuantConfig(bits=8), **options},  # type: ignore[arg-type]
    )


def gradients_for(world: int, steps: int, seed: int = 0) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.normal(rank, 1.0, NUMEL).astype(np.float32) for _ in range(steps)] for rank in range(world)]


def exact_mean(gradients: list[list[np.ndarray]], step: int) -> np.ndarray:
    return np.mean([ranks[step] for ranks in gradients], axis=0)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_two_hosts_of_two_ranks_average_like_the_flat_path_with_half_the_bytes(aggregator: AggregatorServer) -> None:
    gradients = gradients_for(4, steps=3)
    two_level = host_ranks.run(job(aggregator, (0, 0, 1, 1), "two-level"), gradients)
    flat = host_ranks.run(job(aggregator, (0, 0, 1, 1), "flat", host_grouping="flat"), gradients)

    assert [run.host for run in two_level] == [(0, 2, 0, 2, 2), (0, 2, 1, 2, 2), (1, 2, 0, 2, 2), (1, 2, 1, 2, 2)]
    assert [run.host for run in flat] == [(rank, 4, 0, 1, 1) for rank in range(4)]
    for step in range(3):
        want = exact_mean(gradients, step)
        for runs in (two_level, flat):
            for run in runs:  # every rank applies the same mean
                np.testing.assert_array_equal(run.reduced[step], runs[0].reduced[step])
        # Each path quantizes once on the way in and once on the way back, at 8 bits.
        assert relative_error(two_level[0].reduced[step], want) < 0.01
        assert relative_error(flat[0].reduced[step], want) < 0.01
    # The aggregator decodes one contribution per host and piece: half the flat path's bytes at 2 ranks per host.
    ratio = received_bytes(aggregator, "two-level") / received_bytes(aggregator, "flat")
    assert 0.45 < ratio < 0.55, ratio
    host_bytes = sum(run.bytes_sent for run in two_level[:2])
    assert host_bytes <= 0.5 * sum(run.bytes_sent for run in flat[:2]) * 1.05


def test_uneven_hosts_of_three_and_one_rank_average_over_all_four(aggregator: AggregatorServer) -> None:
    gradients = gradients_for(4, steps=2, seed=1)
    runs = host_ranks.run(job(aggregator, (0, 0, 0, 1), "uneven", pieces=2), gradients)

    assert [run.host for run in runs] == [(0, 2, 0, 3, 3), (0, 2, 1, 3, 3), (0, 2, 2, 3, 3), (1, 2, 0, 1, 3)]
    for step in range(2):
        for run in runs:
            np.testing.assert_array_equal(run.reduced[step], runs[0].reduced[step])
        assert relative_error(runs[0].reduced[step], exact_mean(gradients, step)) < 0.01
    # The lone rank pushes every piece; each rank of the bigger host a third of them.
    assert runs[3].bytes_sent == pytest.approx(sum(run.bytes_sent for run in runs[:3]), rel=0.02)


def test_error_feedback_residuals_per_slice_survive_a_checkpoint(aggregator: AggregatorServer) -> None:
    config = QuantConfig(bits=2, channel_size=64)
    gradients = gradients_for(4, steps=4, seed=2)
    first_three = [ranks[:3] for ranks in gradients]
    last = [ranks[3:] for ranks in gradients]
    hosts = (0, 0, 1, 1)

    continuous = host_ranks.run(job(aggregator, hosts, "ef-continuous", config=config, error_feedback=True), gradients)
    saved = host_ranks.run(job(aggregator, hosts, "ef-saved", config=config, error_feedback=True), first_three)
    checkpoints = host_ranks.checkpoints_of(saved, config)
    resumed = host_ranks.run(
        job(aggregator, hosts, "ef-resumed", config=config, error_feedback=True, checkpoints=checkpoints), last
    )
    fresh = host_ranks.run(job(aggregator, hosts, "ef-fresh", config=config, error_feedback=True), last)

    # Each rank holds the residual of the slice it owns: a host's two ranks cover the parameter once.
    for host in (0, 1):
        spans = [name.split(" ")[-1] for run in saved[2 * host : 2 * host + 2] for name in run.residuals]
        bounds = sorted(tuple(int(bound) for bound in span.strip("[]").split(":")) for span in spans)
        assert bounds[0][0] == 0 and bounds[-1][1] == NUMEL
        assert all(left[1] == right[0] for left, right in itertools.pairwise(bounds))
    # The resumed job's first step adds exactly the residuals the uninterrupted one adds at step 3.
    for rank in range(4):
        np.testing.assert_array_equal(resumed[rank].reduced[0], continuous[rank].reduced[3])
    assert not np.array_equal(fresh[0].reduced[0], continuous[0].reduced[3])


def test_join_with_uneven_inputs_and_no_sync_in_two_level(aggregator: AggregatorServer) -> None:
    runs = host_ranks.run_with_ddp_options(
        job(aggregator, (0, 0, 1, 1), "uneven-join", error_feedback=True), (6, 6, 6, 3)
    )
    assert len(runs) == 4 and all(run.host[4] == 2 for run in runs)
    assert [run.step for run in runs] == [3, 3, 3, 3]  # rank 3 shadowed the last two reductions
    for run in runs:
        np.testing.assert_array_equal(run.reduced[0], runs[0].reduced[0])


def test_static_graph_in_two_level(aggregator: AggregatorServer) -> None:
    runs = host_ranks.run_with_ddp_options(
        job(aggregator, (0, 0, 1, 1), "static-graph"), (4, 4, 4, 4), static_graph=True
    )
    assert [run.step for run in runs] == [4, 4, 4, 4]
    for run in runs:
        np.testing.assert_array_equal(run.reduced[0], runs[0].reduced[0])


def test_adaptive_bits_compose_with_two_level(aggregator: AggregatorServer) -> None:
    """The adaptive policy splits each bucket at parameter bounds; two-level then cuts each run per host rank."""
    runs = host_ranks.run_with_ddp_options(
        job(
            aggregator,
            (0, 0, 1, 1),
            "adaptive-two-level",
            config=QuantConfig(bits=2),
            bit_policy="adaptive",
            average_bits=4.0,
            error_feedback=True,
        ),
        (4, 4, 4, 4),
    )
    assert len(runs) == 4 and all(run.host[4] == 2 for run in runs)  # two-level, two pieces per run
    assert [run.step for run in runs] == [4, 4, 4, 4]
    for run in runs:  # every rank applied the same means
        np.testing.assert_array_equal(run.reduced[0], runs[0].reduced[0])
        assert run.bits == runs[0].bits and len(run.bits) >= 2 and run.bits[0] == 2, run.bits
