"""Every import inside sparsekv points down the layers; no two modules import each other.

A private (``_name``) helper is not imported from another module either: shared
helpers live in a shared module (``kernels/cpu/_pages.py``, ``layers/_common.py``)
under a public name.

Layers, top to bottom (an import may stay in its layer or go down, never up)::

    app       cli, demo*, bench, integrations
    layers    nn.Modules
    ops       public ops, backend registry, the k-pool indexer step
    kernels   reference / cpu / triton backends
    cache     storage: layout, address math, page pool, manager
    leaf      _checks, numerics, _env, _address (import nothing of sparsekv above them)

The package root ``sparsekv/__init__.py`` re-exports the public API from every
layer, so it sits above them all: importing it from inside the package is an
upward import. Package ``__init__`` files of a subpackage belong to that
subpackage's layer and so may re-export its modules.

Imports are read with ``ast`` from the source (module level, inside functions
and classes, ``TYPE_CHECKING`` blocks, relative or absolute), plus
``importlib.import_module`` calls whose name starts with a literal
``sparsekv.`` prefix. Nothing is imported to check it.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "sparsekv"

#: Layer ranks, higher is further up. Longest matching prefix decides.
LAYERS = {
    "sparsekv": 6,  # the package root: re-exports everything
    "sparsekv.cli": 5,
    "sparsekv.demo": 5,
    "sparsekv.demo_checks": 5,
    "sparsekv.demo_report": 5,
    "sparsekv.demo_sweep": 5,
    "sparsekv.demo_work": 5,
    "sparsekv.demo_tp": 5,
    "sparsekv.bench": 5,
    "sparsekv.integrations": 5,
    "sparsekv.layers": 4,
    "sparsekv.ops": 3,
    "sparsekv.kernels": 2,
    "sparsekv.cache": 1,
    "sparsekv._checks": 0,
    "sparsekv.numerics": 0,
    "sparsekv._env": 0,
    "sparsekv._address": 0,
}

def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted name of every module under ``root/package`` (a package by its ``__init__``)."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _resolve(base: str, name: str, modules: dict[str, Path]) -> str:
    """``base.name`` when that is a module (``from pkg import submodule``), else ``base``."""
    candidate = f"{base}.{name}" if base else name
    return candidate if candidate in modules else base


def _from_module(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module named by ``from <here> import ...`` inside ``module``."""
    if not node.level:
        return node.module or ""
    anchor = module.split(".") if is_package else module.split(".")[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def _literal_prefix(node: ast.expr) -> str | None:
    """The constant leading part of a string or f-string expression."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        prefix = ""
        for part in node.values:
            if not (isinstance(part, ast.Constant) and isinstance(part.value, str)):
                break
            prefix += part.value
        return prefix
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path], package: str) -> set[str]:
    """The modules of ``package`` that ``module`` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _from_module(module, is_package, node)
            found.update(_resolve(base, alias.name, modules) for alias in node.names)
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.func, (ast.Attribute, ast.Name))
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"):
            prefix = _literal_prefix(node.args[0])
            if prefix:
                found.add(prefix.rstrip("."))
    return {name for name in found if name == package or name.startswith(package + ".")}


def private_names_imported(module: str, path: Path, modules: dict[str, Path], package: str) -> list[str]:
    """``source.name`` for every ``_private`` name (not a ``_module``) that ``module`` takes from another module.

    A helper that several modules need lives in a shared module under a public name.
    """
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = _from_module(module, is_package, node)
        if not (base == package or base.startswith(package + ".")):
            continue
        for alias in node.names:
            private = alias.name.startswith("_") and not alias.name.startswith("__")
            if private and f"{base}.{alias.name}" not in modules:
                found.append(f"{base}.{alias.name}")
    return found


def layer_of(module: str, layers: dict[str, int]) -> int:
    matches = [prefix for prefix in layers if module == prefix or module.startswith(prefix + ".")]
    if not matches:
        raise LookupError(f"{module}: no layer assigned; add it to LAYERS in tests/test_layering.py")
    return layers[max(matches, key=len)]


def layering_problems(root: Path, package: str, layers: dict[str, int]) -> list[str]:
    """Every upward import and every pair of modules that import each other, as readable lines."""
    modules = module_names(root, package)
    graph = {name: imports_of(name, path, modules, package) for name, path in modules.items()}
    problems = []
    for name, targets in sorted(graph.items()):
        if name == package:
            continue  # the root re-exports every layer
        for target in sorted(targets):
            if layer_of(target, layers) > layer_of(name, layers):
                problems.append(f"{name} (layer {layer_of(name, layers)}) imports {target} "
                                f"(layer {layer_of(target, layers)}): an import that runs back up")
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            if name < target and name in graph.get(target, ()):
                problems.append(f"{name} and {target} import each other")
    for name, path in sorted(modules.items()):
        problems.extend(f"{name} imports the private {private}: move it to a shared module under a public name"
                        for private in private_names_imported(name, path, modules, package))
    return problems


