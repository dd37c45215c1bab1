"""DiLoCo's checkpoints, and the state a joining host receives from a live one.

A checkpoint holds the outer loop's counters, the global state (on the
aggregator's terms or the hosts'), this rank's error feedback and its token
counts; the model and the inner optimizer are checkpointed beside it as
usual. A joiner receives only what every host holds alike (``SharedOuterState``):
error feedback and token counts are each host's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradq.client.diloco.outer import DiLoCo

__all__ = ["SharedOuterState", "load_state_dict", "state_dict"]


class SharedOuterState:
    """The part of a DiLoCo every host holds alike: its round counters and global state (a joiner's share).

    Not ``gradq.client.diloco.on_aggregator.GlobalState``, which is only the
    aggregator's global parameters and momentum; this adds the counters and
    takes either place of the outer step.
    """

    def __init__(self, diloco: DiLoCo) -> None:
        self.diloco = diloco

    def state_dict(self) -> dict[str, Any]:
        diloco = self.diloco
        return {"outer_round": diloco.outer_round, "inner_steps": diloco.inner_steps, **diloco.outer_state.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back ``state_dict()``'s output.

        Raises:
            ValueError: a key is missing, or the global state differs in number or shape from the model's.
        """
        diloco = self.diloco
        outer = "outer_momentum" if diloco.on_aggregator is not None else "outer_optimizer"
        missing = sorted({"outer_round", "inner_steps", "global_parameters", outer} - set(state))
        if missing:
            raise ValueError(
                f"state lacks {', '.join(missing)}; expected the output of DiLoCo.state_dict() with "
                f"outer_step={diloco.options.outer_step!r}"
            )
        diloco.outer_state.load_state_dict(state)
        diloco.outer_round, diloco.inner_steps = int(state["outer_round"]), int(state["inner_steps"])


def state_dict(diloco: DiLoCo) -> dict[str, Any]:
    """``DiLoCo.state_dict()``: at an outer-round boundary where fragments are in use.

    Raises:
        RuntimeError: with fragments, mid-round (some fragments stand at the next round, one may be in flight).
    """
    fragments, sync_every = diloco.schedule.fragments, diloco.sync_every
    if fragments > 1 and diloco.inner_steps % sync_every:
        raise RuntimeError(
            f"with fragments={fragments}, checkpoint at a multiple of sync_every={sync_every} inner steps (now "
            f"{diloco.inner_steps}), where every fragment stands at the same outer round and none is in flight"
        )
    session = diloco.session
    return {
        **SharedOuterState(diloco).state_dict(),
        "residuals": session.residuals.state_dict() if session is not None else {},
        **diloco.token_count.state_dict(),
    }


def load_state_dict(diloco: DiLoCo, state: dict[str, Any]) -> None:
    """``DiLoCo.load_state_dict()``: before or after ``start()``; a started host re-seeds the aggregator.

    Raises:
        ValueError: a key is missing, or the global parameters or token counts differ in number or shape.
        RuntimeError: the checkpoint holds error feedback and the DiLoCo is not started.
    """
    SharedOuterState(diloco).load_state_dict(state)
    diloco.token_count.load_state_dict(state)
    residuals = state.get("residuals", {})
    if residuals:
        diloco._connected().residuals.load_state_dict(residuals)
    if diloco.on_aggregator is not None:
        diloco.on_aggregator.load_into_model()
        if diloco.session is not None:  # the aggregator's copy becomes the checkpoint's round
            diloco.on_aggregator.seed(diloco.session, diloco.outer_round)
