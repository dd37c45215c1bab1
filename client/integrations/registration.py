"""Registering gradq on a framework's DDP model once, the state an integration registers, and the clear error when
there is no DDP model to register on."""

from __future__ import annotations

import weakref

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradq.client.config import GradqConfig
from gradq.client.ddp import GradqHookState, gradq_hook

__all__ = ["GradqIntegrationError", "hook_state", "register_once", "registered_state"]

# DDP models gradq was registered on: DDP accepts one comm hook per model, and the
# frameworks hand the same DDP object back (a second train(), a second prepare).
_registered: weakref.WeakKeyDictionary[DistributedDataParallel, GradqHookState] = weakref.WeakKeyDictionary()


class GradqIntegrationError(RuntimeError):
    """An integration was used where gradq cannot reduce the gradients; the message says what to change."""


def hook_state(state: GradqHookState | None, config: GradqConfig | None, where: str) -> GradqHookState:
    """The state an integration registers: ``state``, else one built from ``config``, else from the GRADQ_* variables.

    Args:
        state: a state the user built (None: build one).
        config: the configuration to build it from (None: ``GradqConfig.from_env()``).
        where: the integration's call, for messages.

    Raises:
        GradqIntegrationError: both ``state`` and ``config`` were given.
        ValueError: neither was given and a GRADQ_* variable is unset or invalid.
    """
    if state is not None and config is not None:
        raise GradqIntegrationError(
            f"{where} was given both state= and config=; pass one (a state carries its config: state.gradq_config)"
        )
    if state is not None:
        return state
    return GradqHookState.from_config(config if config is not None else GradqConfig.from_env())


def register_once(model: nn.Module, state: GradqHookState, where: str, fix: str) -> DistributedDataParallel:
    """Register ``gradq_hook`` with ``state`` on the DDP ``model``; a model already registered with it is kept.

    Args:
        model: what the framework returned (must be a DistributedDataParallel).
        state: the hook state (one per DDP model).
        where: the framework call that produced ``model``, for messages.
        fix: how to get a DDP model there, for messages.

    Returns:
        ``model``, training through gradq.

    Raises:
        GradqIntegrationError: ``model`` is not a DistributedDataParallel, or it
            already carries another comm hook (gradq's with another state, or the framework's own).
    """
    if not isinstance(model, DistributedDataParallel):
        raise GradqIntegrationError(
            f"{where} returned a {type(model).__name__}, not a torch DistributedDataParallel: gradq reduces DDP's "
            f"gradient buckets, so it has nothing to hook into; {fix}"
        )
    registered = _registered.get(model)
    if registered is state:
        return model
    if registered is not None:
        raise GradqIntegrationError(
            f"{where} returned a DDP model that already trains through gradq with another GradqHookState "
            f"(job_id={registered.job_id!r}); DDP takes one comm hook per model: use one state per model"
        )
    try:
        model.register_comm_hook(state, gradq_hook)
    except RuntimeError as error:
        raise GradqIntegrationError(
            f"{where} returned a DDP model that already has a comm hook ({error}); drop the other hook "
            f"(e.g. DistributedDataParallelKwargs(comm_hook=...)) so gradq's can be registered"
        ) from error
    _registered[model] = state
    return model


def registered_state(model: nn.Module) -> GradqHookState | None:
    """The state gradq was registered with on ``model`` by ``register_once``; None if it was not."""
    return _registered.get(model) if isinstance(model, DistributedDataParallel) else None
