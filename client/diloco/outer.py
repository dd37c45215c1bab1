"""The ``DiLoCo`` class: a thin loop of outer rounds over its parts (the package docstring says how it runs).

Each inner step's hook counts the step; every ``sync_every`` steps (or at
each fragment's own steps) it pushes the pseudo-gradients, waits for the
means and applies them where the outer step runs (``on_aggregator`` or
``on_hosts``); a host late or dropped takes the job's state (``joining``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradq.client.config import GradqConfig
from gradq.client.diloco import checkpoint, joining
from gradq.client.diloco.checkpoint import SharedOuterState
from gradq.client.diloco.fragments import DEFAULT_BUCKET_ELEMENTS, choose_buckets, split_buckets
from gradq.client.diloco.on_aggregator import GlobalState, outer_step_of
from gradq.client.diloco.on_hosts import HostsOuterStep
from gradq.client.diloco.options import OUTER_STEP_PLACES, DiLoCoOptions, check_outer_optimizer, default_outer_optimizer
from gradq.client.diloco.tokens import TokenCount
from gradq.client.elastic import JobWorld
from gradq.client.sending import AggregationError
from gradq.client.session import GradqSession
from gradq.client.session.elastic import check_shareable
from gradq.client.session.job_steps import check_total, job_steps
from gradq.client.session.member import dropped_from_job
from gradq.client.session.training_log import TrainingSummary
from gradq.client.stats import ClientStats
from gradq.client.torch_support import is_fsdp2_module, require_torch

__all__ = ["DEFAULT_BUCKET_ELEMENTS", "OUTER_STEP_PLACES", "DiLoCo", "default_outer_optimizer"]

log = logging.getLogger(__name__)


class DiLoCo:
    """A training loop's outer rounds through gradq (see gradq.client.diloco); a context manager.

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
        outer_optimizer: over ``model``'s parameters; None: ``default_outer_optimizer`` (for ``config.quant``).
        process_group: the host's ranks (None: the default group of its own launch;
            a host of one process started without a launcher needs none).
        sync_every, bucket_elements, outer_step, quorum, grace_s, fragments, fragment_sync_delay,
            fragment_update_alpha, token_weighted: the fields of
            ``gradq.client.diloco.options.DiLoCoOptions``, which says what each does.
            A late host of semi-synchronous rounds (``quorum``) takes the global
            state at the next boundary (``late_rounds`` counts these); a
            ``token_weighted`` host counts its tokens with ``count_tokens``, and
            every host of the job must say the same.

    Raises:
        ValueError: an option out of range (named by ``DiLoCoOptions``), ``elastic_hosts``
            unset, an outer optimizer over other parameters than the model's, or an
            outer optimizer or bit policy the aggregator does not run.
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
        self.options = DiLoCoOptions(
            sync_every=sync_every,
            bucket_elements=bucket_elements,
            outer_step=outer_step,
            quorum=quorum,
            grace_s=grace_s,
            fragments=fragments,
            fragment_sync_delay=fragment_sync_delay,
            fragment_update_alpha=fragment_update_alpha,
            token_weighted=token_weighted,
        )
        self.sharded = is_fsdp2_module(model)  # FSDP2 inside the host: each rank holds its own shards
        self.options.check_against(config, self.sharded)
        self.config, self.model, self.inner_optimizer = config, model, inner_optimizer
        self.parameters = [param for param in model.parameters() if param.requires_grad]
        self.outer_optimizer = outer_optimizer or default_outer_optimizer(self.parameters, config.quant)
        check_outer_optimizer(self.outer_optimizer, self.parameters)
        self.sync_every, self.process_group = sync_every, process_group
        self.schedule = self.options.schedule()
        numels = [param.numel() for param in self.parameters]
        self.buckets = choose_buckets(numels, fragments, bucket_elements)  # [begin, end) of each round key
        sizes = [sum(numels[begin:end]) for begin, end in self.buckets]
        self.fragment_keys = split_buckets(sizes, fragments)  # the round keys of each fragment
        self.outer_step = outer_step
        # Where the outer step runs: this host's copy of the aggregator's global state, or its own optimizer.
        self.on_aggregator: GlobalState | None = None
        self.on_hosts: HostsOuterStep | None = None
        self.outer_state: GlobalState | HostsOuterStep  # the one of the two that is not None
        if outer_step == "aggregator":
            self.outer_state = self.on_aggregator = GlobalState(
                self.parameters, self.buckets, outer_step_of(self.outer_optimizer)
            )
            self.global_parameters = self.on_aggregator.views  # float32 views of its flat buckets
        else:
            self.outer_state = self.on_hosts = HostsOuterStep(self.parameters, self.buckets, self.outer_optimizer)
            self.global_parameters = self.on_hosts.global_parameters
        self.outer_round = 0  # the next outer round: the job's step
        self.inner_steps = 0  # inner steps taken, in all
        self.session: GradqSession | None = None
        self.summary = TrainingSummary(self, "DiLoCo")  # rounds, rejoins, bytes: logged once at the end
        self.token_count = TokenCount(token_weighted, len(self.buckets))
        self._in_flight: tuple[int, list[Any]] | None = None  # a fragment whose round started, and its pushes
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
            self.session = joining.connect(self)
            joining.enter(self, self.session)
            self._hook = self.inner_optimizer.register_step_post_hook(self._after_inner_step)
        return self.outer_round

    def steps(self, total: int) -> Iterator[int]:
        """The job's inner steps this host trains, up to ``total``: ``for step in diloco.steps(total):``.

        Starts first, as ``start()`` does, if it has not started. Each
        iteration is one inner step (the inner optimizer's ``step()``); every
        ``sync_every``-th ends with an outer round. A host that took the job's
        state (dropped and rejoined, or late) goes on from the round the others
        reached, never repeating or skipping one of the job's steps, and stops
        with them at ``total`` (gradq.client.session.job_steps says why a loop
        counting its own steps would not).

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
        since that key's last push (gradq.client.diloco.tokens).

        Raises:
            ValueError: ``tokens`` is not an integer >= 0, or the job is not ``token_weighted``.
        """
        self.token_count.count(tokens)

    @property
    def tokens(self) -> int:
        """With ``token_weighted``: the tokens this rank has counted, in all."""
        return self.token_count.tokens

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
            self.session = joining.rejoin(self, self._connected(), error)

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
            self.session = joining.rejoin(self, self._connected(), error)

    @torch.no_grad()
    def _start(self, keys: Sequence[int]) -> list[Any]:
        """Push the pseudo-gradients of round keys ``keys`` for this outer round; returns their futures."""
        session, state = self._connected(), self.outer_state
        weights = self.token_count.weights(keys, session, self.outer_round)
        pushed = []
        for key, weight in zip(keys, weights, strict=True):
            begin, end = self.buckets[key]
            # The tensors this rank holds (an FSDP2 rank's local shards): its error feedback follows them.
            pseudo, params = state.pseudo_gradient(key), state.parameters[begin:end]
            pushed.append(session.reduce(pseudo, self.outer_round, key, parameters=params, weight=weight))
        session.end_step()
        return pushed

    @torch.no_grad()
    def _land(self, keys: Sequence[int], pushed: Sequence[Any], last: bool) -> None:
        """Take round keys ``keys``' means (the futures ``pushed``) into the global parameters and the model.

        ``last``: this completes the outer round (every fragment has landed).
        """
        if self.on_hosts is None:
            assert self.on_aggregator is not None  # one of the two, chosen by outer_step
            self._land_on_aggregator(self.on_aggregator, keys, pushed, last)
            return
        means = [future.wait() for future in pushed]  # every bucket is in flight before the first wait
        self.on_hosts.apply(keys, means, self.schedule.alpha)
        if last:
            self.outer_round += 1
            self.summary.rounds += 1
            # The boundary a joiner enters at: the model holds the new global parameters.
            self._connected().member.serve_joiners(self.shared(), self.outer_round)

    def _land_on_aggregator(self, state: GlobalState, keys: Sequence[int], pushed: Sequence[Any], last: bool) -> None:
        session = self._connected()
        received, late = joining.wait_for_means(pushed)
        if late is not None:
            self._in_flight = None  # the rounds of this outer round it had started are the job's past now
            joining.catch_up(self, session, state, late)
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

    # -- state ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The outer loop's state for a checkpoint (gradq.client.diloco.checkpoint says what it holds).

        Raises:
            RuntimeError: with fragments, not at a multiple of ``sync_every`` inner steps.
        """
        return checkpoint.state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back ``state_dict()``'s output (before or after ``start()``).

        Raises:
            ValueError: a key is missing, or the global parameters differ in number or shape.
        """
        checkpoint.load_state_dict(self, state)

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

    def shared(self) -> list[Any]:
        """What a joining host receives from a live host: the outer loop's state, the model, the inner optimizer.

        With the outer step on the aggregator, a joiner receives the global
        state from it instead; the model alone then names the job's model.
        """
        if self.on_aggregator is not None:
            return check_shareable([self.model])
        return check_shareable([SharedOuterState(self), self.model, self.inner_optimizer])

    def _connected(self) -> GradqSession:
        if self.session is None:
            raise RuntimeError("DiLoCo is not started; use it as a context manager or call start() first")
        return self.session
