"""Imports run one way: models (and the kernels beneath them) -> sharding -> speculate -> the host
side (api, costs, proposers by name) -> research (ablation, sweeps, plots, Spec-Bench) and
training -> the CLI and demo.

Two checks: what importing every module of the lower layers loads (in a fresh interpreter), and
every import statement those modules hold, including the ones inside functions, which run only
when called (a lazy `from specjax.api import generate` is still a dependency on the host side).
"""

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "specjax"
LAYERS = {"kernels": 0, "models": 1, "sharding": 2, "speculate": 3}  # above these: the host side
HOST_SIDE = ("specjax.api", "specjax.train", "specjax.ablation", "specjax.cli")

# Python runs a package's __init__ before any of its modules, and specjax/__init__.py imports
# every layer to re-export the public API. A stub stands in for it here, so that what appears in
# sys.modules is what the lower layers import themselves.
LOAD_LOWER_LAYERS = """
import importlib, importlib.util, json, pkgutil, sys, types

found = importlib.util.find_spec("specjax")
stub = types.ModuleType("specjax")
stub.__path__ = list(found.submodule_search_locations)
sys.modules["specjax"] = stub
imported = []
for name in ("specjax.models", "specjax.speculate"):
    package = importlib.import_module(name)
    for module in pkgutil.walk_packages(package.__path__, name + "."):
        imported.append(importlib.import_module(module.name).__name__)
print(json.dumps({"imported": imported, "loaded": sorted(sys.modules)}))
"""


def test_models_and_speculate_load_nothing_from_the_host_side():
    run = subprocess.run(
        [sys.executable, "-c", LOAD_LOWER_LAYERS], capture_output=True, text=True, cwd=PACKAGE.parent
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert {"specjax.speculate.loop", "specjax.models.heads", "specjax.models.loading"} <= set(
        result["imported"]
    )
    loaded = [m for m in result["loaded"] if m.startswith("specjax.")]
    host = [m for m in loaded if m.startswith(HOST_SIDE)]
    assert not host, f"importing specjax.models and specjax.speculate loaded {host}"
    # Generating needs neither training's nor head checkpoints' libraries.
    assert not [m for m in result["loaded"] if m.split(".")[0] in ("optax", "orbax")]


def _modules(folder: str) -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py"))


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every specjax import in the file, at any depth: `from specjax import x`
    is the module specjax.x when x is one, else the top-level package `specjax`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "specjax"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module != "specjax":
                if node.module.split(".")[0] == "specjax":
                    found.append((node.lineno, node.module))
                continue
            for alias in node.names:
                is_module = (PACKAGE / f"{alias.name}.py").is_file() or (PACKAGE / alias.name).is_dir()
                found.append((node.lineno, f"specjax.{alias.name}" if is_module else "specjax"))
    return found


def _layer(module: str) -> int | None:
    """The rank of a lower-layer module, -1 for specjax._version and specjax.checks (the shared
    checks of user input: any layer may read them), None for the top-level package and everything
    above the lower layers."""
    if module in ("specjax._version", "specjax.checks"):
        return -1
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


@pytest.mark.parametrize("folder", sorted(LAYERS))
def test_lower_layers_import_only_downwards(folder):
    wrong = []
    for path in _modules(folder):
        name = path.relative_to(PACKAGE).as_posix()
        for line, module in _imports(path):
            layer = _layer(module)
            if layer is None or layer > LAYERS[folder]:
                wrong.append(f"specjax/{name}:{line} imports {module}")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_training_does_not_import_the_top_level_package():
    wrong = [
        f"specjax/{path.relative_to(PACKAGE).as_posix()}:{line}"
        for path in _modules("train")
        for line, module in _imports(path)
        if module == "specjax"
    ]
    assert not wrong, f"specjax.train imports the top-level package (read specjax._version): {wrong}"


def test_the_import_scan_sees_lazy_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from specjax import sharding\n"
        "def f():\n"
        "    import specjax\n"
        "    from specjax.api import generate\n"
        "    from specjax import __version__\n"
    )
    assert _imports(source) == [(1, "specjax.sharding"), (3, "specjax"), (4, "specjax.api"), (5, "specjax")]
    assert [m for m in pkgutil.iter_modules([str(PACKAGE)]) if m.name == "_version"]
