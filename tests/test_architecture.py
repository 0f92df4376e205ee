"""The package's architecture: import-linter's contracts in pyproject.toml (layers, and a model folder that imports
nothing else of the package), held by `lint-imports`, and modules small enough to read."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPOSITORY

PACKAGE = REPOSITORY / "vaswani_transformer"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` on the package found first under `root`, with the contracts of pyproject.toml."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(REPOSITORY / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )


def test_every_contract_of_pyproject_is_kept():
    run = lint_imports(REPOSITORY)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Contracts: 2 kept, 0 broken." in run.stdout


def test_an_upward_import_breaks_the_contracts(tmp_path):
    # The package copied with one import that climbs a layer: the model reaching into training.
    shutil.copytree(PACKAGE, tmp_path / "vaswani_transformer", ignore=shutil.ignore_patterns("__pycache__"))
    ops = tmp_path / "vaswani_transformer" / "model" / "ops_vaswani.py"
    ops.write_text(ops.read_text(encoding="utf-8") + "\nfrom ..training import config  # noqa\n", encoding="utf-8")
    run = lint_imports(tmp_path)
    assert run.returncode != 0
    assert "Contracts: 0 kept, 2 broken." in run.stdout
    report = " ".join(run.stdout.split())  # lint-imports wraps its lines
    assert "vaswani_transformer.model.ops_vaswani -> vaswani_transformer.training.config" in report


def test_every_module_has_room_to_grow():
    # Each job its own module: no module over 600 lines and no class over 200, the ceilings the project keeps.
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        if (lines := source.count("\n")) > 600:
            too_long.append(f"{path.relative_to(PACKAGE)}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and (size := node.end_lineno - node.lineno + 1) > 200:
                too_long.append(f"{path.relative_to(PACKAGE)}: class {node.name}, {size} lines")
    assert not too_long, too_long
