"""The torch floors: one table in gradq.client.torch_support, stated by pyproject's extras, enforced by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
import torch

from gradq.client.config import GradqConfig
from gradq.client.torch_support import FEATURES, MINIMUM_TORCH, TorchTooOldError, require_torch, torch_release
from gradq.qcore import QuantConfig

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
EXTRA_OF = {"ddp": "torch", "diloco": "diloco", "fsdp": "fsdp"}  # the extra that installs each feature


def torch_floor(requirements: list[str]) -> tuple[int, int]:
    (floor,) = [re.fullmatch(r"torch>=(\d+)\.(\d+)", line) for line in requirements if line.startswith("torch")]
    assert floor is not None, requirements
    return int(floor.group(1)), int(floor.group(2))


def test_each_extra_states_its_features_floor() -> None:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    assert {feature: torch_floor(extras[extra]) for feature, extra in EXTRA_OF.items()} == {
        feature: MINIMUM_TORCH[feature] for feature in EXTRA_OF
    }
    # The integrations and the demo stand on the DDP hook: none promises an older torch than it needs.
    for extra in ("demo", "accelerate", "transformers", "ray"):
        assert torch_floor(extras[extra]) >= MINIMUM_TORCH["ddp"], extra


def test_torch_release_reads_major_and_minor_of_any_build() -> None:
    assert torch_release("2.15.0+cu132") == (2, 15)
    assert torch_release("2.7.0a0+git1234abc") == (2, 7)
    assert torch_release("2.13.0+cpu") == (2, 13)
    with pytest.raises(ValueError, match=r"torch version 'nightly' is invalid"):
        torch_release("nightly")


@pytest.mark.parametrize("feature", sorted(MINIMUM_TORCH))
def test_a_torch_below_the_floor_is_refused_naming_version_feature_and_floor(feature: str) -> None:
    major, minor = MINIMUM_TORCH[feature]
    require_torch(feature, f"{major}.{minor}.0")  # the floor itself passes
    with pytest.raises(TorchTooOldError) as refused:
        require_torch(feature, f"{major}.{minor - 1}.1+cu121")
    assert str(refused.value) == (
        f"{FEATURES[feature]} needs torch>={major}.{minor}; torch is {major}.{minor - 1}.1+cu121 "
        f"(pip install 'torch>={major}.{minor}')"
    )


def test_use_gradq_refuses_a_torch_without_fsdp2s_hook_before_anything_else(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradq.client.fsdp import use_gradq

    major, minor = MINIMUM_TORCH["fsdp"]
    monkeypatch.setattr(torch, "__version__", f"{major}.{minor - 1}.0")
    config = GradqConfig.of(["127.0.0.1:1"], QuantConfig(bits=8), job_id="too-old")
    with pytest.raises(TorchTooOldError, match=rf"^FSDP2 \(use_gradq.*needs torch>={major}\.{minor}; torch is"):
        use_gradq(torch.nn.Linear(2, 2), config)


def test_the_ddp_hook_and_diloco_refuse_a_torch_below_their_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradq.client.ddp import GradqHookState
    from gradq.client.diloco import DiLoCo

    monkeypatch.setattr(torch, "__version__", "2.2.2")
    with pytest.raises(TorchTooOldError, match=r"^the DDP comm hook \(gradq_hook\) needs torch>=2\.3; torch is 2\.2"):
        GradqHookState("127.0.0.1:1")
    model = torch.nn.Linear(2, 2)
    config = GradqConfig.of(["127.0.0.1:1"], QuantConfig(bits=8), job_id="too-old", elastic_hosts=2)
    with pytest.raises(TorchTooOldError, match=r"^DiLoCo needs torch>=2\.3; torch is 2\.2\.2"):
        DiLoCo(config, model, torch.optim.SGD(model.parameters(), lr=0.1))
