"""DiLoCo's outer step on the aggregator: the host's half (the aggregator's is gradq.server.outer_state).

The job's global parameters and outer momentum live on the aggregator, one
pair of float32 arrays per round key. Every host keeps the same pair in the
same layout (it needs the global parameters for its pseudo-gradients anyway):
after each outer round it applies the mean it received with
``gradq.qcore.outer_step.take_outer_step``, as the aggregator did, so the two
copies agree bit for bit. That is what lets

- a joiner take the state from the aggregator, with no donor host: the
  aggregator sends its copy at the next outer-round boundary;
- a restarted aggregator lose nothing: the hosts seed it again from theirs,
  momentum included, after the rejoin;
- hosts that start from different weights agree: the first seed is the job's,
  and the others adopt it;
- hosts at different outer rounds agree: the newest round is the job's, and a
  host behind it takes the job's state at the next boundary (its push is
  refused with Refusal.BEHIND, handled as a late host's).

On a host of FSDP2 ranks each rank keeps the global state of its own shards
(the parameters' local tensors) and seeds, pushes and receives its own round
keys; on a host of DDP ranks the ranks hold the same copy and the first seeds.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from gradq.client.sending import AggregationError
from gradq.client.session import GradqSession
from gradq.qcore.outer_step import OuterStep, take_outer_step

__all__ = ["GlobalState", "outer_step_of"]

log = logging.getLogger(__name__)


def outer_step_of(optimizer: torch.optim.Optimizer) -> OuterStep:
    """The aggregator's outer step for an outer optimizer: torch.optim.SGD without dampening or weight decay.

    Raises:
        ValueError: another optimizer, or SGD settings the aggregator does not run.
    """
    if type(optimizer) is not torch.optim.SGD:
        raise ValueError(
            f"outer_optimizer is {type(optimizer).__name__}; the aggregator runs SGD with momentum "
            f"(torch.optim.SGD) only; pass outer_step='hosts' to run another optimizer on the hosts"
        )
    settings = {
        (g["lr"], g["momentum"], g["nesterov"], g["dampening"], g["weight_decay"]) for g in optimizer.param_groups
    }
    if len(settings) != 1:
        raise ValueError(f"outer_optimizer has {len(settings)} settings across its groups; expected one")
    lr, momentum, nesterov, dampening, weight_decay = settings.pop()
    if dampening or weight_decay or optimizer.defaults.get("maximize"):
        raise ValueError(
            f"outer_optimizer has dampening={dampening}, weight_decay={weight_decay}; the aggregator's outer step "
            f"has neither (pass outer_step='hosts' to run them on the hosts)"
        )
    return OuterStep(float(lr), float(momentum), bool(nesterov))


class GlobalState:
    """This host's copy of the job's global parameters and outer momentum, one flat float32 run per bucket.

    Args:
        parameters: the model's trainable parameters, in order.
        buckets: ``[begin, end)`` runs of ``parameters``, one per outer round key.
        step: the outer step's settings.
    """

    def __init__(self, parameters: Sequence[nn.Parameter], buckets: Sequence[tuple[int, int]], step: OuterStep):
        # The tensors this rank holds: a DTensor's local shard (FSDP2), else the parameter itself.
        self.parameters = [_local(param) for param in parameters]
        self.buckets, self.step = list(buckets), step
        self.flat = [
            torch.cat([p.detach().reshape(-1).float().cpu() for p in self.parameters[b:e]]) for b, e in self.buckets
        ]
        empty = [key for key, flat in enumerate(self.flat) if not flat.numel()]
        if empty:
            raise ValueError(
                f"bucket {empty[0]} holds no elements on this rank (its parameters' shards are empty here); "
                f"expected parameters of at least as many rows as the host has ranks, or fewer buckets"
            )
        self.momentum = [torch.zeros_like(flat) for flat in self.flat]
        # The global parameters shaped like the model's: views of ``flat``.
        self.views: list[torch.Tensor] = []
        for (begin, end), flat in zip(self.buckets, self.flat, strict=True):
            offset = 0
            for param in self.parameters[begin:end]:
                self.views.append(flat[offset : offset + param.numel()].view(param.shape))
                offset += param.numel()
        self.seeded_joins = -1  # the worker client's Join count when this host last seeded the aggregator

    # -- the outer round --------------------------------------------------------------------------

    def pseudo_gradient(self, key: int) -> torch.Tensor:
        """Bucket ``key``'s global parameters minus the host's own, flat float32."""
        begin, end = self.buckets[key]
        local = torch.cat([p.detach().reshape(-1).float().cpu() for p in self.parameters[begin:end]])
        return self.flat[key] - local

    def apply(self, key: int, mean: torch.Tensor) -> None:
        """The outer step of bucket ``key`` by the mean received: the aggregator's arithmetic, in place."""
        take_outer_step(self.flat[key].numpy(), self.momentum[key].numpy(), mean.float().cpu().numpy(), self.step)

    @torch.no_grad()
    def load_into_model(self, keys: Sequence[int] | None = None, alpha: float = 0.0) -> None:
        """Every host starts the next inner steps from the global parameters (of round keys ``keys``; None: all).

        ``alpha`` > 0 keeps that share of the host's own parameters (Streaming DiLoCo's mixing).
        """
        indices = range(len(self.parameters)) if keys is None else [i for k in keys for i in range(*self.buckets[k])]
        for index in indices:
            param, view = self.parameters[index], self.views[index]
            if alpha:
                param.copy_(view.to(param.dtype).lerp(param, alpha))
            else:
                param.copy_(view)

    # -- the aggregator's copy --------------------------------------------------------------------

    def round_keys(self, session: GradqSession) -> list[tuple[int, int, int, int, int]]:
        """(round key, bucket, begin, end, owner) of every round of an outer round, ascending round keys.

        ``owner`` is the host's local rank that holds the round's values: on a
        host of shards every rank its own (gathered over the host's ranks, a
        collective), else the host's first rank holds them all.
        """
        mine = [
            (round_key, key, begin, end, session.host.local_rank if session.host.sharded else 0)
            for key, flat in enumerate(self.flat)
            for round_key, begin, end in session.round_keys(key, flat.numel())
        ]
        if session.host.sharded and session.host.local_size > 1 and session.group is not None:
            gathered: list[Any] = [None] * session.host.local_size
            dist.all_gather_object(gathered, mine, group=session.group)
            mine = [entry for rounds in gathered for entry in rounds]
        member = session.member
        idle = sorted(set(range(member.shards)) - {member.shard_of(round_key) for round_key, *_ in mine})
        if idle:
            # Each shard keeps the global state of its own round keys and sends joiners that part: a shard with
            # none would never reach an outer-round boundary, and a joiner would wait on it forever.
            raise ValueError(
                f"an outer round of this model is {len(mine)} round keys over {member.shards} aggregator shards: "
                f"shard {idle[0]} would hold none of the global state; expected at least a round key per shard "
                f"(smaller bucket_elements, or fewer shards)"
            )
        return sorted(mine)

    def seed(self, session: GradqSession, step: int) -> None:
        """Hand the aggregator this host's copy before outer round ``step``; adopt the job's if it differs.

        Collective over the host's ranks: its first rank seeds, and the others
        take what it holds then.

        Raises:
            AggregationError: the aggregator refused (the message says why).
        """
        member, host = session.member, session.host
        rounds = self.round_keys(session)
        keys_on = Counter(member.shard_of(round_key) for round_key, *_ in rounds)
        if host.sharded or host.local_rank == 0:
            adopted = 0
            for round_key, key, begin, end, owner in rounds:
                if owner != host.local_rank:
                    continue
                parameters, momentum = self.flat[key][begin:end], self.momentum[key][begin:end]
                matched, held_step, theirs, their_momentum = member.seed_outer(
                    # No momentum yet (before the first outer round) travels as none: half the bytes.
                    step,
                    round_key,
                    keys_on[member.shard_of(round_key)],
                    parameters.numpy(),
                    momentum.numpy() if momentum.any() else None,
                )
                if matched:
                    continue
                if held_step != step:
                    # The job is past this host's round (a later seed or push is the job's): its next push is
                    # refused (BEHIND) and it takes the whole state at the next boundary, never key by key.
                    log.warning(
                        "the job's global state is at outer round %d, this host at %d; it takes the job's state",
                        held_step,
                        step,
                    )
                    break
                parameters.copy_(torch.from_numpy(np.frombuffer(theirs, dtype="<f4").copy()))
                momentum.copy_(torch.from_numpy(np.frombuffer(their_momentum, dtype="<f4").copy()))
                adopted += 1
            if adopted:
                log.warning(
                    "took the job's global state of %d round keys from the aggregator (this host's differed)", adopted
                )
        self._share_within_host(session)
        self.seeded_joins = member.joins

    def matches(self, session: GradqSession, step: int) -> bool:
        """Whether the aggregator's copy before outer round ``step`` is this host's, bit for bit (adopts nothing).

        Collective over the host's ranks: each checks the rounds it holds, and all return the host's answer.

        Raises:
            AggregationError: the aggregator refused (the message says why).
        """
        rounds = self.round_keys(session)
        keys_on = Counter(session.member.shard_of(round_key) for round_key, *_ in rounds)
        mismatched = 0
        for round_key, key, begin, end, owner in rounds:
            if owner != session.host.local_rank:
                continue
            parameters, momentum = self.flat[key][begin:end], self.momentum[key][begin:end]
            shard = session.member.shard_of(round_key)
            matched, held_step, _, _ = session.member.seed_outer(
                step, round_key, keys_on[shard], parameters.numpy(), momentum.numpy()
            )
            mismatched += not matched or held_step != step
        if (
            session.host.local_size > 1 and session.group is not None
        ):  # no rank leaves (for the host) while another still asks
            counted = torch.tensor([mismatched])
            dist.all_reduce(counted, group=session.group)
            mismatched = int(counted.item())
        return mismatched == 0

    def receive(self, session: GradqSession) -> int:
        """A joiner takes the global state the aggregator sends at the next boundary; returns that outer round.

        Collective over the host's ranks.

        Raises:
            AggregationError: refused, the transfer broke, or the state does not fit this model.
        """
        host = session.host
        rounds = self.round_keys(session)
        step, shards, _ = session.member.fetch()
        mine = host.local_rank if host.sharded else 0
        # Each shard sends the global state of the round keys it owns: their parameters in ascending round-key
        # order, then their momentum (gradq.server.outer_state.OuterState.snapshot).
        for shard, data in enumerate(shards):
            owned = [entry for entry in rounds if session.member.shard_of(entry[0]) == shard]
            expected = 8 * sum(end - begin for _, _, begin, end, _ in owned)
            if len(data) != expected:
                raise AggregationError(
                    session.member.address(),
                    None,
                    f"shard {shard} sent {len(data)} bytes of global state; this model's round keys there hold "
                    f"{expected} (parameters and momentum, float32)",
                )
            values = np.frombuffer(data, dtype="<f4")
            offset = 0
            for target in (self.flat, self.momentum):
                for _, key, begin, end, owner in owned:
                    if owner == mine:
                        target[key][begin:end] = torch.from_numpy(values[offset : offset + end - begin].copy())
                    offset += end - begin
        self.load_into_model()
        self.seeded_joins = session.member.joins
        return step

    def _share_within_host(self, session: GradqSession) -> None:
        # A host of shards holds no common copy; a host of one process has no one to share it with.
        if session.host.local_size > 1 and not session.host.sharded and session.group is not None:
            source = dist.get_global_rank(session.group, 0)
            for tensor in (*self.flat, *self.momentum):
                dist.broadcast(tensor, src=source, group=session.group)
        self.load_into_model()

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "global_parameters": [view.clone() for view in self.views],
            "outer_momentum": [m.clone() for m in self.momentum],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved, momentum = state["global_parameters"], state["outer_momentum"]
        if [tuple(t.shape) for t in saved] != [tuple(v.shape) for v in self.views] or len(momentum) != len(
            self.momentum
        ):
            raise ValueError(
                f"state['global_parameters'] holds {len(saved)} tensors and {len(momentum)} momentum buckets; "
                f"expected {len(self.views)} shaped like the model's and {len(self.momentum)} buckets"
            )
        for view, value in zip(self.views, saved, strict=True):
            view.copy_(value)
        for mine, value in zip(self.momentum, momentum, strict=True):
            mine.copy_(value)


def _local(param: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``param``: a DTensor's local shard (it shares the parameter's memory)."""
    to_local = getattr(param, "to_local", None)
    return to_local() if callable(to_local) else param
