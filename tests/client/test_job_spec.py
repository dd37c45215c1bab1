"""The job's spec travels whole: checked once as it is made, placed by GradqSession.connect, carried by every Join."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradq.client import JobSpec, WorkerClient, serde
from gradq.client.config import GradqConfig
from gradq.client.session import GradqSession
from gradq.qcore import QuantConfig
from gradq.qcore.outer_step import OuterStep


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"world_size": 0}, r"world_size=0 is invalid; expected an integer >= 1"),
        ({"world_size": True}, r"world_size=True is invalid; expected an integer >= 1"),
        ({"ranks": 0}, r"ranks=0 is invalid; expected an integer >= 1"),
        ({"ranks": 1.5}, r"ranks=1.5 is invalid; expected an integer >= 1"),
        ({"world_size": 2, "job_ranks": 1}, r"job_ranks=1 is invalid; expected an integer >= world_size=2"),
        ({"job_ranks": None}, r"job_ranks=None is invalid; expected an integer >= world_size=1"),
        ({"max_members": -1}, r"max_members=-1 is invalid; expected an integer >= 0 \(0: no cap\)"),
    ],
)
def test_a_spec_out_of_range_is_refused_naming_the_field_and_value(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        JobSpec(**fields)  # type: ignore[arg-type]


def test_the_loops_part_is_written_alone_and_a_bare_world_size_still_makes_a_client() -> None:
    spec = JobSpec(model_signature="0.fc.weight float32[4]", weighted=True)
    assert (spec.world_size, spec.ranks, spec.job_ranks, spec.elastic) == (1, 1, 0, False)
    client = WorkerClient("127.0.0.1:1", "j", 1, 2, QuantConfig(bits=8))
    try:
        assert client.spec == JobSpec(world_size=2)
    finally:
        client.close()


def test_a_join_carries_every_field_of_the_spec() -> None:
    spec = JobSpec(
        world_size=2,
        ranks=4,
        job_ranks=8,
        model_signature="m",
        outer_step=OuterStep(lr=0.7, momentum=0.9, nesterov=True),
        weighted=True,
    )
    request = serde.join_request("j", 1, spec, "run")
    assert (request.world_size, request.ranks, request.job_ranks, request.model_signature) == (2, 4, 8, "m")
    assert request.weighted and request.outer_step.lr == pytest.approx(0.7) and request.outer_step.nesterov
    assert not request.HasField("semi_sync")


@pytest.mark.parametrize(
    ("placement", "value"),
    [("world_size", 4), ("ranks", 2), ("elastic", True), ("job_ranks", 8), ("max_members", 3)],
)
def test_connect_refuses_a_job_that_places_the_member_itself(placement: str, value: object) -> None:
    config = GradqConfig.of("127.0.0.1:1", job_id="placed")
    job = JobSpec(**{placement: value})  # type: ignore[arg-type]
    expected = rf"job\.{placement}={value!r} is invalid; expected the default .*: GradqSession\.connect sets it from"
    with pytest.raises(ValueError, match=f"{expected} the config and the host placement"):
        GradqSession.connect(config, job=job)


def test_connect_refuses_a_model_signature_where_the_spec_goes() -> None:
    config = GradqConfig.of("127.0.0.1:1", job_id="old-call")
    with pytest.raises(ValueError, match=r"job='linear\.weight.*' is invalid; expected a gradq\.client\.JobSpec"):
        GradqSession.connect(config, None, None, "linear.weight 4x4 float32")  # type: ignore[arg-type]


def test_numpy_counts_are_taken_as_integers() -> None:
    spec = JobSpec(world_size=np.int64(3), ranks=np.int32(2))  # type: ignore[arg-type]
    assert (spec.world_size, spec.ranks) == (3, 2) and type(spec.world_size) is int


def test_a_weighted_job_given_to_connect_reaches_the_client_and_its_pushes(exact_aggregator: str) -> None:
    config = GradqConfig((exact_aggregator,), QuantConfig(bits=8), job_id="session-weighted")
    session = GradqSession.connect(config, job=JobSpec(weighted=True))
    try:
        assert session.client is not None and session.client.spec == JobSpec(weighted=True, job_ranks=1)
        values = torch.linspace(-1.0, 1.0, 64)
        with pytest.raises(ValueError, match=r"weight=0 is invalid; expected an integer in 1\.\."):
            session.reduce(values.clone(), 0, 0)
        mean = session.reduce(values.clone(), 0, 0, weight=3).wait()
    finally:
        session.close()
    assert torch.allclose(mean, values, atol=2 / 255)  # one host: its weighted mean is what it sent, to 8 bits
