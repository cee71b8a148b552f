"""Running a compiled step once: inputs in, the runtime, new state written back.

`run_step` is what `nnx_mpmd.jit.stages.Compiled` does when called: it hands
the step's instructions and inputs to the runtime (one process or several),
records a profile or per-mesh memory when asked (into `StepRecords`), writes
the new state into the caller's Variables and raises a `NonFiniteError`
found by ``check_finite`` after that write-back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from nnx_mpmd.compiler.final.step import CompiledStep
from nnx_mpmd.compiler.trace.trace_step import FlatArgs
from nnx_mpmd.errors import CompileError
from nnx_mpmd.jit.arguments import StepCall
from nnx_mpmd.jit.options import JitOptions
from nnx_mpmd.runtime.executor import MemoryRecorder, TaskRecord, _Shardings, execute
from nnx_mpmd.runtime.finite_check import FiniteCheck
from nnx_mpmd.runtime.interpreter import PreparedCache
from nnx_mpmd.runtime.timeline_profiler import Profile, TimelineProfiler

__all__ = ["StepRecords", "profile_mode", "run_step"]


_PROFILE_MODES = {True: "timeline", "timeline": "timeline", "isolated": "isolated"}


def profile_mode(profile: Any) -> str | None:
    """``"timeline"``, ``"isolated"`` or None (not profiled) for a call's ``profile=``.

    Example:
      >>> profile_mode(True), profile_mode(False)
      ('timeline', None)
    """
    if profile is False or profile is None:
        return None
    if isinstance(profile, bool | str) and profile in _PROFILE_MODES:
        return _PROFILE_MODES[profile]
    raise CompileError(
        f"profile={profile!r} is not a profiling mode; use profile=True (or 'timeline': "
        "meshes overlap as they do unprofiled), profile='isolated' (each program waited "
        "for before the next is dispatched: clean per-task times) or profile=False."
    )


@dataclasses.dataclass
class StepRecords:
    """What the last profiled (``profile=``) or measured (``memory=True``) run recorded."""

    last_profile: Profile | None = None
    last_memory: dict[str, Any] | None = None


def _write_back(flat: FlatArgs, new_leaves: list[Any]) -> None:
    """Stores a step's new state leaves into the caller's Variables."""
    if flat.variables is None:
        nnx.update(flat.nodes, jax.tree.unflatten(flat.state_tree, new_leaves))
        return
    for variable, value in zip(flat.variables, new_leaves, strict=True):
        variable.set_raw_value(value)


def run_step(
    step: CompiledStep,
    call: StepCall,
    options: JitOptions,
    shardings: _Shardings,
    records: StepRecords,
    profile: str | None = None,
    memory: bool = False,
    prepared: PreparedCache | None = None,
) -> Any:
    """Runs ``step`` on ``call``'s arguments and writes the new state back.

    Args:
      step: the compiled step whose calls go to their programs' executables.
      call: the arguments, read (`nnx_mpmd.jit.arguments.StepArguments.read`)
        and placed where the step was lowered for them.
      options: the step's options (mesh, ``check_finite``).
      shardings: the step's sharding cache for the runtime.
      records: where a profile or a memory summary goes.
      profile: a `profile_mode`, or None.
      memory: record per-mesh live bytes.
      prepared: the caller's cache of the step's prepared steps (None: prepared
        for this run only).

    Returns:
      The step's outputs, as the step returned them.
    """
    mesh = options.mesh
    inputs = call.inputs(step.consts)
    task_records: list[TaskRecord] = []
    profiler: Any = None
    if profile == "timeline":
        profiler = TimelineProfiler(task_records)
    elif profile == "isolated":
        profiler = task_records
    recorder = None
    check = [FiniteCheck(step)] if options.check_finite else []
    if mesh.is_multi_process:
        from nnx_mpmd.runtime.multi_process import execute_multi_process

        outputs = execute_multi_process(step, inputs, mesh, shardings, profiler, check, prepared)
    else:
        submeshes = list(mesh.submeshes)
        recorder = MemoryRecorder(submeshes) if memory else None
        outputs = execute(step, inputs, submeshes, shardings, profiler, recorder, check, prepared)
    if profile is not None:
        timed = isinstance(profiler, TimelineProfiler)
        records.last_profile = Profile(
            task_records,
            tasks=step.tasks,
            transfers=profiler.transfers if timed else (),
            mode=profile,
            approximate=profiler.approximate if timed else 0,
        )
    if recorder is not None:
        records.last_memory = recorder.summary()
    user = outputs[: step.num_user_outputs]
    _write_back(call.flat, outputs[step.num_user_outputs :])
    for finite_check in check:
        if mesh.is_multi_process:
            finite_check.agree_across_processes()  # every process raises the same
        finite_check.raise_if_found()  # after the write-back: the donated state is whole
    return jax.tree.unflatten(step.out_tree, user)
