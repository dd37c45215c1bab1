"""What a finished round tells the observer (metrics): its outcome, sizes, timing and re-quantization error."""

from __future__ import annotations

import time

import numpy as np

from gradq import qcore
from gradq.qcore import QuantizedArray
from gradq.server.reports import RoundReport
from gradq.server.round_state import Round

__all__ = ["relative_error", "round_report"]


def relative_error(mean: np.ndarray, encoded: QuantizedArray) -> float:
    """||decode(encoded) - mean|| / ||mean||: what re-quantizing the mean cost (0 for a zero mean).

    Args:
        mean: the round's fp32 mean.
        encoded: that mean on the return grid.

    Returns:
        The relative L2 error, in one pass over the mean for the uniform grids (``gradq.qcore.relative_error``:
        no decoded copy of a mean that may be hundreds of MB).
    """
    return qcore.relative_error(encoded, mean)


def round_report(job_id: str, rnd: Round, outcome: str, reason: str) -> RoundReport:
    """The report of a round that has just finished.

    Args:
        job_id: its job.
        rnd: the round (its result set unless it failed).
        outcome: completed, partial, skipped or failed.
        reason: why it closed early ("" when complete).

    Returns:
        The report for the observer.
    """
    arrivals = sorted(rnd.arrivals.items(), key=lambda item: item[1])
    # Counted as the client counts what it receives: the encoded mean's wire size.
    sent = rnd.result.mean_bytes * len(rnd.result.contributors) if rnd.result is not None else 0
    return RoundReport(
        job_id=job_id,
        outcome=outcome,
        reason=reason,
        contributors=len(rnd.contributors),
        numel=rnd.pushed.numel,
        received_bytes=rnd.received_bytes,
        sent_bytes=sent,
        seconds=time.monotonic() - rnd.opened_at,
        straggler_seconds=arrivals[-1][1] - arrivals[-2][1] if len(arrivals) > 1 else 0.0,
        slowest_rank=arrivals[-1][0] if arrivals else -1,
        relative_error=rnd.relative_error,
        dtype=rnd.pushed.dtype,
        error=str(rnd.error) if rnd.error is not None else "",
    )
