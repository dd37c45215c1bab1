"""gradq as the cross-host reduction of an FSDP2 model: ``use_gradq(model, config)``.

Under HSDP a host's ranks shard the model among themselves (fast links) and
only the replicas on different hosts must agree (the slow link). FSDP2 lets
a hook take that second reduction: on a unit sharded over a 1-D mesh (the
host's ranks), ``set_all_reduce_hook`` runs no all-reduce of its own and hands
the hook this rank's reduce-scattered shard of the unit, already averaged
inside the host, to be filled with the mean over hosts. gradq's hook:

- pushes the shard, compressed, as member ``host`` of the aggregator's job
  under round key ``unit * L + local_rank`` (L ranks per host). A host's L
  ranks thus push one compressed copy of each unit between them, each a
  different 1/L, with no local sum and no gather: FSDP already reduced inside
  the host and keeps the shards. Each member stands for one replica, so the
  aggregator's mean over the members present is the mean over hosts, also
  in a partial round.
- counts rounds per unit: a unit's k-th reduction is step k. Under gradient
  accumulation FSDP reduces only on the micro-batch that syncs
  (``set_requires_gradient_sync``), so nothing is sent before it.
- lets the mean land after it returns when FSDP makes the shard itself the
  gradient and reads it no sooner than the optimizer (``Unit.fills_in_place``):
  backward goes on computing the earlier units while the shard travels, and
  an autograd callback at the end of backward waits for every unit's mean.
  Otherwise (a dtype cast, a GPU stream, an existing gradient) it waits in
  the hook, as the API demands.

Error feedback is kept per shard by the session; ``state_dict`` names each
shard's residual by host and round key, so torch.distributed.checkpoint saves
every rank's own and loads it back in place.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from gradq.client.config import GradqConfig
from gradq.client.fsdp.units import Hosts, Unit, find_hosts, units_of
from gradq.client.session import GradqSession
from gradq.client.session.host_groups import HostGroup
from gradq.client.stats import ClientStats

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = ["GradqFSDP", "use_gradq"]

log = logging.getLogger(__name__)

_MARK = "_gradq_fsdp"  # the attribute use_gradq leaves on the root module


def use_gradq(model: nn.Module | FSDPModule, config: Any) -> GradqFSDP:
    """Make gradq the cross-host reduction of every FSDP unit of ``model``; collective over the default group.

    Args:
        model: the root module, sharded with ``fully_shard`` over each host's
            ranks (a 1-D mesh, e.g. ``init_device_mesh(...)["shard"]``), every
            block first and then the root.
        config: a GradqConfig, or anything carrying one as ``gradq_config``
            (the DDP hook's state, e.g. ``GradqHookState.from_env()``).

    Returns:
        The handle: its ``state_dict()`` / ``load_state_dict()`` hold the
        steps and error feedback (a ``Stateful`` for torch.distributed.checkpoint),
        ``stats()`` the client's figures and ``close()`` leaves the job.

    Raises:
        TorchTooOldError: the installed torch is older than MINIMUM_TORCH["fsdp"] (gradq.client.torch_support).
        TypeError: ``model`` is not an FSDP2 module, or ``config`` no configuration.
        ValueError: a 2-D (native HSDP) mesh, several parameter groups, hosts
            of different sizes, or a configuration this adapter does not serve.
        RuntimeError: use_gradq was already called on ``model``.
        AggregationError: the aggregator refused the Join, or is unreachable
            and the fallback is "error".
    """
    gradq_config = _config_of(config)
    if getattr(model, _MARK, None) is not None:
        raise RuntimeError(
            "use_gradq was already called on this model; its FSDP units already reduce through gradq "
            "(close the first handle and shard a fresh model to connect again)"
        )
    units = units_of(model)
    if gradq_config.bit_policy != "uniform":
        raise ValueError(
            f"bit_policy={gradq_config.bit_policy!r} is not served under FSDP yet; expected 'uniform' "
            f"(a shard's parameters are not laid end to end, so there are no bounds to plan bits at)"
        )
    hosts = find_hosts(units[0])
    # Each host is one member standing for one replica: FSDP already averaged inside it.
    member = HostGroup(hosts.host, hosts.hosts, 0, 1, 1, None, None)
    session = GradqSession.connect(gradq_config, dist.group.WORLD, member)
    handle = GradqFSDP(session, units, hosts)
    for unit in units:
        unit.module.set_all_reduce_hook(handle.hook_for(unit))
    setattr(model, _MARK, handle)
    log.info(
        "gradq reduces %d FSDP units across %d hosts of %d ranks (host %d, shard %d)",
        len(units),
        hosts.hosts,
        hosts.local_size,
        hosts.host,
        hosts.local_rank,
    )
    return handle


class GradqFSDP:
    """One FSDP2 model's gradq reduction (see the module docstring); made by ``use_gradq``."""

    def __init__(self, session: GradqSession, units: list[Unit], hosts: Hosts) -> None:
        self.session, self.units, self.hosts = session, units, hosts
        self.steps = [0] * len(units)  # each unit's next round
        self._landing: list[tuple[torch.futures.Future[torch.Tensor], torch.Tensor]] = []
        self._step_open = False  # a unit reduced since the last end of backward
        self._replicas: dist.ProcessGroup | None = None
        self._lock = threading.Lock()
        self._travel_s = 0.0  # seconds from each push to its mean landing, summed
        self._waited_s = 0.0  # of those, seconds backward stood still waiting
        if session.mode != "gradq":
            self._replicas = _replica_group(hosts)

    # -- the hook ---------------------------------------------------------------------------------

    def hook_for(self, unit: Unit) -> Callable[[torch.Tensor], None]:
        """FSDP's all-reduce hook of ``unit``: fill its shard with the mean over hosts."""
        key = unit.index * self.hosts.local_size + self.hosts.local_rank

        def hook(shard: torch.Tensor) -> None:
            step = self.steps[unit.index]
            self.steps[unit.index] = step + 1
            if self._replicas is not None:  # the ranks agreed on a fallback at connect
                dist.all_reduce(shard, group=self._replicas)
                shard.div_(self.hosts.hosts)
                return
            started = time.perf_counter()
            future = self.session.reduce(shard, step, key)
            future.add_done_callback(lambda _: self._traveled(time.perf_counter() - started))
            self._step_open = True
            if self._queue_finish() and unit.fills_in_place(shard):
                self._landing.append((future, shard))
            else:
                self._land(future, shard)

        return hook

    def _queue_finish(self) -> bool:
        """Make the end of this backward wait for every mean; False outside a backward pass.

        Every hook queues its own callback, and the first to run lands them
        all: a backward that raised before its callbacks ran leaves nothing
        armed that a later backward could miss.
        """
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        except RuntimeError:  # not inside backward (a hook called by hand): the caller waits
            return False
        return True

    def _finish(self) -> None:
        """End of backward: every unit's mean is in its shard before ``loss.backward()`` returns."""
        if not self._step_open:
            return  # an earlier callback of this backward ended it
        landing, self._landing, self._step_open = self._landing, [], False
        failure: BaseException | None = None
        for future, shard in landing:
            try:
                self._land(future, shard)
            except Exception as error:  # wait for the rest too, then raise the first
                failure = failure or error
        self.session.end_step()
        if failure is not None:
            raise failure

    def _land(self, future: torch.futures.Future[torch.Tensor], shard: torch.Tensor) -> None:
        started = time.perf_counter()
        try:
            mean = future.wait()
        finally:
            with self._lock:
                self._waited_s += time.perf_counter() - started
        if mean.data_ptr() != shard.data_ptr():  # decoded elsewhere (another dtype, a host copy)
            shard.copy_(mean.view_as(shard))

    def _traveled(self, seconds: float) -> None:
        with self._lock:
            self._travel_s += seconds

    # -- figures ----------------------------------------------------------------------------------

    def overlap(self) -> tuple[float, float]:
        """(seconds the shards traveled, seconds backward waited for them), summed since use_gradq.

        ``1 - waited / traveled`` is the share of the cross-host time that
        overlapped backward's compute.
        """
        with self._lock:
            return self._travel_s, self._waited_s

    def stats(self) -> ClientStats | None:
        """The worker client's figures (bytes, rounds); None under a fallback."""
        return self.session.stats()

    def close(self) -> None:
        """Leave the job; idempotent. A later backward fails instead of rejoining silently."""
        self.session.close()

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Steps and this rank's error feedback, as CPU tensors with names no other rank uses.

        ``steps`` is each unit's next round (the same on every rank);
        ``residual/host<h>/key<k>`` is the residual of the shard this rank
        pushes under round key k, zeros before its first push, so the names and
        shapes are known before training (torch.distributed.checkpoint loads
        into them).
        """
        state = {"steps": torch.tensor(self.steps, dtype=torch.int64)}
        if self.session.config.error_feedback and self.session.mode == "gradq":
            for unit in self.units:
                key = self._key(unit)
                held = self.session.residuals.read(key, unit.shard_numel, unit.device)
                state[self._residual_name(key)] = held if held is not None else torch.zeros(unit.shard_numel)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take back ``state_dict()``'s output; checked whole before anything changes.

        Raises:
            ValueError: a name, length or shape differs from this rank's, named in the message.
        """
        steps = state.get("steps")
        if not isinstance(steps, torch.Tensor) or steps.shape != (len(self.units),):
            shape = list(steps.shape) if isinstance(steps, torch.Tensor) else type(steps).__name__
            raise ValueError(f"state['steps'] is {shape}; expected a tensor of {len(self.units)} steps, one per unit")
        wanted = self.state_dict()
        unknown = sorted(set(state) - set(wanted))
        if unknown:
            raise ValueError(
                f"state[{unknown[0]!r}] is not this rank's (host {self.hosts.host}, shard {self.hosts.local_rank}); "
                f"expected only {sorted(wanted)}"
            )
        for name, template in wanted.items():
            given = state.get(name)
            if name != "steps" and (not isinstance(given, torch.Tensor) or given.numel() != template.numel()):
                got = f"{given.numel()} elements" if isinstance(given, torch.Tensor) else type(given).__name__
                raise ValueError(f"state[{name!r}] holds {got}; expected {template.numel()} elements")
        self.steps = [int(step) for step in steps.tolist()]
        for unit in self.units:
            residual = state.get(self._residual_name(self._key(unit)))
            if isinstance(residual, torch.Tensor):
                self.session.residuals.write(self._key(unit), residual, unit.device)

    def _key(self, unit: Unit) -> int:
        return unit.index * self.hosts.local_size + self.hosts.local_rank

    def _residual_name(self, key: int) -> str:
        return f"residual/host{self.hosts.host}/key{key}"


def _config_of(config: Any) -> GradqConfig:
    found = config if isinstance(config, GradqConfig) else getattr(config, "gradq_config", None)
    if not isinstance(found, GradqConfig):
        raise TypeError(
            f"config is {type(config).__name__}; expected a GradqConfig (GradqConfig.from_env(), GradqConfig.of(...)) "
            f"or the DDP hook's state"
        )
    return found


def _replica_group(hosts: Hosts) -> dist.ProcessGroup | None:
    """Under a fallback: this shard's ranks on every host, for a native all-reduce (collective over all ranks)."""
    mine = None
    for local_rank in range(hosts.local_size):  # every rank makes every group, in the same order
        group = dist.new_group([members[local_rank] for members in hosts.members])
        if local_rank == hosts.local_rank:
            mine = group
    return mine
