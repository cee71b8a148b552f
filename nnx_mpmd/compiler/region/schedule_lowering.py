"""Schedule lowering: the schedule's task lists -> one `Call` per task.

Three passes, in order:

1. `dispatch_order`: the per-mesh task lists -> one global order consistent
   with every mesh's list (a dry run of the schedule that always advances the
   first mesh whose next task is ready), so JAX's asynchronous dispatch lets
   submeshes overlap.
2. `lower_schedule`: that order -> the accumulators' ``init`` calls, then one
   `Call` per task (forward, backward, BI, BW; forwards only for a forward-only
   step). Every argument is a `RegionValue` on the task's own mesh: values made
   on other meshes are moved there later by `insert_transfers`.
3. `fuse_forward_backward`: a forward directly followed on its mesh by the
   backward of the same stage and microbatch becomes one ``FB`` call that keeps
   no residuals, for stages that receive no cotangents (the last stage).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

from nnx_mpmd.compiler.ir import Call, Instruction
from nnx_mpmd.compiler.region.region_values import RegionContext, RegionValue
from nnx_mpmd.compiler.trace.stage_programs import StageFunctions
from nnx_mpmd.compiler.trace.stages import StagePlan
from nnx_mpmd.errors import CompileError, ScheduleError
from nnx_mpmd.schedules.tasks import overlap_groups

__all__ = [
    "dispatch_order",
    "fuse_forward_backward",
    "init_accumulators",
    "lower_schedule",
    "lower_task",
]


def _producers(plan: StagePlan, stage: int) -> set[int]:
    return {plan.producer[v] for v in plan.stages[stage].boundary_in}


def _dependencies(plan: StagePlan, task: Any, *, fns: Sequence[StageFunctions]) -> list[tuple]:
    s, i, kind = task.stage, task.microbatch, task.kind
    if kind == "F":
        return [(p, i, "F") for p in _producers(plan, s)]
    if kind in ("B", "BI"):
        deps = [(s, i, "F")]
        for v in fns[s].diff_sends:
            deps += [(c, i, "B") for c in plan.consumers[v]]
        return deps
    if kind == "BW":
        return [(s, i, "BI")]
    raise ScheduleError(f"unknown task kind {kind!r} in task {task}")


def _done_key(task: Any) -> tuple:
    kind = "B" if task.kind == "BI" else task.kind
    return (task.stage, task.microbatch, kind)


def _ready(group: Sequence[Any], done: set[tuple], deps: Callable[[Any], list[tuple]]) -> bool:
    """Whether a group's dependencies are done; a BW may depend on its BI in the group."""
    inside = {(t.stage, t.microbatch, "BI") for t in group if t.kind == "BI"}
    return all(d in done or (t.kind == "BW" and d in inside) for t in group for d in deps(t))


def dispatch_order(
    plan: StagePlan, tasks: Any, fns: Sequence[StageFunctions]
) -> list[tuple[int, Any]]:
    """A global order of ``(mesh, task)`` consistent with every mesh's list, round by round.

    An overlapped group is one unit, dispatched when its members' dependencies are done.

    Raises:
      ScheduleError: the task lists deadlock (e.g. a group member depends on another).
    """
    groups = [overlap_groups(mesh_tasks) for mesh_tasks in tasks]
    pos = [0] * len(groups)
    done: set[tuple] = set()
    order: list[tuple[int, Any]] = []
    total = sum(len(g) for g in groups)
    deps = functools.partial(_dependencies, plan, fns=fns)
    dispatched = 0
    while dispatched < total:
        progressed = False
        for mesh, mesh_groups in enumerate(groups):
            if pos[mesh] >= len(mesh_groups):
                continue
            group = mesh_groups[pos[mesh]]
            if _ready(group, done, deps):
                for task in group:
                    order.append((mesh, task))
                    done.add(_done_key(task))
                    if task.kind == "BI":
                        done.add((task.stage, task.microbatch, "BI"))
                pos[mesh] += 1
                dispatched += 1
                progressed = True
        if not progressed:
            stuck = ["+".join(map(str, g[p])) for g, p in zip(groups, pos) if p < len(g)]
            raise ScheduleError(
                f"the schedule deadlocks: no mesh can run its next task ({', '.join(stuck)}). "
                "Check the task order with mp.schedules.validate; tasks joined by '+' run "
                "as one program and must not depend on each other."
            )
    return order


