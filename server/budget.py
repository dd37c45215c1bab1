"""The memory budget: bytes held by open rounds' accumulators, retained means and failures, refused past a limit.

Counted, not measured: the accumulator of a round is allocated only after its
bytes are charged here, so a push that would pass the budget is refused before
anything is allocated and nothing else changes.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading

from gradq.server.errors import ResourceExhaustedError

__all__ = ["MemoryAccount", "MemoryBudget", "return_free_memory"]

log = logging.getLogger(__name__)


def _format_bytes(count: int) -> str:
    return f"{count / (1 << 20):.1f} MiB ({count} bytes)"


class MemoryAccount:
    """One job's share of the budget, so one job cannot take all of it from the others.

    Args:
        name: for messages (``job 'x' (incarnation='y')``).
        limit: most bytes this job may hold (--max-job-memory-bytes).
    """

    __slots__ = ("in_use", "limit", "name")

    def __init__(self, name: str, limit: int) -> None:
        self.name = name
        self.limit = limit
        self.in_use = 0  # changed only under the budget's lock


class MemoryBudget:
    """A byte counter with a ceiling; thread-safe.

    Args:
        limit: most bytes that may be charged at once (--max-memory-bytes).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._in_use = 0

    @property
    def in_use(self) -> int:
        """Bytes charged now."""
        return self._in_use

    def charge(self, nbytes: int, what: str, account: MemoryAccount) -> None:
        """Charge ``nbytes`` for ``what`` to ``account`` and the whole budget, or refuse.

        Raises:
            ResourceExhaustedError: naming the limit (the job's share or the
                budget), what is in use and what was asked for.
        """
        with self._lock:
            if account.in_use + nbytes > account.limit:
                raise ResourceExhaustedError(
                    f"{what} needs {_format_bytes(nbytes)}, but {account.name} may hold at most "
                    f"{_format_bytes(account.limit)} (--max-job-memory-bytes) and holds "
                    f"{_format_bytes(account.in_use)} in open and retained rounds and its buckets' grids; "
                    "retry when its rounds finish"
                )
            if self._in_use + nbytes > self.limit:
                raise ResourceExhaustedError(
                    f"{what} needs {_format_bytes(nbytes)}, but the memory budget is {_format_bytes(self.limit)} "
                    f"(--max-memory-bytes) and {_format_bytes(self._in_use)} is in use by open and "
                    f"retained rounds; retry when rounds finish"
                )
            self._in_use += nbytes
            account.in_use += nbytes

    def adjust(self, old: int, new: int, account: MemoryAccount) -> None:
        """Replace a charge of ``old`` bytes by ``new`` (never refused: it only swaps an accumulator for its mean)."""
        with self._lock:
            self._in_use += new - old
            account.in_use += new - old


_libc: ctypes.CDLL | None = None


def return_free_memory() -> bool:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``).

    The aggregator tells glibc to keep freed multi-megabyte blocks for reuse
    (gradq.proto.transport.keep_large_buffers); after a burst of rounds ends
    that would leave their accumulators resident, so the sweeper calls this
    when the budget's use has fallen.

    Returns:
        True when memory was returned; False off glibc.
    """
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    try:
        _libc = _libc or ctypes.CDLL("libc.so.6")
        trim = _libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return bool(trim(0))
