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

The fragments are whole round keys, so a model needs at least F of them:
when the user leaves ``bucket_elements`` unset, ``choose_buckets`` cuts the
model into smaller round keys until there are (down to one tensor each).

Because ``delay`` is below ``sync_every / F``, the last fragment's update
lands at the outer round's last inner step, before the next round's first
fragment starts: at every multiple of ``sync_every`` no round is in flight
and every fragment stands at the same outer round. Joiners enter, late hosts
catch up and checkpoints are taken there, exactly as without fragments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_BUCKET_ELEMENTS", "FragmentSchedule", "choose_buckets", "cut_buckets", "split_buckets"]

DEFAULT_BUCKET_ELEMENTS = 1 << 22  # 4M elements (16 MiB of fp32) per round key: rounds pipeline, memory stays flat


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


def cut_buckets(numels: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """[begin, end) runs of tensors of ``numels`` elements, of at most ``limit`` elements each (a larger one alone)."""
    buckets, begin, size = [], 0, 0
    for index, numel in enumerate(numels):
        if size and size + numel > limit:
            buckets.append((begin, index))
            begin, size = index, 0
        size += numel
    if size or begin < len(numels):
        buckets.append((begin, len(numels)))
    return buckets


def choose_buckets(numels: Sequence[int], fragments: int, bucket_elements: int | None) -> list[tuple[int, int]]:
    """The round keys of a model of tensors of ``numels`` elements: runs of tensors, at least one per fragment.

    Args:
        numels: the trainable tensors' sizes, in the model's order (the same on every host).
        fragments: F, the fragments the round keys are cut into.
        bucket_elements: the most elements one round key carries, as the user set it;
            None: ``DEFAULT_BUCKET_ELEMENTS``, lowered (halved, down to one tensor
            per key) until the model makes at least F round keys.

    Raises:
        ValueError: fewer tensors than fragments, or a ``bucket_elements`` that makes
            fewer round keys than fragments; the message gives the model's size and what to set.
    """
    total = sum(numels)
    if len(numels) < fragments:
        raise ValueError(
            f"fragments={fragments} but the model has {len(numels)} trainable tensors ({total:,} parameters); "
            f"a fragment is at least one whole tensor: expected fragments <= {len(numels)}"
        )
    if bucket_elements is not None:
        buckets = cut_buckets(numels, bucket_elements)
        if len(buckets) < fragments:
            fits = _largest_limit(numels, fragments)
            raise ValueError(
                f"fragments={fragments} but bucket_elements={bucket_elements:,} cuts the model's {total:,} "
                f"parameters ({len(numels)} tensors) into {len(buckets)} round key(s); expected at least one per "
                f"fragment: set bucket_elements <= {fits:,}, or leave it unset and DiLoCo chooses"
            )
        return buckets
    limit = min(DEFAULT_BUCKET_ELEMENTS, max(1, -(-total // fragments)))
    buckets = cut_buckets(numels, limit)
    while len(buckets) < fragments:  # runs of small tensors fill keys unevenly: smaller keys, down to one tensor each
        limit = max(1, limit // 2)
        buckets = cut_buckets(numels, limit)
    return buckets


def _largest_limit(numels: Sequence[int], fragments: int) -> int:
    """The largest ``bucket_elements`` that cuts tensors of ``numels`` into at least ``fragments`` round keys."""
    low, high = 1, max(1, sum(numels))  # 1 cuts one tensor per key, enough as len(numels) >= fragments
    while low < high:  # fewer keys as the limit grows: the largest limit that still makes enough
        middle = (low + high + 1) // 2
        if len(cut_buckets(numels, middle)) >= fragments:
            low = middle
        else:
            high = middle - 1
    return low


def split_buckets(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Cut the round keys (buckets of ``sizes`` elements, in order) into ``fragments`` runs of about equal size.

    Raises:
        ValueError: fewer buckets than fragments (``choose_buckets`` makes enough).
    """
    if len(sizes) < fragments:
        raise ValueError(
            f"fragments={fragments} but there are {len(sizes)} round keys; expected at least one per fragment"
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
