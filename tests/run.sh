#!/usr/bin/env bash
# The test command: installs gradq with its pinned test environment (the integrations' extras too) into .venv,
# then runs lint (ruff), types (mypy), the generated-code drift check and pytest.
# Extra arguments go to pytest, e.g. `bash tests/run.sh tests/qcore -x`. By default pytest leaves out the slow
# end-to-end tests (marker e2e: Ray, torchrun, Compose, the browser, elastic and long runs); `--e2e` adds them
# (.ci/run passes it), `-m e2e` runs only them.
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c tests/constraints.txt -e '.[dev,torch,demo,accelerate,transformers,ray]'

echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .

echo "== mypy"
# mypy cannot follow setuptools' editable import hook, so give it the installed
# layout (gradq.qcore -> qcore/, ...) as a tree of links.
typecheck_root=.mypy_cache/src
rm -rf "$typecheck_root" && mkdir -p "$typecheck_root/gradq"
for part in qcore server client proto cli; do ln -s "$PWD/$part" "$typecheck_root/gradq/$part"; done
MYPYPATH="$typecheck_root" .venv/bin/mypy -p gradq
MYPYPATH="$typecheck_root" .venv/bin/mypy bench tests examples

echo "== generated code"
.venv/bin/python proto/generate.py --check

echo "== pytest"
.venv/bin/python -m pytest "$@"
