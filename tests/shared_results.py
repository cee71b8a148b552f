"""Results computed once per test run and shared by every xdist worker.

A module-scoped fixture runs once in each worker that runs a test using it, and
``--dist loadgroup`` cannot keep those tests on one worker with pytest 9 (the
group suffix xdist writes into the node id is ignored). Expensive fixtures
whose result is plain data (losses read from launched runs, a run directory)
compute it through `once_per_test_run`: the first worker to ask computes it
while the others wait on a file lock, then read it.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def shared_dir(name: str) -> Path:
    """Where ``name``'s files go, under this test run's shared directory (tests/conftest.py).

    Only the parent is made here: `once_per_test_run` makes the directory itself
    while it holds the lock, so no worker can create it between another's
    ``rmtree`` and ``mkdir``.
    """
    root = Path(os.environ["NNX_MPMD_TEST_RUN_DIR"]) / "shared"
    root.mkdir(parents=True, exist_ok=True)
    return root / name


def once_per_test_run(key: str, compute: Callable[[Path], T]) -> T:
    """``compute(directory)`` once for the whole test run; its (picklable) value.

    ``directory`` is empty and shared by every worker: ``compute`` may write
    files there that its value refers to. A failure is not stored: the next
    worker that asks computes again (and fails where the first did).
    """
    directory = shared_dir(key)
    result = directory.parent / f"{key}.pickle"
    with open(directory.parent / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if result.exists():
            return pickle.loads(result.read_bytes())
        shutil.rmtree(directory, ignore_errors=True)  # what an earlier, failed attempt left
        directory.mkdir()
        value = compute(directory)
        partial = result.with_suffix(".partial")
        partial.write_bytes(pickle.dumps(value))
        partial.replace(result)
        return value
