"""Optional test dependencies: one that is missing skips its tests here, and fails them under CI (CI=true).

CI installs every one (.ci/run, tests/run.sh), so there a missing one is a broken setup, not a reason to skip.
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType
from typing import NoReturn

import pytest

__all__ = ["require_module", "require_program"]


def _missing(what: str, install: str) -> NoReturn:
    message = f"{what} is missing; {install}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"under CI=true: {message}")
    pytest.skip(message, allow_module_level=True)  # callable at import time as well as inside a test


def require_module(name: str, extra: str) -> ModuleType:
    """Import ``name``, or skip (fail under CI) naming the gradq extra that installs it."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        _missing(f"module {name!r} ({error})", f"pip install -c tests/constraints.txt -e '.[{extra}]'")


def require_program(*names: str, install: str) -> str:
    """The path of the first of ``names`` on PATH, or skip (fail under CI) saying how to install it."""
    for name in names:
        found = shutil.which(name)
        if found is not None:
            return found
    _missing(f"program {' / '.join(names)}", install)
