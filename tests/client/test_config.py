"""GradqConfig: checked once when made, frozen, picklable, and what every adapter and app carries."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from gradq.client.config import GradqConfig
from gradq.client.ddp import GradqHookState
from gradq.qcore import QuantConfig, Scheme


def test_a_config_is_frozen_and_pickles_whole() -> None:
    config = GradqConfig(("a:1", "b:2"), QuantConfig(bits=4), error_feedback=True, job_id="j", max_in_flight=None)
    assert pickle.loads(pickle.dumps(config)) == config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.job_id = "other"  # type: ignore[misc]


def test_replace_checks_the_copy_again() -> None:
    config = GradqConfig(("a:1",))
    assert config.replace(quant=QuantConfig(bits=2)).quant.bits == 2
    with pytest.raises(ValueError, match="codec='cuda' is invalid; expected one of auto, torch, numpy"):
        config.replace(codec="cuda")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"addresses": ()}, r"addresses=\[\] is invalid"),
        ({"fallback": "retry"}, "fallback='retry' is invalid; expected one of error, allreduce, allgather"),
        ({"quant": QuantConfig(scheme=Scheme.FLOAT32)}, "config.scheme=float32 is not quantized"),
        ({"chunk_elements": -1}, "chunk_elements=-1 is invalid; expected an integer >= 0"),
        ({"max_in_flight": 0}, "max_in_flight=0 is invalid"),
        ({"elastic_hosts": 2}, "elastic_hosts needs job_id"),
        ({"elastic_hosts": 2, "job_id": "j", "fallback": "allreduce"}, "an elastic host cannot fall back"),
        (
            {"elastic_hosts": 3, "job_id": "j", "elastic_max_hosts": 2},
            r"elastic_max_hosts=2 is invalid; expected 0 \(no cap\) or an integer >= elastic_hosts=3",
        ),
        ({"elastic_max_hosts": 4}, "elastic_max_hosts=4 caps an elastic job; set elastic_hosts too"),
        ({"elastic_max_hosts": -1}, r"elastic_max_hosts=-1 is invalid; expected 0 \(no cap\) or an integer >= 1"),
        ({"bit_policy": "adaptive", "average_bits": 9.0}, "average_bits=9.0 is out of range; expected 8..8"),
        (
            {"bit_policy": "adaptive", "quant": QuantConfig(bits=2), "elastic_hosts": 2, "job_id": "j"},
            "bit_policy='adaptive' with elastic_hosts=2: elastic hosts plan their bits apart",
        ),
    ],
)
def test_a_bad_field_or_combination_is_refused_naming_it(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GradqConfig(**{"addresses": ("a:1",), **fields})  # type: ignore[arg-type]


def test_from_env_reads_the_variables_and_overrides_win() -> None:
    environ = {"GRADQ_AGGREGATORS": "a:1,b:2", "GRADQ_BITS": "4", "GRADQ_ERROR_FEEDBACK": "1", "GRADQ_JOB_ID": "j"}
    config = GradqConfig.from_env(environ, job_id="mine")
    assert config.addresses == ("a:1", "b:2") and config.quant.bits == 4 and config.error_feedback
    assert config.job_id == "mine"


def test_the_hook_state_carries_a_config_and_reads_its_fields() -> None:
    config = GradqConfig(("a:1",), QuantConfig(bits=4), chunk_elements=4096, host_grouping="flat")
    state = GradqHookState.from_config(config)
    assert state.gradq_config is config
    assert state.config == QuantConfig(bits=4) and state.chunk_elements == 4096 and state.host_grouping == "flat"
    assert state.addresses == ["a:1"] and state.session is None and state.mode is None
    assert pickle.loads(pickle.dumps(state)).gradq_config == config


def test_the_state_s_fields_may_change_before_it_connects_checked_as_a_whole() -> None:
    state = GradqHookState("a:1")
    state.timeout_s = 5.0
    state.job_id = "mine"
    state.config = QuantConfig(bits=2)
    assert state.gradq_config == GradqConfig(("a:1",), QuantConfig(bits=2), timeout_s=5.0, job_id="mine")
    with pytest.raises(ValueError, match="fallback='retry' is invalid"):
        state.fallback = "retry"
    assert state.fallback == "error"  # a refused change leaves the state as it was


def test_a_connected_state_s_copy_keeps_the_job_id_rank_0_drew(exact_aggregator: str, group: None) -> None:
    state = GradqHookState(exact_aggregator)  # no job id: rank 0 draws one at connect
    assert state.start() == 0  # connects now, as the first bucket would
    try:
        drawn = state.job_id
        assert drawn is not None and drawn.startswith("ddp-")
        copy = pickle.loads(pickle.dumps(state))
        assert copy.job_id == drawn and copy.session is None and copy.incarnation is None
        with pytest.raises(RuntimeError, match="timeout_s cannot change once the state has connected"):
            state.timeout_s = 1.0
    finally:
        state.close()
