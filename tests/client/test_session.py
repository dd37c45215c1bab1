"""GradqSession directly, as a new training loop's adapter drives it: one call per flat tensor, a real aggregator."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from gradq.client.config import GradqConfig
from gradq.client.sending import AggregationError
from gradq.client.session import GradqSession
from gradq.qcore import QuantConfig
from gradq.server.app import AggregatorServer
from gradq.server.policy import RoundPolicy


def test_reduce_averages_a_flat_tensor_and_the_session_says_what_it_holds(exact_aggregator: str, group: None) -> None:
    config = GradqConfig((exact_aggregator,), QuantConfig(bits=8), error_feedback=True, job_id="session-direct")
    session = GradqSession.connect(config)
    try:
        assert session.mode == "gradq" and session.host.flat
        values = torch.linspace(-1.0, 1.0, 3000)
        reduced = [session.reduce(values.clone(), 0, key) for key in (0, 1)]
        session.end_step()
        means = [future.wait() for future in reduced]
        held = session.held_bytes()
    finally:
        session.close()
    for mean in means:  # one rank: the mean is what it sent, to 8 bits
        assert mean.shape == values.shape and torch.allclose(mean, values, atol=2 / 255)
    # Error feedback keeps one float32 per element pushed; nothing is in flight once the means are in.
    assert held == {"residuals": 2 * 3000 * 4, "requests": 0}
    with pytest.raises(RuntimeError, match="the gradq session is closed"):
        session.reduce(values, 1, 0)


def test_a_refused_join_is_reported_as_refused_whatever_the_fallback(
    start_aggregator: Callable[..., AggregatorServer], group: None
) -> None:
    server = start_aggregator(RoundPolicy(world_size=4))
    config = GradqConfig((f"127.0.0.1:{server.port}",), fallback="allreduce", job_id="refused")
    with pytest.raises(AggregationError, match=r"refused the Join: .*configuration mismatch") as raised:
        GradqSession.connect(config)
    assert "unreachable" not in str(raised.value)
