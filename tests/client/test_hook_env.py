"""GradqHookState.from_env(): the GRADQ_* names of `gradq worker`'s flags, their defaults and their errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gradq.client.ddp import GradqHookState
from gradq.client.ddp.env import HOOK_ENVIRONMENT, hook_arguments_from_env
from gradq.qcore import QuantConfig, Scheme


def test_every_variable_reaches_the_state(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_bytes(b"CA")
    (tmp_path / "token").write_text("secret\n")
    state = GradqHookState.from_env(
        {
            "GRADQ_AGGREGATORS": "a:1, b:2",
            "GRADQ_BITS": "2",
            "GRADQ_SCHEME": "per_tensor_affine",
            "GRADQ_ERROR_FEEDBACK": "yes",
            "GRADQ_JOB_ID": "tutjob",
            "GRADQ_TLS_CA": str(tmp_path / "ca.pem"),
            "GRADQ_TOKEN_FILE": str(tmp_path / "token"),
            "GRADQ_PORT": "50051",  # a `gradq serve` variable: not the worker's business
        },
        fallback="allreduce",
    )
    assert state.addresses == ["a:1", "b:2"] and state.job_id == "tutjob" and state.error_feedback
    assert state.config == QuantConfig(scheme=Scheme.PER_TENSOR_AFFINE, bits=2)
    assert state.security is not None and state.security.root_certificates == b"CA"
    assert state.security.token == "secret" and state.fallback == "allreduce"


def test_unset_variables_leave_the_states_defaults() -> None:
    state = GradqHookState.from_env({"GRADQ_AGGREGATORS": "a:1"})
    default = GradqHookState("a:1")
    assert state.config == default.config and state.error_feedback == default.error_feedback
    assert state.job_id is None and state.security is None  # rank 0 draws the job id at connect


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({}, "GRADQ_AGGREGATORS='' is invalid; expected 'host:port"),
        ({"GRADQ_AGGREGATORS": " , "}, "GRADQ_AGGREGATORS=' , ' is invalid"),
        ({"GRADQ_BITS": "four"}, "GRADQ_BITS='four' is invalid; expected an integer in 1..8"),
        ({"GRADQ_BITS": "9"}, "GRADQ_BITS / GRADQ_SCHEME: bits=9 is out of range"),
        ({"GRADQ_ERROR_FEEDBACK": "maybe"}, "GRADQ_ERROR_FEEDBACK='maybe' is invalid; expected one of 1, true"),
        ({"GRADQ_TLS_CA": "/nonexistent/ca.pem"}, "GRADQ_TLS_CA='/nonexistent/ca.pem' is invalid; expected a readable"),
    ],
)
def test_a_bad_variable_is_named_with_its_value(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        hook_arguments_from_env({"GRADQ_AGGREGATORS": "a:1", **environ} if environ else {})


def test_every_variable_is_one_gradq_worker_reads() -> None:
    # A torchrun script and a Compose worker are configured by one environment.
    from gradq.client.apps.cluster import build_parser

    worker_names = set(re.findall(r"GRADQ_[A-Z_]+", build_parser().format_help()))
    assert sorted(set(HOOK_ENVIRONMENT) - worker_names) == []
