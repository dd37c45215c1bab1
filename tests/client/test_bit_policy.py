"""The adaptive bit policy: its choices, and a DDP model trained through a real aggregator with several grids."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradq.client.bit_policy import ParameterGradient, Piece, assign_bits, plan_pieces, relative_error_at
from gradq.client.ddp import GradqHookState, gradq_hook
from gradq.qcore import QuantConfig, Scheme
from gradq.server.app import AggregatorServer


def _average(params: list[ParameterGradient], bits: list[int]) -> float:
    return sum(p.numel * b for p, b in zip(params, bits, strict=True)) / sum(p.numel for p in params)


def test_one_dimensional_parameters_get_eight_bits_first_and_the_average_stays_under_the_target() -> None:
    params = [
        ParameterGradient(2048, 2, 0.5),  # a weight matrix
        ParameterGradient(64, 1, 0.1),  # its bias
        ParameterGradient(64, 1, 0.2),  # a norm's scale
        ParameterGradient(8192, 2, 0.4),
    ]
    bits = assign_bits(params, 2, 2.5)
    assert bits[1] == bits[2] == 8
    assert _average(params, bits) <= 2.5
    # 0.5 bits x 10,368 elements leave 5,184 - 768 spare: the matrix with the larger error gets 4 bits (4,096).
    assert bits == [4, 8, 8, 2]


def test_the_hardest_matrices_come_next_and_nothing_is_raised_when_nothing_fits() -> None:
    params = [ParameterGradient(1000, 2, 0.3), ParameterGradient(1000, 2, 0.9), ParameterGradient(1000, 2, 0.6)]
    # 3000 elements at 3.0 bits on average: 3000 spare bits, one matrix at 4 bits (2000), not at 8 (6000).
    assert assign_bits(params, 2, 3.0) == [2, 4, 2]
    assert assign_bits(params, 2, 2.0) == [2, 2, 2]
    assert assign_bits(params, 2, 8.0) == [8, 8, 8]
    for target in (2.0, 2.3, 2.5, 3.0, 4.7, 8.0):
        assert _average(params, assign_bits(params, 2, target)) <= target


@pytest.mark.parametrize("target", [1.5, 8.5, float("nan")])
def test_a_target_below_the_low_bits_or_past_eight_is_refused_naming_it(target: float) -> None:
    with pytest.raises(ValueError, match=r"average_bits=.* is out of range; expected 2\.\.8"):
        assign_bits([ParameterGradient(10, 2, 0.0)], 2, target)


def test_pieces_are_runs_of_equal_bits_and_raised_ones_are_affine() -> None:
    low = QuantConfig(Scheme.PER_CHANNEL_SIGN, 1, seed=3)
    pieces = plan_pieces([10, 5, 5, 20, 7], [1, 8, 8, 1, 4], low)
    assert [(p.begin, p.end, p.config.bits) for p in pieces] == [(0, 10, 1), (10, 20, 8), (20, 40, 1), (40, 47, 4)]
    assert pieces[0].config is low
    assert pieces[1] == Piece(10, 20, QuantConfig(Scheme.PER_CHANNEL_AFFINE, 8, seed=3))


def test_relative_error_is_what_the_low_grid_loses() -> None:
    assert relative_error_at(np.zeros(100, np.float32), QuantConfig(bits=2)) == 0.0
    rows = np.zeros(1024, np.float32)
    rows[:8] = np.linspace(-1, 1, 8)  # a gradient that is mostly zeros, as an embedding's is
    dense = np.random.default_rng(0).standard_normal(1024).astype(np.float32)
    assert 0 < relative_error_at(dense, QuantConfig(bits=8)) < relative_error_at(dense, QuantConfig(bits=2)) < 1


def test_an_adaptive_ddp_model_pushes_its_norm_and_biases_on_eight_bits_through_a_real_aggregator(
    aggregator: AggregatorServer, group: None
) -> None:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 10)))
    state = GradqHookState(
        f"127.0.0.1:{aggregator.port}",
        QuantConfig(bits=2),
        error_feedback=True,
        job_id="adaptive",
        bit_policy="adaptive",
        average_bits=2.5,
    )
    model.register_comm_hook(state, gradq_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = torch.randn(16, 32), torch.randint(0, 10, (16,))
    losses = []
    try:
        for _ in range(5):  # DDP rebuilds its buckets after the first step: a new plan, new round keys
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        job = aggregator.table.jobs.all()[0]
        bits = sorted({int(str(grid[1])) for grid in job.grids.values()})
        assert state.session is not None
        plan = [piece for _, pieces in state.session.plans._plans.values() for _, piece in pieces]
    finally:
        state.close()
    assert bits == [2, 8] or bits == [2, 4, 8]
    numel = sum(piece.end - piece.begin for piece in plan)
    assert numel == sum(p.numel() for p in model.parameters())
    assert sum((piece.end - piece.begin) * piece.config.bits for piece in plan) / numel <= 2.5
    assert losses[-1] < losses[0]


def test_adaptive_needs_a_target_it_can_meet() -> None:
    with pytest.raises(ValueError, match=r"average_bits=1\.5 is out of range"):
        GradqHookState("127.0.0.1:1", QuantConfig(bits=2), bit_policy="adaptive", average_bits=1.5)
    with pytest.raises(ValueError, match=r"bit_policy='mixed' is invalid; expected one of uniform, adaptive"):
        GradqHookState("127.0.0.1:1", bit_policy="mixed")
