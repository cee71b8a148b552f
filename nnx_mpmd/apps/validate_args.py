"""Checks of ``nnx-mpmd train``'s input that turn bad values into one-line errors.

Each check runs before the step that would otherwise fail with a raw
traceback (a negative seed deep in NumPy, a run directory that is a file at
``mkdir``, a hand-edited plan or checkpoint metadata at a ``KeyError``), and
before anything is written, so a refused run leaves no files behind. Every
error is an `nnx_mpmd.errors.MpmdError` that says which option or file was
wrong and how to fix it; ``nnx-mpmd train`` prints it on one line and exits
with 2.

This module imports no JAX: the argument checks run before the simulated CPU
device count is set.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from nnx_mpmd.errors import CheckpointError, MpmdError, PlanError

__all__ = ["MAX_SEED", "check_output_dir", "check_seed", "checked_metadata", "read_plan_settings"]

#: Seeds must lie in ``[0, MAX_SEED)``: NumPy refuses negative seeds, JAX larger ones.
MAX_SEED = 2**63


def check_seed(seed: int) -> None:
    """Refuses (`MpmdError`) a seed NumPy's or JAX's generators would reject.

    Example:
      >>> check_seed(0)
      >>> check_seed(-1)
      Traceback (most recent call last):
      ...
      nnx_mpmd.errors.MpmdError: --seed=-1 must lie in [0, 2**63), e.g. --seed 0.
    """
    if not 0 <= seed < MAX_SEED:
        raise MpmdError(f"--seed={seed} must lie in [0, 2**63), e.g. --seed 0.")


def check_output_dir(path: pathlib.Path, option: str) -> None:
    """Refuses (`MpmdError`) a directory ``option`` names that cannot be created or written.

    Creates nothing; checks the nearest existing folder above a new one.

    Example:
      >>> import tempfile
      >>> check_output_dir(pathlib.Path(tempfile.mkdtemp()) / "run", "--run-dir")
    """
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    where = f"{option} {path}" if existing == path else f"{option} {path}: {existing}"
    if not existing.is_dir():
        raise MpmdError(f"{where} is a file, not a directory; choose another {option}.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise MpmdError(
            f"{where} is not writable by you; choose another {option}, or fix its "
            "permissions (`chmod u+w`)."
        )


def read_plan_settings(path: str) -> dict[str, Any]:
    """The settings ``nnx-mpmd train --plan`` takes from a plan file, checked without JAX.

    ``num_meshes``, ``batch_size``, ``schedule``, ``num_stages``, ``num_microbatches``, ``donate``.

    Raises:
      PlanError: the file cannot be read, is not JSON, or misses one of these
        or has it with the wrong type.

    Example:
      >>> read_plan_settings("/no/such/plan.json")
      Traceback (most recent call last):
      ...
      nnx_mpmd.errors.PlanError: --plan /no/such/plan.json: cannot read a plan (No such file or directory); write one with `nnx-mpmd plan --out FILE`.
    """
    fix = "write one with `nnx-mpmd plan --out FILE`."
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise PlanError(f"--plan {path}: cannot read a plan ({e.strerror}); {fix}") from None
    except ValueError as e:  # not JSON, or not text
        raise PlanError(f"--plan {path}: cannot read a plan (not JSON: {e}); {fix}") from None
    best = data.get("best") if isinstance(data, dict) else None
    if not isinstance(best, dict):
        raise PlanError(f"--plan {path}: cannot read a plan (no 'best' configuration); {fix}")
    fields = {
        "num_meshes": data.get("num_meshes"),
        "batch_size": data.get("batch_size"),
        "num_stages": best.get("num_stages"),
        "num_microbatches": best.get("num_microbatches"),
    }
    wrong = [k for k, v in fields.items() if not _is_positive_int(v)]
    if wrong or not isinstance(best.get("schedule"), str):
        wrong += [] if isinstance(best.get("schedule"), str) else ["schedule (a name)"]
        raise PlanError(
            f"--plan {path}: cannot read a plan ({', '.join(wrong)} missing or of the wrong "
            f"type; integers >= 1 expected); {fix}"
        )
    return {**fields, "schedule": best["schedule"], "donate": bool(data.get("donate"))}


def _is_positive_int(value: Any) -> bool:
    return _is_int(value) and value >= 1


def checked_metadata(saved: Any, where: pathlib.Path, step: int | None) -> dict[str, Any]:
    """``saved`` checkpoint metadata, checked for what ``--resume`` reads from it.

    Raises:
      CheckpointError: not a dict, or its ``step`` (an int >= 0) or ``data`` (the
        data position) is missing or malformed.

    Example:
      >>> checked_metadata({"step": 3, "data": {"position": 3}}, pathlib.Path("c"), 3)["step"]
      3
    """
    meta = saved if isinstance(saved, dict) else {}
    problems = []
    if not _is_int(meta.get("step")) or meta["step"] < 0:
        problems.append(f"'step' is {meta.get('step')!r}, not a step number")
    data = meta.get("data")
    if not isinstance(data, dict) or not _is_int(data.get("position")):
        problems.append(f"'data' is {data!r}, not the data position ({{'position': N, ...}})")
    if problems:
        raise CheckpointError(
            f"the metadata of checkpoint {step} in {where} is damaged: {'; '.join(problems)}. "
            "Resume from another step (remove this one), or start a new --run-dir."
        )
    return meta


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
