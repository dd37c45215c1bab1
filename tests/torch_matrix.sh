#!/usr/bin/env bash
# The torch matrix: gradq's torch-using tests on torch releases other than the pin (tests/run.sh tests the pin).
# For each release named, a venv .venv-torch-<release> (kept between runs) gets that torch from the package index
# (on Linux a CUDA build, which runs on the CPU) and gradq with every extra's packages, pinned by
# tests/constraints.txt less its torch pin.
# Then pytest runs there what depends on torch's version: tests/client and the import layers (every adapter and
# integration: the DDP hook, FSDP2, DiLoCo, the torch codec) and, on a torch that has FSDP2's all-reduce hook, the
# FSDP2 end-to-end tests. The torch-free rest (qcore, server, proto, docs) is the same on every release and runs
# once, in tests/run.sh.
# A release written RELEASE:fsdp runs only the FSDP2 tests (the torch floor of use_gradq, when another release
# already covers the rest); RELEASE:ddp only the DDP hook's own tests (its floor, in CI's time).
# Usage: bash tests/torch_matrix.sh RELEASE[:fsdp|:ddp]... [-- PYTEST-ARGS]
# e.g. `bash tests/torch_matrix.sh 2.3.1 2.8.0:fsdp 2.15.0`: the DDP hook's and DiLoCo's floor, FSDP2's, the newest.
# CI runs `2.15.0:fsdp 2.3.1:ddp`: the FSDP2 path on the newest release, the DDP hook on its floor (FSDP2s floor,
# 2.8.0:fsdp, about 6 minutes more, runs by hand).
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
releases=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    releases+=("$1")
    shift
done
[ $# -gt 0 ] && shift  # the "--"
[ ${#releases[@]} -gt 0 ] || { echo "usage: bash tests/torch_matrix.sh RELEASE[:fsdp]... [-- PYTEST-ARGS]" >&2; exit 2; }

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
grep -v '^torch==' tests/constraints.txt >"$constraints"
# PIP_CONSTRAINT stands in for any constraint file pip's own configuration names (a machine may cap torch's release).
export PIP_CONSTRAINT="$constraints" PIP_DISABLE_PIP_VERSION_CHECK=1
failed=()  # the releases whose tests failed: every release runs, then the script fails naming them

for spec in "${releases[@]}"; do
    release="${spec%:*}"
    mode="${spec#"$release"}"
    case "$mode" in
        "") tests=(tests/client tests/test_layers.py) ;;
        :fsdp) tests=(tests/client/test_fsdp_internals.py tests/client/test_torch_support.py) ;;
        :ddp) tests=(tests/client/test_ddp_hook.py tests/client/test_ddp_training.py tests/client/test_torch_support.py) ;;
        *) echo "unknown mode in $spec; expected RELEASE, RELEASE:fsdp or RELEASE:ddp" >&2 && exit 2 ;;
    esac
    venv=".venv-torch-$release"
    started=$SECONDS
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
    # Every extra's requirements but its torch floor (the floors are for users; here torch is the release under test).
    mapfile -t requirements < <("$venv/bin/python" -c 'import tomllib
extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
print("\n".join(sorted({r for e in extras.values() for r in e if not r.startswith("torch")})))')
    # uv, not pip: it downloads and unpacks torch's CUDA wheels (about 3 GB) in parallel, in seconds rather than minutes.
    "$venv/bin/python" -m pip install --quiet uv==0.13.9
    "$venv/bin/uv" pip install --quiet --python "$venv/bin/python" --constraint "$constraints" \
        "torch==$release" -e . "${requirements[@]}"
    installed=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
    case "$installed" in
        "$release" | "$release+"*) ;;
        *) echo "torch $installed is installed in $venv; expected $release" >&2 && exit 1 ;;
    esac
    echo "== torch $installed ready in $venv after $((SECONDS - started)) s"
    "$venv/bin/python" -m pytest -p no:cacheprovider "${tests[@]}" "$@" || failed+=("$release")
    # The FSDP2 end-to-end tests need the all-reduce hook; below its floor test_torch_support checks the refusal.
    if [ "$mode" != :ddp ] && "$venv/bin/python" -c 'import sys, torch
from gradq.client.torch_support import MINIMUM_TORCH, torch_release
sys.exit(torch_release(torch.__version__) < MINIMUM_TORCH["fsdp"])'; then
        "$venv/bin/python" -m pytest -p no:cacheprovider -m e2e tests/client/test_fsdp.py "$@" || failed+=("$release e2e")
    fi
    echo "== torch $installed: tested after $((SECONDS - started)) s"
done
[ ${#failed[@]} -eq 0 ] || { echo "== torch matrix failed on: ${failed[*]}" >&2; exit 1; }
