"""One elastic host training the digits MLP: its own process group, a gradq job shared with the other hosts.

Hosts that start the job start from the same seed (there is no broadcast
between hosts); one that joins later receives the model and optimizer state
from a live host (see gradq.client.session.elastic) and trains from that step on.
Each step's batch is drawn from the step, the host's member id and the rank
within the host, so a run's data does not depend on when a host came or went.
Run it in one process per host, or under one torchrun per host (the host's
ranks then reduce together first).
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradq.client.apps.training import load_digits_split
from gradq.client.config import GradqConfig
from gradq.client.ddp import GradqHookState, gradq_hook
from gradq.qcore import decode, encode

__all__ = ["ElasticSpec", "ElasticStep", "ElasticResult", "train_elastic"]


@dataclass(frozen=True, slots=True)
class ElasticStep:
    """What one host saw at the end of one step."""

    step: int
    member: int  # this host's member id
    finished_at: float  # time.time() once the optimizer step was taken
    loss: float
    parameters_sha256: str  # of every parameter's bytes: equal on every host after the same step
    ranks: int  # the ranks training as last announced (0 before the first announcement)


@dataclass(frozen=True, slots=True)
class ElasticResult:
    """A host's run: where it started, its held-out loss and accuracy at the end."""

    member: int
    first_step: int
    steps: int
    held_out_loss: float
    accuracy: float
    parameters_sha256: str


@dataclass(frozen=True, slots=True)
class ElasticSpec:
    """One elastic host's training run.

    Args:
        gradq: the elastic job: its one aggregator, the ``job_id`` every host
            shares and the hosts it starts with (``elastic_hosts`` >= 1).
        steps: train until this step (a joiner starts at the step it receives).
        batch_size, learning_rate, seed, hidden: the usual (AdamW; the rate
            decays on a cosine to 0 at ``steps``, a function of the step alone).
        step_sleep_s: pause after each step (a benchmark's stand-in for a bigger model's compute).
        on_step: called after every step (on the host's first rank).
        join_when: a standby host: build everything, then join only once this file exists.

    Raises:
        ValueError: ``gradq`` is a fixed job's (``elastic_hosts=0``).
    """

    gradq: GradqConfig
    steps: int = 200
    batch_size: int = 128
    learning_rate: float = 1e-3
    seed: int = 0
    hidden: int = 64
    step_sleep_s: float = 0.0
    on_step: Callable[[ElasticStep], None] | None = None
    join_when: Path | None = None

    def __post_init__(self) -> None:
        if self.gradq.elastic_hosts < 1:
            raise ValueError(
                f"gradq.elastic_hosts={self.gradq.elastic_hosts} is invalid; expected hosts >= 1 (an elastic job)"
            )


def train_elastic(spec: ElasticSpec) -> ElasticResult:
    """Train this host until ``spec.steps``; returns its result (held-out loss on the same split on every host)."""
    torch.set_num_threads(1)  # several hosts may share a few cores
    with tempfile.TemporaryDirectory() as rendezvous:
        # The host's own process group: its launcher's (torchrun's) ranks, or this process alone.
        # Hosts meet only at the aggregator.
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", init_method=f"file://{Path(rendezvous) / 'pg'}", rank=0, world_size=1)
        local_rank = dist.get_rank()
        state: GradqHookState | None = None
        try:
            x_train, y_train, x_test, y_test = load_digits_split(spec.seed)
            torch.manual_seed(spec.seed)  # every starting host builds the same initial model
            model = DistributedDataParallel(_model(x_train.shape[1], spec.hidden))
            optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate)
            state = GradqHookState.from_config(spec.gradq)
            model.register_comm_hook(state, gradq_hook)
            state.share(model, optimizer)
            if spec.join_when is not None:
                decode(encode(np.zeros(8, np.float32), spec.gradq.quant))  # warm: the kernels load now, not at the Join
                while not spec.join_when.exists():
                    time.sleep(0.01)
            first = last = state.start()  # 0, or the step this host received the state at
            # The job's steps, not a count of this host's: one dropped and joined again goes on from the job's step.
            for step in state.steps(spec.steps):
                client = state.client
                assert client is not None
                member = client.membership.rank  # a host that joined again may hold another member id
                for group in optimizer.param_groups:
                    group["lr"] = spec.learning_rate * 0.5 * (1.0 + math.cos(math.pi * step / spec.steps))
                draw = np.random.default_rng([spec.seed, step, member, local_rank])
                batch = draw.choice(len(y_train), spec.batch_size)
                loss = nn.functional.cross_entropy(
                    model(torch.from_numpy(x_train[batch])), torch.from_numpy(y_train[batch])
                )
                optimizer.zero_grad()
                rejoins = state.rejoins
                loss.backward()
                optimizer.step()  # a host found dropped in this step rejoins here and takes the state
                if state.rejoins != rejoins:
                    continue  # its step was dropped with it: the model holds the job's state of a later step
                world = state.world()
                if spec.on_step is not None and local_rank == 0:
                    spec.on_step(
                        ElasticStep(step, member, time.time(), loss.item(), _digest(model), world.ranks if world else 0)
                    )
                last = step + 1
                if spec.step_sleep_s:
                    time.sleep(spec.step_sleep_s)
            with torch.no_grad():
                logits = model.module(torch.from_numpy(x_test))
                held_out = nn.functional.cross_entropy(logits, torch.from_numpy(y_test)).item()
                accuracy = 100.0 * (logits.argmax(1).numpy() == y_test).mean()
            client = state.client
            member = client.membership.rank if client is not None else -1
            return ElasticResult(member, first, last - first, held_out, float(accuracy), _digest(model))
        finally:
            if state is not None:
                state.close()
            dist.destroy_process_group()


def _model(features: int, hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
    )


def _digest(model: nn.Module) -> str:
    """SHA-256 of the parameters' bytes: two hosts agree bit for bit exactly when these are equal."""
    digest = hashlib.sha256()
    for parameter in model.parameters():
        digest.update(parameter.detach().cpu().numpy().tobytes())
    return digest.hexdigest()