# ---------------------------------------------------------------------------
# the rule on sparsekv itself
# ---------------------------------------------------------------------------
def test_every_import_points_down_and_no_modules_import_each_other():
    problems = layering_problems(SRC, PACKAGE, LAYERS)
    assert not problems, "\n".join(problems)


def test_every_module_has_a_layer():
    for name in module_names(SRC, PACKAGE):
        layer_of(name, LAYERS)


# ---------------------------------------------------------------------------
# the checker on synthetic packages (it must be able to fail)
# ---------------------------------------------------------------------------
def _write_package(root: Path, files: dict[str, str]) -> None:
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    for directory in {p.parent for p in root.rglob("*.py")} | {root / "pkg"}:
        (directory / "__init__.py").touch()


TOY_LAYERS = {"pkg": 9, "pkg.app": 5, "pkg.ops": 3, "pkg.kernels": 2, "pkg.cache": 1, "pkg._leaf": 0}


@pytest.mark.parametrize(
    "source, target",
    [
        ("from ..ops.store import put\n", "pkg.ops.store"),  # relative, module level
        ("def store():\n    from ..ops import store\n", "pkg.ops.store"),  # relative, inside a function
        ("import pkg.kernels.ref\n", "pkg.kernels.ref"),  # absolute
        ("class View:\n    def f(self):\n        from pkg.ops.store import put\n", "pkg.ops.store"),
        ("from .. import ops\n", "pkg.ops"),
        ("from .. import put\n", "pkg"),  # the package root re-exports: importing it runs up
        ("import importlib\nM = importlib.import_module(f'pkg.kernels.{1}')\n", "pkg.kernels"),
    ],
    ids=["relative", "in-function", "absolute", "in-method", "subpackage", "root", "import_module"],
)
def test_checker_flags_an_upward_import(tmp_path, source, target):
    _write_package(tmp_path, {"pkg/cache/layout.py": source, "pkg/ops/store.py": "X = 1\n",
                              "pkg/kernels/ref.py": "X = 1\n"})
    problems = layering_problems(tmp_path, "pkg", TOY_LAYERS)
    assert len(problems) == 1 and problems[0].startswith(f"pkg.cache.layout (layer 1) imports {target} "), problems


def test_checker_accepts_downward_and_same_layer_imports(tmp_path):
    _write_package(tmp_path, {
        "pkg/_leaf.py": "X = 1\n",
        "pkg/cache/layout.py": "from .._leaf import X\nfrom . import rows\n",
        "pkg/cache/rows.py": "from pkg._leaf import X\n",
        "pkg/kernels/ref.py": "from ..cache.layout import X\nfrom . import fast\n",
        "pkg/kernels/fast.py": "def f():\n    from ..cache import rows\n",
        "pkg/ops/store.py": "import importlib\nimportlib.import_module('pkg.kernels.ref')\n",
        "pkg/app/cli.py": "from ..ops import store\nimport pkg.cache.layout\n",
    })
    assert layering_problems(tmp_path, "pkg", TOY_LAYERS) == []


def test_checker_flags_modules_that_import_each_other(tmp_path):
    _write_package(tmp_path, {
        "pkg/app/demo.py": "def run():\n    from .report import build\n",
        "pkg/app/report.py": "from .demo import shared\n",
    })
    assert layering_problems(tmp_path, "pkg", TOY_LAYERS) == ["pkg.app.demo and pkg.app.report import each other"]


def test_checker_flags_a_private_helper_taken_from_another_module(tmp_path):
    _write_package(tmp_path, {
        "pkg/kernels/qsa.py": "def _first_missing(): pass\n",
        "pkg/kernels/kpool.py": "from .qsa import _first_missing\nfrom . import _shared\n",
        "pkg/kernels/_shared.py": "def first_missing(): pass\n",
    })
    assert layering_problems(tmp_path, "pkg", TOY_LAYERS) == [
        "pkg.kernels.kpool imports the private pkg.kernels.qsa._first_missing: "
        "move it to a shared module under a public name"]


def test_checker_asks_for_a_layer_for_an_unknown_module(tmp_path):
    _write_package(tmp_path, {"pkg/extra.py": "X = 1\n", "pkg/cache/layout.py": "from .. import extra\n"})
    with pytest.raises(LookupError, match="pkg.extra: no layer assigned"):
        layering_problems(tmp_path, "pkg", {k: v for k, v in TOY_LAYERS.items() if k != "pkg"})
