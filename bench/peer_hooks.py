"""PyTorch's own comm hooks a user on a slow link tries first: PowerSGD and bf16, set up as their docs advise.

Shared by bench/ddp_step.py, bench/network.py and bench/convergence.py, so every
benchmark measures the same peers.

PowerSGD runs with error feedback and warm start on (the PowerSGD paper's and
PyTorch's recommendation) and plain allreduce for its first
``start_iteration`` steps. On gloo it needs DDP to have a single bucket: its
hook chains a second and third collective from the first one's callback, and
with two buckets in flight those chains interleave differently on different
ranks (``gloo::EnforceNotMet ... Received data size doesn't match expected
size``). Its rows therefore build DDP with ``bucket_cap_mb=PEER_SINGLE_BUCKET_MB``.
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations at
# registration and needs real types, not strings.
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

__all__ = ["PEER_SINGLE_BUCKET_MB", "PeerHook", "PEER_HOOKS", "gloo_bf16_compress_hook", "powersgd_ring_elements"]

# Larger than any benchmark model, so DDP keeps all its gradients in one bucket.
PEER_SINGLE_BUCKET_MB = 4096.0
# PowerSGD's own default asks a matrix to shrink at least this much before compressing it.
_POWERSGD_MIN_COMPRESSION_RATE = 2.0


@dataclass(frozen=True, slots=True)
class PeerHook:
    """One of PyTorch's hooks, with what a fresh DDP model needs to use it."""

    key: str  # name on the command line
    label: str  # name in a table
    hook: Callable[[Any, Any], torch.futures.Future[torch.Tensor]]
    make_state: Callable[[int], Any]  # start_iteration -> a fresh state (one per DDP model)
    rank: int | None = None  # PowerSGD's matrix approximation rank; None for bf16
    single_bucket: bool = False  # build DDP with bucket_cap_mb=PEER_SINGLE_BUCKET_MB

    def ring_elements(self, model: nn.Module) -> int:
        """Elements one step puts through allreduce rings (bf16: every gradient; PowerSGD: P, Q and 1-D tensors)."""
        if self.rank is None:
            return sum(parameter.numel() for parameter in model.parameters())
        return powersgd_ring_elements(model, self.rank)


def gloo_bf16_compress_hook(
    process_group: dist.ProcessGroup, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's ``bf16_compress_hook``, under a name DDP's registration check does not refuse on CPU.

    DDP refuses a hook called ``bf16_compress_hook`` unless CUDA 11+ and NCCL
    2.10+ are present, but gloo allreduces bfloat16 on the CPU, and the hook
    itself is device-agnostic.
    """
    return bf16_compress_hook(process_group, bucket)


def _default_group_state(_start_iteration: int) -> None:
    return None  # the bf16 hook's state is its process group; None is the default group


def _powersgd_state(rank: int, start_iteration: int) -> powerSGD_hook.PowerSGDState:
    return powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=start_iteration,  # must be >= 2 with error feedback or warm start
        use_error_feedback=True,
        warm_start=True,
        min_compression_rate=_POWERSGD_MIN_COMPRESSION_RATE,
        random_seed=0,
    )


def powersgd_ring_elements(model: nn.Module, rank: int) -> int:
    """Elements PowerSGD allreduces per step: (n + m) x rank per compressed matrix, the rest whole.

    It views each gradient of two or more dimensions as an n x m matrix (n its
    first dimension) and compresses it only when n x m >= min_compression_rate x
    (n + m) x rank; 1-D gradients and matrices not worth compressing go through
    one plain allreduce.
    """
    elements = 0
    for parameter in model.parameters():
        if parameter.dim() < 2:
            elements += parameter.numel()
            continue
        rows = parameter.shape[0]
        columns = parameter.numel() // rows
        compressed = (rows + columns) * min(rank, rows, columns)
        worth_it = rows * columns >= _POWERSGD_MIN_COMPRESSION_RATE * compressed
        elements += compressed if worth_it else parameter.numel()
    return elements


PEER_HOOKS = {
    peer.key: peer
    for peer in (
        PeerHook("bf16", "bf16 compress hook", gloo_bf16_compress_hook, _default_group_state),
        PeerHook("powersgd-r1", "PowerSGD rank 1", powerSGD_hook.powerSGD_hook, partial(_powersgd_state, 1), 1, True),
        PeerHook("powersgd-r4", "PowerSGD rank 4", powerSGD_hook.powerSGD_hook, partial(_powersgd_state, 4), 4, True),
    )
}
