"""GRADQ_* variables: GradqHookState.from_env() and `gradq worker` read them alike (names, defaults, errors)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gradq.client.ddp import GradqHookState
from gradq.client.env import DEFAULT_CONNECT_TIMEOUT_S, HOOK_ENVIRONMENT, HOOK_PARSERS, hook_arguments_from_env
from gradq.qcore import QuantConfig, Scheme

QUANTIZED = "per_tensor_affine, per_tensor_symmetric, per_channel_affine, per_channel_symmetric, per_channel_sign"
# Variables both readers share, with a bad value and the message both give.
BAD_SHARED_VARIABLES = [
    ({"GRADQ_AGGREGATORS": " , "}, "GRADQ_AGGREGATORS=' , ' is invalid; expected 'host:port[,host:port...]'"),
    ({"GRADQ_BITS": "four"}, "GRADQ_BITS='four' is invalid; expected an integer in 1..8"),
    ({"GRADQ_BITS": "9"}, "GRADQ_BITS='9' is invalid; expected an integer in 1..8"),
    ({"GRADQ_SCHEME": "per_row"}, f"GRADQ_SCHEME='per_row' is invalid; expected one of: {QUANTIZED}"),
    ({"GRADQ_SCHEME": "float32"}, f"GRADQ_SCHEME='float32' is invalid; expected one of: {QUANTIZED}"),
    ({"GRADQ_ERROR_FEEDBACK": "maybe"}, "GRADQ_ERROR_FEEDBACK='maybe' is invalid; expected one of 1, true, yes, on"),
    ({"GRADQ_CHUNK_ELEMENTS": "0"}, "GRADQ_CHUNK_ELEMENTS='0' is invalid; expected an integer >= 1"),
    ({"GRADQ_CONNECT_TIMEOUT": "soon"}, "GRADQ_CONNECT_TIMEOUT='soon' is invalid; expected a number > 0"),
    ({"GRADQ_CONNECT_TIMEOUT": "-1"}, "GRADQ_CONNECT_TIMEOUT='-1' is invalid; expected a number > 0"),
    (
        {"GRADQ_TLS_CA": "/nonexistent/ca.pem"},
        "GRADQ_TLS_CA='/nonexistent/ca.pem' is invalid; expected a readable file",
    ),
]


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
            "GRADQ_CHUNK_ELEMENTS": "4096",
            "GRADQ_CONNECT_TIMEOUT": "2.5",
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
    assert state.chunk_elements == 4096 and state.connect_timeout_s == 2.5


def test_unset_variables_leave_the_states_defaults() -> None:
    state = GradqHookState.from_env({"GRADQ_AGGREGATORS": "a:1"})
    default = GradqHookState("a:1")
    assert state.config == default.config and state.error_feedback == default.error_feedback
    assert state.job_id is None and state.security is None  # rank 0 draws the job id at connect


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({}, "GRADQ_AGGREGATORS='' is invalid; expected 'host:port"),
        *BAD_SHARED_VARIABLES,
    ],
)
def test_a_bad_variable_is_named_with_its_value(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        hook_arguments_from_env({"GRADQ_AGGREGATORS": "a:1", **environ} if environ else {})


@pytest.mark.parametrize(("environ", "message"), BAD_SHARED_VARIABLES)
def test_gradq_worker_refuses_a_bad_variable_with_the_same_message(environ: dict[str, str], message: str) -> None:
    from gradq.client.apps.cluster import build_parser

    with pytest.raises(ValueError, match=re.escape(message)):
        build_parser({"GRADQ_AGGREGATORS": "a:1", **environ})


def test_gradq_worker_and_the_hook_state_have_one_set_of_defaults() -> None:
    from gradq.client.apps.cluster import build_parser

    worker = build_parser({}).parse_args([])
    state = GradqHookState("a:1")
    assert QuantConfig(scheme=worker.scheme, bits=worker.bits) == state.config
    assert worker.connect_timeout == state.connect_timeout_s == DEFAULT_CONNECT_TIMEOUT_S
    assert worker.chunk_elements == state.chunk_elements
    # Unset: the worker passes nothing, and the state keeps its own (off; rank 0 draws the job id).
    assert worker.error_feedback is None and state.error_feedback is False
    assert worker.job_id is None and state.job_id is None


def test_gradq_worker_and_the_hook_state_read_the_same_values() -> None:
    from gradq.client.apps.cluster import build_parser

    environ = {
        "GRADQ_AGGREGATORS": "a:1",
        "GRADQ_BITS": "2",
        "GRADQ_SCHEME": "per_channel_sign",
        "GRADQ_ERROR_FEEDBACK": "on",
        "GRADQ_JOB_ID": "shared",
        "GRADQ_CHUNK_ELEMENTS": "512",
        "GRADQ_CONNECT_TIMEOUT": "0.5",
    }
    worker = build_parser(environ).parse_args([])
    state = GradqHookState.from_env(environ)
    assert QuantConfig(scheme=worker.scheme, bits=worker.bits) == state.config
    assert (worker.error_feedback, worker.job_id) == (state.error_feedback, state.job_id) == (True, "shared")
    assert (worker.chunk_elements, worker.connect_timeout) == (state.chunk_elements, state.connect_timeout_s)


def test_every_variable_has_one_parser() -> None:
    assert set(HOOK_PARSERS) == set(HOOK_ENVIRONMENT)


def test_every_variable_is_one_gradq_worker_reads() -> None:
    # A torchrun script and a Compose worker are configured by one environment.
    from gradq.client.apps.cluster import build_parser

    worker_names = set(re.findall(r"GRADQ_[A-Z_]+", build_parser().format_help()))
    assert sorted(set(HOOK_ENVIRONMENT) - worker_names) == []


def test_host_variables_set_two_level_grouping_and_a_bad_one_is_named() -> None:
    environ = {"GRADQ_AGGREGATORS": "a:1", "GRADQ_HOST": "rack3-node7", "GRADQ_HOST_GROUPING": "flat"}
    state = GradqHookState.from_env(environ)
    assert (state.host, state.host_grouping) == ("rack3-node7", "flat")
    with pytest.raises(ValueError, match=r"GRADQ_HOST_GROUPING='hosts' is invalid; expected one of: auto, flat"):
        GradqHookState.from_env({"GRADQ_AGGREGATORS": "a:1", "GRADQ_HOST_GROUPING": "hosts"})
    with pytest.raises(ValueError, match=r"host_grouping='hosts' is invalid; expected one of auto, flat"):
        GradqHookState("a:1", host_grouping="hosts")
