"""`gradq worker`: every flag the hook takes reaches the GradqConfig the state is built from, on both paths."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from gradq.client.apps import cluster, elastic_training, training
from gradq.client.config import GradqConfig
from gradq.client.security import ChannelSecurity
from gradq.qcore import QuantConfig, Scheme
from gradq.server.process import free_port

# A quantized scheme other than the default, so that a dropped --scheme shows.
SCHEME = next(scheme for scheme in Scheme if scheme.is_quantized and scheme != QuantConfig().scheme)
AGGREGATOR = "127.0.0.1:1"
# The flags of `gradq worker` that are the app's own (discovery, training length, verdict), not the hook's.
APP_FLAGS = {"world_size", "peers", "master_port", "peer_timeout", "peer_settle", "epochs", "min_accuracy"}


class _StateBuiltError(Exception):
    """Raised by the stand-in for GradqHookState: the config is recorded, and training goes no further."""


def _hook_flags(tmp_path: Path, bit_policy: str = "adaptive") -> tuple[list[str], dict[str, Any]]:
    """Every hook flag set away from its default, and the GradqConfig fields they must make."""
    files = {}
    for name, content in (("ca", "CA PEM"), ("cert", "CERT PEM"), ("key", "KEY PEM"), ("token", "secret\n")):
        files[name] = tmp_path / name
        files[name].write_text(content)
    flags = ["--bits", "3", "--scheme", SCHEME.name.lower(), "--error-feedback", "--connect-timeout", "7"]
    flags += ["--chunk-elements", "4096"]
    flags += ["--host", "rack-7", "--host-grouping", "flat", "--bit-policy", bit_policy, "--average-bits", "4.5"]
    flags += ["--job-id", "hooks", "--tls-ca", str(files["ca"]), "--tls-cert", str(files["cert"])]
    flags += ["--tls-key", str(files["key"]), "--token-file", str(files["token"])]
    expected = {
        "quant": QuantConfig(scheme=SCHEME, bits=3),
        "error_feedback": True,
        "connect_timeout_s": 7.0,
        "chunk_elements": 4096,
        "host": "rack-7",
        "host_grouping": "flat",
        "bit_policy": bit_policy,
        "average_bits": 4.5,
        "job_id": "hooks",
        "security": ChannelSecurity(
            root_certificates=b"CA PEM", certificate_chain=b"CERT PEM", private_key=b"KEY PEM", token="secret"
        ),
    }
    return flags, expected


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[GradqConfig]:
    """The GradqConfig the worker's state is built from (GradqHookState.from_config's), once it is built."""
    for name in [name for name in os.environ if name.startswith("GRADQ_") or name == "WORLD_SIZE"]:
        monkeypatch.delenv(name)
    configs: list[GradqConfig] = []

    class RecordingState:
        @classmethod
        def from_config(cls, config: GradqConfig) -> None:
            configs.append(config)
            raise _StateBuiltError

    monkeypatch.setattr(training, "GradqHookState", RecordingState)
    monkeypatch.setattr(elastic_training, "GradqHookState", RecordingState)
    monkeypatch.setattr(cluster, "wait_for_aggregators", lambda *args: None)  # no aggregator: nothing connects
    monkeypatch.setattr(cluster.PeerDiscovery, "wait", lambda _discovery: (0, "127.0.0.1"))
    monkeypatch.setattr(cluster, "exit_on_sigterm", lambda _status: None)  # leave pytest's SIGTERM alone
    return configs


def _fixed(*flags: str) -> list[str]:
    return [*flags, "--aggregator", AGGREGATOR, "--world-size", "1", "--master-port", str(free_port())]


def test_every_flag_of_gradq_worker_is_the_hooks_or_the_apps(tmp_path: Path) -> None:
    flags, _ = _hook_flags(tmp_path)
    hook_flags = {flag[2:].replace("-", "_") for flag in flags if flag.startswith("--")}
    # The addresses, which path, the elastic path's cap and the fixed path's fallback: they reach the config too.
    path_flags = {"aggregator", "elastic_hosts", "elastic_max_hosts", "fallback"}
    every_flag = {action.dest for action in cluster.build_parser({})._actions} - {"help"}
    assert every_flag == hook_flags | path_flags | APP_FLAGS


def test_the_elastic_path_builds_its_state_from_every_hook_flag(built: list[GradqConfig], tmp_path: Path) -> None:
    # An elastic job refuses the adaptive policy (GradqConfig), so the policy is the default here.
    flags, expected = _hook_flags(tmp_path, bit_policy="uniform")
    with pytest.raises(_StateBuiltError):
        cluster.run([*flags, "--aggregator", AGGREGATOR, "--elastic-hosts", "2"])
    assert built == [GradqConfig.of(AGGREGATOR, elastic_hosts=2, **expected)]


def test_the_fixed_path_builds_its_state_from_every_hook_flag(built: list[GradqConfig], tmp_path: Path) -> None:
    flags, expected = _hook_flags(tmp_path)
    with pytest.raises(_StateBuiltError):
        cluster.run(_fixed(*flags))
    assert built == [GradqConfig.of(AGGREGATOR, **expected)]


def test_a_flag_wins_over_its_variable_and_an_unset_one_leaves_the_variable(
    built: list[GradqConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADQ_BITS", "2")
    monkeypatch.setenv("GRADQ_HOST", "from-env")
    monkeypatch.setenv("GRADQ_ERROR_FEEDBACK", "1")
    with pytest.raises(_StateBuiltError):
        cluster.run(_fixed("--host", "from-flag"))
    assert built == [GradqConfig.of(AGGREGATOR, QuantConfig(bits=2), host="from-flag", error_feedback=True)]


def test_no_hook_flag_and_no_variable_is_gradq_configs_defaults(built: list[GradqConfig]) -> None:
    with pytest.raises(_StateBuiltError):
        cluster.run(_fixed())
    assert built == [GradqConfig.of(AGGREGATOR)]


def test_a_combination_gradq_config_refuses_ends_in_exit_2_naming_it(
    built: list[GradqConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    elastic = ["--aggregator", AGGREGATOR, "--elastic-hosts", "2", "--job-id", "j"]
    with pytest.raises(SystemExit) as stop:
        cluster.run([*elastic, "--bits", "2", "--bit-policy", "adaptive"])
    assert stop.value.code == 2
    assert "gradq worker: error: bit_policy='adaptive' with elastic_hosts=2" in capsys.readouterr().err
    assert built == []
