"""`gradq worker`: every flag the hook takes reaches GradqHookState, on the fixed path and on the elastic path."""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import pytest

from gradq.client.apps import cluster, elastic_training, training
from gradq.client.ddp import GradqHookState
from gradq.client.security import ChannelSecurity
from gradq.qcore import QuantConfig, Scheme
from gradq.server.process import free_port

# A quantized scheme other than the default, so that a dropped --scheme shows.
SCHEME = next(scheme for scheme in Scheme if scheme.is_quantized and scheme != QuantConfig().scheme)
AGGREGATOR = "127.0.0.1:1"
# The flags of `gradq worker` that are the app's own (discovery, training length, verdict), not the hook's.
APP_FLAGS = {"world_size", "peers", "master_port", "peer_timeout", "peer_settle", "epochs", "min_accuracy"}


class _StateBuiltError(Exception):
    """Raised by the stand-in for GradqHookState: the arguments are recorded, and training goes no further."""


def _hook_flags(tmp_path: Path) -> tuple[list[str], dict[str, Any]]:
    """Every hook flag set away from its default, and the GradqHookState argument each must arrive as."""
    files = {}
    for name, content in (("ca", "CA PEM"), ("cert", "CERT PEM"), ("key", "KEY PEM"), ("token", "secret\n")):
        files[name] = tmp_path / name
        files[name].write_text(content)
    flags = ["--bits", "3", "--scheme", SCHEME.name.lower(), "--error-feedback", "--connect-timeout", "7"]
    flags += ["--chunk-elements", "4096"]
    flags += ["--host", "rack-7", "--host-grouping", "flat", "--bit-policy", "adaptive", "--average-bits", "4.5"]
    flags += ["--job-id", "hooks", "--tls-ca", str(files["ca"]), "--tls-cert", str(files["cert"])]
    flags += ["--tls-key", str(files["key"]), "--token-file", str(files["token"])]
    expected = {
        "config": QuantConfig(scheme=SCHEME, bits=3),
        "error_feedback": True,
        "connect_timeout_s": 7.0,
        "chunk_elements": 4096,
        "host": "rack-7",
        "host_grouping": "flat",
        "bit_policy": "adaptive",
        "average_bits": 4.5,
        "job_id": "hooks",
        "security": ChannelSecurity(
            root_certificates=b"CA PEM", certificate_chain=b"CERT PEM", private_key=b"KEY PEM", token="secret"
        ),
    }
    return flags, expected


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The arguments the worker's GradqHookState is built with (by name; the addresses as ``addresses``)."""
    for name in [name for name in os.environ if name.startswith("GRADQ_") or name == "WORLD_SIZE"]:
        monkeypatch.delenv(name)
    arguments: dict[str, Any] = {}

    def record(*args: Any, **kwargs: Any) -> None:
        arguments.update(inspect.signature(GradqHookState).bind(*args, **kwargs).arguments)
        raise _StateBuiltError

    monkeypatch.setattr(training, "GradqHookState", record)
    monkeypatch.setattr(elastic_training, "GradqHookState", record)
    monkeypatch.setattr(cluster, "wait_for_aggregators", lambda *args: None)  # no aggregator: nothing connects
    return arguments


def test_every_flag_of_gradq_worker_is_the_hooks_or_the_apps(tmp_path: Path) -> None:
    flags, _ = _hook_flags(tmp_path)
    hook_flags = {flag[2:].replace("-", "_") for flag in flags if flag.startswith("--")}
    path_flags = {"aggregator", "elastic_hosts"}  # the addresses, and which path: both reach the state too
    every_flag = {action.dest for action in cluster.build_parser({})._actions} - {"help"}
    assert every_flag == hook_flags | path_flags | APP_FLAGS


def test_the_elastic_path_hands_every_hook_flag_to_the_state(built: dict[str, Any], tmp_path: Path) -> None:
    flags, expected = _hook_flags(tmp_path)
    with pytest.raises(_StateBuiltError):
        cluster.run([*flags, "--aggregator", AGGREGATOR, "--elastic-hosts", "2"])
    assert {name: built.get(name) for name in expected} == expected
    assert (built["addresses"], built["elastic_hosts"]) == (AGGREGATOR, 2)


def test_the_fixed_path_hands_every_hook_flag_to_the_state(
    built: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cluster.PeerDiscovery, "wait", lambda _discovery: (0, "127.0.0.1"))
    monkeypatch.setattr(cluster, "exit_on_sigterm", lambda _status: None)  # leave pytest's SIGTERM alone
    flags, expected = _hook_flags(tmp_path)
    with pytest.raises(_StateBuiltError):
        cluster.run([*flags, "--aggregator", AGGREGATOR, "--world-size", "1", "--master-port", str(free_port())])
    assert {name: built.get(name) for name in expected} == expected
    assert list(built["addresses"]) == [AGGREGATOR]
