"""The code stays `ruff format` and `ruff check` clean (configuration in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATHS = ["nnx_mpmd", "tests", "examples", "benchmarks"]


def _ruff() -> str:
    candidate = Path(sys.executable).with_name("ruff")
    found = str(candidate) if candidate.exists() else shutil.which("ruff")
    if found is None:
        pytest.fail('ruff is not installed; install the dev extra: pip install -e ".[dev]"')
    return found


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=["format", "check"])
def test_ruff_is_clean(command):
    result = subprocess.run(
        [_ruff(), *command, *PATHS], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
