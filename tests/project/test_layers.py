"""The package's layers import one way, without cycles; private JAX stays in one module.

The floors are the folders (DESIGN.md's layer table), bottom to top: ``errors`` /
``_jax_compat`` → ``schedules`` (no JAX) → ``annotate`` → ``placement`` → ``compiler``
(its root: the IR; then ``trace``, ``region``, ``outer``, ``final``) → ``runtime`` →
``aot`` → ``jit`` → ``checkpoint`` / ``planner`` / ``models`` / ``distributed`` → the
package's ``__init__`` → ``apps``. Read from the source with ``ast`` (function-level
imports included), so a violation names the file and the import.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "nnx_mpmd"


def _modules() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _name(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def _is_module(name: str) -> bool:
    """Whether ``name`` is a module or package of nnx_mpmd (not a name defined in one)."""
    relative = PACKAGE.parent.joinpath(*name.split("."))
    return relative.with_suffix(".py").is_file() or (relative / "__init__.py").is_file()


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:`` (imports that never run)."""
    skipped = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(test):
            skipped |= {id(inner) for part in node.body for inner in ast.walk(part)}
    return skipped


def _imports_of(source: str, *, run_time_only: bool = False) -> list[str]:
    """Every module the source imports, at any depth (function bodies included).

    ``from a.b import c`` is module ``a.b.c`` when ``c`` is a module, else ``a.b``:
    ``import nnx_mpmd`` and ``from nnx_mpmd import x`` name the package's ``__init__``.
    ``run_time_only`` leaves out the imports under ``if TYPE_CHECKING:``.
    """
    names = []
    tree = ast.parse(source)
    skipped = _type_checking_only(tree) if run_time_only else set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.append(full if _is_module(full) else node.module)
    return names


def _imports(path: pathlib.Path) -> list[str]:
    return _imports_of(path.read_text())


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


# Floors bottom to top. A folder's modules sit on the folder's floor; a sub-package is
# listed on its own floor (above its parent's root modules). Only the package root mixes
# floors, so its files are listed by name. A module may import its own floor or below.
FLOORS: list[tuple[str, ...]] = [
    ("errors.py", "_jax_compat.py"),
    ("schedules",),
    ("annotate",),
    ("placement",),
    ("compiler",),
    ("compiler/trace",),
    ("compiler/region",),
    ("compiler/outer",),
    ("compiler/final",),
    ("runtime",),
    ("aot",),
    ("jit",),
    ("checkpoint", "planner", "models", "distributed.py"),
    ("__init__.py",),
    ("apps", "__main__.py"),
]


def _floor_of_path(path: pathlib.Path) -> int:
    """The floor of the file at ``path``: its own name at the root, else its deepest folder."""
    relative = path.relative_to(PACKAGE)
    keys = [relative.as_posix()] if len(relative.parts) == 1 else []
    keys += ["/".join(relative.parts[:n]) for n in range(len(relative.parts) - 1, 0, -1)]
    for key in keys:
        for floor, entries in enumerate(FLOORS):
            if key in entries:
                return floor
    raise AssertionError(f"{relative} is on no floor: add its folder to FLOORS in {__file__}")


def _path_of(module: str) -> pathlib.Path:
    relative = PACKAGE.parent.joinpath(*module.split("."))
    return relative / "__init__.py" if relative.is_dir() else relative.with_suffix(".py")


def _floor(module: str) -> int:
    return _floor_of_path(_path_of(module))


def _upward(name: str, imported: list[str]) -> list[str]:
    own = _floor(name)
    internal = {n for n in imported if n == "nnx_mpmd" or n.startswith("nnx_mpmd.")}
    return sorted(n for n in internal if _floor(n) > own)


def test_every_folder_and_root_file_is_on_a_floor():
    listed = {entry for entries in FLOORS for entry in entries}
    folders = {p.parent.relative_to(PACKAGE).as_posix() for p in _modules()} - {"."}
    root_files = {p.name for p in PACKAGE.glob("*.py")}
    assert not (folders | root_files) - listed, "add these to FLOORS (DESIGN.md's layer table)"
    assert not listed - (folders | root_files), "FLOORS names folders or files that are gone"


