"""Ray Train: ``use_gradq(model, config)`` in ``train_func`` trains the model ``prepare_model`` returned through gradq.

Ray Train takes no comm hook: ``ray.train.torch.prepare_model(model)`` returns
a DistributedDataParallel (when the worker group has 2 or more workers), on
which gradq registers like on any DDP model. The aggregator runs outside Ray
(``gradq serve``, or an ``AggregatorServer`` in the driver); the driver hands
its address to the workers in ``train_loop_config``: a whole GradqConfig under
``"gradq"`` (Ray pickles it to the workers), or ``gradq_*`` keys that stand for
the GRADQ_* variables, or the variables themselves through the runtime
environment. The job id defaults to
the run's name (``RunConfig(name=...)``), so a group Ray restarts after a
failure rejoins the same job as a new incarnation and starts it clean.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import ray.train
from torch import nn

from gradq.client.config import GradqConfig
from gradq.client.ddp import GradqHookState
from gradq.client.env import HOOK_ENVIRONMENT
from gradq.client.integrations.registration import (
    GradqIntegrationError,
    hook_state,
    register_once,
    registered_state,
)

__all__ = ["GradqIntegrationError", "use_gradq"]

# train_loop_config keys are the GRADQ_* variables in lower case; this prefix marks them.
_PREFIX = "gradq_"
# The train_loop_config key of a whole GradqConfig (instead of gradq_* keys).
_CONFIG_KEY = "gradq"


def use_gradq(
    model: nn.Module, config: Mapping[str, Any] | None = None, state: GradqHookState | None = None
) -> GradqHookState:
    """Make ``model`` (what ``ray.train.torch.prepare_model`` returned) reduce its gradients through gradq.

    Call it in ``train_func``, once per model, on every worker.

    Args:
        model: the DistributedDataParallel ``ray.train.torch.prepare_model(model)`` returned.
        config: the ``train_loop_config`` handed to ``train_func``. Its ``"gradq"`` key, a
            GradqConfig, is the configuration; else its ``gradq_*`` keys (the GRADQ_* variables
            in lower case: ``gradq_aggregators``, ``gradq_bits``, ...) win over the worker's
            GRADQ_* variables. A list of addresses is taken as shards.
        state: the hook state; None builds it from ``config``, with job id
            ``"ray-<run name>"`` unless the configuration sets one.

    Returns:
        The state, for ``stats()`` and ``close()``.

    Raises:
        GradqIntegrationError: no aggregator address was given, a ``gradq_*`` key is unknown,
            ``"gradq"`` is not a GradqConfig or comes with ``gradq_*`` keys, ``model`` is not a
            DistributedDataParallel (a worker group of 1, or the model before ``prepare_model``),
            or ``use_gradq`` was already called on it.
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
    gradq = None if state is not None else _gradq_config(config or {}, os.environ, context.get_experiment_name())
    state = hook_state(state, gradq, "use_gradq(model, config)")
    register_once(model, state, "ray.train.torch.prepare_model", fix)
    return state


def _gradq_config(config: Mapping[str, Any], environ: Mapping[str, str], run_name: str) -> GradqConfig:
    """The configuration ``config`` gives (its GradqConfig, else its keys over the variables), the job id filled in."""
    given = config.get(_CONFIG_KEY)
    keys = sorted(key for key in config if key.startswith(_PREFIX))
    if given is None:
        gradq = GradqConfig.from_env(_variables(config, environ))
    elif not isinstance(given, GradqConfig):
        raise GradqIntegrationError(
            f"train_loop_config[{_CONFIG_KEY!r}]={given!r} is invalid; expected a gradq.client.config.GradqConfig"
        )
    elif keys:
        raise GradqIntegrationError(
            f"train_loop_config has both {_CONFIG_KEY!r} and {', '.join(map(repr, keys))}; pass the whole "
            f"GradqConfig or the {_PREFIX}* keys, not both"
        )
    else:
        gradq = given
    return gradq if gradq.job_id is not None else gradq.replace(job_id=f"ray-{run_name}")


def _variables(config: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, str]:
    """The GRADQ_* variables the worker sees, overridden by ``config``'s ``gradq_*`` keys."""
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
            "in this worker; pass TorchTrainer(train_loop_config={'gradq_aggregators': 'host:port'}) (or "
            "{'gradq': GradqConfig.of('host:port')}) or set GRADQ_AGGREGATORS in the runtime_env's env_vars"
        )
    return variables


def _as_variable(value: Any) -> str:
    """A config value as its GRADQ_* variable would spell it."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (list, tuple)):
        return ",".join(str(item) for item in value)
    return str(value)
