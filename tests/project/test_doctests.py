"""Every docstring example in the package runs (8 CPU devices, set by conftest)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import nnx_mpmd

# Entry-point shims with nothing to test.
SKIP = {"nnx_mpmd.__main__"}

MODULES = sorted(
    name
    for _, name, _ in pkgutil.walk_packages(nnx_mpmd.__path__, prefix="nnx_mpmd.")
    if name not in SKIP
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


def test_public_api_has_examples():
    """Every public function and class re-exported by nnx_mpmd has an Example."""
    missing = []
    for name in nnx_mpmd.__all__:
        obj = getattr(nnx_mpmd, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            continue  # errors are documented in errors.py and Troubleshooting
        if callable(obj) and "Example" not in (obj.__doc__ or ""):
            missing.append(name)
    assert not missing, f"public names without an Example in their docstring: {missing}"
