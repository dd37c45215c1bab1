"""The outer step on the hosts (``outer_step="hosts"``): the aggregator only averages, every host steps alike.

Every host holds the global parameters (where every host started this outer
round from) and its own outer optimizer, any torch optimizer; it applies
each round key's mean as that optimizer's gradient. Hosts that start alike
and apply the same means with the same optimizer stay bit-identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["HostsOuterStep"]


class HostsOuterStep:
    """The global parameters and the outer optimizer of a host that runs the outer step itself.

    Args:
        parameters: the model's trainable parameters, in order.
        buckets: ``[begin, end)`` runs of ``parameters``, one per outer round key.
        optimizer: the outer optimizer, over exactly ``parameters``.
    """

    def __init__(
        self, parameters: Sequence[nn.Parameter], buckets: Sequence[tuple[int, int]], optimizer: torch.optim.Optimizer
    ) -> None:
        self.parameters, self.buckets, self.optimizer = list(parameters), list(buckets), optimizer
        self.global_parameters = [param.detach().clone() for param in self.parameters]

    def pseudo_gradient(self, key: int) -> torch.Tensor:
        """Round key ``key``'s global parameters minus the host's own, flat float32."""
        begin, end = self.buckets[key]
        return torch.cat(
            [
                (start.float() - param.detach().float()).reshape(-1)
                for param, start in zip(self.parameters[begin:end], self.global_parameters[begin:end], strict=True)
            ]
        )

    @torch.no_grad()
    def apply(self, keys: Sequence[int], means: Sequence[torch.Tensor], alpha: float) -> None:
        """The outer step of round keys ``keys`` by their ``means``, into the global parameters and the model.

        ``alpha`` > 0 keeps that share of the host's own parameters (Streaming DiLoCo's mixing).
        """
        landed = [index for key in keys for index in range(*self.buckets[key])]
        # The other fragments' parameters hold this host's own inner gradients: the outer optimizer must not
        # see them (its momentum would differ between hosts), so they sit out this step and come back after.
        others = {index: self.parameters[index].grad for index in set(range(len(self.parameters))) - set(landed)}
        for index in others:
            self.parameters[index].grad = None
        own: list[torch.Tensor] = []
        for key, mean in zip(keys, means, strict=True):
            begin, end = self.buckets[key]
            offset = 0
            for param, start in zip(self.parameters[begin:end], self.global_parameters[begin:end], strict=True):
                if alpha:
                    own.append(param.detach().clone())
                param.copy_(start)  # back to where every host started
                param.grad = mean[offset : offset + param.numel()].view_as(param).to(param.dtype)
                offset += param.numel()
        self.optimizer.step()  # the parameters without a gradient (other fragments') stay as they are
        self.optimizer.zero_grad(set_to_none=True)
        for index, grad in others.items():
            self.parameters[index].grad = grad
        for index in landed:
            self.global_parameters[index].copy_(self.parameters[index])
        if alpha:
            for index, mine in zip(landed, own, strict=True):
                self.parameters[index].lerp_(mine.to(self.parameters[index].dtype), alpha)

    def state_dict(self) -> dict[str, Any]:
        return {
            "global_parameters": [start.clone() for start in self.global_parameters],
            "outer_optimizer": self.optimizer.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back ``state_dict()``'s output.

        Raises:
            ValueError: the global parameters differ in number or shape from the model's.
        """
        saved = state["global_parameters"]
        shapes = [tuple(start.shape) for start in self.global_parameters]
        if [tuple(start.shape) for start in saved] != shapes:
            raise ValueError(
                f"state['global_parameters'] holds {len(saved)} tensors of shapes "
                f"{[tuple(start.shape) for start in saved][:4]}...; expected {len(shapes)} of {shapes[:4]}..."
            )
        for start, value in zip(self.global_parameters, saved, strict=True):
            start.copy_(value)
        self.optimizer.load_state_dict(state["outer_optimizer"])
