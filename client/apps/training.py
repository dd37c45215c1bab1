"""A small real training job: an MLP on scikit-learn's digits, under DDP on gloo.

Shared by `gradq demo` and the DDP tests, so what the tests prove is what the
demo shows. Each rank is a spawned process; rank 0 reports.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradq.client.config import GradqConfig
from gradq.client.ddp import GradqHookState, gradq_hook
from gradq.client.stats import ClientStats

__all__ = ["TrainSpec", "TrainResult", "train_digits", "load_digits_split"]


@dataclass(frozen=True, slots=True)
class TrainSpec:
    """One training run.

    Args:
        world_size: DDP ranks.
        init_method: torch.distributed rendezvous, e.g. ``tcp://127.0.0.1:PORT``.
        gradq: how the ranks reduce through gradq (its job_id None: rank 0
            draws one and every rank uses it); None trains with plain fp32 allreduce.
        epochs, batch_size, learning_rate, seed: the usual.
        hidden: width of the MLP's hidden layers.
        dtype: parameter dtype ("float32", "bfloat16", "float16").
        device: "cpu" or a CUDA device such as "cuda" (the hook then quantizes on it).
        progress: rank 0 prints loss and accuracy after every epoch.
        on_epoch: called on every rank after each epoch with (epoch, mean
            loss, test accuracy in percent), e.g. to print each rank's progress.
        on_trained: called with the result once training is done, before the
            rank leaves the aggregator (which may then shut down): a rank can
            report its verdict before anyone is told to stop.
    """

    world_size: int
    init_method: str
    gradq: GradqConfig | None = None
    epochs: int = 20
    batch_size: int = 32
    learning_rate: float = 0.05
    seed: int = 0
    hidden: int = 128
    dtype: str = "float32"
    device: str = "cpu"
    progress: bool = False
    on_epoch: Callable[[int, float, float], None] | None = None
    on_trained: Callable[[TrainResult], None] | None = None


@dataclass(frozen=True, slots=True)
class TrainResult:
    """What one rank saw."""

    rank: int
    accuracy: float  # on the held-out split, in percent
    first_loss: float
    last_loss: float
    steps: int
    seconds_per_step: float
    bytes_sent: int  # gradq wire bytes pushed (0 without an aggregator)
    fp32_bytes: int  # what the same buckets weigh in fp32
    parameters: np.ndarray  # flat final parameters, to compare across ranks
    mode: str  # "gradq", "allreduce" or the fallback that ran
    stats: ClientStats | None = None  # the hook's client figures, when gradq ran


def load_digits_split(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 digits (ships in the package: no download), 80/20 split, scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(labels))
    cut = int(0.8 * len(labels))
    train, test = order[:cut], order[cut:]
    features = (images / 16.0).astype(np.float32)
    return features[train], labels[train], features[test], labels[test]


def _model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def train_digits(rank: int, spec: TrainSpec) -> TrainResult:
    """Train under DDP as ``rank``; call in each of ``spec.world_size`` processes."""
    torch.set_num_threads(1)  # several ranks share a few cores
    dist.init_process_group("gloo", init_method=spec.init_method, rank=rank, world_size=spec.world_size)
    state: GradqHookState | None = None
    try:
        dtype = getattr(torch, spec.dtype)
        x_train, y_train, x_test, y_test = load_digits_split(spec.seed)
        torch.manual_seed(spec.seed + rank)  # DDP broadcasts rank 0's initial weights anyway
        device = torch.device(spec.device)
        model = DistributedDataParallel(_model(spec.hidden).to(device, dtype))
        if spec.gradq is not None:
            state = GradqHookState.from_config(spec.gradq)
            model.register_comm_hook(state, gradq_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=spec.learning_rate, momentum=0.9)
        mine = np.arange(rank, len(y_train), spec.world_size)
        losses: list[float] = []
        steps, started = 0, time.perf_counter()
        for epoch in range(spec.epochs):
            order = mine[np.random.default_rng(spec.seed + epoch).permutation(len(mine))]
            epoch_losses = []
            for begin in range(0, len(order) - spec.batch_size + 1, spec.batch_size):
                batch = order[begin : begin + spec.batch_size]
                inputs = torch.from_numpy(x_train[batch]).to(device, dtype)
                labels = torch.from_numpy(y_train[batch]).to(device)
                loss = nn.functional.cross_entropy(model(inputs).float(), labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                epoch_losses.append(loss.item())
                steps += 1
                if steps == 1:  # time from the second step: the first connects and warms up
                    started = time.perf_counter()
            losses.append(float(np.mean(epoch_losses)))
            if spec.progress and rank == 0:
                accuracy = _accuracy(model, x_test, y_test, device, dtype)
                print(
                    f"  epoch {epoch + 1:>3}/{spec.epochs}  loss {losses[-1]:.4f}  test accuracy {accuracy:5.1f}%",
                    flush=True,
                )
            if spec.on_epoch is not None:
                spec.on_epoch(epoch + 1, losses[-1], _accuracy(model, x_test, y_test, device, dtype))
        elapsed = time.perf_counter() - started
        numel = sum(p.numel() for p in model.parameters())
        client = state.client if state is not None else None
        dist.barrier()  # no rank tears gloo down while a peer's last collective is in flight
        result = TrainResult(
            rank=rank,
            accuracy=_accuracy(model, x_test, y_test, device, dtype),
            first_loss=losses[0],
            last_loss=losses[-1],
            steps=steps,
            seconds_per_step=elapsed / max(steps - 1, 1),
            bytes_sent=client.bytes_sent if client is not None else 0,
            fp32_bytes=4 * numel * steps,
            parameters=torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).cpu().numpy(),
            mode=(state.mode or "gradq") if state is not None else "allreduce",
            stats=state.stats() if state is not None else None,
        )
        if spec.on_trained is not None:
            spec.on_trained(result)
        return result
    finally:
        if state is not None:
            state.close()
        dist.destroy_process_group()


def _accuracy(
    model: nn.Module, features: np.ndarray, labels: np.ndarray, device: torch.device, dtype: torch.dtype
) -> float:
    with torch.no_grad():
        predicted = model(torch.from_numpy(features).to(device, dtype)).argmax(dim=1).cpu().numpy()
    return float(100.0 * np.mean(predicted == labels))
