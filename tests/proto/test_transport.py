"""The allocator settings gradq's processes apply, checked in fresh interpreters."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "from gradq.proto.transport import keep_large_buffers as k; print(k(), k())"


def probe(**environment: str) -> str:
    env = {name: value for name, value in os.environ.items() if not name.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    env.update(environment)
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_large_buffers_are_kept_once_per_process() -> None:
    assert probe() == "True True\n"


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("MALLOC_MMAP_THRESHOLD_", "131072"),
        ("MALLOC_TRIM_THRESHOLD_", "131072"),
        ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=131072"),
    ],
)
def test_the_users_own_malloc_settings_win(variable: str, value: str) -> None:
    assert probe(**{variable: value}) == "False False\n"


ARENA_PROBE = """
import os
import threading
import gradq.client  # shares one malloc arena unless MALLOC_ARENA_MAX is set
from gradq.proto.transport import keep_large_buffers
keep_large_buffers()  # as WorkerClient does: round-sized blocks come from the heaps
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def churn(done, release):
    blocks = [bytearray(2 << 20) for _ in range(16)]  # 32 MiB of round-sized buffers, freed on this thread
    del blocks
    done.set()
    release.wait()  # and the thread lives on, as gRPC's do
before = rss()
release = threading.Event()
threads = []
for _ in range(3):
    done = threading.Event()
    threads.append(threading.Thread(target=churn, args=(done, release)))
    threads[-1].start()
    done.wait()
print((rss() - before) >> 20)
release.set()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_a_rank_reuses_freed_buffers_across_threads_unless_the_user_set_the_arenas() -> None:
    def retained_mib(**environment: str) -> int:
        env = {name: value for name, value in os.environ.items() if not name.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
        env.update(environment)
        run = subprocess.run([sys.executable, "-c", ARENA_PROBE], env=env, capture_output=True, text=True, check=True)
        return int(run.stdout)

    # One arena: the second and third threads reuse what the first freed (32 MiB held, not 96).
    assert retained_mib() < 48
    assert retained_mib(MALLOC_ARENA_MAX="8") > 80  # the user's setting wins: an arena per thread, each holding its own
