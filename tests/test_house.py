"""How the package is built, checked from its source: no import circle, no module reaching into
another's underscore names, no file a reader cannot hold in mind, one home for the checks of user
input, and the engine's config and programs declared."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "specjax"
MAX_LINES = 800  # "a file one person can hold in mind" (STYLE.md): no file of the package above this


def modules() -> dict[str, Path]:
    """specjax's modules by dotted name."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(name: str, path: Path, module_level: bool = False) -> list[tuple[str, list[str], int]]:
    """(module imported, the names taken from it, line) for each import in a module, at any depth
    (a function's deferred import is still a dependency), or with `module_level` only those run
    when the module loads. Relative imports are resolved."""
    out = []
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    for node in tree.body if module_level else ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            out.append((module, [alias.name for alias in node.names], node.lineno))
    return out


def test_no_import_circle():
    """Module-level imports between the package's modules form no circle (a deferred import
    inside a function is how a lower module reaches a higher one at call time, and no circle)."""
    names = modules()
    graph = {name: set() for name in names}
    for name, path in names.items():
        for module, taken, _ in imports(name, path, module_level=True):
            for target in (module, *(f"{module}.{t}" for t in taken)):
                if target in names and target != name:
                    graph[name].add(target)
    # Tarjan's strongly connected components: any of more than one module is a circle.
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    # A package and its own submodules import each other by design (__init__ re-exports them).
    circles = [c for c in circles if not all(m == c[0] or m.startswith(c[0] + ".") for m in c)]
    assert not circles, circles


def test_no_module_takes_another_modules_underscore_names():
    names = modules()
    found = []
    for name, path in names.items():
        tree = ast.parse(path.read_text())
        imported_modules = {}  # local name -> module, for `module._name`
        for module, taken, line in imports(name, path):
            if not module.startswith("specjax"):
                continue
            for t in taken:
                if t.startswith("_") and not t.startswith("__"):
                    found.append(f"{path.relative_to(REPO)}:{line}: from {module} import {t}")
                if f"{module}.{t}" in names:
                    imported_modules[t] = f"{module}.{t}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("specjax"):
                        imported_modules[alias.asname or alias.name.split(".")[0]] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in imported_modules
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not found, "\n".join(found)


def test_no_file_of_the_package_is_too_long():
    long = {
        str(path.relative_to(REPO)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def test_integers_are_checked_in_one_place():
    """The check of an integer argument is specjax.checks' (check_int, is_int): no module writes
    `isinstance(x, bool) or not isinstance(x, int ...)` again, nor keeps a helper of its own."""
    pattern = re.compile(
        r"isinstance\([^)]*, bool\)\s*(or|and)\s*not\s*isinstance|not isinstance\([^)]*, bool\) and"
    )
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "checks.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line) or re.search(r"def _(check_int|is_int)\b", line):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_every_engine_config_field_has_a_docstring():
    from specjax.serve.engine_config import EngineConfig

    source = (PACKAGE / "serve" / "engine_config.py").read_text()
    classes = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef)]
    tree = next(node for node in classes if node.name == "EngineConfig")
    documented = set()
    for first, second in zip(tree.body, tree.body[1:], strict=False):
        if (
            isinstance(first, ast.AnnAssign)
            and isinstance(second, ast.Expr)
            and isinstance(second.value, ast.Constant)
            and isinstance(second.value.value, str)
        ):
            documented.add(first.target.id)
    assert documented == {field.name for field in dataclasses.fields(EngineConfig)}


def test_an_unknown_engine_program_is_an_error():
    from specjax.serve import engine_programs

    with pytest.raises(ValueError, match="engine program kind 'prefil' is not one of prefill, start_prompt"):
        engine_programs.jitted("prefil")
