"""DiLoCo's options, checked once where they are built, and its default outer optimizer.

One frozen value holds every option of an outer loop beside the model and
its optimizers, so ``DiLoCo`` reads settled values and the checks sit in one
place. Options that only make sense against the job (its configuration, an
FSDP2 model) are checked by ``check_against``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gradq.client.config import GradqConfig
from gradq.client.diloco.fragments import FragmentSchedule
from gradq.qcore import QuantConfig, codec_for
from gradq.qcore.outer_step import DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM

__all__ = ["OUTER_STEP_PLACES", "SPARSE_OUTER_LR", "DiLoCoOptions", "check_outer_optimizer", "default_outer_optimizer"]

OUTER_STEP_PLACES = ("aggregator", "hosts")  # where the outer step runs (see gradq.client.diloco)


# The outer lr of sparse pseudo-gradients (sparse_topk with error feedback): chosen on bench/sparse_diloco.py's
# two tuning tasks from 0.3-1.0, with and without momentum; its figures are in docs/diloco.md.
SPARSE_OUTER_LR = 0.7


def default_outer_optimizer(
    parameters: Iterator[nn.Parameter] | Sequence[nn.Parameter], quant: QuantConfig | None = None
) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer unless the user brings one: SGD, lr 0.3, momentum 0.9, Nesterov.

    Not torchtitan's lr 0.7, which lost up to 62% held-out loss where 0.3 lost at most 4%
    (gradq.qcore.outer_step.DEFAULT_OUTER_LR says on what). Sparse pseudo-gradients
    (``quant`` a sparse scheme) take ``SPARSE_OUTER_LR``: a mean that carries 1.6% of
    the entries each round moves the parameters less per round.
    """
    sparse = quant is not None and codec_for(quant.scheme).sparse
    lr = SPARSE_OUTER_LR if sparse else DEFAULT_OUTER_LR
    return torch.optim.SGD(parameters, lr=lr, momentum=DEFAULT_OUTER_MOMENTUM, nesterov=True)


