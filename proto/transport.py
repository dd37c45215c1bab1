"""Transport settings every gradq gRPC endpoint shares: message limits, flow control, buffer reuse, TLS or not.

Why the allocator is tuned here: a bucket crosses gRPC-Python as several
multi-megabyte buffers per call (the serialized message, core's slices, the
bytes handed back to Python). glibc serves each from a fresh ``mmap`` (or
trims a thread arena with ``madvise``) and the kernel zero-fills its pages on
first touch, so every call pays page faults and page clearing for memory it
freed a moment ago. Measured on a 5.8 MB echo over loopback (2 cores), the
client spent 12.1 ms of CPU per call with glibc's defaults and 5.6 ms with
large blocks kept in the heap: page faults, not copies, were half the cost.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import ssl
import sys

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MAX_DETAILS_CHARACTERS",
    "MAX_PUSH_WEIGHT",
    "MAX_STATE_CHUNK_BYTES",
    "REFUSAL_METADATA_KEY",
    "STREAM_WINDOW_BYTES",
    "bounded_details",
    "channel_options",
    "keep_large_buffers",
    "share_one_arena",
    "speaks_tls",
]

log = logging.getLogger(__name__)

# gRPC refuses messages over 4 MiB by default; a 256 MB fp32 bucket returned
# as fp32 needs ~256 MiB, so 1 GiB leaves room on both ends.
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
# StateChunk.data's limit (the .proto says it, tests/proto/test_comments.py holds it to this): the
# aggregator refuses a larger chunk, and a sender cuts the state into chunks of this size.
MAX_STATE_CHUNK_BYTES = 1 << 20
# The trailing metadata key that carries a refusal's reason (the proto enum Refusal's value name, without
# its prefix): clients decide on it, never on the details' prose.
REFUSAL_METADATA_KEY = "gradq-refusal"
# The most characters of a refusal's details: enough for every message gradq writes, and a cap on what a
# refusal that quotes a request field (a job id, a signature line) can cost while it waits to be read.
MAX_DETAILS_CHARACTERS = 2048
# The largest PushPullRequest.weight (a weighted job's push: tokens or samples): a trillion per host and
# round key is far past any run, and the bound keeps the sum of a round's weights an exact integer well
# inside int64 (a weighted sum that overflows float32 fails its round as any overflowing contribution does).
MAX_PUSH_WEIGHT = 1 << 40
# A stream's first HTTP/2 flow-control window, both ways (channel_options).
STREAM_WINDOW_BYTES = 4 << 20


def bounded_details(details: str) -> str:
    """``details`` cut to ``MAX_DETAILS_CHARACTERS``, saying how much was left out."""
    if len(details) <= MAX_DETAILS_CHARACTERS:
        return details
    return f"{details[: MAX_DETAILS_CHARACTERS - 40]} ... ({len(details) - MAX_DETAILS_CHARACTERS + 40} more)"


# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it accepts on 64-bit.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_MMAP_THRESHOLD_MAX = 32 << 20
# Free memory a heap keeps before returning it to the kernel.
_TRIM_THRESHOLD = 256 << 20
# The user's own malloc settings win over ours.
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_USER_TUNABLES = "glibc.malloc."

_tuned: bool | None = None


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, connection: int = 0) -> list[tuple[str, int]]:
    """gRPC options for a gradq channel or server: message limits both ways, the streams' first window.

    Args:
        max_message_bytes: the largest message either way.
        connection: a client's extra connection to one shard (1, 2, ...; 0: its
            first). gRPC puts channels whose arguments are equal on one shared
            connection; an extra one gets a subchannel pool of its own and an
            argument that differs, so it is a TCP connection of its own.
    """
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Each stream's first flow-control window (HTTP/2's default is 64 KiB): a new connection to an
        # aggregator 100 ms away would carry 640 KB/s until gRPC's BDP probe (left on) grew the window,
        # which takes several round trips of traffic. The probe still sets the window from then on.
        ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
    ]
    if connection:
        options += [("grpc.use_local_subchannel_pool", 1), ("gradq.connection", connection)]
    return options


def keep_large_buffers() -> bool:
    """Let glibc reuse freed multi-megabyte blocks instead of unmapping them (once per process).

    Serves blocks up to 32 MiB from the heap and keeps up to 256 MiB of free
    heap, so a process's resident memory stays near its peak between steps.
    Does nothing off Linux/glibc or when the user set MALLOC_MMAP_THRESHOLD_,
    MALLOC_TRIM_THRESHOLD_ or glibc.malloc tunables (GLIBC_TUNABLES).

    Returns:
        True when the settings are in effect (set now or earlier).
    """
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if not sys.platform.startswith("linux") or any(name in os.environ for name in _USER_SETTINGS):
        return False
    if _USER_TUNABLES in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        # By name, not ctypes.util.find_library: that runs ldconfig in a subprocess.
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl and other libcs have no libc.so.6 with mallopt
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _tuned = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    log.debug("large gRPC buffers are %s", "kept in the heap" if _tuned else "left to glibc's defaults")
    return _tuned


def share_one_arena() -> bool:
    """Have every thread started from now on allocate from glibc's main arena (a training rank's setting).

    A rank's pushes allocate and free round-sized buffers (encoded payloads,
    request and response bytes) on several threads: the training loop's, the
    sender, gRPC's. glibc gives each thread an arena of its own and returns a
    freed block to the arena that made it, so every arena keeps its own
    high-water mark of those buffers: 375-433 MB of free heap at a GPT-2 124M
    rank's peak (bench/worker_memory.py). In one arena they are reused across
    threads: the peak fell to the residuals and the kernels, and the step's
    CPU did not grow (docs/performance.md). Threads that already have an
    arena keep it, so this runs when gradq.client is imported, before a
    training script starts its threads. Once per process; does nothing off
    Linux/glibc or when the user set MALLOC_ARENA_MAX or glibc.malloc tunables.

    Returns:
        True when the setting is in effect.
    """
    if not sys.platform.startswith("linux") or "MALLOC_ARENA_MAX" in os.environ:
        return False
    if _USER_TUNABLES in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl and other libcs have no libc.so.6 with mallopt
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_ARENA_MAX, 1))


def speaks_tls(address: str, timeout_s: float = 2.0) -> bool | None:
    """Whether the endpoint at ``host:port`` answers a TLS handshake, to explain a failed call.

    A gRPC call over plaintext to a TLS aggregator (or the reverse) fails as
    UNAVAILABLE or DEADLINE_EXCEEDED with nothing that names the cause; this
    opens a TCP connection of its own and starts a TLS handshake, verifying no
    certificate.

    Args:
        address: ``host:port`` (an IPv6 host in brackets).
        timeout_s: for the connection and the handshake.

    Returns:
        True if it answered in TLS (a completed handshake, or a TLS alert such
        as "certificate required"), False if it answered but not in TLS, None
        if no connection could be made (or ``address`` is not host:port).
    """
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])  # gRPC servers refuse a handshake without it
    try:
        connection = socket.create_connection((host.strip("[]") or "localhost", int(port)), timeout=timeout_s)
    except OSError:
        return None
    with connection:
        try:
            context.wrap_socket(connection).close()
        except ssl.SSLError as error:
            return "ALERT" in str(error.reason).upper()
        except OSError:  # closed or reset mid-handshake: not a TLS peer
            return False
    return True
