#!/bin/sh
# Drops from an installed virtual environment what gradq never runs: pip and
# setuptools (nothing is installed after the build) and the libraries' own
# test suites (numba's alone is 13 MB). Usage: sh docker/slim-venv.sh VENV
set -eu
venv="$1"
"$venv/bin/python" -m pip uninstall --quiet --yes pip setuptools
site=$(echo "$venv"/lib/python3*/site-packages)
rm -rf "$site/numba/tests" "$site/llvmlite/tests" "$site"/numpy/*/tests "$site"/numpy/tests \
       "$site"/torch/test "$site"/sklearn/*/tests "$site"/sklearn/tests "$site"/scipy/*/tests "$site"/scipy/*/*/tests
du -sh "$site"
