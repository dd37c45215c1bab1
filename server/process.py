"""Run `gradq serve` as a child process on loopback (tests, benchmarks, the demo); no torch involved."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["spawn_aggregator", "free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def spawn_aggregator(*flags: str, port: int = 0, timeout_s: float = 60.0, **popen: Any) -> tuple[subprocess.Popen, int]:
    """Start `python -m gradq.server` on 127.0.0.1 and wait until it serves.

    Args:
        flags: more `gradq serve` flags.
        port: port to bind; 0 picks a free one.
        timeout_s: how long to wait for it to serve.
        popen: passed to ``subprocess.Popen`` (stderr, env, ...).

    Returns:
        (the process, the port it serves on).

    Raises:
        RuntimeError: it exited or did not serve within ``timeout_s``.
    """
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        command = [sys.executable, "-m", "gradq.server", "--host", "127.0.0.1", "--port", str(port)]
        process = subprocess.Popen([*command, "--port-file", str(port_file), *flags], **popen)
        deadline = time.monotonic() + timeout_s
        while not (port_file.exists() and port_file.read_text().strip()):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"gradq serve {' '.join(flags)} did not start (exit status {process.wait()})")
            time.sleep(0.05)
        return process, int(port_file.read_text())
