"""Error-feedback residuals that survive DDP's bucket rebuild and a checkpoint: each bucket named by its parameters.

A residual is per element of a bucket, so it may only ever be added to the
same parameters it came from. The bucket index does not say which those are:
DDP rebuilds its buckets after the first iteration, and a resumed run starts
again from the initial layout, so index 0 (even with the same numel) can hold
other parameters than it did. What does say it, on any device and in any
process, is the bucket's *signature*: the dtype and shape of each parameter in
it, in order, plus its occurrence among the buckets with that signature (a
model's identical blocks have equal ones). So:

- a bucket whose signature at an index changes (the rebuild) starts from a zero
  residual instead of another bucket's;
- ``state_dict()`` keys residuals by signature, as CPU tensors;
- after ``load_state_dict()`` a residual waits until a bucket with its signature
  appears (in the initial layout or the rebuilt one) and is then restored onto
  that bucket's device. One left unmatched after the rebuild is dropped with a
  warning: that bucket's error feedback restarts from zero.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from gradq.client.chunks import chunk_bounds, chunk_key
from gradq.client.ddp.placement import quantizes_on_device
from gradq.qcore import QuantConfig
from gradq.qcore.arrays import ResidualStore

if TYPE_CHECKING:
    from gradq.client.ddp.hook import GradqHookState

__all__ = ["BucketResiduals", "checkpoint_of", "resume_from"]

log = logging.getLogger(__name__)

# DDP builds its buckets in the first iteration and rebuilds them once, before the second.
_LAYOUT_ITERATIONS = 2


class BucketResiduals:
    """Names the buckets a hook state sees and moves their residuals in and out of checkpoints."""

    __slots__ = ("_iterations", "_names", "_pending", "_seen")

    def __init__(self) -> None:
        self._names: dict[int, tuple[str, int, torch.device]] = {}  # index -> (signature, numel, device)
        self._pending: dict[str, torch.Tensor] = {}  # loaded residuals not yet matched to a bucket
        self._seen: Counter[str] = Counter()  # signatures of this iteration's buckets so far
        self._iterations = 0  # backward passes observed (only the first few can change the layout)

    def observe(self, state: GradqHookState, bucket: dist.GradBucket) -> None:
        """Note ``bucket``'s signature before it is pushed; reset or restore its residual when that changed.

        Args:
            state: the connected hook state whose residuals are kept.
            bucket: DDP's bucket, in launch (index) order.
        """
        if self._iterations >= _LAYOUT_ITERATIONS:
            return
        signature = "+".join(f"{str(p.dtype).removeprefix('torch.')}{list(p.shape)}" for p in bucket.parameters())
        name = f"{signature}#{self._seen[signature]}"
        self._seen[signature] += 1
        index, buffer = bucket.index(), bucket.buffer()
        known = self._names.get(index)
        if known is None or known[0] != name:
            self._names[index] = (name, buffer.numel(), buffer.device)
            restored = self._pending.pop(name, None)
            if known is not None or restored is not None:  # another bucket's residual must not be added here
                _write(state, index, buffer.numel(), buffer.device, restored)
        if bucket.is_last():
            self._seen.clear()
            self._iterations += 1
            if self._iterations == _LAYOUT_ITERATIONS and self._pending:
                log.warning(
                    "checkpointed residuals of %d bucket(s) matched no bucket of this model (%s); their error "
                    "feedback restarts from zero",
                    len(self._pending),
                    ", ".join(sorted(self._pending)),
                )
                self._pending.clear()

    def state_dict(self, state: GradqHookState) -> dict[str, torch.Tensor]:
        """Signature -> the bucket's residual (flat float32, on the CPU), for every bucket that has one."""
        residuals = {}
        for index, (name, numel, device) in self._names.items():
            residual = _read(state, index, numel, device)
            if residual is not None:
                residuals[name] = residual
        return {**self._pending, **residuals}

    def load_state_dict(self, residuals: dict[str, torch.Tensor]) -> None:
        """Hold ``residuals`` (from ``state_dict``) until buckets with their signatures appear."""
        for name, residual in residuals.items():
            if not isinstance(residual, torch.Tensor) or residual.dim() != 1:
                raise ValueError(f"residuals[{name!r}] is {type(residual).__name__}; expected a flat torch.Tensor")
        self._pending = {name: residual.detach().float().cpu() for name, residual in residuals.items()}


