"""DiLoCo through gradq: hosts take ``sync_every`` local steps, then average their pseudo-gradients once.

DiLoCo (Douillard et al., arXiv 2311.08105) trades per-step averaging for an
outer step every H inner steps: each host trains its own copy of the model
with its inner optimizer (AdamW, say) on its own data, then every host pushes
its *pseudo-gradient* (the global parameters minus its local ones), the mean
of those becomes the gradient of an outer optimizer (Nesterov SGD), and every
host starts the next H steps from the new global parameters. The link carries
one compressed copy of the model each way per H steps instead of per step.

How it runs here:

- Each host is one member of an elastic gradq job (``elastic_hosts`` is the
  number of hosts the job starts with): a single process (plain ``python``, no
  process group needed), a DDP group inside the host (its ranks reduce the
  pseudo-gradient together and push one copy, as two-level aggregation
  does), or an FSDP2 group inside the host (each
  rank pushes the pseudo-gradient of its own shards, so the host pushes one
  copy of the model between its ranks, none gathered). The inner steps use
  the host's own collectives; only outer rounds cross the slow link.
- Outer round r is step r of the job; the model's trainable parameters are
  laid end to end in buckets of at most ``bucket_elements``, bucket k is round
  key k. Pseudo-gradients are compressed with the session's grid and error
  feedback (per parameter, kept across rounds and checkpoints).
- By default (``outer_step="aggregator"``) the outer step runs on the
  aggregator: the job's global parameters and outer momentum live there
  (gradq.server.outer_state), charged to its memory budget, and every host
  keeps the same copy by applying the same mean with the same float32
  operations (gradq.client.diloco.on_aggregator). A joiner takes the global
  state from the aggregator, with no donor host; a restarted aggregator is
  seeded again from the hosts' copies; hosts that start from different
  weights all take the first one's. The outer optimizer is SGD with momentum
  (Nesterov or not), read from ``outer_optimizer``.
- With ``outer_step="hosts"`` the aggregator only averages; every host
  applies the mean with its own ``outer_optimizer`` (any torch optimizer), and
  a joiner takes the state from a live host.
- Either way every host holds bit-identical global parameters after every
  outer round.
- A host lost mid-round is dropped by the aggregator, which finishes the round
  over the others. A host dropped because it fell silent (stopped, hung,
  partitioned) and then comes back finds its next push refused: it joins
  again as a joiner and takes the global state, never training on its own.
  A host that joins later receives the global state at the next outer-round
  boundary and is bit-identical from there on: from the aggregator's copy
  (the global parameters and momentum; its inner optimizer starts afresh, as
  every DiLoCo replica's is its own), or with ``outer_step="hosts"`` from a
  live host (the global parameters, the outer optimizer, the round counters,
  its model and inner optimizer).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradq.client.config import GradqConfig
from gradq.client.diloco.fragments import DEFAULT_BUCKET_ELEMENTS, FragmentSchedule, choose_buckets, split_buckets
from gradq.client.diloco.on_aggregator import GlobalState, outer_step_of
from gradq.client.elastic import JobWorld
from gradq.client.sending import AggregationError
from gradq.client.session import GradqSession
from gradq.client.session.elastic import check_shareable, model_signature
from gradq.client.session.host_groups import HostGroup
from gradq.client.session.job_steps import check_total, job_steps
from gradq.client.session.member import dropped_from_job
from gradq.client.session.training_log import TrainingSummary
from gradq.client.stats import ClientStats
from gradq.client.torch_support import is_fsdp2_module, require_torch
from gradq.qcore.outer_step import DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM

__all__ = ["DEFAULT_BUCKET_ELEMENTS", "OUTER_STEP_PLACES", "DiLoCo", "default_outer_optimizer"]

log = logging.getLogger(__name__)

OUTER_STEP_PLACES = ("aggregator", "hosts")  # where the outer step runs (see the module docstring)


def default_outer_optimizer(parameters: Iterator[nn.Parameter] | Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer unless the user brings one: SGD, lr 0.3, momentum 0.9, Nesterov.

    Not torchtitan's lr 0.7, which lost up to 62% held-out loss where 0.3 lost at most 4%
    (gradq.qcore.outer_step.DEFAULT_OUTER_LR says on what).
    """
    return torch.optim.SGD(parameters, lr=DEFAULT_OUTER_LR, momentum=DEFAULT_OUTER_MOMENTUM, nesterov=True)


