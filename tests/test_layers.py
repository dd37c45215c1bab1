"""Imports point one way: qcore <- server, qcore <- client <- DDP adapter <- apps, integrations (fresh interpreters)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

CASES = [
    ("gradq.qcore", ("grpc", "google.protobuf", "torch", "numba")),
    ("gradq.proto", ("torch", "gradq.server", "gradq.client")),
    ("gradq.proto.convert", ("torch", "gradq.server", "gradq.client")),
    ("gradq.proto.v1.aggregator_pb2_grpc", ("torch", "gradq.server", "gradq.client")),
    ("gradq.server", ("torch", "gradq.client")),
    ("gradq.server.process", ("torch", "gradq.client")),
    ("gradq.server.app", ("torch", "gradq.client")),
    # Ray places shards from the driver, and is imported only then
    ("gradq.server.ray_shards", ("torch", "gradq.client", "ray")),
    ("gradq.client", ("torch", "gradq.server", "gradq.client.ddp", "gradq.client.apps")),
    ("gradq.client.worker", ("torch", "gradq.server", "gradq.client.ddp", "gradq.client.apps")),
    ("gradq.client.sending", ("torch", "gradq.server", "gradq.client.ddp", "gradq.client.apps")),
    # the hook loads torch on first use
    ("gradq.client.ddp", ("torch", "gradq.server", "gradq.client.apps", "gradq.client.integrations")),
    ("gradq.client.env", ("torch", "gradq.server", "gradq.client.apps")),
    # the configuration is checked (and pickled to other processes) without torch
    ("gradq.client.config", ("torch", "gradq.server", "gradq.client.ddp", "gradq.client.apps")),
    # the session is torch's side of the client; it never reaches up into an adapter
    ("gradq.client.session", ("gradq.server", "gradq.client.ddp", "gradq.client.apps", "gradq.client.integrations")),
    # the FSDP adapter stands on the session beside the DDP adapter, never on it
    ("gradq.client.fsdp", ("gradq.server", "gradq.client.ddp", "gradq.client.apps", "gradq.client.integrations")),
    ("gradq.client.diloco", ("gradq.server", "gradq.client.ddp", "gradq.client.apps", "gradq.client.integrations")),
    # `gradq worker` checks its settings and its aggregator before it pays for torch.
    ("gradq.client.apps.cluster", ("torch", "gradq.server")),
    ("gradq.client.integrations.accelerate", ("gradq.server", "accelerate", "transformers")),
    ("gradq.client.integrations.transformers", ("gradq.server",)),
    ("gradq.client.integrations.ray_train", ("gradq.server", "accelerate", "transformers")),
    ("gradq.cli", ("torch", "grpc", "numpy")),
]


@pytest.mark.parametrize(("module", "forbidden"), CASES)
def test_layer_does_not_import_what_it_must_not(module: str, forbidden: tuple[str, ...]) -> None:
    probe = f"import sys, {module}; print(','.join(m for m in {forbidden!r} if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "", f"importing {module} pulled in {loaded}"


def test_qcore_imports_in_under_a_second() -> None:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import gradq.qcore"], check=True)
    python_alone = time.perf_counter() - started
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert python_alone - (time.perf_counter() - started) < 1.0