def init_accumulators(ctx: RegionContext) -> list[Instruction]:
    """One ``init`` call per stage, writing its zero ``grad`` and ``acc`` accumulators."""
    calls: list[Instruction] = []
    for k, f in enumerate(ctx.fns if ctx.with_grad else []):
        q = ctx.stage_mesh[k]
        params = tuple(ctx.input(r, q) for r in f.param_inputs)
        key, fn = ctx.program("init", k)
        # An init that also makes an alike stage's accumulators (`region_plan.init_donors`).
        padding = getattr(fn, "padding", ())
        unused = tuple(RegionValue("unused_acc", (k, j), None, q) for j in range(len(padding)))
        outs = (ctx.grad_accumulators(k), ctx.result_accumulators(k) + unused)
        structure = f.structure("init")
        if padding and structure is not None:
            structure = (*structure, "padding", padding)
        calls.append(Call(q, key, fn, (params,), outs, f"init{k}", structure=structure))
    return calls


def _forward(ctx: RegionContext, k: int, i: int) -> tuple[str, tuple, Any]:
    racc = ctx.result_accumulators(k)
    outs = (ctx.sends(k, i), ctx.residuals(k, i), racc, ctx.carried_out(k, i))
    return "F", (*ctx.forward_args(k, i), racc), outs


def _forward_only(ctx: RegionContext, k: int, i: int) -> tuple[str, tuple, Any]:
    outs = (ctx.sends(k, i), ctx.outputs(k, i), ctx.carried_out(k, i))
    return "Fwd", ctx.forward_args(k, i), outs


def _backward(ctx: RegionContext, k: int, i: int) -> tuple[str, tuple, Any]:
    gacc = ctx.grad_accumulators(k)
    args = (ctx.residuals(k, i), ctx.forward_args(k, i), ctx.received_cotangents(k, i), gacc)
    return "B", args, (ctx.sent_cotangents(k, i), gacc)


def _backward_input(ctx: RegionContext, k: int, i: int) -> tuple[str, tuple, Any]:
    args = (ctx.residuals(k, i), ctx.forward_args(k, i), ctx.received_cotangents(k, i))
    return "BI", args, (ctx.sent_cotangents(k, i), ctx.extras(k, i))


def _backward_weight(ctx: RegionContext, k: int, i: int) -> tuple[str, tuple, Any]:
    gacc = ctx.grad_accumulators(k)
    args = (ctx.residuals(k, i), ctx.forward_args(k, i), ctx.extras(k, i), gacc)
    return "BW", args, gacc


_LOWERINGS: dict[str, Callable[[RegionContext, int, int], tuple[str, tuple, Any]]] = {
    "F": _forward,
    "B": _backward,
    "BI": _backward_input,
    "BW": _backward_weight,
}


def lower_task(ctx: RegionContext, mesh: int, task: Any) -> Call:
    """The `Call` that runs ``task`` on ``mesh``, reading and writing `RegionValue` keys.

    Raises:
      CompileError: the task runs on a mesh other than its stage's, or its kind
        is unknown.
    """
    k, i = task.stage, task.microbatch
    if ctx.stage_mesh[k] != mesh:
        raise CompileError(
            f"task {task} is on mesh {mesh} but stage {k} is placed on mesh "
            f"{ctx.stage_mesh[k]}: the schedule's task lists and its mesh_of disagree."
        )
    if task.kind == "F" and not ctx.with_grad:
        lowering = _forward_only
    else:
        lowering = _LOWERINGS.get(task.kind)
    if lowering is None:
        raise CompileError(f"unknown task kind {task.kind!r} in task {task}.")
    kind, args, outs = lowering(ctx, k, i)
    key, fn = ctx.program(kind, k)
    label = f"{'F' if kind == 'Fwd' else kind}{k}.{i}"
    return Call(mesh, key, fn, args, outs, label, task, structure=ctx.fns[k].structure(kind))