class DiLoCo:
    """A training loop's outer rounds through gradq (see the module docstring); a context manager.

    Usage, the loop otherwise unchanged (``steps`` says why it iterates the job's steps)::

        with DiLoCo(GradqConfig.from_env(), model, inner_optimizer, sync_every=50) as diloco:
            for step in diloco.steps(total_steps):
                inputs, targets = batch_at(step)
                loss_fn(model(inputs), targets).backward()
                inner_optimizer.step()
                inner_optimizer.zero_grad()

    Args:
        config: the job's configuration; ``elastic_hosts`` is the number of
            hosts it starts with, and every host names the same job id.
        model: this host's model (a DDP module inside a host of several ranks).
        inner_optimizer: the optimizer of the local steps; every ``sync_every``
            of its steps end with an outer round.
        outer_optimizer: over ``model``'s parameters; None: ``default_outer_optimizer``.
        sync_every: H, the inner steps between outer rounds.
        process_group: the host's ranks (None: the default group of its own launch;
            a host of one process started without a launcher needs none).
        bucket_elements: the most elements one round key carries; None (the default):
            ``DEFAULT_BUCKET_ELEMENTS``, lowered with ``fragments`` > 1 until every
            fragment has a round key of its own.
        outer_step: where the outer step runs, one of ``OUTER_STEP_PLACES``:
            "aggregator" (the default; ``outer_optimizer`` must then be SGD
            without dampening or weight decay) or "hosts".

    Raises:
        ValueError: ``sync_every`` < 1, ``bucket_elements`` < 1, ``elastic_hosts`` unset,
            an outer optimizer over other parameters than the model's, an
            unknown ``outer_step``, or an outer optimizer or bit policy the
            aggregator does not run.
        quorum: 0 for synchronous outer rounds (each waits for every host);
            n >= 1 for semi-synchronous ones (outer_step="aggregator" only): a
            round closes once n hosts have pushed and ``grace_s`` more seconds
            have passed. A host late for a round has its pseudo-gradient merged
            into the next round, then takes the global state at the next
            boundary and trains on from it (``late_rounds`` counts these).
        grace_s: the grace window of a semi-synchronous round, seconds.
        fragments: Streaming DiLoCo (gradq.client.diloco.fragments): the round
            keys cut into this many fragments, each synced at its own inner step
            of every outer round; 1 (the default) syncs them all at once.
        fragment_sync_delay: inner steps a fragment's round stays in flight while
            the host trains on, before its update lands (below sync_every / fragments).
        fragment_update_alpha: where a fragment's update lands, the host keeps
            this share of its own parameters (0: it takes the global ones).
        token_weighted: each round's mean weights every host's pseudo-gradient
            by the tokens it trained on since its last push of that round key
            (``count_tokens``), instead of counting every host alike: a host on
            larger or longer batches moves the model in proportion. Every host
            of the job must say the same.
    """

    def __init__(
        self,
        config: GradqConfig,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        outer_optimizer: torch.optim.Optimizer | None = None,
        sync_every: int = 50,
        process_group: dist.ProcessGroup | None = None,
        bucket_elements: int | None = None,
        outer_step: str = "aggregator",
        quorum: int = 0,
        grace_s: float = 1.0,
        fragments: int = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        token_weighted: bool = False,
    ) -> None:
        require_torch("diloco")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every={sync_every!r} is invalid; expected an integer >= 1 (inner steps per round)")
        if bucket_elements is not None and (
            isinstance(bucket_elements, bool) or not isinstance(bucket_elements, int) or bucket_elements < 1
        ):
            raise ValueError(f"bucket_elements={bucket_elements!r} is invalid; expected an integer >= 1 (None: chosen)")
        if not config.elastic_hosts:
            raise ValueError(
                "elastic_hosts=0: DiLoCo's hosts are the members of an elastic job; set elastic_hosts "
                "(GRADQ_ELASTIC_HOSTS) to the number of hosts the job starts with"
            )
        if outer_step not in OUTER_STEP_PLACES:
            raise ValueError(f"outer_step={outer_step!r} is invalid; expected one of {list(OUTER_STEP_PLACES)}")
        if isinstance(quorum, bool) or not isinstance(quorum, int) or quorum < 0:
            raise ValueError(f"quorum={quorum!r} is invalid; expected 0 (synchronous) or the hosts a round needs")
        if quorum and outer_step != "aggregator":
            raise ValueError(
                f"quorum={quorum} needs outer_step='aggregator': a late host takes the global state from its copy"
            )
        if not (isinstance(grace_s, int | float) and 0 <= grace_s <= 3600):
            raise ValueError(f"grace_s={grace_s!r} is invalid; expected seconds in [0, 3600]")
        self._sharded = is_fsdp2_module(model)  # FSDP2 inside the host: each rank holds its own shards
        if self._sharded and outer_step != "aggregator":
            raise ValueError(
                "outer_step='hosts' with an FSDP2 model: its ranks hold shards, which a host-side torch optimizer "
                "would step apart; use outer_step='aggregator' (the default)"
            )
        if outer_step == "aggregator" and config.bit_policy == "adaptive":
            raise ValueError(
                "bit_policy='adaptive' plans new round keys every step; the aggregator's copy of the global "
                "state needs fixed ones: use bit_policy='uniform', or outer_step='hosts'"
            )
        self.config, self.model, self.inner_optimizer = config, model, inner_optimizer
        self.parameters = [param for param in model.parameters() if param.requires_grad]
        self.outer_optimizer = outer_optimizer or default_outer_optimizer(self.parameters)
        _check_outer_optimizer(self.outer_optimizer, self.parameters)
        self.sync_every, self.process_group = sync_every, process_group
        self.schedule = FragmentSchedule(sync_every, fragments, fragment_sync_delay, fragment_update_alpha)
        numels = [param.numel() for param in self.parameters]
        self.buckets = choose_buckets(numels, fragments, bucket_elements)  # [begin, end) of each round key
        self.outer_step = outer_step
        # outer_step="aggregator": this host's copy of the job's global state, as the aggregator holds it.
        self.on_aggregator: GlobalState | None = None
        if outer_step == "aggregator":
            self.on_aggregator = GlobalState(self.parameters, self.buckets, outer_step_of(self.outer_optimizer))
            self.global_parameters = self.on_aggregator.views  # float32 views of its flat buckets
        else:
            # The global parameters: where every host started this outer round from.
            self.global_parameters = [param.detach().clone() for param in self.parameters]
        self.outer_round = 0  # the next outer round: the job's step
        self.inner_steps = 0  # inner steps taken, in all
        self.session: GradqSession | None = None
        self.summary = TrainingSummary(self, "DiLoCo")  # rounds, rejoins, bytes: logged once at the end
        self.semi_sync = (quorum, float(grace_s)) if quorum else None
        sizes = [sum(numels[begin:end]) for begin, end in self.buckets]
        self.fragment_keys = split_buckets(sizes, fragments)  # the round keys of each fragment
        self._in_flight: tuple[int, list[Any]] | None = None  # a fragment whose round started, and its pushes
        self.token_weighted = bool(token_weighted)
        self.tokens = 0  # token_weighted: the tokens this rank has counted (count_tokens), in all
        self._tokens_at_push = [0] * len(self.buckets)  # ... when each round key was last pushed
        self._hook: Any = None

    # -- lifecycle --------------------------------------------------------------------------------

    def __enter__(self) -> DiLoCo:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def start(self) -> int:
        """Join the job (collective over the host's ranks); a joining host receives the global state first.

        Returns:
            The outer round this host trains towards: 0 for a host that starts
            the job, the live hosts' next round for one that joins it.

        Raises:
            AggregationError: the aggregator refused the Join or could not be
                reached (the message says what to check).
            RuntimeError: a launcher started several ranks, but torch.distributed is not initialized.
        """
        if self.session is None:
            self.session = self._connect()
            self._enter()
            self._hook = self.inner_optimizer.register_step_post_hook(self._after_inner_step)
        return self.outer_round

    def steps(self, total: int) -> Iterator[int]:
        """The job's inner steps this host trains, up to ``total``: ``for step in diloco.steps(total):``.

        Starts first, as ``start()`` does, if it has not started. Each
        iteration is one inner step (the inner optimizer's ``step()``); every
        ``sync_every``-th ends with an outer round. A host dropped from the job
        (silent past the keepalive) or late for a semi-synchronous round takes
        the global state at the round the others have reached; the next step
        yielded is that round's first (``outer_round * sync_every``), so the
        host never repeats or skips one of the job's steps and stops with the
        others at ``total``. A loop that counts its own steps (or its batches)
        goes on from its own count instead and trains past the job's end, alone
        once the others have left. A joiner that receives the state at
        ``total`` or later yields nothing.

        Args:
            total: the inner step the job ends at (``rounds * sync_every`` for ``rounds`` outer rounds).

        Returns:
            An iterator of the inner steps to train; ``inner_steps`` also holds the step being trained.

        Raises:
            ValueError: ``total`` is not an integer >= 0.
        """
        check_total(total)
        return self._steps(total)

    def _steps(self, total: int) -> Iterator[int]:
        self.start()
        yield from job_steps(self.inner_steps, total, lambda: self.inner_steps, lambda: self.rejoins + self.late_rounds)

    def count_tokens(self, tokens: int) -> None:
        """With ``token_weighted``: this rank's inner step trained on ``tokens`` more (call it once per step).

        What a host pushes a round key with is the tokens its ranks counted
        since that key's last push; its pseudo-gradient then weighs that much
        in the key's mean (gradq's aggregator divides by the sum).

        Raises:
            ValueError: ``tokens`` is not an integer >= 0, or the job is not ``token_weighted``.
        """
        if not self.token_weighted:
            raise ValueError("count_tokens: this DiLoCo is not token_weighted; its means count every host alike")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens={tokens!r} is invalid; expected an integer >= 0 (this inner step's tokens)")
        self.tokens += tokens

    def _push_weights(self, keys: Sequence[int]) -> list[int]:
        """The weight of each round key's push now: the host's tokens since that key's last push (0: unweighted).

        Raises:
            ValueError: a key's host trained on no token since its last push (``count_tokens`` was not called).
        """
        if not self.token_weighted:
            return [0] * len(keys)
        counted = torch.tensor([self.tokens - self._tokens_at_push[key] for key in keys], dtype=torch.int64)
        session = self._connected()
        if session.host.local_size > 1 and session.group is not None:  # the host's ranks trained on their own batches
            dist.all_reduce(counted, group=session.group)
        weights = [int(weight) for weight in counted.tolist()]
        if min(weights) < 1:
            raise ValueError(
                f"token_weighted=True, but this host counted {min(weights)} tokens for outer round "
                f"{self.outer_round}; call diloco.count_tokens(n) after every inner step with the tokens it trained on"
            )
        for key in keys:
            self._tokens_at_push[key] = self.tokens
        return weights

    def _restart_token_counts(self) -> None:
        """The host takes the job's state: what it trained before is not in it, so no later push weighs it."""
        self._tokens_at_push = [self.tokens] * len(self.buckets)

    def _connect(self) -> GradqSession:
        state = self.on_aggregator
        session = GradqSession.connect(
            self.config,
            self.process_group,
            host=self._host_of_shards() if self._sharded else None,
            model_signature=model_signature(self._shared()),
            outer_step=state.step if state is not None else None,
            semi_sync=self.semi_sync,
            weighted=self.token_weighted,
        )
        if session.mode != "gradq":
            raise RuntimeError(
                f"DiLoCo cannot fall back ({session.mode!r}): its hosts have no common process group "
                f"across the link; start the aggregator, or set fallback='error' to be told at once"
            )
        self.summary.attach(session.events)
        return session

    def _host_of_shards(self) -> HostGroup:
        """An FSDP2 host: its ranks are one member, each pushing its own shards whole (see HostGroup.sharded)."""
        group = self.process_group
        if group is None and dist.is_initialized():
            group = dist.group.WORLD
        if group is None:
            raise RuntimeError(
                "DiLoCo over an FSDP2 model: its ranks hold the shards, and torch.distributed is not initialized; "
                "expected torch.distributed.init_process_group() (as FSDP2 itself needs) or process_group="
            )
        size = dist.get_world_size(group)
        return HostGroup(0, self.config.elastic_hosts, dist.get_rank(group), size, size, None, None, sharded=True)

    def _enter(self) -> None:
        """A joiner takes the global state (from the aggregator or a live host); a starting host seeds it."""
        session, state = self._connected(), self.on_aggregator
        if self.semi_sync is not None and session.host.local_size > 1:
            raise ValueError(
                f"quorum={self.semi_sync[0]}: semi-synchronous rounds take hosts of one process each; this host "
                f"has {session.host.local_size} ranks"
            )
        if self.semi_sync is not None and session.member.shards > 1:
            raise ValueError(
                f"quorum={self.semi_sync[0]}: semi-synchronous rounds run on one aggregator; this job has "
                f"{session.member.shards} shards (a late host would be late on some of them and not on others)"
            )
        self._restart_token_counts()
        if state is None:
            self.outer_round = session.member.receive(self._shared(), self.outer_round)
            return
        if session.member.joining:
            self.outer_round = state.receive(session)
            self.inner_steps = self.outer_round * self.sync_every
        else:
            state.seed(session, self.outer_round)

    def close(self) -> None:
        """Stop syncing and leave the job; idempotent. Logs the run's summary (once)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.session is not None:
            self.session.close()
        self.summary.close()

    @property
    def rejoins(self) -> int:
        """Times this host was dropped (silent past the keepalive) and joined again."""
        return self.summary.rejoins

    @property
    def late_rounds(self) -> int:
        """Semi-synchronous: rounds this host was late for (merged, then it took the state)."""
        return self.summary.late_rounds

    # -- the outer round --------------------------------------------------------------------------

    def _after_inner_step(self, *_: Any) -> None:
        self.inner_steps += 1
        self.summary.steps += 1
        if self.schedule.fragments == 1:
            if self.inner_steps % self.sync_every == 0:
                self.sync()
            return
        try:
            started = self.schedule.starts(self.inner_steps)
            if started is not None:
                self._in_flight = (started, self._start(self.fragment_keys[started]))
            landed = self.schedule.lands(self.inner_steps)
            if landed is not None and self._in_flight is not None:
                fragment, pushed = self._in_flight
                self._in_flight = None
                self._land(self.fragment_keys[fragment], pushed, last=fragment == self.schedule.fragments - 1)
        except AggregationError as error:
            self._in_flight = None
            if not dropped_from_job(error):
                raise
            self._rejoin(error)

    @torch.no_grad()
    def sync(self) -> None:
        """One outer round now: push the pseudo-gradients, apply the mean with the outer optimizer.

        Called by the inner optimizer's step every ``sync_every`` steps; call it
        by hand only for an extra round every host takes at the same point.

        Raises:
            AggregationError: the round failed (the message names it and why).
            RuntimeError: with fragments, whose rounds follow the schedule alone.
        """
        if self.schedule.fragments > 1:
            raise RuntimeError(
                f"sync() runs every round key at once; with fragments={self.schedule.fragments} each fragment's "
                f"round runs at its own inner step"
            )
        try:
            every = list(range(len(self.buckets)))
            self._land(every, self._start(every), last=True)
        except AggregationError as error:
            if not dropped_from_job(error):
                raise
            self._rejoin(error)

    @torch.no_grad()
    def _start(self, keys: Sequence[int]) -> list[Any]:
        """Push the pseudo-gradients of round keys ``keys`` for this outer round; returns their futures."""
        session, state = self._connected(), self.on_aggregator
        step = self.outer_round
        pushed = []
        for key, weight in zip(keys, self._push_weights(keys), strict=True):
            begin, end = self.buckets[key]
            if state is not None:
                # The tensors this rank holds (an FSDP2 rank's local shards): its error feedback follows them.
                pseudo = state.pseudo_gradient(key)
                pushed.append(session.reduce(pseudo, step, key, parameters=state.parameters[begin:end], weight=weight))
                continue
            params = self.parameters[begin:end]
            pseudo = torch.cat(
                [
                    (start.float() - param.detach().float()).reshape(-1)
                    for param, start in zip(params, self.global_parameters[begin:end], strict=True)
                ]
            )
            pushed.append(session.reduce(pseudo, step, key, parameters=params, weight=weight))
        session.end_step()
        return pushed

    @torch.no_grad()
    def _land(self, keys: Sequence[int], pushed: Sequence[Any], last: bool) -> None:
        """Take round keys ``keys``' means (the futures ``pushed``) into the global parameters and the model.

        ``last``: this completes the outer round (every fragment has landed).
        """
        if self.on_aggregator is not None:
            self._land_on_aggregator(self.on_aggregator, keys, pushed, last)
            return
        session, alpha = self._connected(), self.schedule.alpha
        means = [future.wait() for future in pushed]  # every bucket is in flight before the first wait
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
        self.outer_optimizer.step()  # the parameters without a gradient (other fragments') stay as they are
        self.outer_optimizer.zero_grad(set_to_none=True)
        for index, grad in others.items():
            self.parameters[index].grad = grad
        for index in landed:
            self.global_parameters[index].copy_(self.parameters[index])
        if alpha:
            for index, mine in zip(landed, own, strict=True):
                self.parameters[index].lerp_(mine.to(self.parameters[index].dtype), alpha)
        if last:
            self.outer_round += 1
            self.summary.rounds += 1
            # The boundary a joiner enters at: the model holds the new global parameters.
            session.member.serve_joiners(self._shared(), self.outer_round)

    def _land_on_aggregator(self, state: GlobalState, keys: Sequence[int], pushed: Sequence[Any], last: bool) -> None:
        session = self._connected()
        received, late = [], []
        for future in pushed:  # every bucket is in flight before the first wait
            try:
                received.append(future.wait())
            except AggregationError as error:
                if not _late(error):
                    raise
                late.append(error)
        if late:
            self._catch_up(state, late[0])
            return
        for key, mean in zip(keys, received, strict=True):
            state.apply(key, mean)
        state.load_into_model(keys, self.schedule.alpha)
        if not last:
            return
        self.outer_round += 1
        self.summary.rounds += 1
        if session.member.joins != state.seeded_joins:
            # The worker client joined again: a restarted aggregator, which holds no global state. Seed it.
            log.warning("the aggregator of %s was restarted; seeding it with this host's global state", session.job_id)
            state.seed(session, self.outer_round)

    def _catch_up(self, state: GlobalState, error: AggregationError) -> None:
        """Semi-synchronous: this host was late; its pushes were merged. Take the state at the next boundary."""
        log.warning(
            "late for outer round %d of %s (%s); taking the global state",
            self.outer_round,
            self.config.job_id,
            error.details,
        )
        self.outer_round = state.receive(self._connected())
        self.inner_steps = self.outer_round * self.sync_every
        self._restart_token_counts()
        self._in_flight = None  # the rounds of this outer round it had started are the job's past now
        self.summary.late_rounds += 1

    def _rejoin(self, error: AggregationError) -> None:
        """This host was dropped (it fell silent past the keepalive): join again as a joiner, take the state.

        Its local steps of the round it missed are dropped with it: it
        continues from the global state a live host sends, never from its own.
        """
        session = self._connected()
        log.warning(
            "this host was dropped from job %s (%s); rejoining as a joiner, it takes the global state",
            session.job_id,
            error.details,
        )
        session.close()
        self.session = self._connect()
        self._enter()
        self.summary.rejoins += 1
        log.warning(
            "rejoined job %s at outer round %d (rejoins so far: %d)", session.job_id, self.outer_round, self.rejoins
        )

    # -- state ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The outer loop's state for a checkpoint: rounds, global parameters, outer optimizer, error feedback.

        The model and the inner optimizer are checkpointed beside it as usual.
        """
        if self.schedule.fragments > 1 and self.inner_steps % self.sync_every:
            # Mid-round some fragments stand at the next outer round and others not, and one may be in flight.
            raise RuntimeError(
                f"with fragments={self.schedule.fragments}, checkpoint at a multiple of sync_every="
                f"{self.sync_every} inner steps (now {self.inner_steps}), where every fragment stands at the same "
                f"outer round and none is in flight"
            )
        session = self.session
        return {
            **_GlobalState(self).state_dict(),
            "residuals": session.residuals.state_dict() if session is not None else {},
            "tokens": self.tokens,
            "tokens_at_push": list(self._tokens_at_push),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back ``state_dict()``'s output (before or after ``start()``).

        Raises:
            ValueError: a key is missing, or the global parameters differ in number or shape.
        """
        _GlobalState(self).load_state_dict(state)
        self.tokens = int(state.get("tokens", 0))
        marks = state.get("tokens_at_push", [self.tokens] * len(self.buckets))
        if len(marks) != len(self.buckets):
            raise ValueError(
                f"state['tokens_at_push'] holds {len(marks)} counts; expected one per round key ({len(self.buckets)})"
            )
        self._tokens_at_push = [int(mark) for mark in marks]
        residuals = state.get("residuals", {})
        if residuals:
            session = self._connected()
            session.residuals.load_state_dict(residuals)
        if self.on_aggregator is not None:
            self.on_aggregator.load_into_model()
            if self.session is not None:  # the aggregator's copy becomes the checkpoint's round
                self.on_aggregator.seed(self.session, self.outer_round)

    def matches_aggregator(self) -> bool:
        """Whether the aggregator holds this host's global parameters and outer momentum, bit for bit.

        A check for tests and operators (it sends the host's copy, one model's
        worth); with ``outer_step="hosts"`` the aggregator holds none: False.
        """
        if self.on_aggregator is None:
            return False
        return self.on_aggregator.matches(self._connected(), self.outer_round)

    def world(self) -> JobWorld | None:
        """The job's hosts now and the ranks they stand for, as last announced."""
        return self.session.world() if self.session is not None else None

    def stats(self) -> ClientStats | None:
        """The worker client's figures (bytes each way, rounds)."""
        return self.session.stats() if self.session is not None else None

    def _shared(self) -> list[Any]:
        """What a joining host receives from a live host: the outer loop's state, the model, the inner optimizer.

        With the outer step on the aggregator, a joiner receives the global
        state from it instead; the model alone then names the job's model.
        """
        if self.on_aggregator is not None:
            return check_shareable([self.model])
        return check_shareable([_GlobalState(self), self.model, self.inner_optimizer])

    def _connected(self) -> GradqSession:
        if self.session is None:
            raise RuntimeError("DiLoCo is not started; use it as a context manager or call start() first")
        return self.session


class _GlobalState:
    """The part of DiLoCo every host holds alike: what a joiner receives (error feedback is each host's own)."""

    def __init__(self, diloco: DiLoCo) -> None:
        self.diloco = diloco

    def state_dict(self) -> dict[str, Any]:
        diloco = self.diloco
        counters = {"outer_round": diloco.outer_round, "inner_steps": diloco.inner_steps}
        if diloco.on_aggregator is not None:
            return {**counters, **diloco.on_aggregator.state_dict()}
        return {
            **counters,
            "global_parameters": [start.clone() for start in diloco.global_parameters],
            "outer_optimizer": diloco.outer_optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        diloco = self.diloco
        outer = "outer_momentum" if diloco.on_aggregator is not None else "outer_optimizer"
        missing = sorted({"outer_round", "inner_steps", "global_parameters", outer} - set(state))
        if missing:
            raise ValueError(
                f"state lacks {', '.join(missing)}; expected the output of DiLoCo.state_dict() with "
                f"outer_step={diloco.outer_step!r}"
            )
        if diloco.on_aggregator is not None:
            diloco.on_aggregator.load_state_dict(state)
            diloco.outer_round, diloco.inner_steps = int(state["outer_round"]), int(state["inner_steps"])
            return
        saved = state["global_parameters"]
        shapes = [tuple(start.shape) for start in diloco.global_parameters]
        if [tuple(start.shape) for start in saved] != shapes:
            raise ValueError(
                f"state['global_parameters'] holds {len(saved)} tensors of shapes "
                f"{[tuple(start.shape) for start in saved][:4]}...; expected {len(shapes)} of {shapes[:4]}..."
            )
        for start, value in zip(diloco.global_parameters, saved, strict=True):
            start.copy_(value)
        diloco.outer_optimizer.load_state_dict(state["outer_optimizer"])
        diloco.outer_round, diloco.inner_steps = int(state["outer_round"]), int(state["inner_steps"])


def _late(error: AggregationError) -> bool:
    """This host takes the job's state at the next outer-round boundary instead of its round's mean.

    LATE: the aggregator closed a semi-synchronous round without this host and
    merged its push into the next. BEHIND: the job's global state is past this
    host's outer round (another host seeded or pushed a later one, see
    gradq.server.outer_state); the aggregator made it pending, as a late host.
    """
    return error.refusal in ("LATE", "BEHIND")


def _check_outer_optimizer(optimizer: torch.optim.Optimizer, parameters: Sequence[nn.Parameter]) -> None:
    held = {id(param) for group in optimizer.param_groups for param in group["params"]}
    if held != {id(param) for param in parameters}:
        raise ValueError(
            f"outer_optimizer holds {len(held)} parameters, the model {len(parameters)} trainable ones; "
            "expected an optimizer over exactly the model's parameters (default_outer_optimizer(model.parameters()))"
        )
