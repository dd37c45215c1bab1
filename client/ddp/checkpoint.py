"""GradqHookState.state_dict() / load_state_dict(): step, grid and error-feedback residuals, checked on the way in.

The residuals are saved per parameter (see gradq.client.session.residuals), so a
resume puts each back on its own parameter whatever DDP's bucket layout is then.
The format is the one gradq has always written, so older checkpoints load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gradq.client.config import GradqConfig
from gradq.qcore import QuantConfig

__all__ = ["checkpoint_of", "read_checkpoint"]


def checkpoint_of(step: int, config: GradqConfig, residuals: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``GradqHookState.state_dict()``: step, config (plain values), error_feedback and residuals."""
    quant = config.quant
    return {
        "step": step,
        "config": {
            "scheme": quant.scheme.name.lower(),
            "bits": quant.bits,
            "channel_size": quant.channel_size,
            "rounding": quant.rounding.name.lower(),
            "seed": quant.seed,
        },
        "error_feedback": config.error_feedback,
        "residuals": residuals,
    }


def read_checkpoint(checkpoint: Mapping[str, Any]) -> tuple[int, QuantConfig, bool, Mapping[str, Any]]:
    """Check ``GradqHookState.state_dict()``'s output: (step, grid, error_feedback, residual pieces).

    Raises:
        ValueError: a key is missing or holds a bad value, named in the message.
    """
    missing = sorted({"step", "config", "error_feedback", "residuals"} - set(checkpoint))
    if missing:
        raise ValueError(f"state_dict lacks {', '.join(missing)}; expected the output of GradqHookState.state_dict()")
    step = checkpoint["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"state_dict['step']={step!r} is invalid; expected an integer >= 0")
    config = QuantConfig(**checkpoint["config"])
    if not config.scheme.is_quantized:
        raise ValueError(f"state_dict['config'].scheme={config.scheme.name.lower()} is not quantized")
    residuals = checkpoint["residuals"]
    if not isinstance(residuals, Mapping):
        raise ValueError(f"state_dict['residuals'] is {type(residuals).__name__}; expected a mapping of name -> tensor")
    return step, config, bool(checkpoint["error_feedback"]), residuals
