"""How a DiLoCo host enters its job: the first Join, a late host's catch-up, and a dropped host's rejoin.

A host that starts the job seeds the global state (on the aggregator); a
joiner, a host late for a semi-synchronous round and a host dropped for
silence all take the job's state at an outer-round boundary and train on
from there, never from their own steps of a round the others have closed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from gradq.client.sending import AggregationError
from gradq.client.serde import Refusal
from gradq.client.session import GradqSession, JobSpec
from gradq.client.session.elastic import model_signature
from gradq.client.session.host_groups import HostGroup

if TYPE_CHECKING:
    from gradq.client.diloco.on_aggregator import GlobalState
    from gradq.client.diloco.outer import DiLoCo

__all__ = ["catch_up", "connect", "enter", "rejoin", "wait_for_means"]

log = logging.getLogger("gradq.client.diloco.outer")  # the name users filter DiLoCo's lines by


def connect(diloco: DiLoCo) -> GradqSession:
    """Join the job with DiLoCo's terms: the model, the outer step, semi-sync rounds, token weighting.

    Raises:
        RuntimeError: the session fell back (DiLoCo's hosts share no process group across the link),
            or an FSDP2 host without torch.distributed.
    """
    state, options = diloco.on_aggregator, diloco.options
    session = GradqSession.connect(
        diloco.config,
        diloco.process_group,
        host=_host_of_shards(diloco) if diloco.sharded else None,
        job=JobSpec(
            model_signature=model_signature(diloco.shared()),
            outer_step=state.step if state is not None else None,
            semi_sync=options.semi_sync,
            weighted=options.token_weighted,
        ),
    )
    _refuse_fallback(session)
    diloco.summary.attach(session.events)
    return session


def _refuse_fallback(session: GradqSession) -> None:
    if session.mode != "gradq":
        session.close()
        raise RuntimeError(
            f"DiLoCo cannot fall back ({session.mode!r}): its hosts have no common process group "
            f"across the link; start the aggregator, or set fallback='error' to be told at once"
        )


def _host_of_shards(diloco: DiLoCo) -> HostGroup:
    """An FSDP2 host: its ranks are one member, each pushing its own shards whole (see HostGroup.sharded)."""
    group = diloco.process_group
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    if group is None:
        raise RuntimeError(
            "DiLoCo over an FSDP2 model: its ranks hold the shards, and torch.distributed is not initialized; "
            "expected torch.distributed.init_process_group() (as FSDP2 itself needs) or process_group="
        )
    size = dist.get_world_size(group)
    return HostGroup(0, diloco.config.elastic_hosts, dist.get_rank(group), size, size, None, None, sharded=True)


def enter(diloco: DiLoCo, session: GradqSession) -> None:
    """A joiner takes the global state (from the aggregator or a live host); a starting host seeds it.

    Raises:
        ValueError: semi-synchronous rounds on a host of several ranks, or on a job of several shards.
    """
    state, quorum = diloco.on_aggregator, diloco.options.quorum
    if quorum and session.host.local_size > 1:
        raise ValueError(
            f"quorum={quorum}: semi-synchronous rounds take hosts of one process each; this host "
            f"has {session.host.local_size} ranks"
        )
    if quorum and session.member.shards > 1:
        raise ValueError(
            f"quorum={quorum}: semi-synchronous rounds run on one aggregator; this job has "
            f"{session.member.shards} shards (a late host would be late on some of them and not on others)"
        )
    diloco.token_count.restart()
    if state is None:
        diloco.outer_round = session.member.receive(diloco.shared(), diloco.outer_round)
        return
    if session.member.joining:
        diloco.outer_round = state.receive(session)
        diloco.inner_steps = diloco.outer_round * diloco.sync_every
    else:
        state.seed(session, diloco.outer_round)


def wait_for_means(pushed: Sequence[Any]) -> tuple[list[Any], AggregationError | None]:
    """Wait for every pushed round's mean (all are in flight before the first wait), or say the host was late.

    Returns:
        The means, and None; or the means received so far and the first refusal that makes the host
        take the job's state at the next outer-round boundary instead (``takes_state_next``).

    Raises:
        AggregationError: a round failed otherwise.
    """
    received, late = [], None
    for future in pushed:
        try:
            received.append(future.wait())
        except AggregationError as error:
            if not takes_state_next(error):
                raise
            late = late or error
    return received, late


def takes_state_next(error: AggregationError) -> bool:
    """This host takes the job's state at the next outer-round boundary instead of its round's mean.

    LATE: the aggregator closed a semi-synchronous round without this host and
    merged its push into the next. BEHIND: the job's global state is past this
    host's outer round (another host seeded or pushed a later one, see
    gradq.server.outer_state); the aggregator made it pending, as a late host.
    """
    return error.refusal in (Refusal.LATE, Refusal.BEHIND)


def catch_up(diloco: DiLoCo, session: GradqSession, state: GlobalState, error: AggregationError) -> None:
    """Semi-synchronous: this host was late; its pushes were merged. Take the state at the next boundary."""
    log.warning(
        "late for outer round %d of %s (%s); taking the global state", diloco.outer_round, session.job_id, error.details
    )
    diloco.outer_round = state.receive(session)
    diloco.inner_steps = diloco.outer_round * diloco.sync_every
    diloco.token_count.restart()
    diloco.summary.late_rounds += 1


def rejoin(diloco: DiLoCo, session: GradqSession, error: AggregationError) -> GradqSession:
    """This host was dropped (it fell silent past the keepalive): the member joins again, the host takes the state.

    Its local steps of the round it missed are dropped with it: it continues
    from the global state, never from its own. Returns the new session.
    """
    session = session.member.rejoin(error)
    _refuse_fallback(session)
    diloco.summary.attach(session.events)
    enter(diloco, session)
    log.warning(
        "rejoined job %s at outer round %d (rejoins so far: %d)",
        session.job_id,
        diloco.outer_round,
        session.member.rejoins,
    )
    return session
