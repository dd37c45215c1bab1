"""Streaming DiLoCo's schedule: the model in fragments, each synced at its own inner step of every outer round.

Streaming DiLoCo (Douillard et al., arXiv 2501.18512) spreads an outer round
over its ``sync_every`` inner steps: the model's round keys are cut into F
fragments, and fragment i's round starts after inner step
``(i + 1) * sync_every / F - delay`` of the outer round and is applied
``delay`` inner steps later, while the host trains on (the round's
communication overlaps those steps). The link then carries one fragment at a
time (a lower peak), and with ``delay`` > 0 no host waits for a round's mean.
Where the fragment's update lands, the host's own parameters of the fragment
become ``alpha * local + (1 - alpha) * global`` (alpha 0: the global
parameters, as plain DiLoCo).

Because ``delay`` is below ``sync_every / F``, the last fragment's update
lands at the outer round's last inner step, before the next round's first
fragment starts: at every multiple of ``sync_every`` no round is in flight
and every fragment stands at the same outer round. Joiners enter, late hosts
catch up and checkpoints are taken there, exactly as without fragments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["FragmentSchedule", "split_buckets"]


@dataclass(frozen=True, slots=True)
class FragmentSchedule:
    """When each of ``fragments`` fragments starts its round and when its update lands (see the module docstring).

    Args:
        sync_every: H, the inner steps of an outer round; a multiple of ``fragments``.
        fragments: F >= 1; 1 is plain DiLoCo.
        delay: inner steps between a fragment's round starting and its update landing, 0 <= delay < H / F
            (torchft's ``fragment_sync_delay``).
        alpha: the weight of the host's own parameters where an update lands, in [0, 1]
            (torchft's ``fragment_update_alpha``).

    Raises:
        ValueError: a value out of range, named with what was expected.
    """

    sync_every: int
    fragments: int = 1
    delay: int = 0
    alpha: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.fragments, bool) or not isinstance(self.fragments, int) or self.fragments < 1:
            raise ValueError(f"fragments={self.fragments!r} is invalid; expected an integer >= 1 (1: plain DiLoCo)")
        if self.sync_every % self.fragments:
            raise ValueError(
                f"fragments={self.fragments} does not divide sync_every={self.sync_every}; expected a divisor, so "
                f"the fragments start at evenly spaced inner steps"
            )
        spacing = self.sync_every // self.fragments
        if isinstance(self.delay, bool) or not isinstance(self.delay, int) or not 0 <= self.delay < spacing:
            raise ValueError(
                f"fragment_sync_delay={self.delay!r} is invalid; expected an integer in [0, {spacing - 1}] "
                f"(below sync_every / fragments = {spacing}: one fragment in flight at a time)"
            )
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"fragment_update_alpha={self.alpha!r} is invalid; expected a number in [0, 1]")

    def lands(self, inner_steps: int) -> int | None:
        """The fragment whose update lands after inner step number ``inner_steps`` (counted from 1), or None."""
        spacing = self.sync_every // self.fragments
        position = inner_steps % self.sync_every or self.sync_every
        return position // spacing - 1 if position % spacing == 0 else None

    def starts(self, inner_steps: int) -> int | None:
        """The fragment whose round starts after inner step number ``inner_steps``, or None."""
        return self.lands(inner_steps + self.delay)


def split_buckets(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Cut the round keys (buckets of ``sizes`` elements, in order) into ``fragments`` runs of about equal size.

    Raises:
        ValueError: fewer buckets than fragments (lower bucket_elements, or fewer fragments).
    """
    if len(sizes) < fragments:
        raise ValueError(
            f"fragments={fragments} but the model is {len(sizes)} round keys (bucket_elements); expected at least "
            f"one per fragment: lower bucket_elements or use fewer fragments"
        )
    total, runs, key = sum(sizes), [], 0
    done = 0
    for fragment in range(fragments):
        run: list[int] = []
        target = total * (fragment + 1) / fragments
        # Each run takes keys until it reaches its share, leaving at least one key for every run after it.
        while key < len(sizes) - (fragments - fragment - 1) and (not run or done + sizes[key] / 2 <= target):
            run.append(key)
            done += sizes[key]
            key += 1
        runs.append(run)
    runs[-1].extend(range(key, len(sizes)))
    return runs
