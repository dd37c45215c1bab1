"""The Hugging Face Trainer: ``trainer.add_callback(GradqCallback(trainer))`` trains it through gradq.

The Trainer takes no comm hook. Its DDP model exists only once ``train()``
has prepared it, as ``trainer.model_wrapped`` (the ``model`` a callback is
handed is the bare one), so the callback holds the trainer and registers in
``on_train_begin``. A second ``train()`` reuses the DDP object, on which DDP
allows one registration: the callback registers once per DDP object.
Gradient accumulation needs nothing: DDP calls the hook only on the
micro-step that synchronizes.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from gradq.client.config import GradqConfig
from gradq.client.ddp import GradqHookState
from gradq.client.integrations.registration import GradqIntegrationError, hook_state, register_once

__all__ = ["GradqCallback", "GradqIntegrationError"]

_FIX = (
    "run the Trainer in 2 or more processes, e.g. `torchrun --nproc_per_node 2 train.py` "
    "(on CPU with TrainingArguments(use_cpu=True)), and give the model a parameter that requires gradients"
)


class GradqCallback(TrainerCallback):
    """Registers gradq on the Trainer's DDP model when training begins.

    Args:
        trainer: the ``transformers.Trainer`` this callback is added to.
        state: the hook state; None builds one from ``config`` now.
        config: the configuration (with ``state`` None); None reads the GRADQ_* variables
            now (``GradqConfig.from_env()``), so a bad one fails before training.

    Raises:
        GradqIntegrationError: ``trainer`` is not a Trainer, or both ``state`` and ``config`` were given.
        ValueError: ``state`` and ``config`` are None and a GRADQ_* variable is unset or invalid.
    """

    def __init__(self, trainer: Any, state: GradqHookState | None = None, *, config: GradqConfig | None = None) -> None:
        if not hasattr(trainer, "model_wrapped"):
            raise GradqIntegrationError(
                f"trainer={type(trainer).__name__} has no model_wrapped; expected a transformers.Trainer"
            )
        self.trainer = trainer
        self.state = hook_state(state, config, "GradqCallback(trainer)")

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Register on ``trainer.model_wrapped`` (a no-op when this DDP object already trains through gradq).

        Raises:
            GradqIntegrationError: the Trainer's model is not a DistributedDataParallel
                (a single process), or it carries another comm hook.
        """
        register_once(self.trainer.model_wrapped, self.state, "Trainer (its model_wrapped)", _FIX)
