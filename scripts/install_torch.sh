#!/usr/bin/env bash
# Makes PyTorch importable by PYTHON within pyproject.toml's range, installing nothing over a release already there,
# and says which torch PYTHON uses:
#
#   bash scripts/install_torch.sh PYTHON [cpu|newest|lowest]
#
# A release within the range that PYTHON imports is kept, whatever its build (cpu and newest). Only when none is
# there does pip install one: `cpu` (the default) the range's lower bound, whose CPU build lies on the project's
# machines; `newest` the newest release pip may install (on these machines their pip constraints cap it at the CUDA
# build on their disk). `lowest` is the oldest end of scripts/test.sh, in an environment of its own: exactly the
# lower bound. pip, not uv: only pip reads the machine's pip configuration, with its local wheels and its cap.
set -euo pipefail
cd "$(dirname "$0")/.."
python=$1
choice=${2:-cpu}
requirement=$("$python" -c '
import tomllib
with open("pyproject.toml", "rb") as project:
    print(next(r for r in tomllib.load(project)["project"]["dependencies"] if r.startswith("torch")))')
lower_bound=${requirement#*>=}
lower_bound=${lower_bound%%,*}
# Exit 0: a torch within the range (for `lowest`: the lower bound itself) imports; 1: none does.
in_range() {
    "$python" - "$requirement" "$choice" 2>/dev/null <<'PYTHON'
import operator, re, sys
import torch

def release(version: str) -> tuple[int, ...]:
    numbers = [int(part) for part in re.match(r"\d+(?:\.\d+)*", version)[0].split(".")]
    return tuple(numbers + [0] * (3 - len(numbers)))

comparisons = {">=": operator.ge, "<=": operator.le, "==": operator.eq, ">": operator.gt, "<": operator.lt}
bounds = re.findall(r"(>=|<=|==|<|>)\s*([\d.]+)", sys.argv[1])
if sys.argv[2] == "lowest":
    bounds = [("==", bound) for operation, bound in bounds if operation == ">="]
sys.exit(0 if all(comparisons[op](release(torch.__version__), release(bound)) for op, bound in bounds) else 1)
PYTHON
}
if in_range; then
    action="kept: within $requirement"
else
    case $choice in
        newest) wanted=$requirement ;;
        cpu | lowest) wanted=torch==$lower_bound ;;
        *) echo "install_torch.sh: unknown choice '$choice'; use cpu, newest or lowest" >&2; exit 2 ;;
    esac
    "$python" -m pip install --quiet --disable-pip-version-check "$wanted"
    action="installed as $wanted: none importable matched"
fi
echo "torch $("$python" -c "import torch; print(torch.__version__)" 2>/dev/null) for $python ($action)"
