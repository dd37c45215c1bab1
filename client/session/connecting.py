"""How a session connects: the loop's group and its part of the job's spec, where the member sits, the Join.

``GradqSession.connect`` runs these in order. Every rank of the group joins
(an elastic host's first rank for any member id, the others following it),
then the ranks agree on the worst outcome, so they all train through gradq or
all take the same fallback, or all raise.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

import torch
import torch.distributed as dist

from gradq.client.config import GradqConfig
from gradq.client.contact import UnreachableError
from gradq.client.elastic import ANY_RANK
from gradq.client.sending import AggregationError
from gradq.client.serde import JobSpec
from gradq.client.session.host_groups import HostGroup, elastic_host, find_host_group
from gradq.client.worker import WorkerClient

__all__ = ["JoinOutcome", "agree_on_join", "check_fallback", "join_host", "loop_group", "loop_part", "place_member"]
# Codes of an aggregator that answered and said no: a configuration to fix, never a reason to fall back.
_REFUSALS = frozenset({"INVALID_ARGUMENT", "FAILED_PRECONDITION", "PERMISSION_DENIED", "UNAUTHENTICATED"})
# The JobSpec fields that say where a member sits: connect sets them from the configuration and the host placement.
_PLACEMENT = frozenset({"world_size", "ranks", "elastic", "job_ranks", "max_members"})


class JoinOutcome(enum.IntEnum):
    """How a rank's Join went, ordered from best to worst: the group agrees on its worst (``agree_on_join``)."""

    JOINED = 0
    UNREACHABLE = 1  # no answer: the ranks may fall back together
    REFUSED = 2  # the aggregator said no: a configuration to fix, never a reason to fall back


def loop_part(job: JobSpec | None) -> JobSpec:
    """The loop's part of the job's spec, as given (None: nothing said).

    Raises:
        ValueError: ``job`` is not a JobSpec (connect's fourth argument was once a model signature), or
            sets a field of the placement, naming it, its value and who sets it.
    """
    job = job if job is not None else JobSpec()
    if not isinstance(job, JobSpec):
        raise ValueError(
            f"job={job!r:.80} is invalid; expected a gradq.client.JobSpec, e.g. JobSpec(model_signature=...)"
        )
    for spec_field in fields(JobSpec):
        value = getattr(job, spec_field.name)
        if spec_field.name in _PLACEMENT and value != spec_field.default:
            raise ValueError(
                f"job.{spec_field.name}={value!r} is invalid; expected the default {spec_field.default!r}: "
                f"GradqSession.connect sets it from the config and the host placement"
            )
    return job