@pytest.mark.parametrize("path", _modules(), ids=_name)
def test_imports_go_down_the_floors(path):
    name = _name(path).removesuffix(".__init__")
    up = _upward(name, _imports(path))
    assert not up, (
        f"{name} ({'/'.join(FLOORS[_floor(name)])}) imports {up} from a higher floor: "
        "the package's layers import one way (see DESIGN.md)"
    )


@pytest.mark.parametrize(
    "source",
    [
        "def f():\n    from nnx_mpmd.jit.jit import jit\n",
        "def f():\n    import nnx_mpmd\n",
        "from nnx_mpmd import distributed\n",
    ],
    ids=["function-level", "the-package", "from-package-import-module"],
)
def test_the_floor_check_sees_every_kind_of_upward_import(source):
    assert _upward("nnx_mpmd.runtime.interpreter", _imports_of(source))


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in _modules():
        name = _name(path).removesuffix(".__init__")
        imported = _imports_of(path.read_text(), run_time_only=True)  # a cycle needs both to run
        graph[name] = {
            n for n in imported if n.startswith("nnx_mpmd") and n != name and _is_module(n)
        }
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle_through_a_function_level_import():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_for_type_checking_only_make_no_cycle():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import nnx_mpmd.errors\n"
    assert _imports_of(source) == ["typing", "nnx_mpmd.errors"]
    assert _imports_of(source, run_time_only=True) == ["typing"]


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles (function-level imports included): {cycles}"


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


@pytest.mark.parametrize("path", sorted((PACKAGE / "compiler").rglob("*.py")), ids=_name)
def test_compiler_functions_are_small(path):
    long = _long_functions(path)
    assert not long, (
        f"{_name(path)}: {', '.join(long)} over {MAX_COMPILER_FUNCTION_LINES} lines; "
        "split it into passes or helpers"
    )


# The package's ``__init__`` loads its public names on first use (PEP 562): ``import
# nnx_mpmd`` and the launcher (``python -m nnx_mpmd launch``) do not import JAX.


def _type_checking_imports_of_the_package() -> dict[str, tuple[str, str | None]]:
    """Name -> (module, attribute or None for a module), from ``if TYPE_CHECKING:``."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    found: dict[str, tuple[str, str | None]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in (n for n in node.body if isinstance(n, ast.ImportFrom)):
                for alias in imp.names:
                    is_module = imp.module == "nnx_mpmd"
                    where = f"nnx_mpmd.{alias.name}" if is_module else str(imp.module)
                    found[alias.asname or alias.name] = (where, None if is_module else alias.name)
    return found


def test_the_packages_lazy_names_are_its_typed_imports_and_all():
    import nnx_mpmd

    assert _type_checking_imports_of_the_package() == nnx_mpmd._LAZY
    assert set(nnx_mpmd.__all__) <= set(nnx_mpmd._LAZY)  # and `planner`, public but not in *
    for name, (module, attribute) in nnx_mpmd._LAZY.items():
        loaded = importlib.import_module(module)
        assert getattr(nnx_mpmd, name) is (
            loaded if attribute is None else getattr(loaded, attribute)
        )


def test_a_loaded_subpackage_does_not_hide_the_public_name_it_shares(monkeypatch):
    import nnx_mpmd
    from nnx_mpmd.jit import jit as jit_module

    monkeypatch.delitem(
        vars(nnx_mpmd), "jit", raising=False
    )  # as in a fresh process, before mp.jit
    nnx_mpmd.jit = sys.modules["nnx_mpmd.jit"]  # what importing nnx_mpmd.jit.x does
    assert nnx_mpmd.jit is jit_module.jit
    monkeypatch.delitem(vars(nnx_mpmd), "annotate", raising=False)
    nnx_mpmd.annotate = sys.modules["nnx_mpmd.annotate"]  # a public subpackage
    assert nnx_mpmd.annotate is sys.modules["nnx_mpmd.annotate"]


def test_an_unknown_name_of_the_package_is_an_attribute_error():
    import nnx_mpmd

    with pytest.raises(AttributeError, match="module 'nnx_mpmd' has no attribute 'jti'"):
        nnx_mpmd.jti
    assert "jit" in dir(nnx_mpmd)
