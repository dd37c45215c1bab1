"""Hugging Face Accelerate: ``use_gradq(accelerator)`` makes ``accelerator.prepare`` return a model using gradq.

Accelerate takes comm hooks only by its built-in names: passing
``DistributedDataParallelKwargs(comm_hook=gradq_hook)`` is accepted and
silently trains with plain allreduce, and a subclass of the kwargs handler is
refused (handlers are looked up by exact class). What works is registering on
the DistributedDataParallel object ``prepare`` returns (not on
``unwrap_model(model)``, which is the bare module), so ``use_gradq`` wraps the
accelerator's ``prepare_model``, the step every ``prepare`` call takes for a model.
Called after ``prepare`` it is too late: Accelerate keeps the bare modules it
prepared (``accelerator._models``), not the DDP objects it returned, so there
is nothing to register on, and ``use_gradq`` refuses instead of leaving them on
plain allreduce.

On CPU, two processes need ``accelerate launch --multi_gpu --num_processes 2``
with ``Accelerator(cpu=True)``: ``--cpu --num_processes 2`` starts one.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradq.client.config import GradqConfig
from gradq.client.ddp import GradqHookState
from gradq.client.integrations.registration import GradqIntegrationError, hook_state, register_once

__all__ = ["GradqIntegrationError", "use_gradq"]

# Set on an accelerator use_gradq has wrapped: wrapping twice would register twice.
_MARK = "_gradq_state"


def use_gradq(
    accelerator: Any, state: GradqHookState | None = None, *, config: GradqConfig | None = None
) -> GradqHookState:
    """Make every model ``accelerator.prepare`` (or ``prepare_model``) returns for training reduce through gradq.

    Args:
        accelerator: an ``accelerate.Accelerator`` of a multi-process run.
        state: the hook state; None builds one from ``config``.
        config: the configuration (with ``state`` None); None reads the GRADQ_* variables
            (``GradqConfig.from_env()``: GRADQ_AGGREGATORS, GRADQ_BITS, ...).

    Returns:
        The state, for ``stats()`` and ``close()``.

    Raises:
        GradqIntegrationError: ``accelerator`` has no ``prepare_model``,
            ``use_gradq`` was already called on it, or ``prepare`` already
            wrapped a model in DDP (call ``use_gradq`` before it), or both ``state`` and
            ``config`` were given. Later, ``prepare`` raises it when the model it returns is
            not a DistributedDataParallel (a single process, or no parameter requiring gradients).
        ValueError: ``state`` and ``config`` are None and a GRADQ_* variable is unset or invalid.
    """
    original = getattr(accelerator, "prepare_model", None)
    if original is None:
        raise GradqIntegrationError(
            f"accelerator={type(accelerator).__name__} has no prepare_model; expected an accelerate.Accelerator"
        )
    if getattr(accelerator, _MARK, None) is not None:
        raise GradqIntegrationError(
            "use_gradq(accelerator) was already called on this accelerator; call it once, before prepare"
        )
    _refuse_wrapped_models(accelerator)
    gradq_state = hook_state(state, config, "use_gradq(accelerator)")

    @functools.wraps(original)
    def prepare_model(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        prepared = original(model, *args, **kwargs)
        evaluation_mode = kwargs.get("evaluation_mode", args[1] if len(args) > 1 else False)
        if evaluation_mode:
            return prepared  # not trained: Accelerate wraps nothing in DDP, and gradq has nothing to reduce
        fix = (
            f"this accelerator runs {getattr(accelerator, 'num_processes', '?')} process(es) "
            f"(distributed_type={getattr(accelerator, 'distributed_type', '?')}); launch 2 or more, e.g. "
            "`accelerate launch --multi_gpu --num_processes 2 train.py` (with Accelerator(cpu=True) on CPU), "
            "and give the model a parameter that requires gradients"
        )
        return register_once(prepared, gradq_state, "accelerator.prepare", fix)

    accelerator.prepare_model = prepare_model
    setattr(accelerator, _MARK, gradq_state)
    return gradq_state


def _refuse_wrapped_models(accelerator: Any) -> None:
    """Raise GradqIntegrationError if ``prepare`` already returned a model in DDP: it trains on plain allreduce."""
    # prepare_model marks the model it returns: a kept module it returned as it is (evaluation mode, one
    # process) is marked, one it returned wrapped is not. A DDP object is kept when it is prepared again.
    wrapped = [
        model
        for model in getattr(accelerator, "_models", ())
        if isinstance(model, DistributedDataParallel) or not getattr(model, "_is_accelerate_prepared", False)
    ]
    if wrapped and getattr(accelerator, "num_processes", 1) > 1:
        raise GradqIntegrationError(
            f"use_gradq(accelerator) was called after accelerator.prepare wrapped "
            f"{', '.join(type(model).__name__ for model in wrapped)} in DistributedDataParallel: that model already "
            "trains with plain allreduce, and Accelerate keeps only the module inside, so gradq has no DDP model to "
            "register on; call use_gradq(accelerator) before accelerator.prepare(model, ...)"
        )
