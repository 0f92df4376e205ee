#!/usr/bin/env bash
# Installs the project with its test dependencies and runs the test suite; exits non-zero on failure.
# PyTorch is pinned first: its CPU build lies on the project's machines, and an unpinned `torch`
# requirement with no torch installed would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check torch==2.13.0
python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
# Debian's Chromium for the serving page's test in a real browser (Playwright drives it; no browser download).
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null \
        || echo "could not install chromium: the browser test of tests/test_serving.py will be skipped" >&2
fi
python -m pytest -q "$@"
