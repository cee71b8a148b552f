"""The package's layers import one way, and private JAX stays in one module.

Bottom to top: ``errors`` / ``_jax_compat`` → ``schedules`` (no JAX) → the core
(annotation, placement, compiler, runtime, checkpoint, distributed, models) →
``apps`` (the command line and its parts). Read from the source with ``ast``,
so a violation names the file and the import.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "nnx_mpmd"


def _modules() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _imports(path: pathlib.Path) -> list[str]:
    """Every module name ``path`` imports (absolute names; relative ones resolved)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def _name(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


# ``python -m nnx_mpmd`` (``__main__``) is the command line's entry point: an app.
CORE = [
    p for p in _modules() if "apps" not in p.relative_to(PACKAGE).parts and p.name != "__main__.py"
]


@pytest.mark.parametrize("path", CORE, ids=_name)
def test_core_never_imports_the_apps(path):
    bad = [name for name in _imports(path) if name.startswith("nnx_mpmd.apps")]
    assert not bad, f"{_name(path)} imports {bad}: the core must not depend on nnx_mpmd.apps"


SCHEDULES = sorted((PACKAGE / "schedules").glob("*.py"))


@pytest.mark.parametrize("path", SCHEDULES, ids=_name)
def test_schedules_import_no_jax_and_no_core(path):
    allowed = ("nnx_mpmd.schedules", "nnx_mpmd.errors")
    bad = [
        name
        for name in _imports(path)
        if name.split(".")[0] in ("jax", "jaxlib", "flax")
        or (name.startswith("nnx_mpmd") and not name.startswith(allowed))
    ]
    assert not bad, f"{_name(path)} imports {bad}: schedules are pure Python over errors only"


def test_errors_import_nothing_from_the_package():
    assert not [n for n in _imports(PACKAGE / "errors.py") if n.startswith("nnx_mpmd")]


@pytest.mark.parametrize("path", _modules(), ids=_name)
def test_private_jax_only_in_jax_compat(path):
    if path.name == "_jax_compat.py":
        return
    bad = [n for n in _imports(path) if n.startswith(("jax._src", "jaxlib."))]
    assert not bad, (
        f"{_name(path)} imports {bad}: move the private use into nnx_mpmd/_jax_compat.py"
    )


# Floors of the package, bottom to top (DESIGN.md's layer table). A module may import
# modules on its own floor or below. The frontend has two floors: what users
# annotate models with sits at the bottom; the ``jit`` entry that drives the
# compiler and runtime sits above them.
FLOORS = [
    ("nnx_mpmd.errors", "nnx_mpmd._jax_compat"),
    ("nnx_mpmd.schedules",),
    (
        "nnx_mpmd.frontend.stage",
        "nnx_mpmd.frontend.annotate",
        "nnx_mpmd.frontend.assign",
        "nnx_mpmd.frontend.markers",
        "nnx_mpmd.frontend.scan_stack",
    ),
    ("nnx_mpmd.placement",),
    ("nnx_mpmd.compiler",),
    ("nnx_mpmd.runtime",),
    ("nnx_mpmd.frontend.jit", "nnx_mpmd.frontend"),
    ("nnx_mpmd.checkpoint",),
    ("nnx_mpmd.distributed",),
    ("nnx_mpmd.models", "nnx_mpmd.annotate"),
    ("nnx_mpmd.apps", "nnx_mpmd.__main__", "nnx_mpmd"),
]


# Imports up a floor that are allowed: deprecated names forwarded lazily to their new
# home (removed with the names).
DEPRECATION_FORWARDS = {("nnx_mpmd.runtime.multi_process", "nnx_mpmd.distributed")}


def _floor(module: str) -> int:
    """The floor of ``module``: the longest matching prefix wins."""
    best, best_len = None, -1
    for floor, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = floor, len(prefix)
    assert best is not None, f"{module} is on no floor: add it to FLOORS"
    return best


@pytest.mark.parametrize("path", _modules(), ids=_name)
def test_imports_go_down_the_floors(path):
    name = _name(path).removesuffix(".__init__")
    own = _floor(name)
    internal = [n for n in _imports(path) if n == "nnx_mpmd" or n.startswith("nnx_mpmd.")]
    # ``from nnx_mpmd.frontend import markers`` names the package and the module:
    # judge the module.
    up = sorted(
        n
        for n in set(internal)
        if _floor(n) > own
        and not any(m.startswith(n + ".") for m in internal)
        and (name, n) not in DEPRECATION_FORWARDS
    )
    assert not up, (
        f"{name} (floor {own}, {FLOORS[own][0]}) imports {up} from a higher floor: "
        "the package's layers import one way (see DESIGN.md)"
    )


# The compiler is a sequence of small passes: no function body (docstring aside)
# over this many lines.
MAX_COMPILER_FUNCTION_LINES = 80


def _long_functions(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        first = node.body[0]
        has_doc = isinstance(first, ast.Expr) and isinstance(
            getattr(first, "value", None), ast.Constant
        )
        start = first.end_lineno + 1 if has_doc and len(node.body) > 1 else node.lineno
        length = node.end_lineno - start + 1
        if length > MAX_COMPILER_FUNCTION_LINES:
            found.append(f"{node.name} ({length} lines, line {node.lineno})")
    return found


@pytest.mark.parametrize("path", sorted((PACKAGE / "compiler").glob("*.py")), ids=_name)
def test_compiler_functions_are_small(path):
    long = _long_functions(path)
    assert not long, (
        f"{_name(path)}: {', '.join(long)} over {MAX_COMPILER_FUNCTION_LINES} lines; "
        "split it into passes or helpers"
    )
