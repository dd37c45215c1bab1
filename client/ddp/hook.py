"""The DDP comm hook: `model.register_comm_hook(GradqHookState(...), gradq_hook)`.

A thin adapter over a gradq session (gradq.client.session): the state
(gradq.client.ddp.hook_state) holds the configuration, the step and the
session. The hook hands each bucket to the session and returns its future at
once; the thread that reads each answer fills it with the averaged bucket.
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations at
# registration and needs real types, not strings.
from collections.abc import Callable

import torch
import torch.distributed as dist

from gradq.client.ddp.allgather_hooks import allgather_perchannel_hook, allreduce_mean_hook
from gradq.client.ddp.hook_state import GradqHookState
from gradq.client.env import FALLBACKS
from gradq.client.session import GradqSession

__all__ = ["GradqHookState", "gradq_hook", "FALLBACKS"]


def gradq_hook(state: GradqHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` through the gradq aggregator without blocking backward.

    Args:
        state: the GradqHookState registered with the model.
        bucket: DDP's flattened gradient bucket (fp32, fp16 or bf16; CPU or CUDA).

    Returns:
        A future DDP waits on, completed by the thread reading the answer with the mean
        bucket (same shape, dtype and device as ``bucket.buffer()``). A failed
        round makes ``backward()`` raise its AggregationError (see
        gradq.client.session.failures).
    """
    if state.session is None and state.elastic_hosts and not state.closed:
        raise RuntimeError(
            "an elastic host joins before training: call state.share(model, optimizer), then train "
            "`for step in state.steps(total)` (or call state.start() first)"
        )
    session = state.connected()
    buffer = bucket.buffer()
    sparse = buffer.layout != torch.strided
    if session.mode != "gradq":
        if bucket.is_last():
            state.count_step()  # the run's summary counts the steps trained without gradq too
        return _fallback_allreduce(session, bucket) if sparse else _FALLBACK_HOOKS[session.mode](session, bucket)
    step, last = state.step, bucket.is_last()
    if state.elastic_hosts:
        session.member.serve_joiners(state.shared, step)  # at a step boundary, before this step's first push
    if sparse:
        # A sparse gradient (nn.Embedding(sparse=True)) has no dense grid to quantize: its
        # bucket is averaged by the process group, uncompressed, as DDP's default hook does.
        reduced = _fallback_allreduce(session, bucket)
    else:
        reduced = session.failures.guard(session.reduce(buffer, step, bucket.index(), bucket.parameters()), buffer)
    if last:
        # DDP launches buckets in index order, so the last one closes the iteration on every rank.
        state.step += 1
        state.count_step()
        session.end_step()
    return reduced


def _fallback_allreduce(session: GradqSession, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return allreduce_mean_hook(session.group, bucket)


def _fallback_allgather(session: GradqSession, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    quant = session.config.quant
    return allgather_perchannel_hook(session.group, bucket, quant.channel_size, quant.bits)


_FALLBACK_HOOKS: dict[str, Callable[[GradqSession, dist.GradBucket], torch.futures.Future[torch.Tensor]]] = {
    "allreduce": _fallback_allreduce,
    "allgather": _fallback_allgather,
}
