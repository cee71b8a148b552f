"""What ``nnx-mpmd train`` shows while it runs: the progress bar, the schedule's name,
the first step's compilations, and where its commands live.

A run's first step traces and compiles every stage program (seconds to
minutes on a CPU); the bar says so and counts the programs as XLA finishes
them (`CompileCounter`), and each step's loss appears from step 1 on.

Example:
    >>> step_status(2.5, 1000.0)
    'loss 2.500  1,000 tok/s'
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax

__all__ = [
    "CompileCounter",
    "first_step_status",
    "progress_bar",
    "running_venv_hint",
    "schedule_label",
    "step_status",
    "venv_hint",
]


def schedule_label(schedule: Any) -> str:
    """A schedule as ``--schedule`` spells it, with its non-default parameters in parentheses.

    Example:
      >>> from nnx_mpmd.schedules import get_schedule
      >>> schedule_label(get_schedule("interleaved")), schedule_label(get_schedule("zb-v"))
      ('interleaved', 'zb-v')
      >>> schedule_label(get_schedule("interleaved", virtual_stages=3))
      'interleaved (virtual_stages=3)'
    """
    params = [
        f"{field.name}={getattr(schedule, field.name)!r}"
        for field in dataclasses.fields(schedule)
        if getattr(schedule, field.name) != field.default
    ]
    return schedule.name + (f" ({', '.join(params)})" if params else "")


#: JAX's monitoring events: an XLA compilation (or a load from the persistent cache)
#: finished; a load from the persistent cache.
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
    """Counts the programs XLA compiles, and those JAX's compile cache loads, while entered.

    The first step of a run spends its time compiling (seconds to minutes); the
    progress bar shows these counts meanwhile. Compilations run on several
    threads: ``on_change`` is called from them.

    Args:
      on_change: called with the counter after each compiled or loaded program.

    Example:
      >>> with CompileCounter() as counter:
      ...     _ = jax.jit(lambda x: x * 3 + 17)(jax.numpy.arange(3.0))
      >>> counter.programs >= 1, counter.text(cache_on=False)[:9]
      (True, 'compiled ')
    """

    def __init__(self, on_change: Callable[[CompileCounter], None] = lambda counter: None) -> None:
        self.programs = 0  # compiled or loaded from the persistent cache
        self.cache_hits = 0  # loaded from the persistent cache
        self._on_change = on_change
        self._lock = threading.Lock()

    def _on_duration(self, event: str, duration_secs: float, **kwargs: Any) -> None:
        if event == _COMPILE_EVENT:
            with self._lock:
                self.programs += 1
            self._on_change(self)

    def _on_event(self, event: str, **kwargs: Any) -> None:
        if event == _CACHE_HIT_EVENT:
            with self._lock:
                self.cache_hits += 1

    def __enter__(self) -> CompileCounter:
        jax.monitoring.register_event_listener(self._on_event)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        return self

    def __exit__(self, *exc: object) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_duration)
        jax.monitoring.unregister_event_listener(self._on_event)

    def text(self, cache_on: bool) -> str:
        """The compile counts, e.g. ``"compiled 12 programs, 5 from the compile cache"``."""
        plural = "" if self.programs == 1 else "s"
        if not cache_on:
            return f"compiled {self.programs} program{plural}, compile cache off"
        return f"compiled {self.programs} program{plural}, {self.cache_hits} from the compile cache"


def progress_bar(total: int, completed: int, shown: bool) -> tuple[Any, Any]:
    """``(progress, task)``: the run's rich progress bar (drawn if ``shown``); update ``status``.

    Example:
      >>> progress, task = progress_bar(300, 0, shown=False)
      >>> progress.tasks[0].fields["status"]
      'step 1: tracing and compiling the stage programs...'
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    progress = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TimeElapsedColumn(),
        disable=not shown,
    )
    status = first_step_status(completed + 1, None, cache_on=False)
    task = progress.add_task("train", total=total, completed=completed, status=status)
    return progress, task


def first_step_status(step: int, counter: CompileCounter | None, cache_on: bool) -> str:
    """What the progress bar says while the first ``step`` compiles, with ``counter``'s counts.

    Example:
      >>> first_step_status(1, None, cache_on=True)
      'step 1: tracing and compiling the stage programs...'
    """
    status = f"step {step}: tracing and compiling the stage programs..."
    if counter is None or not counter.programs:
        return status
    return f"{status} {counter.text(cache_on)}"


def step_status(loss: float, tokens_per_s: float) -> str:
    """What the progress bar says after a step: its loss and the throughput.

    Example:
      >>> step_status(4.38123, 12345.6)
      'loss 4.381  12,346 tok/s'
    """
    return f"loss {loss:.3f}  {tokens_per_s:,.0f} tok/s"


def venv_hint(prefix: str, base_prefix: str, path: str) -> str | None:
    """How to run the examples and ``nnx-mpmd`` from a virtual environment not on ``PATH``.

    ``make demo`` installs into ``.venv``, which the shell has not activated; None otherwise.

    Example:
      >>> print(venv_hint("/src/.venv", "/usr", "/usr/bin"))
      nnx-mpmd is installed in the virtual environment /src/.venv; to use it:
        source /src/.venv/bin/activate   (then python examples/01_quickstart.py, nnx-mpmd --help)
        or /src/.venv/bin/python examples/01_quickstart.py, /src/.venv/bin/nnx-mpmd --help
      >>> venv_hint("/src/.venv", "/usr", "/src/.venv/bin:/usr/bin") is None
      True
    """
    if prefix == base_prefix:
        return None
    venv = pathlib.Path(prefix)
    bin_dir = venv / "bin"
    on_path = {pathlib.Path(p).resolve() for p in path.split(os.pathsep) if p}
    if bin_dir.resolve() in on_path:
        return None
    shown = os.path.relpath(venv) if venv.resolve().is_relative_to(pathlib.Path.cwd()) else venv
    return (
        f"nnx-mpmd is installed in the virtual environment {shown}; to use it:\n"
        f"  source {shown}/bin/activate   (then python examples/01_quickstart.py, "
        "nnx-mpmd --help)\n"
        f"  or {shown}/bin/python examples/01_quickstart.py, {shown}/bin/nnx-mpmd --help"
    )


def running_venv_hint() -> str | None:
    """`venv_hint` for this process."""
    return venv_hint(sys.prefix, sys.base_prefix, os.environ.get("PATH", ""))
