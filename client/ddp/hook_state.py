"""The DDP comm hook's state: its configuration, the step, and the session it connects (gradq.client.ddp.hook).

The state holds the configuration, the step and what an elastic joiner
receives; the session (gradq.client.session), connected on the first bucket
(or at ``start()``, or the first step of ``steps(total)``), does the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from gradq.client.bit_policy import DEFAULT_AVERAGE_BITS
from gradq.client.chunks import DEFAULT_CHUNK_ELEMENTS
from gradq.client.config import DEFAULT_HOOK_IN_FLIGHT, GradqConfig
from gradq.client.ddp.bucket_layout import fix_bucket_layout
from gradq.client.ddp.checkpoint import checkpoint_of, read_checkpoint
from gradq.client.elastic import JobWorld
from gradq.client.env import DEFAULT_CONNECT_TIMEOUT_S
from gradq.client.security import ChannelSecurity
from gradq.client.sending import AggregationError
from gradq.client.session import GradqSession, JobSpec
from gradq.client.session.elastic import check_shareable, model_signature
from gradq.client.session.host_groups import HostGroup
from gradq.client.session.job_steps import check_total, job_steps
from gradq.client.session.member import dropped_from_job
from gradq.client.session.residuals import ParameterResiduals
from gradq.client.session.training_log import TrainingSummary
from gradq.client.stats import ClientStats
from gradq.client.torch_support import require_torch
from gradq.client.worker import WorkerClient
from gradq.qcore import QuantConfig

__all__ = ["GradqHookState"]

log = logging.getLogger(__name__)

# GradqConfig's fields, read through the state as they were before the config was split out
# (``config`` is the quantization grid, GradqConfig.quant).
_CONFIG_FIELDS = frozenset(GradqConfig.__dataclass_fields__) - {"quant"} | {"config"}


class GradqHookState:
    """What ``gradq_hook`` needs: a GradqConfig, the step, and a session connected on the first bucket.

    Each connect is a new incarnation of ``job_id`` (rank 0 draws it), so a
    rerun or a torchrun restart with the same id starts the job afresh. The
    session leaves the job on ``close()``, at the end of a ``with`` block, when
    the state (or the DDP model holding it) is collected, or when the process exits.
    The configuration's fields read as attributes (``state.addresses``,
    ``state.config`` for the grid, ...); see GradqConfig for each argument.

    Args:
        addresses: ``host:port`` of the aggregator shard(s).
        config: how buckets are quantized (GradqConfig.quant).
        process_group: the group DDP reduces over (None: the default group).
        error_feedback, fallback, job_id, timeout_s, connect_timeout_s, security,
        chunk_elements, max_in_flight, codec, host_grouping, host, elastic_hosts, elastic_max_hosts,
        bit_policy, average_bits: as in GradqConfig. An elastic host calls
            ``share(...)`` before training, then trains ``for step in state.steps(total)``.

    Raises:
        ValueError: a bad value or combination (see GradqConfig).
    """

    __slots__ = (
        "__weakref__",
        "_closed",  # close() was called: a later bucket is an error, not a silent rejoin
        "_config",  # the frozen configuration; replaced only by load_state_dict before connecting
        "_loaded",  # residuals from load_state_dict, handed to the session when it connects
        "_rejoin",  # elastic: the drop found during the step (None: none); it rejoins after the optimizer's step
        "_session",  # the connected session (None before the first bucket); left out of the pickled form
        "_shared",  # elastic: the objects (model, optimizer, ...) whose state a joiner receives
        "_summary",  # steps, rejoins, bytes of this run: logged once at its end (training_log)
        "process_group",  # DDP's group; left out of the pickled form
        "step",  # iteration counter: with the bucket index, the round key
    )

    def __init__(
        self,
        addresses: str | Sequence[str],
        config: QuantConfig | None = None,
        *,
        error_feedback: bool = False,
        fallback: str = "error",
        job_id: str | None = None,
        timeout_s: float = 120.0,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        process_group: dist.ProcessGroup | None = None,
        security: ChannelSecurity | None = None,
        chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
        max_in_flight: int | None = DEFAULT_HOOK_IN_FLIGHT,
        codec: str = "auto",
        host_grouping: str = "auto",
        host: str | None = None,
        elastic_hosts: int = 0,
        elastic_max_hosts: int = 0,
        bit_policy: str = "uniform",
        average_bits: float = DEFAULT_AVERAGE_BITS,
    ) -> None:
        require_torch("ddp")
        gradq_config = GradqConfig.of(
            addresses,
            config,
            error_feedback=error_feedback,
            fallback=fallback,
            job_id=job_id,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            security=security,
            chunk_elements=chunk_elements,
            max_in_flight=max_in_flight,
            codec=codec,
            host_grouping=host_grouping,
            host=host,
            elastic_hosts=elastic_hosts,
            elastic_max_hosts=elastic_max_hosts,
            bit_policy=bit_policy,
            average_bits=average_bits,
        )
        self._begin(gradq_config, process_group, step=0)

    def _begin(self, config: GradqConfig, process_group: dist.ProcessGroup | None, step: int) -> None:
        self._config, self.process_group, self.step = config, process_group, step
        self._session: GradqSession | None = None
        self._loaded = ParameterResiduals(None, config.codec)
        self._shared: list[Any] = []
        self._closed = False
        self._rejoin: AggregationError | None = None
        self._summary = TrainingSummary(self, "DDP hook")

    @classmethod
    def from_config(cls, config: GradqConfig, process_group: dist.ProcessGroup | None = None) -> GradqHookState:
        """A state for a configuration made already (e.g. carried by an app)."""
        state = cls.__new__(cls)
        state._begin(config, process_group, step=0)
        return state

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> GradqHookState:
        """A state configured by the GRADQ_* variables `gradq worker` and the Compose workers use.

        Args:
            environ: the variables (None: ``os.environ``); see
                gradq.client.env.HOOK_ENVIRONMENT for their names.
            overrides: GradqHookState arguments that win over the variables
                (e.g. ``fallback="allreduce"``, ``process_group=...``).

        Returns:
            The configured state (not yet connected).

        Raises:
            ValueError: GRADQ_AGGREGATORS is unset, or a variable holds a bad value.
        """
        process_group = overrides.pop("process_group", None)
        return cls.from_config(GradqConfig.from_env(environ, **overrides), process_group)

    @property
    def gradq_config(self) -> GradqConfig:
        """The frozen configuration this state connects with."""
        return self._config

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not slots: the configuration's fields.
        if name in _CONFIG_FIELDS:
            session = self._session
            if name == "job_id" and session is not None:
                return session.job_id  # rank 0's, or the one it drew
            if name == "addresses":
                return list(self._config.addresses)
            return getattr(self._config, "quant" if name == "config" else name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def incarnation(self) -> str | None:
        """This run of the job, drawn by rank 0 at connect (None before)."""
        return self._session.incarnation if self._session is not None else None

    @property
    def session(self) -> GradqSession | None:
        """The connected session (None before the first bucket)."""
        return self._session

    @property
    def client(self) -> WorkerClient | None:
        """The live WorkerClient (None before the first bucket or under a fallback)."""
        return self._session.client if self._session is not None else None

    @property
    def host_group(self) -> HostGroup | None:
        """This rank's place among the job's hosts (None before the first bucket)."""
        return self._session.host if self._session is not None else None

    @property
    def mode(self) -> str | None:
        """ "gradq", or the fallback in use; None before the first bucket."""
        return self._session.mode if self._session is not None else None

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps so that resuming keeps error feedback (``torch.save`` it with the model).

        Returns:
            ``step`` (the next round's step), ``config`` (the push grid as plain
            values), ``error_feedback``, and ``residuals``: each bucket's residual
            pieces as flat float32 CPU tensors, keyed by parameter and element
            range (see gradq.client.session.residuals), so a resume puts each back
            on its own parameter, on any device and in any bucket layout.
        """
        residuals = self._session.residuals if self._session is not None else self._loaded
        return checkpoint_of(self.step, self._config, residuals.state_dict())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume from ``state_dict()``'s output; call it before the first backward.

        Args:
            state_dict: what ``state_dict()`` returned (e.g. after ``torch.load``).

        Raises:
            RuntimeError: the state has connected already (its grid is in use).
            ValueError: a key is missing or holds a bad value (nothing is taken then).
        """
        if self._session is not None:
            raise RuntimeError("load_state_dict() came after the first backward; call it before training starts")
        step, quant, error_feedback, pieces = read_checkpoint(state_dict)
        config = self._config.replace(quant=quant, error_feedback=error_feedback)
        loaded = ParameterResiduals(None, config.codec)
        loaded.load_state_dict(pieces)
        self._config, self.step, self._loaded = config, step, loaded

    def __setattr__(self, name: str, value: Any) -> None:
        # The configuration's fields stay settable before connecting, checked again as a whole.
        if name in _CONFIG_FIELDS:
            if self._session is not None:
                raise RuntimeError(f"{name} cannot change once the state has connected (its session uses it)")
            field = "quant" if name == "config" else name
            object.__setattr__(self, "_config", self._config.replace(**{field: value}))
            return
        object.__setattr__(self, name, value)

    def __getstate__(self) -> dict[str, Any]:
        # A connected state's copy keeps the job id rank 0 drew, and joins that job as a new incarnation.
        config = self._config if self._session is None else self._config.replace(job_id=self._session.job_id)
        return {"gradq_config": config, "step": self.step}

    def __setstate__(self, state: dict[str, Any]) -> None:
        config = state.get("gradq_config")
        if config is None:  # pickled before GradqConfig: the constructor's arguments as fields
            fields = {name: value for name, value in state.items() if name in _CONFIG_FIELDS}
            config = GradqConfig.of(**fields)
        self._begin(config, None, step=int(state.get("step", 0)))

    def share(self, *objects: Any) -> None:
        """Elastic: the objects a joining host receives the state of (the model, the optimizer, a scheduler...).

        Each needs ``state_dict()`` and ``load_state_dict()``; every host shares
        the same kinds in the same order. Call it before ``start()``.

        Raises:
            TypeError: an object lacks state_dict / load_state_dict.
        """
        self._shared = check_shareable(objects)

    def start(self) -> int:
        """Join the job now; an elastic newcomer receives the training state before this returns.

        Returns:
            The step to train from: 0 for a host that starts the job, the
            donor's step for one that joins it in training (its model and
            optimizer then hold the training state, bit for bit).

        Raises:
            AggregationError: the aggregator refused or could not be reached,
                or the state transfer failed.
            ValueError: an elastic job with nothing shared.
        """
        if self._config.elastic_hosts:
            fix_bucket_layout(self._shared)
            for optimizer in (item for item in self._shared if isinstance(item, torch.optim.Optimizer)):
                optimizer.register_step_post_hook(self._after_optimizer_step)
        session = self.connected()
        self.step = session.member.receive(self._shared, self.step)
        return self.step

    def steps(self, total: int) -> Iterator[int]:
        """The job's steps this host trains, up to ``total``: the elastic loop, ``for step in state.steps(total):``.

        Joins first, as ``start()`` does, unless the state is connected already
        (``start()`` called, or a resumed fixed job). Each iteration is one step
        (one backward through the hook and the optimizer's step). A host
        dropped from an elastic job during a step rejoins at the optimizer's
        step and receives the state at the step the others have reached; the
        next step yielded is that one, so the host never repeats or skips one
        of the job's steps and stops with the others at ``total``. A counted
        ``range(state.start(), total)`` goes on from its own count instead and
        trains past the job's end, alone once the others have left. A joiner
        that receives the state at ``total`` or later yields nothing. A fixed
        job (``elastic_hosts=0``) yields ``state.step``, then one more each
        iteration.

        Args:
            total: the step the job ends at (its steps in all).

        Returns:
            An iterator of the steps to train.

        Raises:
            ValueError: ``total`` is not an integer >= 0.
            AggregationError: at the first iteration, as ``start()``.
        """
        check_total(total)
        return self._steps(total)

    def _steps(self, total: int) -> Iterator[int]:
        first = self.start() if self._session is None else self.step
        yield from job_steps(first, total, lambda: self.step, lambda: self.rejoins)

    def _absorb(self, error: BaseException) -> bool:
        """A bucket failed because the aggregator dropped this host: rejoin after this step instead of raising.

        Only when an optimizer is shared: its step is where the host can take
        the state (this step's buckets went back unreduced, and the state it
        receives then replaces what the optimizer made of them).
        """
        shares_optimizer = any(isinstance(item, torch.optim.Optimizer) for item in self._shared)
        if not (self._config.elastic_hosts and shares_optimizer and dropped_from_job(error)):
            return False
        assert isinstance(error, AggregationError)  # dropped_from_job says so
        if self._rejoin is None:
            log.warning(
                "this host was dropped from its elastic job (%s); it rejoins after this step and takes the "
                "training state from a live host",
                error,
            )
            self._rejoin = error
        return True

    def _after_optimizer_step(self, *_: Any) -> None:
        if self._rejoin is not None and not self._closed:
            error, self._rejoin = self._rejoin, None
            self._rejoin_job(error)

    def _rejoin_job(self, error: AggregationError) -> None:
        """The member joins again as a joiner and takes the state from a live host; the loop goes on from its step.

        Collective over the host's ranks (they all found the host dropped in the same step).
        """
        dropped, self._session = self._session, None  # a failed rejoin leaves it to connect at the next bucket
        assert dropped is not None
        session = self._session = dropped.member.rejoin(error)
        self._summary.attach(session.events)
        self.step = session.member.receive(self._shared, self.step)
        log.warning(
            "rejoined job %s as member %s at step %d (rejoins so far: %d)",
            session.job_id,
            session.member.rank,
            self.step,
            self.rejoins,
        )

    @property
    def rejoins(self) -> int:
        """Elastic: times this host was dropped (silent past the keepalive) and joined again."""
        return self._summary.rejoins

    def world(self) -> JobWorld | None:
        """Elastic: the job's members and the ranks they stand for, as last announced (None before the first)."""
        return self._session.world() if self._session is not None else None

    def stats(self) -> ClientStats | None:
        """The worker client's figures; None if not connected.

        Returns:
            Encode / network / decode time, bytes each way, relative error, and
            the compression ratio against the buckets' own dtype (``dtype``
            names it: a bf16 bucket is compared with 2 bytes per element).
        """
        return self._session.stats() if self._session is not None else None

    def close(self) -> None:
        """Leave the job and close the channels; idempotent. The hook refuses buckets afterwards.

        Logs the run's summary (once; a state never closed logs it when collected or at exit).
        """
        self._closed = True
        if self._session is not None:
            self._session.close()
        self._summary.close()

    @property
    def closed(self) -> bool:
        """``close()`` was called: the hook refuses buckets."""
        return self._closed

    @property
    def shared(self) -> list[Any]:
        """Elastic: the objects ``share`` named, whose state a joiner receives."""
        return self._shared

    def count_step(self) -> None:
        """One step trained, through gradq or a fallback: the run's summary counts it."""
        self._summary.steps += 1

    def __enter__(self) -> GradqHookState:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def connected(self) -> GradqSession:
        """The session, connected now if it is not yet (collective over the process group)."""
        if self._closed:
            raise RuntimeError("GradqHookState is closed; register a new state to train through gradq again")
        if self._session is None:
            signature = model_signature(self._shared) if self._config.elastic_hosts else ""
            session = GradqSession.connect(
                self._config, self.process_group, job=JobSpec(model_signature=signature), on_drop=self._absorb
            )
            session.residuals.load_state_dict(self._loaded.state_dict())
            self._summary.attach(session.events)
            self._session, self._loaded = session, ParameterResiduals(None, self._config.codec)
        return self._session
