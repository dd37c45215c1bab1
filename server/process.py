"""Run `gradq serve` as a child process on loopback (tests, benchmarks, the demo); no torch involved."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["free_port", "spawn_aggregator", "spawn_shards"]


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
    process, ports = _spawn(["--port", str(port), *flags], timeout_s, popen)
    return process, ports[0]


def spawn_shards(
    shards: int, *flags: str, port: int = 0, timeout_s: float = 60.0, **popen: Any
) -> tuple[subprocess.Popen, list[int]]:
    """Start `python -m gradq.server --shards N` on 127.0.0.1 and wait until every shard serves.

    Args:
        shards: how many shard processes the parent runs.
        flags: more `gradq serve` flags.
        port: the first shard's port (the others follow it); 0 picks free ones.
        timeout_s: how long to wait for all of them to serve.
        popen: passed to ``subprocess.Popen`` (stderr, env, ...).

    Returns:
        (the parent process, each shard's port in shard order).

    Raises:
        RuntimeError: it exited or did not serve within ``timeout_s``.
    """
    return _spawn(["--shards", str(shards), "--port", str(port), *flags], timeout_s, popen)


def _spawn(flags: list[str], timeout_s: float, popen: dict[str, Any]) -> tuple[subprocess.Popen, list[int]]:
    """Run `gradq serve` with ``flags`` and a port file; the ports it lists once it serves (one line a shard)."""
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        command = [sys.executable, "-m", "gradq.server", "--host", "127.0.0.1"]
        process = subprocess.Popen([*command, "--port-file", str(port_file), *flags], **popen)
        deadline = time.monotonic() + timeout_s
        while not (port_file.exists() and port_file.read_text().strip()):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"gradq serve {' '.join(flags)} did not start (exit status {process.wait()})")
            time.sleep(0.05)
        return process, [int(line) for line in port_file.read_text().split()]
