"""GradqConfig: what a training loop asks of gradq, validated once, frozen and picklable.

Every adapter (the DDP hook, the apps, the integrations) carries one of these
and connects a session from it (gradq.client.session). Adding an option is one
field here (with its check in ``__post_init__``) and, if a variable sets it,
one row in gradq.client.env. Importing this module loads no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gradq.client.bit_policy import BIT_POLICIES, DEFAULT_AVERAGE_BITS, check_average_bits
from gradq.client.chunks import DEFAULT_CHUNK_ELEMENTS
from gradq.client.env import CODECS, DEFAULT_CONNECT_TIMEOUT_S, FALLBACKS, HOST_GROUPINGS, hook_arguments_from_env
from gradq.client.security import ChannelSecurity
from gradq.client.window import check_max_in_flight
from gradq.proto.address import split_address
from gradq.qcore import QuantConfig

__all__ = ["CODECS", "DEFAULT_HOOK_IN_FLIGHT", "FALLBACKS", "HOST_GROUPINGS", "GradqConfig"]

# DDP pushes every rank's buckets in the same order, so a session may hold pushes back:
# 2 lets one chunk arrive while the previous one's mean leaves.
DEFAULT_HOOK_IN_FLIGHT = 2


@dataclass(frozen=True)
class GradqConfig:
    """How a training loop talks to gradq; every field is checked when the config is made.

    Args:
        addresses: ``host:port`` of the aggregator shard(s), in shard order.
        quant: how tensors are quantized on the way out.
        error_feedback: carry each tensor's quantization error into its next step.
        fallback: if the aggregator is unreachable at start: "error" (raise,
            naming the address), "allreduce" (plain fp32 allreduce) or
            "allgather" (the serverless per-channel allgather). All ranks
            agree on the outcome, so they never mix collectives and RPCs.
        job_id: shared by every rank; None lets rank 0 draw one per run.
        timeout_s: deadline of each RPC (keep it above the server's round timeout).
        connect_timeout_s: how long the first join waits for the aggregator, and a push's
            rejoin for a shard that went away (a restart).
        security: TLS, mutual TLS and/or bearer token for the aggregator channels.
        chunk_elements: tensors above this travel as several rounds (see WorkerClient).
        max_in_flight: pushes per shard on the wire at once however short the
            path, more while they fit its bandwidth-delay product (see
            gradq.client.window); None sends a step's chunks all at once.
        codec: where tensors are quantized: "auto" (on their device: the torch
            codec for GPU tensors, numpy for CPU ones), "torch" (on their
            device, CPU included) or "numpy" (copied to the host first).
        host_grouping: "auto" reduces inside each host first where hosts hold
            several ranks (two-level aggregation, see
            gradq.client.session.host_groups); "flat" pushes every rank's whole tensor.
        host: this rank's host name, for launchers that set no node rank:
            ranks given the same name reduce together (None: the launcher's).
        elastic_hosts: 0 for a fixed job; N > 0 makes the job elastic (see
            gradq.client.session.elastic): it starts training once N hosts
            have joined, and hosts may then be lost and join. N is the start
            quorum, not a size: more hosts may join, up to ``elastic_max_hosts``.
        elastic_max_hosts: elastic: the most hosts the job holds at once; a
            host that would pass it is refused at its Join, naming the cap
            (0: no cap but the aggregator's --max-world-size).
        bit_policy: "uniform" pushes every tensor on ``quant``; "adaptive"
            splits each at parameter boundaries and gives 1-D and
            hard-to-quantize parameters more bits, keeping each tensor's
            average at or under ``average_bits`` (see gradq.client.bit_policy).
        average_bits: the adaptive policy's most bits per element on average
            (``quant.bits``..8; the uniform policy ignores it).

    Raises:
        ValueError: a field holds a bad value or a bad combination, named in the message.
    """

    addresses: tuple[str, ...]
    quant: QuantConfig = field(default_factory=QuantConfig)
    error_feedback: bool = False
    fallback: str = "error"
    job_id: str | None = None
    timeout_s: float = 120.0
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    security: ChannelSecurity | None = None
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
    max_in_flight: int | None = DEFAULT_HOOK_IN_FLIGHT
    codec: str = "auto"
    host_grouping: str = "auto"
    host: str | None = None
    elastic_hosts: int = 0
    elastic_max_hosts: int = 0
    bit_policy: str = "uniform"
    average_bits: float = DEFAULT_AVERAGE_BITS

    def __post_init__(self) -> None:
        addresses = (self.addresses,) if isinstance(self.addresses, str) else tuple(self.addresses)
        object.__setattr__(self, "addresses", addresses)
        if not addresses or not all(isinstance(address, str) and address for address in addresses):
            raise ValueError(f"addresses={list(addresses)!r} is invalid; expected at least one 'host:port'")
        for index, address in enumerate(addresses):
            try:
                split_address(address)
            except ValueError as error:
                field_name = "addresses" if len(addresses) == 1 else f"addresses[{index}]"
                raise ValueError(f"{field_name}={address!r} (GRADQ_AGGREGATORS) is invalid; {error}") from None
        if not isinstance(self.quant, QuantConfig):
            raise ValueError(f"config={self.quant!r} is invalid; expected a gradq.qcore.QuantConfig")
        if not self.quant.scheme.is_quantized:
            raise ValueError(f"config.scheme={self.quant.scheme.name.lower()} is not quantized; use plain DDP")
        _check_choice("fallback", self.fallback, FALLBACKS)
        _check_choice("codec", self.codec, CODECS)
        _check_choice("host_grouping", self.host_grouping, HOST_GROUPINGS)
        _check_choice("bit_policy", self.bit_policy, BIT_POLICIES)
        if not self.timeout_s > 0 or not self.connect_timeout_s > 0:
            raise ValueError(
                f"timeout_s={self.timeout_s}, connect_timeout_s={self.connect_timeout_s}: expected both > 0"
            )
        chunk = self.chunk_elements
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"chunk_elements={chunk!r} is invalid; expected an integer >= 0 (0 never splits)")
        check_max_in_flight(self.max_in_flight)
        hosts = self.elastic_hosts
        if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 0:
            raise ValueError(f"elastic_hosts={hosts!r} is invalid; expected 0 (a fixed job) or hosts >= 1")
        if hosts and self.job_id is None:
            raise ValueError("elastic_hosts needs job_id: independent hosts find their job by it")
        cap = self.elastic_max_hosts
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0 or (cap and cap < max(hosts, 1)):
            raise ValueError(
                f"elastic_max_hosts={cap!r} is invalid; expected 0 (no cap) or an integer >= elastic_hosts={hosts}"
                if hosts
                else f"elastic_max_hosts={cap!r} is invalid; expected 0 (no cap) or an integer >= 1"
            )
        if cap and not hosts:
            raise ValueError(f"elastic_max_hosts={cap} caps an elastic job; set elastic_hosts too (the start quorum)")
        if hosts and self.fallback != "error":
            raise ValueError(f"fallback={self.fallback!r}: an elastic host cannot fall back (it would train alone)")
        if self.bit_policy == "adaptive":
            check_average_bits(self.average_bits, self.quant.bits)
            if hosts:
                # Each host would plan its bits from its own gradients, and a round takes one grid.
                raise ValueError(
                    f"bit_policy='adaptive' with elastic_hosts={hosts}: elastic hosts plan their bits apart, and "
                    "every host of a round must push on one grid; use bit_policy='uniform'"
                )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> GradqConfig:
        """The configuration the GRADQ_* variables give (see gradq.client.env.HOOK_ENVIRONMENT).

        Args:
            environ: the variables (None: ``os.environ``).
            overrides: fields that win over the variables (e.g. ``fallback="allreduce"``;
                ``config=`` is accepted for ``quant``).

        Raises:
            ValueError: GRADQ_AGGREGATORS is unset, or a variable or override holds a bad value.
        """
        return cls.of(**{**hook_arguments_from_env(environ), **overrides})

    @classmethod
    def of(cls, addresses: str | Sequence[str], config: QuantConfig | None = None, **fields: Any) -> GradqConfig:
        """A config from GradqHookState's arguments: ``config`` is the quantization grid (``quant`` here)."""
        if config is not None:
            fields["quant"] = config
        return cls(addresses=tuple([addresses] if isinstance(addresses, str) else addresses), **fields)

    def replace(self, **changes: Any) -> GradqConfig:
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)


def _check_choice(name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is invalid; expected one of {', '.join(choices)}")
