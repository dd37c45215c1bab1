"""The oldest torch each of gradq's torch adapters runs on, and the refusal of an older one by name.

``MINIMUM_TORCH`` is the one table: each floor is the oldest release whose
tests pass (tests/torch_matrix.sh runs them there), and pyproject.toml's
extras state the same floors (tests/client/test_torch_support.py holds the
two together). An adapter calls ``require_torch`` where its feature is used,
so an older torch is refused with the installed version, the feature and the
floor in the message rather than with an AttributeError deep inside torch.
Importing this module does not load torch.
"""

from __future__ import annotations

import re

__all__ = ["FEATURES", "MINIMUM_TORCH", "TorchTooOldError", "is_fsdp2_module", "require_torch", "torch_release"]

MINIMUM_TORCH: dict[str, tuple[int, int]] = {
    # DDP's comm hooks are older; 2.3 is the oldest torch built for NumPy 2, which gradq's pinned environment has
    # (2.2's torch.from_numpy fails beside NumPy 2)
    "ddp": (2, 3),
    # The DDP hook's floor: DiLoCo's hosts train with DDP, or with FSDP2 (see "diloco_fsdp")
    "diloco": (2, 3),
    # fully_shard and FSDPModule public in torch.distributed.fsdp (2.4 and 2.5 had a prototype gradq does not serve)
    "diloco_fsdp": (2, 6),
    # FSDPModule.set_all_reduce_hook, the slot use_gradq takes, appeared in 2.7; 2.8 is the oldest the FSDP2 tests
    # pass on whole: on 2.7 gloo has no ReduceOp.AVG, so native HSDP, their reference on the CPU, cannot run
    "fsdp": (2, 8),
}

FEATURES: dict[str, str] = {
    "ddp": "the DDP comm hook (gradq_hook)",
    "diloco": "DiLoCo",
    "diloco_fsdp": "DiLoCo over an FSDP2 model",
    "fsdp": "FSDP2 (use_gradq, through FSDPModule.set_all_reduce_hook)",
}


class TorchTooOldError(RuntimeError):
    """The installed torch is older than a feature's floor in MINIMUM_TORCH."""


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as ``2.15.0+cu132`` or ``2.7.0a0+git1234``.

    Raises:
        ValueError: the string does not start with ``<major>.<minor>``.
    """
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"torch version {version!r} is invalid; expected '<major>.<minor>[...]'")
    return int(found.group(1)), int(found.group(2))


def require_torch(feature: str, version: str | None = None) -> None:
    """Refuse a torch older than ``feature``'s floor.

    Args:
        feature: a key of MINIMUM_TORCH ("ddp", "diloco", "diloco_fsdp", "fsdp").
        version: the torch version to judge; the installed one's by default.

    Raises:
        KeyError: ``feature`` is not a key of MINIMUM_TORCH.
        TorchTooOldError: ``version`` is older than the floor, named in the message.
    """
    floor = MINIMUM_TORCH[feature]
    if version is None:
        import torch

        version = str(torch.__version__)
    if torch_release(version) < floor:
        wanted = f"{floor[0]}.{floor[1]}"
        raise TorchTooOldError(
            f"{FEATURES[feature]} needs torch>={wanted}; torch is {version} (pip install 'torch>={wanted}')"
        )


def is_fsdp2_module(module: object) -> bool:
    """Whether ``module`` was sharded with FSDP2's ``torch.distributed.fsdp.fully_shard`` (public since torch 2.6).

    Raises:
        TorchTooOldError: ``module`` was sharded with the prototype FSDP2 of torch 2.4 or 2.5
            (``torch.distributed._composable.fsdp``), which gradq does not serve.
    """
    import torch

    if torch_release(str(torch.__version__)) >= MINIMUM_TORCH["diloco_fsdp"]:
        from torch.distributed.fsdp import FSDPModule

        return isinstance(module, FSDPModule)
    try:
        from torch.distributed._composable.fsdp import FSDPModule as PrototypeModule
    except ImportError:  # before 2.4: no FSDP2 at all
        return False
    if isinstance(module, PrototypeModule):
        require_torch("diloco_fsdp")
    return False
