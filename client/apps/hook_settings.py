"""The GradqHookState settings the training apps carry: one field each, turned into the state's arguments in one place.

Every app spec (a fixed DDP job's, an elastic host's) is a ``HookSettings``, so
`gradq worker` builds one from its flags and every path hands all of it to the
hook: a setting added here reaches every path, none can be dropped by one.
Loads no torch: `gradq worker` builds its settings before it imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from gradq.client.security import ChannelSecurity
from gradq.qcore import QuantConfig

__all__ = ["HookSettings"]


@dataclass(frozen=True, slots=True, kw_only=True)
class HookSettings:
    """GradqHookState's settings as an app carries them; None keeps the hook's own default (one default, the hook's).

    Args:
        config: the push grid.
        error_feedback: keep per-bucket residuals.
        fallback: the policy when the aggregator is unreachable.
        connect_timeout_s: how long the first Join waits for each aggregator shard.
        security: TLS / token for the aggregator channels.
        chunk_elements: largest round a bucket is cut into; with several
            shards, smaller chunks spread a small model over them.
        host: this rank's host name for two-level aggregation (None: the launcher's).
        host_grouping: "auto" (two-level where hosts hold several ranks) or "flat".
        bit_policy: "uniform" or "adaptive" bits per bucket piece.
        average_bits: the adaptive policy's most bits per element on average.
    """

    config: QuantConfig = field(default_factory=QuantConfig)
    error_feedback: bool | None = None
    fallback: str | None = None
    connect_timeout_s: float | None = None
    security: ChannelSecurity | None = None
    chunk_elements: int | None = None
    host: str | None = None
    host_grouping: str | None = None
    bit_policy: str | None = None
    average_bits: float | None = None

    def hook_settings(self) -> dict[str, Any]:
        """Every setting by field name, None included: what a spec built from these settings takes.

        Returns:
            ``{field: value}`` for each field of HookSettings (not of a spec that extends it).
        """
        return {setting.name: getattr(self, setting.name) for setting in fields(HookSettings)}

    def state_arguments(self) -> dict[str, Any]:
        """The GradqHookState keyword arguments these settings make.

        Returns:
            Every setting that is not None, by the constructor's argument name
            (the fields are named as its arguments).
        """
        return {name: value for name, value in self.hook_settings().items() if value is not None}
