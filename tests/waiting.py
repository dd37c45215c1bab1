"""Wait for a condition instead of sleeping a fixed time: a test goes on the moment it holds, and fails naming it.

Every folder of tests imports it (tests/ is on pytest's pythonpath), so no test restates the polling loop.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["port_refuses", "wait_until"]

T = TypeVar("T")

# How often a condition is polled: short against every wait a test has, long against the poll's own cost.
_POLL_S = 0.01


def wait_until(
    done: Callable[[], T],
    what: str,
    timeout_s: float = 5.0,
    *,
    alive: Callable[[], bool] | None = None,
    detail: Callable[[], str] | None = None,
    poll_s: float = _POLL_S,
) -> T:
    """Poll ``done`` until it returns something true, and return that.

    Args:
        done: the condition (it must not block).
        what: the condition in words, for the failure.
        timeout_s: how long it may take.
        alive: whether what could still make it hold runs (a process, say); when it stops, fail at once
            rather than at the deadline.
        detail: more for the failure (a log's tail, what each process printed), read only when it fails.
        poll_s: the pause between looks; longer where a look is costly (a command run, a page scraped).

    Raises:
        AssertionError: it did not hold within ``timeout_s``, or ``alive`` said no first; the message names
            ``what`` and the condition's last value.
    """
    deadline = time.monotonic() + timeout_s
    while not (value := done()):
        if alive is not None and not alive():
            raise AssertionError(
                _failure(f"gave up waiting for {what}: what was to make it hold stopped", value, detail)
            )
        if time.monotonic() >= deadline:
            raise AssertionError(_failure(f"waited {timeout_s:g} s for {what}", value, detail))
        time.sleep(poll_s)
    return value


def port_refuses(port: int, host: str = "127.0.0.1") -> bool:
    """Whether nothing accepts connections on ``host:port`` now (a killed server's port, once it is closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        return probe.connect_ex((host, port)) != 0


def _failure(headline: str, value: object, detail: Callable[[], str] | None) -> str:
    text = f"{headline}; the last value was {value!r}"
    return f"{text}\n{detail()}" if detail is not None else text