def lower_schedule(ctx: RegionContext, tasks: Any) -> list[Instruction]:
    """The schedule as calls in `dispatch_order`: ``init`` calls, then one `Call` per task.

    Each argument is a `RegionValue` on the call's own mesh; nothing moves yet.
    A forward-only step runs the forward tasks only.

    Raises:
      ScheduleError: the task lists deadlock.
      CompileError: a task runs on a mesh other than its stage's.
    """
    if not ctx.with_grad:  # inference: the schedule's forwards, in its order, one by one
        tasks = tuple(
            tuple(dataclasses.replace(t, with_next=False) for t in mesh_tasks if t.kind == "F")
            for mesh_tasks in tasks
        )
    program = init_accumulators(ctx)
    for mesh, task in dispatch_order(ctx.plan, tasks, ctx.fns):
        program.append(lower_task(ctx, mesh, task))
    return program


def _next_call_on_same_mesh(program: Sequence[Instruction]) -> list[int | None]:
    """For each position, the position of the next `Call` on the same mesh."""
    following: list[int | None] = [None] * len(program)
    last: dict[int, int] = {}
    for n in reversed(range(len(program))):
        ins = program[n]
        if isinstance(ins, Call):
            following[n] = last.get(ins.mesh)
            last[ins.mesh] = n
    return following


def _fuses_with(ctx: RegionContext, forward: Instruction, backward: Instruction) -> bool:
    if not (isinstance(forward, Call) and isinstance(backward, Call)):
        return False
    if forward.program.kind != "F" or backward.program.kind != "B":
        return False
    f, b = forward.task, backward.task
    same = (f.stage, f.microbatch) == (b.stage, b.microbatch)
    return same and not ctx.fns[f.stage].diff_sends


def _fused_call(ctx: RegionContext, forward: Call, backward: Call) -> Call:
    """``F`` and ``B`` of one stage and microbatch as one ``FB`` call (see `StageFunctions.fused`)."""
    k, i = forward.task.stage, forward.task.microbatch
    *inputs, racc = forward.args  # (params, rest, batch, idx, xd, xn), racc
    _, _, cts, gacc = backward.args  # residuals, forward args, cotangents, gacc
    sends, _, _, carried = forward.outs  # sends, residuals, racc, carried state
    ct_out, _ = backward.outs
    key, fn = ctx.program("FB", k)
    args = (*inputs, cts, gacc, racc)
    return Call(
        forward.mesh,
        key,
        fn,
        args,
        (sends, ct_out, gacc, racc, carried),
        f"FB{k}.{i}",
        forward.task,
        structure=ctx.fns[k].structure("FB"),
    )


def fuse_forward_backward(program: Sequence[Instruction], ctx: RegionContext) -> list[Instruction]:
    """Fuses each forward with the backward that directly follows it on its mesh (a new list).

    Only for stages that send no differentiable values: the ``FB`` program keeps no residuals.
    """
    following = _next_call_on_same_mesh(program)
    fused_away: set[int] = set()
    result: list[Instruction] = []
    for n, ins in enumerate(program):
        if n in fused_away:
            continue
        nxt = following[n]
        if nxt is not None and _fuses_with(ctx, ins, program[nxt]):
            fused_away.add(nxt)
            result.append(_fused_call(ctx, ins, program[nxt]))  # type: ignore[arg-type]
        else:
            result.append(ins)
    return result
