"""A lowered step's programs compiled ahead of time and bound to its calls.

`BoundPrograms` takes a lowered step (the IR, never changed) and compiles its
programs: in one process, each program whose module equals one compiled for
an equal-shaped submesh is loaded, not compiled again
(`nnx_mpmd.aot.program_sharing`), and a step an earlier process stored is
loaded whole (`nnx_mpmd.aot.step_store`). Its ``step`` is a new IR, the
lowered one with every call routed to its program's executables, that the
runtime runs. Started with ``overlap``, the first run dispatches while later
programs compile (each call waits for its own, `AwaitedProgram`); `finish`
then waits for all and routes the calls straight to the executables.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

from nnx_mpmd.aot import step_store
from nnx_mpmd.aot.precompile import AwaitedProgram, Precompiling, route_calls, start_precompile
from nnx_mpmd.compiler.final.step import CompiledStep
from nnx_mpmd.jit.options import JitOptions
from nnx_mpmd.runtime.executor import _Shardings

__all__ = ["BoundPrograms", "older_objects_left_alone"]


@contextlib.contextmanager
def older_objects_left_alone() -> Iterator[None]:
    """Python's collector leaves the objects that existed before the block alone.

    Tracing, lowering and compiling allocate many objects, and each full
    collection walks every object of the process (the model, its jaxprs,
    earlier steps): 0.2-0.3 s of a warm first step of GPT tiny. Frozen
    (`gc.freeze`) for the block, those older objects are skipped. Nothing is
    changed when the collector is off or the caller froze objects already.
    """
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class BoundPrograms:
    """The executables of a lowered step's programs, and the step that calls them.

    Args:
      lowered: the lowered step (not changed).
      step: the step the runtime runs (``lowered`` itself, or a routed copy).
      executables: XLA's compiled programs by name.
    """

    def __init__(
        self, lowered: CompiledStep, step: CompiledStep, executables: dict[str, list[Any]]
    ) -> None:
        self.lowered = lowered
        self.step: CompiledStep = step
        self.executables = executables
        self._pending: tuple[Precompiling, dict[str, Any], Any] | None = None

    @classmethod
    def jit_on_first_call(cls, lowered: CompiledStep) -> BoundPrograms:
        """No ahead-of-time compilation: each program compiles when a run first calls it."""
        return cls(lowered, lowered, {})

    @classmethod
    def compile(
        cls,
        lowered: CompiledStep,
        inputs: list[Any],
        options: JitOptions,
        shardings: _Shardings,
        overlap: bool = False,
    ) -> BoundPrograms:
        """Compiles ``lowered``'s programs and routes its calls to them.

        Args:
          lowered: the lowered step.
          inputs: its inputs, or their `PlacedAval` s.
          options: the step's options (mesh, schedule, ``compile_threads``).
          shardings: the step's sharding cache.
          overlap: return once the compilations are scheduled; `finish` waits.

        Returns:
          The bound programs.
        """
        mesh = options.mesh
        executables: dict[str, list[Any]] = {}
        loaded: dict[str, list[Any]] | None = None if mesh.is_multi_process else {}
        key = None
        if loaded is not None:  # an earlier process may have stored this step's programs
            key, stored = step_store.lookup(
                lowered, inputs, mesh, options.schedule, options.num_microbatches
            )
            if stored is not None:
                executables.update(stored)
                step, _ = route_calls(
                    lowered, lambda name, fn: step_store.stored_program(fn, stored, name)
                )
                return cls(lowered, step, executables)
        compiling = start_precompile(
            lowered,
            inputs,
            list(mesh.submeshes),
            shardings,
            max_workers=options.compile_threads,
            batch_axis=lowered.batch_axis,  # None where the step replicates it
            executables=executables,
            loaded=loaded,
        )
        if loaded is None:  # several processes: every program runs its own jit function
            compiling.finish()
            return cls(lowered, lowered, executables)
        step, awaited = route_calls(
            lowered, lambda name, fn: AwaitedProgram(name, fn, compiling, executables)
        )
        bound = cls(lowered, step, executables)
        bound._pending = (compiling, awaited, key)
        if not overlap:
            bound.finish()
        return bound

    def finish(self) -> None:
        """Waits for the ahead-of-time compilations; calls then go to their executables."""
        if self._pending is None:
            return
        compiling, awaited, key = self._pending
        self._pending = None
        compiling.finish()
        if key is not None:
            step_store.store_step(key, self.executables, compiling.sources)
        self.step, _ = route_calls(self.lowered, lambda name, fn: awaited[name].resolved())
