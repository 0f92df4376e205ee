#!/usr/bin/env bash
# Installs the project with its test dependencies and runs the test suite at both ends of every supported
# range (docs/compatibility.md), each in an environment of its own beside the repository, so that the caller's own is
# never changed: the whole suite with the newest releases this machine can install, torch included, in .venv-newest;
# the tests that touch transformers and torch (the model folder's, the Trainer's, the Hub's) with pyproject.toml's
# lower bounds in .venv-oldest. Exits non-zero on failure. Arguments, if any, replace both runs' selections.
# PyTorch goes first, by pip (scripts/install_torch.sh), which reads the machine's pip configuration: the newest end
# gets the newest release pip may install (on the project's machines, the CUDA build their pip constraints cap torch
# at, from their disk), the oldest the lower bound's CPU build. Either is kept on a rerun.
# uv installs the rest, resolving as pip does, in a fraction of pip's time. The two ends install side by side and
# test side by side, pytest-xdist's workers on every core: each waits on its own processes and files at times, and
# the other fills the cores meanwhile.
set -euo pipefail
cd "$(dirname "$0")/.."
newest=$PWD/.venv-newest oldest=$PWD/.venv-oldest  # absolute: tests run the other end's Python from their own directories
logs=$(mktemp -d)
install() {  # install PYTHON [uv pip install arguments]: the project and its test dependencies
    "$newest/bin/python" -m uv pip install --quiet --compile-bytecode --python "$@" -e ".[dev]"
}
python3 -m venv "$newest"
"$newest/bin/python" -m pip install --quiet --disable-pip-version-check "uv>=0.5"

# The oldest end: every lower bound of pyproject.toml's dependencies, installed exactly.
(
    python3 -m venv "$oldest"
    python3 - >"$oldest/constraints.txt" <<'PYTHON'
import re, tomllib
with open("pyproject.toml", "rb") as project:
    for requirement in tomllib.load(project)["project"]["dependencies"]:
        if bound := re.match(r"([\w.-]+)\s*>=\s*([\w.]+)", requirement):
            print(f"{bound[1]}=={bound[2]}")
PYTHON
    bash scripts/install_torch.sh "$oldest/bin/python" lowest
    install "$oldest/bin/python" --constraint "$oldest/constraints.txt"
) >"$logs/oldest-install.log" 2>&1 &
oldest_install=$!
bash scripts/install_torch.sh "$newest/bin/python" newest
install "$newest/bin/python"
# Debian's Chromium for the serving page's test in a real browser (Playwright drives it; no browser download).
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null \
        || echo "could not install chromium: the browser test of tests/serving/test_app.py will be skipped" >&2
fi
if wait "$oldest_install"; then
    grep "^torch " "$logs/oldest-install.log"
else
    cat "$logs/oldest-install.log" >&2
    echo "could not install the oldest end's environment, $oldest" >&2
    exit 1
fi

selection=("$@")
[ $# -gt 0 ] || selection=(tests/model tests/test_finetune.py tests/exchange/test_hub.py)
# The oldest end's run, one worker, beside the newest's; its report follows the newest's. Without
# VASWANI_OTHER_END_PYTHON: the newest run saves under each end and loads under the other.
# Both ends test the small model of tests/conftest.py trained once, by whichever asks first, in $logs.
export VASWANI_TEST_SHARED_DIR=$logs
"$oldest/bin/python" -m pytest -q -n 1 --durations=15 "${selection[@]}" >"$logs/oldest.log" 2>&1 &
oldest_tests=$!
releases='import torch, transformers; print("transformers", transformers.__version__, "and torch", torch.__version__)'
echo "== the newest releases: $("$newest/bin/python" -c "$releases")"
newest_status=0
VASWANI_OTHER_END_PYTHON="$oldest/bin/python" "$newest/bin/python" -m pytest -q -n auto --durations=15 "$@" || newest_status=$?
oldest_status=0
wait "$oldest_tests" || oldest_status=$?
echo "== the oldest releases: $("$oldest/bin/python" -c "$releases")"
cat "$logs/oldest.log"
[ "$newest_status" -eq 0 ] && [ "$oldest_status" -eq 0 ]
