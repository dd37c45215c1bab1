"""The adaptive bit policy's pieces of each tensor a session reduces: planned once per layout, alike on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradq.client.bit_policy import ParameterGradient, Piece, assign_bits, plan_pieces, relative_error_at
from gradq.qcore import QuantConfig

__all__ = ["BitPlans"]


class BitPlans:
    """Tensor key -> its pieces as (round key, piece); a new layout (DDP's bucket rebuild) gets a new plan.

    Each piece has a round key of its own, never reused: the aggregator fixes
    a key's grid at its first push, and a rebuilt bucket index may hold other
    parameters with other bits. Every rank plans the same buckets in the same
    order, so they draw the same keys.
    """

    __slots__ = ("_next_key", "_plans")

    def __init__(self) -> None:
        self._plans: dict[int, tuple[list[int], list[tuple[int, Piece]]]] = {}
        self._next_key = 0

    def plan(
        self,
        key: int,
        params: list[torch.Tensor],
        buffer: torch.Tensor,
        low: QuantConfig,
        average_bits: float,
        group: dist.ProcessGroup | None,
    ) -> list[tuple[int, Piece]]:
        """The pieces of the flat ``buffer`` laying ``params`` end to end, planned the first time its layout is seen.

        Each parameter's error is averaged over the ranks of ``group`` (one small
        allreduce per new layout; None: this process alone), so every rank chooses the same bits.
        """
        ids = [id(param) for param in params]
        known = self._plans.get(key)
        if known is not None and known[0] == ids:
            return known[1]
        numels = [param.numel() for param in params]
        if sum(numels) != buffer.numel():  # not its parameters end to end: one piece on the configured grid
            pieces = [Piece(0, buffer.numel(), low)]
        else:
            errors = torch.zeros(
                len(params), dtype=torch.float64, device=buffer.device
            )  # NCCL groups take no CPU tensor
            offset = 0
            for index, numel in enumerate(numels):
                errors[index] = relative_error_at(buffer[offset : offset + numel].float().cpu().numpy(), low)
                offset += numel
            if group is not None:
                dist.all_reduce(errors, group=group)
                errors /= dist.get_world_size(group)
            described = [
                ParameterGradient(numel, param.dim(), float(error))
                for numel, param, error in zip(numels, params, errors, strict=True)
            ]
            pieces = plan_pieces(numels, assign_bits(described, low.bits, average_bits), low)
        plan = [(self._next_key + number, piece) for number, piece in enumerate(pieces)]
        self._next_key += len(pieces)
        self._plans[key] = (ids, plan)
        return plan
