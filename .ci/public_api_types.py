"""Fails when a symbol of nnx_mpmd's public API has an unknown or ambiguous type.

Reads the JSON of ``pyright --verifytypes nnx_mpmd --ignoreexternal --outputjson``
on stdin (``make typecheck`` pipes it here). The public API is what
``nnx_mpmd/__init__.py`` exports: its ``__all__`` names, with their members, and
everything under the subpackages it exports. pyright's score over the whole
package (internal modules included) is printed, not checked.

Two kinds of report are not failures: a class whose base class or metaclass
comes from Flax (pyright cannot type ``nnx.Module``'s metaclass, which is
outside this package), and the names in ``PENDING`` (a list that only shrinks).

Example:
    PYTHONPATH=. .venv/bin/pyright --verifytypes nnx_mpmd --ignoreexternal --outputjson \
        | .venv/bin/python .ci/public_api_types.py
"""

from __future__ import annotations

import ast
import json
import pathlib
import sys
from typing import Any

PACKAGE = "nnx_mpmd"
#: Problems of Flax's classes, reported on every NNX module subclass.
EXTERNAL = ("Type of metaclass unknown", "Type of base class unknown")
#: Prefixes of public symbols still under rework, skipped here (empty: every one is typed).
PENDING: tuple[str, ...] = ()


def public_prefixes(init: pathlib.Path) -> set[str]:
    """The dotted names whose symbols (and members) form the public API.

    Each name of ``__all__`` (``nnx_mpmd.Stage``), where it is defined
    (``nnx_mpmd.annotate.stage.Stage``), and each exported subpackage.
    """
    tree = ast.parse(init.read_text())
    prefixes: set[str] = set()
    for node in ast.walk(tree):  # the imports under `if TYPE_CHECKING:` too
        is_all = isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        )
        if is_all and isinstance(node.value, ast.List | ast.Tuple):
            prefixes.update(f"{PACKAGE}.{ast.literal_eval(e)}" for e in node.value.elts)
        if isinstance(node, ast.ImportFrom) and node.module and node.module != PACKAGE:
            prefixes.update(f"{node.module}.{alias.name}" for alias in node.names)
    return prefixes


def is_public(name: str, prefixes: set[str]) -> bool:
    """Whether the symbol ``name`` (``nnx_mpmd.X.y``) is part of the public API."""
    parts = name.split(".")
    return any(".".join(parts[:n]) in prefixes for n in range(2, len(parts) + 1))


def problems(symbol: dict[str, Any]) -> list[str]:
    """The symbol's own type errors (not the missing docstrings), less Flax's base classes."""
    return [
        d["message"].splitlines()[0]
        for d in symbol.get("diagnostics", [])
        if d.get("severity") == "error" and not d["message"].startswith(EXTERNAL)
    ]


def main() -> int:
    report = json.load(sys.stdin)
    completeness = report["typeCompleteness"]
    prefixes = public_prefixes(pathlib.Path(PACKAGE) / "__init__.py")
    failures = []
    for symbol in completeness["symbols"]:
        name = symbol["name"]
        if not symbol.get("isExported") or not is_public(name, prefixes):
            continue
        if name.startswith(PENDING):
            continue
        for message in problems(symbol):
            failures.append(f"{name}: {message}")
    score = completeness["completenessScore"]
    print(f"pyright --verifytypes {PACKAGE}: {score:.1%} of all exported symbols fully typed")
    if failures:
        print(f"{len(failures)} problem(s) in the public API; annotate them:")
        print("\n".join(f"  {line}" for line in failures))
        return 1
    print("public API: every symbol's type is known")
    return 0


if __name__ == "__main__":
    sys.exit(main())
