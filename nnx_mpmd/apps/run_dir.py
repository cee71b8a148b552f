"""The run directory and the processes of ``nnx-mpmd train``: where a run writes, and
how the processes of a launched run agree on it and finish together.

`resolve_run_dir` picks the directory (a new ``runs/TIME`` or, with ``--resume``,
the newest run that has checkpoints), `agree_on_run_dir` makes every process use
process 0's choice, `finish_together` keeps the processes until process 0 has
written its outputs, and `leave_after_dead_peer` ends a process whose peer died.
`nnx_mpmd.apps.train` re-exports them. This module imports no JAX at the top level.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import sys
from typing import Any

__all__ = [
    "FINISHED_KEY",
    "FINISH_WAIT_S",
    "RUNS_ROOT",
    "RUN_DIR_KEY",
    "agree_on_run_dir",
    "finish_together",
    "join_processes",
    "leave_after_dead_peer",
    "RUN_TOKENIZER_FILES",
    "resolve_run_dir",
    "reuse_run_tokenizer",
]

RUNS_ROOT = pathlib.Path("runs")
#: The names of a run's copy of its ``--tokenizer`` file
#: (`nnx_mpmd.apps.text_tokenizers.tokenizer_into_run`).
RUN_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def resolve_run_dir(cfg: Any) -> pathlib.Path:
    """The run directory of ``cfg``; creates nothing.

    Without ``--run-dir``: ``runs/TIME``, or with ``--resume`` the newest run with checkpoints.

    Raises:
      CheckpointError: ``--resume`` without an earlier run to continue.

    Example:
      >>> import argparse
      >>> resolve_run_dir(argparse.Namespace(resume=False, run_dir="my_run"))
      PosixPath('my_run')
    """
    from nnx_mpmd.errors import CheckpointError

    if not cfg.resume:
        if cfg.run_dir:
            return pathlib.Path(cfg.run_dir)
        return RUNS_ROOT / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    if cfg.run_dir:
        run_dir = pathlib.Path(cfg.run_dir)
        if not (run_dir / "checkpoints").is_dir():
            raise CheckpointError(
                f"--resume: {run_dir} holds no checkpoints/ directory, so there is no earlier "
                "run to continue there; run without --resume to start one, or point --run-dir "
                "at a run that saved checkpoints."
            )
        return run_dir
    runs = sorted(p for p in RUNS_ROOT.glob("*") if (p / "checkpoints").is_dir())
    if not runs:
        raise CheckpointError(
            f"--resume: no earlier run with checkpoints under {RUNS_ROOT.resolve()}; run "
            "without --resume to start one, or pass --run-dir with a run that saved checkpoints."
        )
    return runs[-1]


def reuse_run_tokenizer(cfg: Any, given: str | None) -> None:
    """With ``--resume``, points ``cfg.tokenizer`` at the run directory's copy of its tokenizer.

    The original may have moved; a ``given`` ``--tokenizer`` with other contents raises `MpmdError`.

    Example:
      >>> import argparse
      >>> cfg = argparse.Namespace(resume=False, run_dir="r", tokenizer=None)
      >>> reuse_run_tokenizer(cfg, None)  # a new run: nothing to reuse
      >>> cfg.tokenizer is None
      True
    """
    from nnx_mpmd.errors import MpmdError

    if not cfg.resume:
        return
    try:
        run_dir = resolve_run_dir(cfg)
    except MpmdError:  # no run to continue: `run` says so
        return
    copies = [run_dir / name for name in RUN_TOKENIZER_FILES if (run_dir / name).is_file()]
    if not copies or not _trained_with_tokenizer_file(run_dir):
        return
    if given is None:
        cfg.tokenizer = str(copies[0])
        return
    _check_same_tokenizer(pathlib.Path(given), copies[0])


def _trained_with_tokenizer_file(run_dir: pathlib.Path) -> bool:
    """Whether the run's saved ``config.toml`` names a tokenizer file (a copy left by a
    refused resume of a character-level run does not count)."""
    import tomllib

    try:
        saved = tomllib.loads((run_dir / "config.toml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False  # no readable saved configuration: `parse_layered` names a bad one
    return isinstance(saved.get("tokenizer"), str)


def _check_same_tokenizer(given: pathlib.Path, copy: pathlib.Path) -> None:
    """Refuses a ``--tokenizer`` on ``--resume`` that differs from the run's copy, before
    the copy is overwritten (the run's checkpoints need it)."""
    from nnx_mpmd.apps.text_tokenizers import file_sha256
    from nnx_mpmd.errors import MpmdError

    if given.resolve() == copy.resolve() or not given.is_file():
        return  # a missing file is named by the data options' check
    if given.suffix == copy.suffix and file_sha256(given) == file_sha256(copy):
        return
    raise MpmdError(
        f"--resume: --tokenizer {given} differs from the tokenizer the run trained with "
        f"({copy}); resume without --tokenizer to use the run's copy, or start a new --run-dir."
    )


def join_processes() -> Any:
    """Joins the multi-process run the environment describes; returns the `ProcessInfo`.

    Every process calls it before JAX starts its backends.

    Example:
      >>> join_processes().num_processes  # no launcher, no cluster: one process
      1
    """
    from nnx_mpmd.distributed import initialize

    return initialize()


RUN_DIR_KEY = "train/run_dir"


def agree_on_run_dir(run_dir: pathlib.Path) -> pathlib.Path:
    """Process 0's run directory, on every process (each may have timed its own name).

    Raises:
      DistributedError: process 0 died or did not say in time.

    Example:
      >>> agree_on_run_dir(pathlib.Path("runs/x"))  # one process: its own choice
      PosixPath('runs/x')
    """
    import jax

    if jax.process_count() == 1:
        return run_dir
    from nnx_mpmd.runtime.coordination import get_coordination

    coordination = get_coordination()
    if jax.process_index() == 0:
        coordination.publish(RUN_DIR_KEY, str(run_dir))
        return run_dir
    return pathlib.Path(coordination.fetch(RUN_DIR_KEY, 0, "agreeing on the run directory"))


FINISHED_KEY = "train/finished"
#: How long the other processes wait for process 0's validation and sample (while it lives).
FINISH_WAIT_S = 6 * 3600.0


def finish_together() -> None:
    """Keeps every process until process 0 has scored, sampled and written its outputs.

    Only process 0 computes the validation loss and sample; the others wait for it
    while it lives (at most `FINISH_WAIT_S`), then all meet at a barrier.

    Raises:
      DistributedError: a process died, or process 0 did not finish within `FINISH_WAIT_S`.

    Example:
      >>> finish_together()  # one process: nothing to wait for
    """
    import jax

    if jax.process_count() == 1:
        return
    from nnx_mpmd.runtime.coordination import get_coordination

    coordination = get_coordination()
    if jax.process_index() == 0:
        coordination.publish(FINISHED_KEY, True)
    else:
        where = "finishing the run (waiting for process 0's validation loss and sample)"
        coordination.fetch(FINISHED_KEY, 0, where, timeout_s=FINISH_WAIT_S)
    # A process that died at the very end is named here, not lost in the exit hook.
    coordination.barrier("train/finished", "finishing the run (every process done)")


def leave_after_dead_peer(status: int) -> None:
    """Ends this process with ``status`` now, once a peer died (returns on one process).

    A normal exit would wait for the dead peer in threads and the exit barrier.

    Example:
      >>> leave_after_dead_peer(2)  # one process: returns
    """
    import jax

    if jax.process_count() == 1:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
