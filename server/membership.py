"""Membership: a job's members, fixed or elastic, and which contributions complete, or may close, its rounds.

Thread model: a ``Membership`` belongs to one job and is guarded by the job
table's lock. Every method is called with that lock held (by the job table,
liveness, the state relay and the round logic, each briefly) and none blocks,
takes another lock or does I/O. The round logic asks ``complete`` and
``missing`` while it holds a round's lock, taking the table's lock after it
(the table's lock order); a fixed job's ``complete`` reads only what never
changes in a run, so it needs no lock.

A fixed job has ``world_size`` members, ids 0..world_size-1, for the whole run:
a round waits for all of them, and a member lost (its Watch stream ended
without a Leave) stays in ``lost`` until it rejoins, so that the rounds waiting
on it fail, naming it, unless a partial quorum closes them over the others.

An elastic job is formed once ``world_size`` members have joined. From then on
a round waits for the members training now (``joined``); a lost member is
dropped (and shown as lost) and the others go on; a newcomer is pending until
a live member has sent it the training state (gradq.server.state_relay), when
``admit`` moves it into the members training. Member ids pass ``world_size``
as hosts are replaced.

Which model an elastic job trains is its start quorum's: while it forms,
each host's model signature is a candidate; the first signature that a
majority of the ``world_size`` starting hosts share becomes the job's, and the
members that joined with another are refused by name (``refused``). A Join
that meets a disagreement no majority has settled yet waits (the servicer
holds it) rather than letting the fastest host decide. A starting host refused
for its model is a lost host: the job forms with the others, as a formed job
goes on after losing one, instead of waiting for a host that never comes.

Each member stands for ``ranks`` of the job's ranks: one, or a host's under
two-level aggregation. ``job_ranks`` is the job's ranks in all (what the
launcher calls the world size, and what gradq serve --world-size counts).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from gradq.server.errors import FailedPreconditionError, Refusal, ResourceExhaustedError
from gradq.server.job_spec import ANY_RANK

__all__ = ["ANY_RANK", "Membership", "MemberStates", "describe_model_difference"]


@dataclass(frozen=True, slots=True)
class MemberStates:
    """Each member that joined a run, by what it is doing now (for the status page); ascending ids."""

    training: tuple[int, ...]  # joined, neither left nor lost; the members a round waits for
    pending: tuple[int, ...]  # elastic newcomers waiting for the training state
    left: tuple[int, ...]  # left with a Leave
    lost: tuple[int, ...]  # their Watch stream ended without a Leave


@dataclass(eq=False, slots=True)
class Membership:
    """Who the members of one run of a job are, and what its rounds wait for. Guarded by the job table's lock."""

    world_size: int  # members the job starts with (a fixed job's, for the whole run)
    job_ranks: int  # the ranks the job has in all; its members stand for them
    job_ranks_given: bool = False  # the Joins said job_ranks (0 on the wire: world_size, not checked)
    elastic: bool = False
    max_members: int = 0  # elastic: the most members at once, the user's cap (0: only --max-world-size)
    model_signature: str = ""  # elastic: the hosts' shared model, fixed by the start quorum (see check_model)
    # Elastic, while the model is not fixed: member -> the signature it joined with (the candidates).
    models: dict[int, str] = field(default_factory=dict)
    # Member -> why it may not train in this run: its model is not the one the start quorum agreed on.
    refused: dict[int, str] = field(default_factory=dict)
    resumed: bool = False  # a member that trained in this run joined it: hosts hold its state, so it is the job's
    # A run resumed on a shard that lost it re-forms once this many members are back (0: world_size): the fewest
    # members a resuming member said were training (members lost meanwhile never come back under their ids).
    reform_at: int = 0
    formed: bool = False  # elastic: world_size members have joined, so rounds wait for the members training
    joined: set[int] = field(default_factory=set)  # the members training
    # Member -> how many ranks it stands for (a host's under two-level aggregation; 1 by default).
    ranks: dict[int, int] = field(default_factory=dict)
    # Fixed: member -> why it is considered lost; its rounds cannot complete. A Join clears it.
    lost: dict[int, str] = field(default_factory=dict)
    pending: dict[int, int] = field(default_factory=dict)  # elastic: newcomer -> ranks, until it has the state
    dropped: set[int] = field(default_factory=set)  # elastic: members lost and dropped; a Join clears it
    # Member -> its tenure: a number drawn anew whenever an id is taken by a holder that was not a member
    # (a first Join, or one after a Leave or a loss). A Watch vouches for the tenure it opened under, so
    # the end of a former holder's stream never hits the id's new holder.
    tenures: dict[int, int] = field(default_factory=dict)
    # Semi-synchronous: member -> the step it was late for; pending until the next boundary, and its other
    # pushes of that step are still merged (gradq.server.semi_sync).
    late: dict[int, int] = field(default_factory=dict)
    _tenures_drawn: int = 0

    # -- who is a member ------------------------------------------------------------------

    def check_join(
        self, world_size: int, job_ranks: int, ranks: int, describe: Callable[[], str], max_members: int = 0
    ) -> None:
        """Refuse a Join whose view of the job disagrees with this run's.

        Args:
            world_size: the Join's members.
            job_ranks: the Join's ranks in all (0: not given).
            ranks: the ranks the joining member stands for.
            describe: names the job, for messages.
            max_members: the Join's cap on an elastic job's members (0: none).

        Raises:
            FailedPreconditionError: world_size, job_ranks, the cap, or an elastic host's ranks disagree.
        """
        if world_size != self.world_size:
            raise FailedPreconditionError(
                f"world_size={world_size} (the host's elastic_hosts, GRADQ_ELASTIC_HOSTS) does not match elastic "
                f"{describe()}, which starts with {self.world_size} hosts (elastic_hosts={self.world_size}); every "
                "host of an elastic job must set the same"
                if self.elastic
                else f"world_size={world_size} does not match {describe()}, which has world_size={self.world_size}"
            )
        if (job_ranks or world_size) != self.job_ranks:
            raise FailedPreconditionError(
                f"job_ranks={job_ranks or world_size} does not match {describe()}, which has "
                f"job_ranks={self.job_ranks} (the ranks of the whole job); every rank must say the same"
            )
        if max_members != self.max_members:
            raise FailedPreconditionError(
                f"elastic_max_hosts={max_members} does not match {describe()}, which holds at most "
                f"{self.max_members or 'any number of'} hosts (elastic_max_hosts={self.max_members}); "
                f"every host of a job must say the same"
            )
        held = set(self.ranks.values())
        if self.elastic and held and held != {ranks}:
            raise FailedPreconditionError(
                f"ranks={ranks} does not match elastic {describe()}, whose hosts hold {held.pop()} ranks "
                f"each; every host of an elastic job holds as many (its buckets are cut into that many pieces)"
            )

    def check_model(self, signature: str, describe: Callable[[], str]) -> None:
        """Refuse a host whose model differs from the job's, once the job's is fixed (see ``decide_model``).

        Raises:
            FailedPreconditionError: the signatures differ (MODEL_MISMATCH); names the first line that does.
        """
        if signature and self.model_signature and signature != self.model_signature:
            raise FailedPreconditionError(
                describe_model_difference(signature, self.model_signature, describe), Refusal.MODEL_MISMATCH
            )

    def propose_model(self, member: int, signature: str) -> None:
        """Record the model ``member`` joined with while the job's is not fixed yet (a fixed job: fix it)."""
        if not signature or self.model_signature:
            return
        if not self.elastic:
            self.model_signature = signature
            return
        self.models[member] = signature
        self.refused.pop(member, None)

    def decide_model(self, describe: Callable[[], str]) -> list[int]:
        """Fix the job's model once a majority of its starting hosts agree; refuse the members that differ.

        Unanimous members fix it too once the job forms (a host joining later is then checked by
        ``check_model``). A majority is ``world_size // 2 + 1`` of the hosts the job starts with, so two
        signatures can never both reach it: every shard, whatever order the Joins reach it in, decides the same.

        Returns:
            The members refused now (their rounds in flight must fail; their next calls are refused by name).
        """
        if self.model_signature or not self.models:
            return []
        holders = {member: model for member, model in self.models.items() if self.holds(member, pending_ok=True)}
        counts = Counter(holders.values())
        model, count = counts.most_common(1)[0]
        if count < self.world_size // 2 + 1 and not (len(counts) == 1 and self.formed):
            return []
        self.model_signature = model
        refused = sorted(member for member, theirs in holders.items() if theirs != model)
        for member in refused:
            message = describe_model_difference(holders[member], model, describe)
            self.refused[member] = (
                f"{message} (the model {count} of the {self.world_size} hosts it starts with agree on); member "
                f"{member} is refused and the job goes on without it, with the hosts that agree"
            )
            self.joined.discard(member)
            self.pending.pop(member, None)
        self.models.clear()
        self._form()
        return refused

    def refuse_starter(self, rank: int, reason: str, limit: int, describe: Callable[[], str]) -> int | None:
        """A starting host whose model is not the job's (decided already) joined while the job forms: it is lost.

        It takes an id (``rank``, or the lowest free for ANY_RANK) that stays refused for this run, so the
        job forms without it (``_form``). A host that asks again with ANY_RANK takes another id; that can
        only make the job form sooner, never with fewer than a majority of the hosts it starts with.

        Returns:
            The id refused, or None: the id is a member's, or every id is taken (nothing changes).
        """
        if not self.elastic or self.formed:
            return None
        if rank == ANY_RANK:
            try:
                rank = self._lowest_free(limit, describe)
            except ResourceExhaustedError:
                return None
        elif self.holds(rank, pending_ok=True):
            return None
        self.refused[rank] = reason
        self._form()
        return rank

    def model_undecided(self, member: int) -> bool:
        """Whether ``member`` joined with a model that disagrees with another member's, and no majority has
        settled which is the job's yet (its Join waits for the decision)."""
        mine = self.models.get(member)
        return (
            mine is not None
            and not self.model_signature
            and any(theirs != mine for other, theirs in self.models.items() if self.holds(other, pending_ok=True))
        )

    def forget_candidate(self, member: int) -> None:
        """A waiting Join gave up before the model was decided: ``member`` is no member of this run."""
        if self.models.pop(member, None) is not None:
            self.joined.discard(member)
            self.pending.pop(member, None)

    def place(
        self,
        rank: int,
        ranks: int,
        max_members: int,
        describe: Callable[[], str],
        pending: bool = False,
        signature: str = "",
    ) -> tuple[int, bool]:
        """Make ``rank`` a member standing for ``ranks``: training, or pending in a formed elastic job.

        Args:
            rank: the member id, or ANY_RANK (elastic) for the lowest free one.
            ranks: the ranks it stands for; every Join of a member must agree.
            max_members: --max-world-size, the most member ids an elastic job may hold.
            describe: names the job, for messages.
            pending: an elastic newcomer pending on another shard: pending here too, even before the
                run (re)formed here, and not one of the hosts it forms with.
            signature: its model ("": unchecked), a candidate while the job's is not fixed (``decide_model``).

        Returns:
            (the member id, whether it was a member already: a rejoin).

        Raises:
            FailedPreconditionError: ``ranks`` disagrees with the member's, or the ranks
                the members stand for would not add up to ``job_ranks``.
            ResourceExhaustedError: an elastic job holds ``max_members`` ids already.
        """
        taken = self.joined | self.pending.keys()
        if self.max_members and rank not in taken and len(taken) >= self.max_members:
            raise FailedPreconditionError(
                f"elastic {describe()} holds {len(taken)} hosts, its most (elastic_max_hosts={self.max_members}); "
                f"this host can join once one leaves or is lost"
            )
        if rank == ANY_RANK:
            rank = self._lowest_free(max_members, describe)
        if self.ranks.get(rank, ranks) != ranks:
            raise FailedPreconditionError(
                f"ranks={ranks} does not match {describe()}, where member {rank} stands for "
                f"{self.ranks[rank]} ranks; every rank of a host must join with the host's rank count"
            )
        self._check_ranks_add_up(rank, ranks, describe)
        rejoined = rank in self.joined or rank in self.pending
        if not rejoined:
            self._tenures_drawn += 1
            self.tenures[rank] = self._tenures_drawn
        self.propose_model(rank, signature)  # before forming: a run never forms over a disagreement
        if self.elastic and (self.formed or pending) and rank not in self.joined:
            self.pending[rank] = ranks  # trains only once it has the state (gradq.server.state_relay)
        else:
            self.joined.add(rank)
            self._form()
        self.ranks[rank] = ranks
        self.lost.pop(rank, None)  # back: its process (or connection) lives again
        self.dropped.discard(rank)
        return rank, rejoined

    def admit(self, joiner: int, sender: int, describe: Callable[[], str]) -> None:
        """Move a pending ``joiner`` into the members training, as ``sender`` starts sending it the state.

        Raises:
            FailedPreconditionError: ``sender`` is not a member training, or ``joiner`` is not pending.
        """
        if sender != ANY_RANK and sender not in self.joined:  # ANY_RANK: the aggregator's own copy (DiLoCo)
            raise FailedPreconditionError(
                f"member {sender} is not training in elastic {describe()}; only a live member sends the state"
            )
        if joiner not in self.pending:
            raise FailedPreconditionError(f"member {joiner} of elastic {describe()} is not pending")
        self.joined.add(joiner)
        self.ranks[joiner] = self.pending.pop(joiner)
        self.late.pop(joiner, None)

    def make_late(self, member: int, step: int) -> bool:
        """A member training pushed to a round of ``step`` closed without it: pending until it has the state.

        Returns:
            Whether it was training (the first late push of that step; the rounds need not wait for it now).
        """
        if member not in self.joined:
            return False
        self.joined.discard(member)
        self.pending[member] = self.ranks.get(member, 1)
        self.late[member] = step
        return True

    def holds(self, rank: int, pending_ok: bool = False) -> bool:
        """Whether ``rank`` is a member training (or, with ``pending_ok``, one waiting for the state)."""
        return rank in self.joined or (pending_ok and rank in self.pending)

    def is_pending(self, rank: int) -> bool:
        """Whether ``rank`` is an elastic newcomer still waiting for the state."""
        return rank in self.pending

    @property
    def empty(self) -> bool:
        """No member trains or waits: the run is over."""
        return not self.joined and not self.pending

    def remove(self, rank: int) -> bool:
        """``rank`` left (a Leave); returns whether it was a member."""
        if not self.holds(rank, pending_ok=True):
            return False
        self.joined.discard(rank)
        self.pending.pop(rank, None)
        return True

    def tenure(self, rank: int) -> int:
        """The tenure ``rank``'s current holder took the id under (0: never held)."""
        return self.tenures.get(rank, 0)

    def lose(self, rank: int, reason: str, tenure: int | None = None) -> bool:
        """``rank``'s Watch stream ended without a Leave; returns whether it was a member.

        ``tenure`` is the one the stream vouched for: the loss of an id's
        former holder (None: whoever holds it now) does not touch its new one.
        An elastic job drops it (the others go on); a fixed job remembers why,
        and its rounds that wait on it cannot complete until it rejoins.
        """
        if not self.holds(rank, pending_ok=True) or (tenure is not None and tenure != self.tenure(rank)):
            return False
        if self.elastic:
            self.joined.discard(rank)
            self.pending.pop(rank, None)
            self.dropped.add(rank)
        else:
            self.lost[rank] = reason
        return True

    @property
    def goes_on_without_the_gone(self) -> bool:
        """A member gone leaves the rounds to the others (a formed elastic job), instead of closing them short."""
        return self.elastic and self.formed

    def blocking_loss(self, quorum: int) -> tuple[int, str] | None:
        """A lost member no round can complete without, lowest first, and why; None if none.

        A fixed job's lost member blocks every round, unless a partial quorum
        (--partial-quorum, 0: none) may close rounds without it.
        """
        if not self.lost or quorum:
            return None
        rank = min(self.lost)
        return rank, self.lost[rank]

    # -- what a round waits for -----------------------------------------------------------------

    def complete(self, contributors: set[int]) -> bool:
        """Whether a round with these contributors has every contribution it waits for.

        A fixed job (or an elastic one still forming) waits for ``world_size``
        members; a formed elastic job for the members training now.
        """
        if self.elastic and self.formed:
            return bool(self.joined) and self.joined <= contributors
        return len(contributors) == self.world_size

    def expected(self) -> set[int]:
        """The members a round waits for: a fixed job's ids 0..world_size-1, an elastic job's members training."""
        return set(self.joined) if self.elastic else set(range(self.world_size))

    def missing(self, contributors: set[int]) -> tuple[int, ...]:
        """The members a round waits for that have not contributed, ascending."""
        return tuple(sorted(self.expected() - contributors))

    def quorum_met(self, contributors: set[int], quorum: int, in_ranks: bool = True) -> bool:
        """Whether a round short of members may close over ``contributors`` (0: never).

        ``in_ranks``: the quorum counts the ranks the contributors stand for (--partial-quorum, like
        --world-size: a host of L ranks counts L under two-level aggregation); else it counts members
        (hosts: a semi-synchronous round's quorum, JoinRequest.semi_sync).
        """
        counted = sum(self.ranks.get(member, 1) for member in contributors) if in_ranks else len(contributors)
        return bool(quorum) and counted >= quorum

    # -- what others are told -------------------------------------------------------------------

    def ranks_training(self) -> int:
        """The ranks the members training stand for: what a round's mean divides by when they all push."""
        return sum(self.ranks.get(member, 1) for member in self.joined)

    def donor(self) -> int:
        """The member asked to send joiners the state: the lowest training (0 when none trains)."""
        return min(self.joined, default=0)

    def states(self) -> MemberStates:
        """Every member of this run by what it does now."""
        lost = set(self.lost) | self.dropped
        training = self.joined - lost
        return MemberStates(
            training=tuple(sorted(training)),
            pending=tuple(sorted(set(self.pending) - lost)),
            left=tuple(sorted(set(self.ranks) - self.joined - set(self.pending) - lost)),
            lost=tuple(sorted(lost)),
        )

    # -- helpers --------------------------------------------------------------------------------

    def _form(self) -> None:
        """An elastic job forms once ``world_size`` members train on one model (never over a disagreement); a
        run resumed after a restart once the members that were training are back (``reform_at``).

        Each starting host refused for its model (``refused``) is one fewer to wait for, down to a majority
        of ``world_size``: the fewest that can have decided the model."""
        agree = len({self.models[m] for m in self.joined if m in self.models}) <= 1
        needed = min(self.world_size, self.reform_at) if self.reform_at else self.world_size
        needed = max(needed - len(self.refused), min(needed, self.world_size // 2 + 1))
        self.formed = self.formed or (self.elastic and bool(self.joined) and len(self.joined) >= needed and agree)

    def _check_ranks_add_up(self, rank: int, ranks: int, describe: Callable[[], str]) -> None:
        """The ranks a fixed job's members stand for add up to ``job_ranks`` (an elastic host's, times world_size)."""
        if not self.job_ranks_given:
            return
        if self.elastic:
            if ranks * self.world_size != self.job_ranks:
                raise FailedPreconditionError(
                    f"ranks={ranks} of member {rank} does not add up in elastic {describe()}: its world_size="
                    f"{self.world_size} hosts of {ranks} ranks each stand for {ranks * self.world_size} ranks, "
                    f"not job_ranks={self.job_ranks}"
                )
            return
        members = {**self.ranks, rank: ranks}
        total = sum(members.values())
        if total > self.job_ranks or (len(members) == self.world_size and total != self.job_ranks):
            raise FailedPreconditionError(
                f"ranks={ranks} of member {rank} does not add up in {describe()}: its {len(members)} of "
                f"world_size={self.world_size} members would stand for {total} ranks, but job_ranks="
                f"{self.job_ranks}; the ranks of the job's hosts must add up to the job's ranks"
            )

    def _lowest_free(self, limit: int, describe: Callable[[], str]) -> int:
        """The lowest member id no member (training or pending) holds.

        Raises:
            ResourceExhaustedError: ``limit`` (--max-world-size) members hold ids already.
        """
        taken = self.joined | self.pending.keys() | self.refused.keys()  # a refused id stays its host's
        if len(taken) >= limit:
            raise ResourceExhaustedError(
                f"{describe()} has {len(taken)} members, the most this aggregator allows (--max-world-size)"
            )
        return next(candidate for candidate in range(len(taken) + 1) if candidate not in taken)


def describe_model_difference(signature: str, job_signature: str, describe: Callable[[], str]) -> str:
    """Where a host's model first differs from the job's: the tensor's index and both lines."""
    mine, theirs = signature.split("\n"), job_signature.split("\n")
    index = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), min(len(mine), len(theirs)))
    here = repr(mine[index]) if index < len(mine) else f"nothing (its model ends after {len(mine)} tensors)"
    there = repr(theirs[index]) if index < len(theirs) else f"nothing (its model ends after {len(theirs)} tensors)"
    return (
        f"this host's model differs from {describe()}'s at tensor {index}: this host has {here}, the job "
        f"{there}; every host of a job must build the same model"
    )
