#!/usr/bin/env bash
# Installs the project with its test dependencies and runs the test suite; exits non-zero on failure.
# PyTorch is pinned first: its CPU build lies on the project's machines, and an unpinned `torch`
# requirement with no torch installed would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check torch==2.13.0
python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
python -m pytest -q "$@"
