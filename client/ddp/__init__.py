"""The torch adapter over the numpy client: the DDP comm hook, its lifecycle, checkpoints and allgather baselines.

The hook's names load torch on first use, not on import: `gradq worker` reads
its settings through ``gradq.client.env`` before it pays for torch.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradq.client.ddp.hook import FALLBACKS, GradqHookState, gradq_hook

__all__ = ["FALLBACKS", "GradqHookState", "gradq_hook"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from gradq.client.ddp import hook

        return getattr(hook, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
