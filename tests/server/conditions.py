"""The tests' condition waits, under the name this folder's tests first imported them by (see tests/waiting.py)."""

from __future__ import annotations

from waiting import wait_until

__all__ = ["wait_until"]
