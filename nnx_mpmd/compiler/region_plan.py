"""Turning a schedule into the region's instruction list.

Tasks are dispatched in one global order consistent with every mesh's task
list (a dry run of the schedule that always advances the first mesh whose next
task is ready), so JAX's asynchronous dispatch lets submeshes overlap. Values a
task produces for a stage on another mesh are transferred right after the
task, gradients accumulate per stage in donated buffers, and a gradient of a
parameter used by several stages is summed on the parameter's home mesh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_mpmd.compiler.instructions import Call, Instruction, ProgramKey, SlotTable, Transfer
from nnx_mpmd.compiler.jaxpr_utils import named_jit, var_bytes
from nnx_mpmd.compiler.stage_programs import StageFunctions
from nnx_mpmd.compiler.stages import StagePlan
from nnx_mpmd.errors import CompileError, ScheduleError

__all__ = ["RegionProgram", "build_region_program", "dispatch_order"]


def _producers(plan: StagePlan, stage: int) -> set[int]:
    return {plan.producer[v] for v in plan.stages[stage].boundary_in}


def _dependencies(plan: StagePlan, task: Any, fns: list[StageFunctions]) -> list[tuple]:
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


def dispatch_order(plan: StagePlan, tasks: Any, fns: list[StageFunctions]) -> list[tuple[int, Any]]:
    """A global order of ``(mesh, task)`` consistent with every mesh's list.

    Raises:
      ScheduleError: if the task lists deadlock (no mesh can advance).
    """
    pos = [0] * len(tasks)
    done: set[tuple] = set()
    order: list[tuple[int, Any]] = []
    total = sum(len(t) for t in tasks)

    def key(task: Any) -> tuple:
        kind = "B" if task.kind == "BI" else task.kind
        return (task.stage, task.microbatch, kind)

    while len(order) < total:
        progressed = False
        for mesh, mesh_tasks in enumerate(tasks):
            if pos[mesh] >= len(mesh_tasks):
                continue
            task = mesh_tasks[pos[mesh]]
            if all(d in done for d in _dependencies(plan, task, fns)):
                order.append((mesh, task))
                done.add(key(task))
                if task.kind == "BI":
                    done.add((task.stage, task.microbatch, "BI"))
                pos[mesh] += 1
                progressed = True
        if not progressed:
            stuck = [str(t[p]) for t, p in zip(tasks, pos) if p < len(t)]
            raise ScheduleError(
                f"the schedule deadlocks: no mesh can run its next task ({', '.join(stuck)}). "
                "Check the task order with mp.schedules.validate."
            )
    return order


@dataclasses.dataclass
class RegionProgram:
    instructions: list[Instruction]
    output_slots: list[list[tuple[int, int]]]  # per region output: [(mesh, slot)]
    constants: dict[int, Any]
    compiled: dict[str, Any]  # label -> jitted program, for inspection


class _LazyInit:
    """Zero accumulators, compiled on first use with the parameters' shardings."""

    def __init__(self, fn: Callable[..., Any], submesh: Any, num_acc: int, label: str) -> None:
        self.fn, self.submesh, self.num_acc, self.jitted = fn, submesh, num_acc, None
        self.label = self.__name__ = label

    def _jitted(self, params: tuple[Any, ...]) -> Any:
        if self.jitted is None:
            replicated = jax.sharding.NamedSharding(self.submesh, jax.sharding.PartitionSpec())
            out = (tuple(p.sharding for p in params), (replicated,) * self.num_acc)
            self.jitted = named_jit(self.fn, self.label, out_shardings=out)
        return self.jitted

    def __call__(self, params: tuple[Any, ...]) -> Any:
        return self._jitted(params)(params)

    def trace(self, params: tuple[Any, ...]) -> Any:
        """``jax.jit``'s trace, for ahead-of-time compilation (abstract ``params``)."""
        return self._jitted(params).trace(params)


def _sum(*xs: Any) -> Any:
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total


_sum_jit = jax.jit(_sum)
_zeros_like_jit = jax.jit(jnp.zeros_like)
_stack_jit = jax.jit(lambda *xs: jnp.stack(xs))


