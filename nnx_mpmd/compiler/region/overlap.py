"""Overlapped tasks: stage tasks that a schedule runs as one program.

A schedule joins tasks of one mesh with ``+`` (`Task.with_next`), as DualPipe
overlaps the forward of one microbatch with the backward of another: compiled
as one XLA program, the device may overlap one task's communication (a
collective inside a stage, an activation leaving) with the other's compute,
and the host dispatches one program instead of two or three.

`overlap_tasks` is the region pass after `schedule_lowering.lower_schedule`
(whose `dispatch_order` emits a group's tasks consecutively): each group
becomes one `Call` whose program runs the members' stage functions in order
(`ProgramKey.overlapped`, named like ``F0+B7``). A ``BI`` followed in its group
by the ``BW`` of the same stage and microbatch runs as one full backward
(``B``). The pass refuses a group whose members exchange values (one reads
what another writes) or write the same value (a gradient accumulator, a
stage's carried state): run in one program, each member sees the values as
they were before the group, so either would be a silently wrong result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeGuard, cast

from nnx_mpmd.compiler.ir import Call, Instruction, ProgramKey
from nnx_mpmd.compiler.jaxpr_utils import named_jit
from nnx_mpmd.compiler.region.region_values import RegionContext, region_values_in
from nnx_mpmd.compiler.region.schedule_lowering import lower_task
from nnx_mpmd.compiler.trace.stage_programs import STAGE_PROGRAMS
from nnx_mpmd.errors import CompileError
from nnx_mpmd.schedules.tasks import Task

__all__ = ["overlap_tasks", "overlapped_call"]

_OVERLAPPABLE = ("F", "B", "BI", "BW")


def _starts_group(ins: Instruction) -> TypeGuard[Call]:
    return isinstance(ins, Call) and isinstance(ins.task, Task) and ins.task.with_next


def _merge_split_backwards(ctx: RegionContext, calls: Sequence[Call]) -> list[Call]:
    """A ``BI`` directly followed by its own ``BW`` becomes one ``B`` call."""
    merged: list[Call] = []
    for call in calls:
        prev = merged[-1] if merged else None
        if (
            prev is not None
            and call.task.kind == "BW"
            and prev.task.kind == "BI"
            and (prev.task.stage, prev.task.microbatch) == (call.task.stage, call.task.microbatch)
        ):
            whole = Task(call.task.stage, call.task.microbatch, "B")
            merged[-1] = lower_task(ctx, call.mesh, whole)
        else:
            merged.append(call)
    return merged


def _check_independent(calls: Sequence[Call], text: str) -> None:
    """Raises if a member reads or writes a value another member writes."""
    written: dict[Any, str] = {}
    for call in calls:
        reads = set(region_values_in(call.args))
        writes = set(region_values_in(call.outs))
        for value in reads | writes:
            if value in written:
                raise CompileError(
                    f"the overlapped tasks {text} on mesh {call.mesh} cannot run as one "
                    f"program: {call.label} {'writes' if value in writes else 'reads'} "
                    f"{value!r}, which {written[value]} writes (a gradient accumulator, "
                    "carried state or an activation). In one program every task sees the "
                    "values as they were before the group. Join only independent tasks with "
                    "'+', e.g. the forward of one stage and the backward of another."
                )
        for value in writes:
            written[value] = call.label


def _composed(ctx: RegionContext, key: ProgramKey, calls: Sequence[Call]) -> Callable[..., Any]:
    """One jitted program running the members' stage functions on consecutive arguments."""
    parts: list[tuple[Callable[..., Any], int, int]] = []
    donated: list[int] = []
    offset = 0
    for call in calls:
        method, always = STAGE_PROGRAMS[call.program.kind]
        stage = cast(int, call.program.stage)  # a stage task's program names its stage
        parts.append((getattr(ctx.fns[stage], method), offset, len(call.args)))
        donated += [offset + d for d in always]
        offset += len(call.args)

    def run(*args: Any) -> tuple[Any, ...]:
        return tuple(fn(*args[start : start + n]) for fn, start, n in parts)

    return named_jit(run, str(key), donate_argnums=tuple(donated))


def overlapped_call(ctx: RegionContext, members: Sequence[Call]) -> Call:
    """The one `Call` running an overlapped group: arguments and results concatenated, tasks tupled.

    Raises:
      CompileError: a member is not a stage task of kind F, B, BI or BW, or
        the members are not independent (see the module docstring).
    """
    text = "+".join(str(m.task) for m in members)
    for m in members:
        if m.program.kind not in _OVERLAPPABLE or m.program.members:
            raise CompileError(
                f"the overlapped tasks {text} on mesh {m.mesh} include {m.label} "
                f"(program {m.program}); only {', '.join(_OVERLAPPABLE)} tasks run overlapped."
            )
    calls = _merge_split_backwards(ctx, members)
    _check_independent(calls, text)
    key = ProgramKey.overlapped([c.program for c in calls])
    if key not in ctx.programs:
        ctx.programs[key] = _composed(ctx, key, calls)
    # The composed program is its members' programs side by side: equal members, equal program.
    parts = tuple(ctx.fns[cast(int, c.program.stage)].structure(c.program.kind) for c in calls)
    return Call(
        members[0].mesh,
        key,
        ctx.programs[key],
        tuple(a for c in calls for a in c.args),
        tuple(c.outs for c in calls),
        "+".join(c.label for c in calls),
        tuple(m.task for m in members),
        structure=None if any(p is None for p in parts) else ("overlapped", parts),
    )


def overlap_tasks(program: Sequence[Instruction], ctx: RegionContext) -> list[Instruction]:
    """Pass: every group of overlapped tasks (`Task.with_next`) becomes one `Call` (a new list).

    Raises:
      CompileError: a group is not contiguous on its mesh, or cannot run as
        one program (`overlapped_call`).
    """
    result: list[Instruction] = []
    n = 0
    while n < len(program):
        ins = program[n]
        if not _starts_group(ins):
            result.append(ins)
            n += 1
            continue
        members = [ins]
        while members[-1].task.with_next:
            n += 1
            nxt = program[n] if n < len(program) else None
            if not (isinstance(nxt, Call) and isinstance(nxt.task, Task) and nxt.mesh == ins.mesh):
                raise CompileError(
                    f"the overlapped tasks starting at {ins.label} on mesh {ins.mesh} are not "
                    "consecutive in the dispatch order (the last task of a mesh cannot have "
                    "with_next); check the schedule with mp.schedules.validate."
                )
            members.append(nxt)
        result.append(overlapped_call(ctx, members))
        n += 1
    return result