@dataclass(frozen=True)
class DiLoCoOptions:
    """How a DiLoCo's outer rounds run; each field is the ``DiLoCo`` argument of that name.

    Args:
        sync_every: H, the inner steps between outer rounds.
        bucket_elements: the most elements one round key carries; None:
            ``DEFAULT_BUCKET_ELEMENTS``, lowered with ``fragments`` > 1 until every
            fragment has a round key of its own.
        outer_step: where the outer step runs, one of ``OUTER_STEP_PLACES``:
            "aggregator" (the outer optimizer must then be SGD without dampening
            or weight decay) or "hosts".
        quorum: 0 for synchronous outer rounds (each waits for every host);
            n >= 1 for semi-synchronous ones (outer_step="aggregator" only): a
            round closes once n hosts have pushed and ``grace_s`` more seconds
            have passed. A host late for a round has its pseudo-gradient merged
            into the next round, then takes the global state at the next boundary.
        grace_s: the grace window of a semi-synchronous round, seconds.
        fragments: Streaming DiLoCo (gradq.client.diloco.fragments): the round
            keys cut into this many fragments, each synced at its own inner step
            of every outer round; 1 syncs them all at once.
        fragment_sync_delay: inner steps a fragment's round stays in flight while
            the host trains on, before its update lands (below sync_every / fragments).
        fragment_update_alpha: where a fragment's update lands, the host keeps
            this share of its own parameters (0: it takes the global ones).
        token_weighted: each round's mean weights every host's pseudo-gradient by
            the tokens it trained on since its last push of that round key.

    Raises:
        ValueError: a field out of range, or two that do not go together, named with what was expected.
    """

    sync_every: int = 50
    bucket_elements: int | None = None
    outer_step: str = "aggregator"
    quorum: int = 0
    grace_s: float = 1.0
    fragments: int = 1
    fragment_sync_delay: int = 0
    fragment_update_alpha: float = 0.0
    token_weighted: bool = False

    def __post_init__(self) -> None:
        sync_every, bucket_elements, quorum = self.sync_every, self.bucket_elements, self.quorum
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every={sync_every!r} is invalid; expected an integer >= 1 (inner steps per round)")
        if bucket_elements is not None and (
            isinstance(bucket_elements, bool) or not isinstance(bucket_elements, int) or bucket_elements < 1
        ):
            raise ValueError(f"bucket_elements={bucket_elements!r} is invalid; expected an integer >= 1 (None: chosen)")
        if self.outer_step not in OUTER_STEP_PLACES:
            raise ValueError(f"outer_step={self.outer_step!r} is invalid; expected one of {list(OUTER_STEP_PLACES)}")
        if isinstance(quorum, bool) or not isinstance(quorum, int) or quorum < 0:
            raise ValueError(f"quorum={quorum!r} is invalid; expected 0 (synchronous) or the hosts a round needs")
        if quorum and self.outer_step != "aggregator":
            raise ValueError(
                f"quorum={quorum} needs outer_step='aggregator': a late host takes the global state from its copy"
            )
        if not (isinstance(self.grace_s, int | float) and 0 <= self.grace_s <= 3600):
            raise ValueError(f"grace_s={self.grace_s!r} is invalid; expected seconds in [0, 3600]")
        self.schedule()  # the fragment options' own checks

    def schedule(self) -> FragmentSchedule:
        """When each fragment's round starts and lands."""
        return FragmentSchedule(self.sync_every, self.fragments, self.fragment_sync_delay, self.fragment_update_alpha)

    @property
    def semi_sync(self) -> tuple[int, float] | None:
        """(quorum, grace seconds) of semi-synchronous rounds, as the session's Join takes them; None: synchronous."""
        return (self.quorum, float(self.grace_s)) if self.quorum else None

    def check_against(self, config: GradqConfig, sharded: bool) -> None:
        """Refuse options the job cannot run: no elastic job, or an outer step its model or bits rule out.

        Args:
            config: the job's configuration.
            sharded: the model is an FSDP2 module (each rank holds its own shards).

        Raises:
            ValueError: ``elastic_hosts`` unset, ``outer_step="hosts"`` with an FSDP2 model, an
                adaptive bit policy with the outer step on the aggregator, or a sparse scheme
                without error feedback.
        """
        if codec_for(config.quant.scheme).sparse and not config.error_feedback:
            raise ValueError(
                f"scheme={config.quant.scheme.name.lower()} without error feedback: each round sends "
                f"{config.quant.topk} of every {config.quant.channel_size} entries and the rest would never "
                "arrive; set error_feedback=True (GRADQ_ERROR_FEEDBACK=1)"
            )
        if not config.elastic_hosts:
            raise ValueError(
                "elastic_hosts=0: DiLoCo's hosts are the members of an elastic job; set elastic_hosts "
                "(GRADQ_ELASTIC_HOSTS) to the number of hosts the job starts with"
            )
        if sharded and self.outer_step != "aggregator":
            raise ValueError(
                "outer_step='hosts' with an FSDP2 model: its ranks hold shards, which a host-side torch optimizer "
                "would step apart; use outer_step='aggregator' (the default)"
            )
        if self.outer_step == "aggregator" and config.bit_policy == "adaptive":
            raise ValueError(
                "bit_policy='adaptive' plans new round keys every step; the aggregator's copy of the global "
                "state needs fixed ones: use bit_policy='uniform', or outer_step='hosts'"
            )


def check_outer_optimizer(optimizer: torch.optim.Optimizer, parameters: Sequence[nn.Parameter]) -> None:
    """Refuse an outer optimizer over other parameters than the model's trainable ones.

    Raises:
        ValueError: the optimizer's parameters are not exactly ``parameters``.
    """
    held = {id(param) for group in optimizer.param_groups for param in group["params"]}
    if held != {id(param) for param in parameters}:
        raise ValueError(
            f"outer_optimizer holds {len(held)} parameters, the model {len(parameters)} trainable ones; "
            "expected an optimizer over exactly the model's parameters (default_outer_optimizer(model.parameters()))"
        )
