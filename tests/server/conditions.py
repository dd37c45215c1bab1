"""Wait for a condition instead of sleeping a fixed time: a test goes on the moment it holds, and fails naming it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["wait_until"]

T = TypeVar("T")

# How often a condition is polled: short against every wait a test has, long against the poll's own cost.
_POLL_S = 0.01


def wait_until(done: Callable[[], T], what: str, timeout_s: float = 5.0) -> T:
    """Poll ``done`` until it returns something true, and return that.

    Args:
        done: the condition (it must not block).
        what: the condition in words, for the failure.
        timeout_s: how long it may take.

    Raises:
        AssertionError: it did not hold within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not (value := done()):
        assert time.monotonic() < deadline, f"waited {timeout_s:g} s for {what}"
        time.sleep(_POLL_S)
    return value