def checkpoint_of(state: GradqHookState) -> dict[str, Any]:
    """``GradqHookState.state_dict()``: step, config (plain values), error_feedback and residuals."""
    config = state.config
    return {
        "step": state.step,
        "config": {
            "scheme": config.scheme.name.lower(),
            "bits": config.bits,
            "channel_size": config.channel_size,
            "rounding": config.rounding.name.lower(),
            "seed": config.seed,
        },
        "error_feedback": state.error_feedback,
        "residuals": state._bucket_residuals.state_dict(state),
    }


def resume_from(state: GradqHookState, checkpoint: Mapping[str, Any]) -> None:
    """``GradqHookState.load_state_dict()``: check ``checkpoint``, then take its step, config and residuals."""
    if state.mode is not None:
        raise RuntimeError("load_state_dict() came after the first backward; call it before training starts")
    missing = sorted({"step", "config", "error_feedback", "residuals"} - set(checkpoint))
    if missing:
        raise ValueError(f"state_dict lacks {', '.join(missing)}; expected the output of GradqHookState.state_dict()")
    step = checkpoint["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"state_dict['step']={step!r} is invalid; expected an integer >= 0")
    config = QuantConfig(**checkpoint["config"])
    if not config.scheme.is_quantized:
        raise ValueError(f"state_dict['config'].scheme={config.scheme.name.lower()} is not quantized")
    state._bucket_residuals.load_state_dict(dict(checkpoint["residuals"]))
    state.step, state.config, state.error_feedback = step, config, bool(checkpoint["error_feedback"])


# -- where the residuals live ----------------------------------------------------------------------
# The client keeps one store per array library, by round key (one per chunk):
# tensors quantized on their device keep theirs there, host arrays in numpy.
# Only these functions know.


def _store(state: GradqHookState, device: torch.device) -> tuple[ResidualStore | None, bool]:
    """(the store the bucket's residuals live in, whether it holds tensors)."""
    client = state.client
    assert client is not None, "residuals are read and written only while connected"
    on_device = quantizes_on_device(device, state.codec)
    return client.residuals("torch" if on_device else "numpy"), on_device


def _client_chunks(state: GradqHookState, index: int, numel: int) -> list[tuple[int, int, int]]:
    client = state.client
    assert client is not None, "residuals are read and written only while connected"
    bounds = chunk_bounds(numel, client.chunk_elements, client.config.channel_size, len(client.addresses))
    return [(chunk_key(index, chunk), begin, end) for chunk, (begin, end) in enumerate(bounds)]


def _read(state: GradqHookState, index: int, numel: int, device: torch.device) -> torch.Tensor | None:
    store, holds_tensors = _store(state, device)
    if store is None:
        return None
    pieces = [store.residual(key) for key, _, _ in _client_chunks(state, index, numel)]
    if any(piece is None for piece in pieces):
        return None
    if holds_tensors:
        return torch.cat([piece.detach().float().cpu() for piece in pieces])
    return torch.from_numpy(np.concatenate(pieces))


def _write(state: GradqHookState, index: int, numel: int, device: torch.device, residual: torch.Tensor | None) -> None:
    """Make ``residual`` (None: nothing) the residual of bucket ``index``."""
    if residual is not None and residual.numel() != numel:
        log.warning(
            "checkpointed residual of bucket %d has %d elements, the bucket %d; dropped", index, residual.numel(), numel
        )
        residual = None
    store, holds_tensors = _store(state, device)
    if store is None:
        return
    for key, begin, end in _client_chunks(state, index, numel):
        if residual is None:
            store.reset(key)
        elif holds_tensors:
            store.set_residual(key, residual[begin:end].to(device, torch.float32).clone())
        else:
            store.set_residual(key, residual[begin:end].float().numpy().copy())
