"""What a worker's compression saves and costs: the client-side half of gradq's observability."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from gradq.proto.convert import DTYPE_BYTES

__all__ = ["ClientStats", "StatsRecorder"]

log = logging.getLogger("gradq.client.stats")


@dataclass(frozen=True, slots=True)
class ClientStats:
    """Totals since the client was made (seconds are summed over pushes)."""

    pushes: int
    encode_seconds: float  # quantizing (and error feedback) on the caller's thread
    network_seconds: float  # push sent to mean received, including the wait for other ranks
    decode_seconds: float  # checking and dequantizing the mean
    bytes_sent: int
    bytes_received: int
    uncompressed_bytes: int  # what the pushed buckets weigh in their own dtype (what DDP would send)
    dtype: str  # that dtype, e.g. "bfloat16"; "+"-joined when buckets differ; "" before the first push
    relative_error: float  # mean of ||decoded push - input|| / ||input|| over the pushes sampled
    skipped_rounds: int  # rounds the aggregator skipped (a rank had NaN/Inf)
    partial_rounds: int  # rounds averaged over a quorum, ranks missing

    @property
    def compression_ratio(self) -> float:
        """Uncompressed bytes (in ``dtype``) / wire bytes pushed (0 before the first push)."""
        return self.uncompressed_bytes / self.bytes_sent if self.bytes_sent else 0.0

    def line(self) -> str:
        """One log line: the figures an operator asks for first."""
        per_push = 1000 / max(self.pushes, 1)  # milliseconds per push
        return (
            f"pushes={self.pushes} ratio={self.compression_ratio:.2f}x vs {self.dtype or 'none'} "
            f"rel_error={self.relative_error:.2e} "
            f"encode_ms={self.encode_seconds * per_push:.2f} network_ms={self.network_seconds * per_push:.2f} "
            f"decode_ms={self.decode_seconds * per_push:.2f} sent_mb={self.bytes_sent / 1e6:.1f} "
            f"received_mb={self.bytes_received / 1e6:.1f} skipped={self.skipped_rounds} partial={self.partial_rounds}"
        )


class StatsRecorder:
    """Thread-safe accumulation (pushes start on the caller, replies land on gRPC threads)."""

    def __init__(self, log_every_s: float | None = None) -> None:
        self._lock = threading.Lock()
        self._totals = dict.fromkeys(
            (
                "pushes",
                "bytes_sent",
                "bytes_received",
                "uncompressed_bytes",
                "skipped_rounds",
                "partial_rounds",
                "errors",
            ),
            0,
        )
        self._seconds = dict.fromkeys(("encode", "network", "decode", "error_sum"), 0.0)
        self._dtypes: set[str] = set()
        self._log_every_s = log_every_s
        self._last_log = time.monotonic()

    def pushed(
        self, numel: int, wire_bytes: int, encode_seconds: float, relative_error: float | None, dtype: str = "float32"
    ) -> None:
        """Record one push of ``numel`` elements of ``dtype`` (the bucket's own element type)."""
        with self._lock:
            self._totals["pushes"] += 1
            self._totals["bytes_sent"] += wire_bytes
            self._totals["uncompressed_bytes"] += DTYPE_BYTES[dtype] * numel
            self._dtypes.add(dtype)
            self._seconds["encode"] += encode_seconds
            if relative_error is not None:
                self._totals["errors"] += 1
                self._seconds["error_sum"] += relative_error

    def pulled(
        self, wire_bytes: int, network_seconds: float, decode_seconds: float, skipped: bool, partial: bool
    ) -> None:
        """Record one answer; logs the one-line summary when ``log_every_s`` has passed."""
        with self._lock:
            self._totals["bytes_received"] += wire_bytes
            self._totals["skipped_rounds"] += skipped
            self._totals["partial_rounds"] += partial
            self._seconds["network"] += network_seconds
            self._seconds["decode"] += decode_seconds
            due = self._log_every_s is not None and time.monotonic() - self._last_log >= self._log_every_s
            if due:
                self._last_log = time.monotonic()
        if due:
            log.info("gradq client %s", self.snapshot().line())

    def snapshot(self) -> ClientStats:
        """The totals so far."""
        with self._lock:
            totals, seconds, dtypes = dict(self._totals), dict(self._seconds), "+".join(sorted(self._dtypes))
        return ClientStats(
            pushes=totals["pushes"],
            encode_seconds=seconds["encode"],
            network_seconds=seconds["network"],
            decode_seconds=seconds["decode"],
            bytes_sent=totals["bytes_sent"],
            bytes_received=totals["bytes_received"],
            uncompressed_bytes=totals["uncompressed_bytes"],
            dtype=dtypes,
            relative_error=seconds["error_sum"] / totals["errors"] if totals["errors"] else 0.0,
            skipped_rounds=totals["skipped_rounds"],
            partial_rounds=totals["partial_rounds"],
        )
