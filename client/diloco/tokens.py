"""Token weighting: what a host's pseudo-gradient weighs in each round key's mean.

A token-weighted host pushes each round key with the tokens its ranks trained
on since that key's last push, and the aggregator divides the weighted sum by
the weights' sum: a host on larger or longer batches moves the model in
proportion. The count is per round key because with fragments the keys are
pushed at different inner steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradq.client.session import GradqSession

__all__ = ["TokenCount"]


class TokenCount:
    """The tokens this rank has counted, and the count at each round key's last push.

    Args:
        weighted: whether the job's means weigh hosts by tokens (else every push weighs 0: unweighted).
        keys: the number of round keys.
    """

    def __init__(self, weighted: bool, keys: int) -> None:
        self.weighted = bool(weighted)
        self.tokens = 0  # counted (``count``), in all
        self._at_push = [0] * keys  # ... when each round key was last pushed

    def count(self, tokens: int) -> None:
        """This rank's inner step trained on ``tokens`` more.

        Raises:
            ValueError: ``tokens`` is not an integer >= 0, or the job is not token-weighted.
        """
        if not self.weighted:
            raise ValueError("count_tokens: this DiLoCo is not token_weighted; its means count every host alike")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens={tokens!r} is invalid; expected an integer >= 0 (this inner step's tokens)")
        self.tokens += tokens

    def weights(self, keys: Sequence[int], session: GradqSession, outer_round: int) -> list[int]:
        """The weight of each round key's push now (the host's tokens since its last push), and mark them pushed.

        A collective over the host's ranks when it has several: each trained on its own batches.

        Raises:
            ValueError: the host counted no token for a key since its last push (``count`` was not called).
        """
        if not self.weighted:
            return [0] * len(keys)
        counted = torch.tensor([self.tokens - self._at_push[key] for key in keys], dtype=torch.int64)
        if session.host.local_size > 1 and session.group is not None:
            dist.all_reduce(counted, group=session.group)
        weights = [int(weight) for weight in counted.tolist()]
        if min(weights) < 1:
            raise ValueError(
                f"token_weighted=True, but this host counted {min(weights)} tokens for outer round "
                f"{outer_round}; call diloco.count_tokens(n) after every inner step with the tokens it trained on"
            )
        for key in keys:
            self._at_push[key] = self.tokens
        return weights

    def restart(self) -> None:
        """The host takes the job's state: what it trained before is not in it, so no later push weighs it."""
        self._at_push = [self.tokens] * len(self._at_push)

    def state_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "tokens_at_push": list(self._at_push)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back ``state_dict()``'s keys from a checkpoint (absent: a checkpoint that counted none).

        Raises:
            ValueError: ``state['tokens_at_push']`` holds another number of counts than round keys.
        """
        self.tokens = int(state.get("tokens", 0))
        marks = state.get("tokens_at_push", [self.tokens] * len(self._at_push))
        if len(marks) != len(self._at_push):
            raise ValueError(
                f"state['tokens_at_push'] holds {len(marks)} counts; expected one per round key ({len(self._at_push)})"
            )
        self._at_push = [int(mark) for mark in marks]
