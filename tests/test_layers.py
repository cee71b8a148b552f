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
    bad = [n for n in _imports(path) if n.startswith("jax._src")]
    assert not bad, (
        f"{_name(path)} imports {bad}: move the private use into nnx_mpmd/_jax_compat.py"
    )
