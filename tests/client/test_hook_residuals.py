"""Error feedback stays on its parameters (real DDP, world 1, gloo, a real aggregator); sparse buckets train.

World 1 and a float32 return make the arithmetic exact: the mean a rank gets
back is ``g + e_used - e_new``, so the residual the hook actually added to each
parameter's gradient can be read off as ``mean - g + e_new``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradq.client.apps.demo import free_port
from gradq.client.ddp import GradqHookState, gradq_hook
from gradq.qcore import QuantConfig

CONFIG = QuantConfig(bits=2, channel_size=16)  # coarse: every residual is far from zero


def square_stack() -> nn.Module:
    """Same-shaped, bias-free layers in one bucket: DDP's rebuild reverses them and keeps every shape in place."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(32, 32, bias=False) for _ in range(3)))


def backward(model: nn.Module, step: int) -> list[torch.Tensor]:
    model.zero_grad()
    inputs = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
    model(inputs).tanh().square().sum().backward()
    return [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


def residuals_by_parameter(state: GradqHookState, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Each parameter's whole residual, from state_dict()'s pieces (serials follow model order here)."""
    found = [torch.zeros(shape).reshape(-1) for shape in shapes]
    for name, values in state.state_dict()["residuals"].items():
        serial, span = name.split(" ")[0].removeprefix("param"), name.split(" ")[-1]
        start, stop = (int(bound) for bound in span.strip("[]").split(":"))
        found[int(serial)][start:stop] = values
    return [residual.reshape(shape) for residual, shape in zip(found, shapes, strict=True)]


def test_a_rebuilt_bucket_of_same_shaped_parameters_carries_each_residual_with_its_parameter(
    exact_aggregator: str, group: None
) -> None:
    plain = square_stack()
    model = DistributedDataParallel(copy.deepcopy(plain))
    state = GradqHookState(exact_aggregator, CONFIG, error_feedback=True, job_id="ef-rebuild")
    model.register_comm_hook(state, gradq_hook)
    shapes = [p.shape for p in plain.parameters()]

    backward(model, 0)  # initial layout: model order
    kept = residuals_by_parameter(state, shapes)
    assert all(residual.abs().max() > 1e-3 for residual in kept)
    averaged = backward(model, 1)  # rebuilt layout: reversed, the same shapes at the same offsets
    exact = backward(plain, 1)
    left = residuals_by_parameter(state, shapes)
    for layer, (mean, gradient, new, old) in enumerate(zip(averaged, exact, left, kept, strict=True)):
        applied = mean - gradient + new
        torch.testing.assert_close(applied, old, rtol=0, atol=1e-5, msg=f"layer {layer} got another's residual")
    state.close()


def test_after_the_rebuild_only_the_new_layouts_residuals_are_held(exact_aggregator: str, group: None) -> None:
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)),
        bucket_cap_mb=0.01,  # one bucket at first (DDP caps only later ones), two after the rebuild
    )
    # Small rounds: a bucket's residual lives under several round keys, which the rebuild changes too.
    state = GradqHookState(exact_aggregator, CONFIG, error_feedback=True, job_id="ef-memory", chunk_elements=512)
    model.register_comm_hook(state, gradq_hook)
    gradient_elements = sum(p.numel() for p in model.parameters())
    for step in range(4):
        backward(model, step)
        assert state.client is not None
        store = state.client.residuals("numpy")
        assert store is not None
        held = sum(store.residual(key).size for key in list(store.keys()))
        assert held == gradient_elements, f"step {step}: {held} residual elements for {gradient_elements}"
    state.close()


class _Bag(nn.Module):
    """A bag of sparse embeddings and a dense head: one sparse bucket beside a dense one."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(100, 16, sparse=True)
        self.head = nn.Linear(16, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens).mean(dim=1))


def _train_bag(state: GradqHookState) -> list[float]:
    torch.manual_seed(0)
    model = DistributedDataParallel(_Bag())
    model.register_comm_hook(state, gradq_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    tokens = torch.randint(0, 100, (32, 5), generator=torch.Generator().manual_seed(0))
    target = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(12):
        optimizer.zero_grad()
        loss = (model(tokens) - target).square().mean()
        loss.backward()
        grad = model.module.embedding.weight.grad
        assert grad is not None and grad.is_sparse
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_a_sparse_bucket_is_averaged_by_the_process_group_beside_quantized_ones(
    exact_aggregator: str, group: None
) -> None:
    state = GradqHookState(exact_aggregator, CONFIG, error_feedback=True, job_id="ef-sparse")
    losses = _train_bag(state)
    assert losses[-1] < 0.8 * losses[0]
    assert state.step == 12  # the sparse bucket still closes the step when it is the last one
    stats = state.stats()
    assert stats is not None and stats.bytes_sent > 0  # the dense head went through the aggregator
    state.close()


def test_a_sparse_bucket_under_the_allgather_fallback_is_allreduced(group: None) -> None:
    # The allgather hook quantizes dense buckets; a sparse one goes to the process group, as in gradq mode.
    state = GradqHookState(f"127.0.0.1:{free_port()}", CONFIG, fallback="allgather", connect_timeout_s=0.5)
    losses = _train_bag(state)
    assert state.mode == "allgather" and losses[-1] < 0.8 * losses[0]
    state.close()