def loop_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group a loop reduces over: ``group``, else the default one; None: this process alone, no group at all.

    Raises:
        RuntimeError: a launcher (torchrun) started several ranks, but torch.distributed is not initialized.
    """
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    launched = os.environ.get("WORLD_SIZE", "").strip()
    if launched not in ("", "1"):
        raise RuntimeError(
            f"WORLD_SIZE={launched!r}: a launcher started this process as one of {launched} ranks, but "
            "torch.distributed is not initialized; expected torch.distributed.init_process_group() before gradq "
            "connects (a host's ranks reduce together over it), or one process started without the launcher"
        )
    return None


def place_member(
    config: GradqConfig, group: dist.ProcessGroup | None, host: HostGroup | None, job: JobSpec
) -> tuple[HostGroup, JobSpec]:
    """This rank's member and what its Joins say of the job: the loop's ``job`` with the placement set.

    ``host`` is the member the adapter placed itself (FSDP); None finds it
    from the launcher (DDP), or makes this process a member alone when there
    is no group. Under two-level aggregation the aggregator's members are
    hosts, each standing for its ranks.

    Raises:
        ValueError: an elastic job through an adapter whose jobs are not elastic yet.
    """
    if host is not None:
        if config.elastic_hosts and not host.sharded:
            raise ValueError(f"elastic_hosts={config.elastic_hosts}: this adapter's jobs are not elastic yet")
        job_ranks = host.hosts * host.member_ranks
    elif group is None:  # this process alone: one member of one rank
        host = HostGroup(0, config.elastic_hosts or 1, 0, 1, 1, None, None)
        job_ranks = config.elastic_hosts or 1
    elif config.elastic_hosts:
        host = elastic_host(group, config.elastic_hosts, config.timeout_s)
        job_ranks = config.elastic_hosts * host.local_size
    else:
        host = find_host_group(group, config.host_grouping, config.host, os.environ, config.timeout_s)
        job_ranks = dist.get_world_size(group)
    spec = replace(
        job,
        world_size=host.hosts,
        ranks=host.member_ranks,
        elastic=bool(config.elastic_hosts),
        job_ranks=job_ranks,
        max_members=config.elastic_max_hosts,
    )
    return host, spec


def join_host(
    group: dist.ProcessGroup | None,
    host: HostGroup,
    client_for: Callable[[int, str], WorkerClient],
    config: GradqConfig,
    incarnation: str,
) -> tuple[WorkerClient | None, AggregationError | None]:
    """Join as this rank's member; an elastic host's first rank joins for any id and the others follow it.

    Collective over ``group`` for an elastic host of several ranks. Returns this
    rank's client (None when it could not be made) and its failure to join.
    """

    def join(client: WorkerClient) -> AggregationError | None:
        try:
            client.membership.timeout_s = config.connect_timeout_s
            client.join()
            client.membership.timeout_s = config.timeout_s
        except AggregationError as error:
            client.close()
            return error
        return None

    client: WorkerClient | None = None
    failure: AggregationError | None = None
    if not config.elastic_hosts:
        client = client_for(host.host, incarnation)
        failure = join(client)
        return (client if failure is None else None), failure
    if host.local_rank == 0:
        client = client_for(ANY_RANK, incarnation)
        failure = join(client)
    joined: list[Any] = [
        (client.membership.rank, client.membership.incarnation) if client is not None and failure is None else None
    ]
    if host.local_size > 1 and group is not None:
        dist.broadcast_object_list(joined, src=dist.get_global_rank(group, 0), group=group)
        if host.local_rank != 0 and joined[0] is not None:
            client = client_for(*joined[0])
            failure = join(client)
    if failure is None and joined[0] is None:
        failure = AggregationError(",".join(config.addresses), None, "the host's first rank could not join")
    return (client if failure is None else None), failure


def agree_on_join(group: dist.ProcessGroup | None, failure: AggregationError | None) -> JoinOutcome:
    """The worst of every rank's outcome (collective over ``group``): a refusal anywhere is one everywhere."""
    mine = (
        JoinOutcome.JOINED if failure is None else JoinOutcome.REFUSED if _refused(failure) else JoinOutcome.UNREACHABLE
    )
    agreed = torch.tensor([int(mine)], dtype=torch.int32)
    if group is not None:
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return JoinOutcome(int(agreed.item()))


def check_fallback(
    outcome: JoinOutcome, failure: AggregationError | None, config: GradqConfig, group: dist.ProcessGroup | None
) -> None:
    """Return when the ranks, which did not all join, fall back together; else raise what this rank says.

    Raises:
        AggregationError: a Join was refused (the message names both sides' values, or says another rank
            was refused), or the aggregator could not be reached and ``config.fallback`` is "error" (or
            there is no group to fall back over); the message says what to check.
        UnreachableError: this rank's Join met TLS against plaintext (it says so in one line).
    """
    if outcome == JoinOutcome.REFUSED:
        if isinstance(failure, UnreachableError):
            raise failure
        if failure is not None and _refused(failure):
            raise AggregationError(failure.address, failure.code, f"the aggregator refused the Join: {failure.details}")
        raise AggregationError(
            ",".join(config.addresses), None, "the aggregator refused another rank's Join; that rank's error says why"
        )
    if config.fallback == "error" or group is None:
        where = str(failure) if failure else "another rank could not reach the aggregator"
        raise AggregationError(
            failure.address if failure else ",".join(config.addresses),
            failure.code if failure else None,
            f"unreachable at start ({where}); {_unreachable_advice(config, group)}",
        )


def _unreachable_advice(config: GradqConfig, group: dist.ProcessGroup | None) -> str:
    """What a user whose aggregator cannot be reached can do, for this kind of job."""
    port = config.addresses[0].rpartition(":")[2] or "<port>"
    check = (
        f"check that an aggregator runs at {','.join(config.addresses)} and that this host reaches it "
        f"(start one with `gradq serve --port {port}`); one that starts slowly needs a longer "
        f"connect_timeout_s={config.connect_timeout_s:g} (GRADQ_CONNECT_TIMEOUT, seconds)"
    )
    if config.elastic_hosts:
        return f"{check}. An elastic or DiLoCo host trains only through the aggregator: it has no fallback"
    if group is None:
        return f"{check}. A process without torch.distributed has no process group to fall back to"
    return (
        f"{check}; or train without gradq while it is down: fallback='allreduce' or 'allgather' "
        f"(GRADQ_FALLBACK), now fallback={config.fallback!r}"
    )


def _refused(failure: AggregationError) -> bool:
    return failure.code is not None and failure.code.name in _REFUSALS
