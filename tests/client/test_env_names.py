"""Unknown GRADQ_* variables are warned of once, with the closest known name; every name gradq reads is known."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from gradq.client import variable_names
from gradq.client.config import GradqConfig
from gradq.client.env import HOOK_ENVIRONMENT
from gradq.client.variable_names import OTHER_VARIABLES, unknown_variables
from gradq.server.env import HEALTHCHECK_ENVIRONMENT, SERVE_ENVIRONMENT

ROOT = Path(__file__).resolve().parents[2]
KNOWN = set(HOOK_ENVIRONMENT) | OTHER_VARIABLES
# Where gradq's readers of variables live: the packages, the tools, the deployment files and the tests.
READERS = ("client", "server", "cli", "proto", "qcore", "bench", "examples", "docker", "deploy", "tests")
# Names that appear in those files without being read: a docstring's placeholder, and this file's misspellings.
NOT_READ = {"GRADQ_X", "GRADQ_BIT", "GRADQ_ERROR_FEEDBAK", "GRADQ_EXPERIMENT_NOTES"}


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a process that has warned of nothing yet."""
    monkeypatch.setattr(variable_names, "_warned", set())


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]


def test_a_misspelt_variable_is_warned_of_once_naming_the_closest_one(caplog: pytest.LogCaptureFixture) -> None:
    environ = {"GRADQ_AGGREGATORS": "a:1", "GRADQ_BIT": "4", "GRADQ_ERROR_FEEDBAK": "1", "gradq_job_id": "j"}
    with caplog.at_level(logging.WARNING, logger="gradq"):
        config = GradqConfig.from_env(environ)
        GradqConfig.from_env(environ)  # read again (every rank's adapter may): no second warning
    assert config.quant.bits == 8  # what the user did not get
    assert warnings_of(caplog) == [
        "GRADQ_BIT is not a gradq variable (it is ignored); did you mean GRADQ_BITS?",
        "GRADQ_ERROR_FEEDBAK is not a gradq variable (it is ignored); did you mean GRADQ_ERROR_FEEDBACK?",
        "gradq_job_id is not a gradq variable (it is ignored); did you mean GRADQ_JOB_ID?",
    ]
    assert {record.name for record in caplog.records} == {"gradq.client.variable_names"}


def test_a_name_like_none_lists_the_worker_s_variables(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gradq"):
        GradqConfig.from_env({"GRADQ_AGGREGATORS": "127.0.0.1:50051", "GRADQ_EXPERIMENT_NOTES": "lr sweep"})
    assert warnings_of(caplog) == [
        f"GRADQ_EXPERIMENT_NOTES is not a gradq variable (it is ignored); a worker reads {', '.join(HOOK_ENVIRONMENT)}"
    ]


def test_gradq_worker_warns_too(caplog: pytest.LogCaptureFixture) -> None:
    from gradq.client.apps.cluster import build_parser

    with caplog.at_level(logging.WARNING, logger="gradq"):
        build_parser({"GRADQ_AGGREGATORS": "127.0.0.1:50051", "GRADQ_BIT": "4"})
    assert warnings_of(caplog) == ["GRADQ_BIT is not a gradq variable (it is ignored); did you mean GRADQ_BITS?"]


def test_the_aggregator_s_and_the_tools_variables_in_a_worker_s_shell_are_not_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # One script may export `gradq serve`'s settings and start the ranks from the same shell.
    environ = {"GRADQ_AGGREGATORS": "127.0.0.1:50051", "GRADQ_WORLD_SIZE": "2", "GRADQ_PORT": "50051"}
    with caplog.at_level(logging.WARNING, logger="gradq"):
        GradqConfig.from_env({**environ, "GRADQ_ROUND_TIMEOUT": "30", "GRADQ_WORKERS": "2", "GRADQ_VENV": "/opt/v"})
    assert warnings_of(caplog) == []
    assert unknown_variables(dict.fromkeys(KNOWN, "1"), HOOK_ENVIRONMENT) == {}


def test_every_variable_the_aggregator_reads_is_known_to_the_worker() -> None:
    assert sorted((set(SERVE_ENVIRONMENT) | set(HEALTHCHECK_ENVIRONMENT)) - KNOWN) == []


def test_every_variable_named_in_gradq_s_code_and_deployment_files_is_known() -> None:
    named: dict[str, set[str]] = {}
    files = [path for folder in READERS for path in (ROOT / folder).rglob("*") if path.is_file()]
    for path in [*files, *ROOT.glob("compose*.yaml")]:
        if "__pycache__" in path.parts or path.suffix in (".pyc", ".png", ".gz"):
            continue
        for name in re.findall(r"GRADQ_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace")):
            named.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    unknown = {name: sorted(paths) for name, paths in named.items() if name not in KNOWN | NOT_READ}
    assert unknown == {}, "add each to gradq.client.variable_names.OTHER_VARIABLES (or the worker's table)"
    # The list holds nothing stale either: each of its names is read somewhere.
    assert sorted(OTHER_VARIABLES - named.keys()) == []


def test_gradq_fallback_sets_the_fallback_for_torchrun_scripts() -> None:
    environ = {"GRADQ_AGGREGATORS": "127.0.0.1:50051", "GRADQ_FALLBACK": "allreduce"}
    assert GradqConfig.from_env(environ).fallback == "allreduce"
    with pytest.raises(ValueError, match=r"^GRADQ_FALLBACK='all' is invalid; expected one of: error, allreduce, allg"):
        GradqConfig.from_env({**environ, "GRADQ_FALLBACK": "all"})
