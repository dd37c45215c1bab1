"""GradqHookState.state_dict() / load_state_dict(): step, grid and error-feedback residuals, checked on the way in.

The residuals are saved per parameter (see gradq.client.ddp.residuals), so a
resume puts each back on its own parameter whatever DDP's bucket layout is then.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gradq.qcore import QuantConfig

if TYPE_CHECKING:
    from gradq.client.ddp.hook import GradqHookState

__all__ = ["checkpoint_of", "resume_from"]


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
        "residuals": state._residuals.state_dict(state),
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
    residuals = checkpoint["residuals"]
    if not isinstance(residuals, Mapping):
        raise ValueError(f"state_dict['residuals'] is {type(residuals).__name__}; expected a mapping of name -> tensor")
    state._residuals.load_state_dict(residuals)
    state.step, state.config, state.error_feedback = step, config, bool(checkpoint["error_feedback"])