def build_region_program(
    plan: StagePlan,
    fns: list[StageFunctions],
    tasks: Any,
    stage_mesh: list[int],
    submeshes: list[Any],
    slots: SlotTable,
    input_slot: Callable[[int, int], int],
    home_mesh: Callable[[int], int],
) -> RegionProgram:
    """Emits the region's instructions for one schedule.

    Args:
      plan: the region cut into stages.
      fns: one `StageFunctions` per stage.
      tasks: per-mesh task lists (from the schedule).
      stage_mesh: the mesh of each stage.
      submeshes: the jax Mesh of each mesh id.
      slots: slot allocator shared with the rest of the step.
      input_slot: ``(region input index, mesh) -> slot`` where the outer step
        makes that input available (batch inputs already reshaped).
      home_mesh: ``region input index -> mesh`` of a parameter's home copy.

    Returns:
      The `RegionProgram`.
    """
    info = plan.info
    program: list[Instruction] = []
    constants: dict[int, Any] = {}
    compiled: dict[str, Any] = {}
    fwd, bwd, fused, init, bi, bw, fwd_only = {}, {}, {}, {}, {}, {}, {}
    for k, f in enumerate(fns):
        fwd[k] = compiled[f"F{k}"] = named_jit(f.forward, f"F{k}", donate_argnums=(6,))
        bwd[k] = compiled[f"B{k}"] = named_jit(f.backward, f"B{k}", donate_argnums=(3,))
        fused[k] = compiled[f"FB{k}"] = named_jit(f.fused, f"FB{k}", donate_argnums=(7, 8))
        bi[k] = compiled[f"BI{k}"] = named_jit(f.backward_input, f"BI{k}")
        fwd_only[k] = compiled[f"Fwd{k}"] = named_jit(f.forward_only, f"Fwd{k}")
        bw[k] = compiled[f"BW{k}"] = named_jit(f.backward_weight, f"BW{k}", donate_argnums=(3,))
        init[k] = compiled[f"init{k}"] = _LazyInit(
            f.init, submeshes[stage_mesh[k]], len(f.accumulated), f"init{k}"
        )

    def idx_slot(i: int, q: int) -> int:
        key = ("idx", i, q)
        if key not in slots:
            sharding = jax.sharding.NamedSharding(submeshes[q], jax.sharding.PartitionSpec())
            constants[slots(key)] = jax.device_put(np.int32(i), sharding)
        return slots(key)

    # Accumulators (training only).
    for k, f in enumerate(fns if info.with_grad else []):
        q = stage_mesh[k]
        params = tuple(input_slot(r, q) for r in f.param_inputs)
        gacc = tuple(slots(("g", k, j)) for j in range(len(f.param_inputs)))
        racc = tuple(slots(("racc", k, j)) for j in range(len(f.accumulated)))
        program.append(Call(q, ProgramKey("init", k), init[k], (params,), (gacc, racc), f"init{k}"))

    def state_slot(r: int, i: int, q: int) -> int:
        # Microbatch i reads the state the forward of microbatch i-1 left.
        return input_slot(r, q) if i == 0 else slots(("carry", r, i))

    def carried_outs(k: int, i: int) -> tuple:
        return tuple(slots(("carry", r, i + 1)) for r in fns[k].carries)

    def forward_args(k: int, i: int) -> tuple:
        f, q = fns[k], stage_mesh[k]
        return (
            tuple(input_slot(r, q) for r in f.param_inputs),
            tuple(
                state_slot(r, i, q) if r in f.carries else input_slot(r, q) for r in f.rest_inputs
            ),
            tuple(input_slot(r, q) for r in f.batch_inputs),
            idx_slot(i, q),
            tuple(slots(("y", id(v), i, q)) for v in f.xd),
            tuple(slots(("y", id(v), i, q)) for v in f.xn),
        )

    def cts_args(k: int, i: int) -> tuple:
        f, q = fns[k], stage_mesh[k]
        return tuple(
            tuple(slots(("ct", id(v), i, c, q)) for c in plan.consumers[v]) for v in f.diff_sends
        )

    def after_forward(k: int, i: int) -> None:
        f, q = fns[k], stage_mesh[k]
        for v in f.sends:
            for c in plan.consumers[v]:
                qc = stage_mesh[c]
                if qc != q and ("y", id(v), i, qc) not in slots:
                    program.append(
                        Transfer(
                            slots(("y", id(v), i, q)),
                            slots(("y", id(v), i, qc)),
                            qc,
                            f"act s{k}->s{c} mb{i}",
                            src_mesh=q,
                            nbytes=var_bytes(v),
                            per_microbatch=True,
                        )
                    )

    def after_backward(k: int, i: int) -> tuple:
        f, q = fns[k], stage_mesh[k]
        outs = tuple(slots(("ct", id(v), i, k, q)) for v in f.xd)
        return outs

    def emit_cotangent_transfers(k: int, i: int) -> None:
        f, q = fns[k], stage_mesh[k]
        for v in f.xd:
            qp = stage_mesh[plan.producer[v]]
            if qp != q:
                program.append(
                    Transfer(
                        slots(("ct", id(v), i, k, q)),
                        slots(("ct", id(v), i, k, qp)),
                        qp,
                        f"grad s{k}->s{plan.producer[v]} mb{i}",
                        src_mesh=q,
                        nbytes=var_bytes(v),
                        per_microbatch=True,
                    )
                )

    if not info.with_grad:  # inference: the schedule's forwards, in its order
        tasks = tuple(tuple(t for t in mesh_tasks if t.kind == "F") for mesh_tasks in tasks)
    order = dispatch_order(plan, tasks, fns)
    skip: set[int] = set()
    for n, (mesh, task) in enumerate(order):
        if n in skip:
            continue
        k, i = task.stage, task.microbatch
        if stage_mesh[k] != mesh:
            raise CompileError(
                f"task {task} is on mesh {mesh} but stage {k} is placed on mesh "
                f"{stage_mesh[k]}: the schedule's task lists and its mesh_of disagree."
            )
        f = fns[k]
        gacc = tuple(slots(("g", k, j)) for j in range(len(f.param_inputs)))
        racc = tuple(slots(("racc", k, j)) for j in range(len(f.accumulated)))
        sends = tuple(slots(("y", id(v), i, mesh)) for v in f.sends)
        if task.kind == "F" and not info.with_grad:
            outs = tuple(slots(("out", k, j, i)) for j in range(len(f.accumulated)))
            program.append(
                Call(
                    mesh,
                    ProgramKey("Fwd", k),
                    fwd_only[k],
                    forward_args(k, i),
                    (sends, outs, carried_outs(k, i)),
                    f"F{k}.{i}",
                    task,
                )
            )
            after_forward(k, i)
        elif task.kind == "F":
            nxt = next(
                (j for j in range(n + 1, len(order)) if order[j][0] == mesh and j not in skip),
                None,
            )
            fusable = (
                nxt is not None
                and order[nxt][1].kind == "B"
                and (order[nxt][1].stage, order[nxt][1].microbatch) == (k, i)
                and not f.diff_sends
            )
            if fusable:
                skip.add(nxt)
                program.append(
                    Call(
                        mesh,
                        ProgramKey("FB", k),
                        fused[k],
                        (*forward_args(k, i), cts_args(k, i), gacc, racc),
                        (sends, after_backward(k, i), gacc, racc, carried_outs(k, i)),
                        f"FB{k}.{i}",
                        task,
                    )
                )
                after_forward(k, i)
                emit_cotangent_transfers(k, i)
                continue
            program.append(
                Call(
                    mesh,
                    ProgramKey("F", k),
                    fwd[k],
                    (*forward_args(k, i), racc),
                    (sends, slots(("res", k, i)), racc, carried_outs(k, i)),
                    f"F{k}.{i}",
                    task,
                )
            )
            after_forward(k, i)
        elif task.kind == "B":
            program.append(
                Call(
                    mesh,
                    ProgramKey("B", k),
                    bwd[k],
                    (slots(("res", k, i)), forward_args(k, i), cts_args(k, i), gacc),
                    (after_backward(k, i), gacc),
                    f"B{k}.{i}",
                    task,
                )
            )
            emit_cotangent_transfers(k, i)
        elif task.kind == "BI":
            program.append(
                Call(
                    mesh,
                    ProgramKey("BI", k),
                    bi[k],
                    (slots(("res", k, i)), forward_args(k, i), cts_args(k, i)),
                    (after_backward(k, i), slots(("extras", k, i))),
                    f"BI{k}.{i}",
                    task,
                )
            )
            emit_cotangent_transfers(k, i)
        elif task.kind == "BW":
            program.append(
                Call(
                    mesh,
                    ProgramKey("BW", k),
                    bw[k],
                    (slots(("res", k, i)), forward_args(k, i), slots(("extras", k, i)), gacc),
                    gacc,
                    f"BW{k}.{i}",
                    task,
                )
            )
        else:
            raise CompileError(f"unknown task kind {task.kind!r} in task {task}.")

    # Region outputs.
    output_slots: list[list[tuple[int, int]]] = []
    n_acc_outputs = 1 + info.n_aux
    if not info.with_grad:  # stack each output's microbatches: [m, ...]
        for o_index, source in enumerate(plan.outputs[:n_acc_outputs]):
            if source.kind != "stage":
                raise CompileError(
                    f"output {o_index} of the forward-only step does not come from a stage; "
                    "return values computed by the model."
                )
            k, q = source.stage, stage_mesh[source.stage]
            j = fns[k].accumulated.index(source.var)
            parts = tuple(slots(("out", k, j, i)) for i in range(info.num_microbatches))
            out = slots(("stacked", o_index))
            key = ProgramKey("stack", index=o_index, mesh=q)
            compiled[str(key)] = _stack_jit
            program.append(Call(q, key, _stack_jit, parts, out, f"stack output {o_index}"))
            output_slots.append([(q, out)])
    for o_index, source in enumerate(plan.outputs[:n_acc_outputs] if info.with_grad else []):
        if source.kind != "stage":
            raise CompileError(
                f"region output {o_index} (loss/aux) does not come from a stage; compute it "
                "from the model's outputs."
            )
        k = source.stage
        j = fns[k].accumulated.index(source.var)
        output_slots.append([(stage_mesh[k], slots(("racc", k, j)))])
    if info.with_grad:
        for d in range(info.n_diff):
            r = info.n_closure + d
            home = home_mesh(r)
            contributions = []
            for k in plan.input_stages.get(r, []):
                pos = fns[k].param_inputs.index(r)
                src = slots(("g", k, pos))
                q = stage_mesh[k]
                if q != home:
                    dst = slots(("gx", k, pos, home))
                    program.append(Transfer(src, dst, home, f"shared grad s{k}", src_mesh=q))
                    src = dst
                contributions.append(src)
            if not contributions:
                out = slots(("gzero", d))
                key = ProgramKey("zeros", index=d, mesh=home)
                compiled[str(key)] = _zeros_like_jit
                zero_args = (input_slot(r, home),)
                program.append(Call(home, key, _zeros_like_jit, zero_args, out, f"zero grad {d}"))
            elif len(contributions) == 1:
                out = contributions[0]
            else:
                out = slots(("gsum", d))
                key = ProgramKey("sum", index=d, mesh=home)
                compiled[str(key)] = _sum_jit
                parts = tuple(contributions)
                program.append(Call(home, key, _sum_jit, parts, out, f"sum shared grad {d}"))
            output_slots.append([(home, out)])
    first_other = info.n_closure + info.n_diff
    for j, source in enumerate(plan.outputs[n_acc_outputs:]):
        r = first_other + j
        if source.kind == "input":
            output_slots.append([("input", source.input_index)])
        elif source.kind == "literal":
            output_slots.append([("literal", source.value)])
        else:
            readers = sorted(set(plan.input_stages.get(r, [])) | {source.stage})
            if len(readers) > 1:
                raise CompileError(
                    f"{info.other_paths[j]} is updated by stage {source.stage} and used by "
                    f"stages {readers}: mutable state other than RNG streams (batch "
                    "statistics, running counters) must belong to one stage. Give each stage "
                    "its own state (e.g. one BatchNorm per Stage), or update it in one stage."
                )
            k, m = source.stage, info.num_microbatches
            q, home = stage_mesh[k], home_mesh(r)
            final = slots(("carry", r, m))
            if q != home:
                moved = slots(("carry home", r))
                program.append(Transfer(final, moved, home, f"state {j}", src_mesh=q))
                final = moved
            output_slots.append([(home, final)])
    return RegionProgram(program, output_slots, constants, compiled)
