"""The package's import graph against README.md's layout: no import from a layer above, and no cycle."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vaswani_transformer"
README = PACKAGE.parent / "README.md"


def layers_of_the_readme() -> dict[str, int]:
    """Each module of README.md's layout and its layer, 0 at the top."""
    block = README.read_text().split("## Layout", 1)[1].split("```")[1]
    layer, layers = -1, {}
    for line in block.splitlines()[2:]:
        if line.strip().startswith("#"):
            layer += 1
        else:
            names = line.strip().split("  ")[0]  # the first column; the description follows two spaces
            layers |= {module: layer for module in re.findall(r"(\w+)\.py", names)}
    return layers


def imports_of(module: str) -> set[str]:
    """The package's modules that `module` imports, at the top or inside a function."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("vaswani_transformer")):
            path = (node.module or "").removeprefix("vaswani_transformer").lstrip(".")
            names = [path.split(".")[0]] if path else [alias.name for alias in node.names]
            imported |= {name for name in names if (PACKAGE / f"{name}.py").is_file()}
    return imported - {module}


def test_the_readme_lays_out_every_module_of_the_package():
    modules = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__"}
    assert set(layers_of_the_readme()) == modules


def test_no_module_imports_from_a_layer_above_its_own():
    layers = layers_of_the_readme()
    upward = [
        f"{module} (layer {layers[module]}) imports {other} (layer {layers[other]})"
        for module in layers
        for other in sorted(imports_of(module))
        if layers[other] < layers[module]
    ]
    assert not upward, upward


def test_the_import_graph_has_no_cycle():
    graph = {module: imports_of(module) for module in layers_of_the_readme()}
    done, path = set(), []

    def visit(module: str) -> None:
        if module in path:
            raise AssertionError(" -> ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        path.append(module)
        for other in sorted(graph[module]):
            visit(other)
        path.pop()
        done.add(module)

    for module in graph:
        visit(module)


def test_every_module_has_room_to_grow():
    # Each job its own module: no module over 600 lines and no class over 200, the ceilings the project keeps.
    too_long = []
    for path in sorted(PACKAGE.glob("*.py")):
        source = path.read_text()
        if (lines := source.count("\n")) > 600:
            too_long.append(f"{path.name}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and (size := node.end_lineno - node.lineno + 1) > 200:
                too_long.append(f"{path.name}: class {node.name}, {size} lines")
    assert not too_long, too_long
