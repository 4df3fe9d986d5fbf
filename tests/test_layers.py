"""The package layering, read from the source: who may import whom, no import cycles, imports at the top.

    dvi (core: maths, engine, models, records, control, config, store, swap, metrics, tracking, procs, ...)
      ^-- dvi.serving (a replica, handed its channels)     ^-- streams (Kafka)     ^-- trainers (the recipe)
            ^------------------------------- dvi.cli (the shell: imports everything, imported by nothing)
    benchmarks sit on top of everything, beside the shell.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dvi", "streams", "trainers")

# layer of a module -> the layers it must not import
FORBIDDEN = {
    "core": {"dvi.serving", "dvi.cli", "streams", "trainers", "benchmarks"},
    "dvi.serving": {"dvi.cli", "streams", "trainers", "benchmarks"},
    "streams": {"dvi.serving", "dvi.cli", "trainers", "benchmarks"},
    "trainers": {"dvi.serving", "dvi.cli", "streams", "benchmarks"},
    "dvi.cli": {"benchmarks"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    for prefix in ("dvi.serving", "dvi.cli", "streams", "trainers"):
        if module == prefix or module.startswith(prefix + "."):
            return prefix
    return "core"


def project_imports(path: Path) -> list[tuple[str, bool]]:
    """(imported project module, imported inside a function) for every import statement of the file."""
    tree = ast.parse(path.read_text())
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES + ("benchmarks",):
                found.append((name, id(node) in inner))
    return found


SOURCES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
MODULES = {module_name(p) for p in SOURCES}


def resolve(name: str) -> str | None:
    """The project module an imported name lives in (`dvi.store.PRODUCTION` -> `dvi.store`)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_a_layer_above_it(path):
    own = layer(module_name(path))
    bad = sorted({name for name, _ in project_imports(path) if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[own])})
    assert not bad, f"{module_name(path)} ({own}) imports {bad}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_project_imports_are_at_the_top(path):
    inside = sorted({name for name, in_function in project_imports(path) if in_function})
    assert not inside, f"{module_name(path)} imports {inside} inside a function"


def test_there_is_no_import_cycle():
    graph = {module_name(p): {m for name, _ in project_imports(p) if (m := resolve(name)) and m != module_name(p)} for p in SOURCES}
    # a package's __init__ is imported with its modules; edges into it are edges into the package
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
