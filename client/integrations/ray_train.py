"""Ray Train: ``use_gradq(model, config)`` in ``train_func`` trains the model ``prepare_model`` returned through gradq.

Ray Train takes no comm hook: ``ray.train.torch.prepare_model(model)`` returns
a DistributedDataParallel (when the worker group has 2 or more workers), on
which gradq registers like on any DDP model. The aggregator runs outside Ray
(``gradq serve``, or an ``AggregatorServer`` in the driver); the driver hands
its address to the workers in ``train_loop_config`` (``gradq_aggregators``) or
as GRADQ_AGGREGATORS through the runtime environment. The job id defaults to
the run's name (``RunConfig(name=...)``), so a group Ray restarts after a
failure rejoins the same job as a new incarnation and starts it clean.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import ray.train
from torch import nn

from gradq.client.ddp import GradqHookState
from gradq.client.env import HOOK_ENVIRONMENT
from gradq.client.integrations.registration import GradqIntegrationError, register_once, registered_state

__all__ = ["GradqIntegrationError", "use_gradq"]

# train_loop_config keys are the GRADQ_* variables in lower case; this prefix marks them.
_PREFIX = "gradq_"


def use_gradq(
    model: nn.Module, config: Mapping[str, Any] | None = None, state: GradqHookState | None = None
) -> GradqHookState:
    """Make ``model`` (what ``ray.train.torch.prepare_model`` returned) reduce its gradients through gradq.

    Call it in ``train_func``, once per model, on every worker.

    Args:
        model: the DistributedDataParallel ``ray.train.torch.prepare_model(model)`` returned.
        config: the ``train_loop_config`` handed to ``train_func``; its ``gradq_*`` keys
            (the GRADQ_* variables in lower case: ``gradq_aggregators``, ``gradq_bits``, ...)
            win over the worker's GRADQ_* variables. A list of addresses is taken as shards.
        state: the hook state; None builds it from ``config`` and the GRADQ_* variables, with
            job id ``"ray-<run name>"`` unless ``gradq_job_id`` / GRADQ_JOB_ID sets one.

    Returns:
        The state, for ``stats()`` and ``close()``.

    Raises:
        GradqIntegrationError: no aggregator address was given, a ``gradq_*`` key is unknown,
            ``model`` is not a DistributedDataParallel (a worker group of 1, or the model
            before ``prepare_model``), or ``use_gradq`` was already called on it.
        ValueError: a ``gradq_*`` key or GRADQ_* variable holds a bad value.
        RuntimeError: called outside a Ray Train worker (Ray's ``get_context`` refuses).
    """
    context = ray.train.get_context()
    world_size = context.get_world_size()
    if world_size < 2:
        fix = (
            f"this Ray Train worker group has world size {world_size} and prepare_model wraps nothing in DDP; "
            "run ScalingConfig(num_workers=2) or more"
        )
    else:
        fix = "pass the model ray.train.torch.prepare_model(model) returns"
    registered = registered_state(model)
    if registered is not None and registered is not state:
        raise GradqIntegrationError(
            "use_gradq(model) was already called on this model; call it once per model (DDP takes one comm hook)"
        )
    if state is None:
        state = GradqHookState.from_env(_variables(config or {}, os.environ, context.get_experiment_name()))
    register_once(model, state, "ray.train.torch.prepare_model", fix)
    return state


def _variables(config: Mapping[str, Any], environ: Mapping[str, str], run_name: str) -> dict[str, str]:
    """The GRADQ_* variables the worker sees, overridden by ``config``'s ``gradq_*`` keys, with the job id filled in."""
    variables = {name: value for name, value in environ.items() if name in HOOK_ENVIRONMENT}
    for key, value in config.items():
        if not key.startswith(_PREFIX):
            continue  # the user's own settings share the config
        name = key.upper()
        if name not in HOOK_ENVIRONMENT:
            known = ", ".join(sorted(variable.lower() for variable in HOOK_ENVIRONMENT))
            raise GradqIntegrationError(f"train_loop_config[{key!r}] is unknown; expected one of {known}")
        variables[name] = _as_variable(value)
    if not variables.get("GRADQ_AGGREGATORS"):
        raise GradqIntegrationError(
            "no aggregator address: train_loop_config has no 'gradq_aggregators' and GRADQ_AGGREGATORS is unset "
            "in this worker; pass TorchTrainer(train_loop_config={'gradq_aggregators': 'host:port'}) or set "
            "GRADQ_AGGREGATORS in the runtime_env's env_vars"
        )
    variables.setdefault("GRADQ_JOB_ID", f"ray-{run_name}")
    return variables


def _as_variable(value: Any) -> str:
    """A config value as its GRADQ_* variable would spell it."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (list, tuple)):
        return ",".join(str(item) for item in value)
    return str(value)
