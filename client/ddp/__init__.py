"""The torch adapter over the numpy client: the DDP comm hook, its lifecycle, checkpoints and allgather baselines."""

from gradq.client.ddp.hook import FALLBACKS, GradqHookState, gradq_hook

__all__ = ["FALLBACKS", "GradqHookState", "gradq_hook"]
