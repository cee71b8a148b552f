"""The pipelined region's lowering passes, one by one, on small hand-made plans.

A hand-made plan is a chain of stages: stage k reads parameter k and sends one
activation ``y{k}`` to stage k+1; the last stage computes the loss. Options add
a parameter shared by the first and last stage, an unused parameter, and
mutable state carried by the last stage. No jax tracing: these tests run in
milliseconds.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from pipeline_models import make_mesh

import nnx_mpmd as mp
from nnx_mpmd.compiler.ir import (
    Call,
    ProgramKey,
    SlotTable,
    Transfer,
    format_instructions,
    slots_in,
)
from nnx_mpmd.compiler.region.region_outputs import (
    carry_state_home,
    collect_results,
    reduce_shared_gradients,
    region_outputs,
)
from nnx_mpmd.compiler.region.region_plan import assign_slots, build_region_program
from nnx_mpmd.compiler.region.region_transfers import insert_transfers
from nnx_mpmd.compiler.region.region_values import RegionContext, RegionValue, region_values_in
from nnx_mpmd.compiler.region.schedule_lowering import (
    dispatch_order,
    fuse_forward_backward,
    lower_schedule,
    lower_task,
)
from nnx_mpmd.compiler.trace.stages import OutputSource

KINDS = ("F", "B", "FB", "BI", "BW", "Fwd", "init")
PROGRAM_ATTRS = ("forward", "backward", "fused", "backward_input", "forward_only")
PROGRAM_ATTRS += ("backward_weight", "init")


class Var:
    """A stand-in for a jaxpr variable: a name and an abstract value."""

    def __init__(self, name: str, shape=(4, 8), dtype=np.float32) -> None:
        self.name, self.aval = name, SimpleNamespace(shape=shape, dtype=np.dtype(dtype))

    def __repr__(self) -> str:
        return self.name


def _program(name):
    def fn(*args):
        raise AssertionError(f"{name} is a stub: these tests never run programs")

    fn.__name__ = name
    return fn


def _stage_fns(k, last, *, with_grad, shared, state, ys, loss, state_var, r):
    params = [k] + ([0] if shared and k == last and k != 0 else [])
    rest = [r["state"]] if state and k == last else []
    carries = {r["state"]: state_var} if state and k == last else {}
    sends = [ys[k]] if k < last else []
    return SimpleNamespace(
        param_inputs=params if with_grad else [],
        rest_inputs=rest if with_grad else [*params, *rest],
        batch_inputs=[r["batch"]] if k == 0 else [],
        carries=carries,
        xd=[ys[k - 1]] if k > 0 else [],
        xn=[],
        sends=sends,
        diff_sends=sends if with_grad else [],
        accumulated=[loss] if k == last else [],
        accumulated_outputs=[0] if k == last else [],
        cotangents_fit_inputs=lambda: False,  # no cotangent donation in these plans
        structure=lambda kind: None,  # no stage is twin to another
        **{attr: _program(attr) for attr in PROGRAM_ATTRS},
    )


def chain(
    num_stages=2,
    stage_mesh=(0, 1),
    num_microbatches=2,
    *,
    with_grad=True,
    shared=False,
    unused=False,
    state=False,
):
    """A hand-made plan, its stage functions and a context with stub programs."""
    last = num_stages - 1
    ys = [Var(f"y{k}") for k in range(last)]
    loss, state_var = Var("loss", shape=()), Var("state")
    n_params = num_stages + unused
    n_diff = n_params if with_grad else 0
    r = {"state": n_params, "batch": n_params + state}  # region input indices
    info = SimpleNamespace(
        with_grad=with_grad,
        num_microbatches=num_microbatches,
        n_aux=0,
        n_closure=n_params - n_diff,
        n_diff=n_diff,
        n_other=int(state),
        n_batch=1,
        other_paths=["norm.mean"],
    )
    input_stages = {k: [k] for k in range(num_stages)}
    input_stages[r["batch"]] = [0]
    if shared:
        input_stages[0] = [0, last]
    if state:
        input_stages[r["state"]] = [last]
    outputs = [OutputSource("stage", stage=last, var=loss)]
    outputs += [OutputSource("stage", stage=last, var=state_var)] if state else []
    plan = SimpleNamespace(
        info=info,
        stages=[SimpleNamespace(boundary_in=[ys[k - 1]] if k else []) for k in range(num_stages)],
        producer={**{y: k for k, y in enumerate(ys)}, loss: last},
        consumers={y: [k + 1] for k, y in enumerate(ys)},
        outputs=outputs,
        input_stages=input_stages,
        num_stages=num_stages,
    )
    options = dict(with_grad=with_grad, shared=shared, state=state, ys=ys, loss=loss, r=r)
    fns = [_stage_fns(k, last, state_var=state_var, **options) for k in range(num_stages)]
    programs = {
        ProgramKey(kind, k): _program(f"{kind}{k}") for k in range(num_stages) for kind in KINDS
    }
    ctx = RegionContext.build(plan, fns, list(stage_mesh), programs)
    return plan, fns, ctx


def one_f_one_b(ctx, num_meshes=2):
    num_stages = len(ctx.fns)
    return mp.OneFOneB().tasks(num_stages, num_meshes, ctx.num_microbatches)


def labels(program):
    return [ins.label for ins in program]


def meshes_of_values(program):
    """(instruction mesh, value mesh) for every value a call reads or writes."""
    return {
        (ins.mesh, v.mesh)
        for ins in program
        if isinstance(ins, Call)
        for v in region_values_in((ins.args, ins.outs))
    }


# -- RegionValue ---------------------------------------------------------------


def test_region_value_moves_between_meshes_by_key():
    act = RegionValue("act", (0,), microbatch=1, mesh=0)
    assert act.on(1) == RegionValue("act", (0,), 1, 1) and act.on(1) != act
    assert act.on(1).on(0) == act and hash(act.on(1).on(0)) == hash(act)
    assert repr(act) == "act0.mb1" and repr(RegionValue("grad", (1, 2), mesh=3)) == "grad1.2"


def test_region_value_kind_is_checked():
    with pytest.raises(mp.CompileError, match=r"kind 'activation' is unknown: use one of"):
        RegionValue("activation", (0,))


# -- dispatch_order and lower_schedule -------------------------------------------


def test_dispatch_order_interleaves_meshes_and_reports_deadlock():
    plan, fns, ctx = chain()
    tasks = one_f_one_b(ctx)
    order = dispatch_order(plan, tasks, fns)
    assert [str(t) for _, t in order] == [
        "F0.0",
        "F1.0",
        "F0.1",
        "B1.0",
        "B0.0",
        "F1.1",
        "B1.1",
        "B0.1",
    ]
    backwards_first = (tuple(reversed(tasks[0])), tasks[1])
    with pytest.raises(mp.ScheduleError, match=r"deadlocks: no mesh can run its next task \(B0.1"):
        dispatch_order(plan, backwards_first, fns)


def test_lower_schedule_makes_one_call_per_task_on_the_tasks_own_mesh():
    _, _, ctx = chain()
    program = lower_schedule(ctx, one_f_one_b(ctx))
    assert labels(program) == [
        "init0",
        "init1",
        "F0.0",
        "F1.0",
        "F0.1",
        "B1.0",
        "B0.0",
        "F1.1",
        "B1.1",
        "B0.1",
    ]
    assert all(isinstance(ins, Call) for ins in program)  # no transfers yet
    assert all(q == v for q, v in meshes_of_values(program))
    f1 = program[3]
    assert f1.program == ProgramKey("F", 1) and f1.fn is ctx.programs[ProgramKey("F", 1)]
    # (params, rest, batch, idx, xd, xn, racc) -> (sends, residuals, racc, carried)
    assert repr(f1.args).replace(" ", "") == "((input1,),(),(),idx.mb0,(act0.mb0,),(),(acc1.0,))"
    assert repr(f1.outs) == "((), res1.mb0, (acc1.0,), ())"
    assert f1.args[4][0].mesh == 1  # stage 1 reads stage 0's activation on its own mesh


def test_lower_schedule_of_a_forward_only_step_runs_forwards_only():
    _, _, ctx = chain(with_grad=False)
    program = lower_schedule(ctx, one_f_one_b(ctx))
    assert labels(program) == ["F0.0", "F1.0", "F0.1", "F1.1"]
    assert {ins.program.kind for ins in program} == {"Fwd"}
    assert repr(program[1].outs) == "((), (out1.0.mb0,), ())"


def test_lower_schedule_rejects_a_task_on_another_mesh():
    _, _, ctx = chain(stage_mesh=(0, 0))
    with pytest.raises(
        mp.CompileError, match=r"task F1.0 is on mesh 1 but stage 1 is placed on mesh 0"
    ):
        lower_schedule(ctx, one_f_one_b(ctx))


def test_lower_task_and_dispatch_order_reject_unknown_task_kinds():
    plan, fns, ctx = chain()
    odd = SimpleNamespace(stage=0, microbatch=0, kind="X", with_next=False)
    with pytest.raises(mp.CompileError, match=r"unknown task kind 'X'"):
        lower_task(ctx, 0, odd)
    with pytest.raises(mp.ScheduleError, match=r"unknown task kind 'X'"):
        dispatch_order(plan, ((odd,), ()), fns)


def test_a_missing_stage_program_is_a_compile_error():
    _, _, ctx = chain()
    ctx = dataclasses.replace(ctx, programs={})
    with pytest.raises(mp.CompileError, match=r"no program init0 among the region's programs"):
        lower_schedule(ctx, one_f_one_b(ctx))


def test_lower_schedule_splits_backward_for_zero_bubble():
    _, _, ctx = chain()
    program = lower_schedule(ctx, mp.ZeroBubbleH1().tasks(2, 2, 2))
    bi, bw = (next(c for c in program if c.label == label) for label in ("BI0.0", "BW0.0"))
    assert bi.outs[1] == bw.args[2] == RegionValue("extras", (0,), 0, 0)
    assert bw.outs == bw.args[3] == ctx.grad_accumulators(0)


# -- fuse_forward_backward -------------------------------------------------------


def test_fuse_forward_backward_fuses_the_last_stage_only():
    _, _, ctx = chain()
    lowered = lower_schedule(ctx, one_f_one_b(ctx))
    before = list(lowered)
    fused = fuse_forward_backward(lowered, ctx)
    assert lowered == before  # the input is not changed
    assert labels(fused) == ["init0", "init1", "F0.0", "FB1.0", "F0.1", "B0.0", "FB1.1", "B0.1"]
    fb = fused[3]
    assert fb.program == ProgramKey("FB", 1) and str(fb.task) == "F1.0"
    # (params, rest, batch, idx, xd, xn, cts, gacc, racc) -> (sends, ct_xd, gacc, racc, carried)
    assert fb.args[:6] == lowered[3].args[:6] and fb.args[6:] == (
        (),
        ctx.grad_accumulators(1),
        ctx.result_accumulators(1),
    )
    assert fb.outs == (
        (),
        ctx.sent_cotangents(1, 0),
        ctx.grad_accumulators(1),
        ctx.result_accumulators(1),
        (),
    )


def test_fuse_forward_backward_needs_the_backward_of_the_same_microbatch_next():
    _, _, ctx = chain()
    lowered = lower_schedule(ctx, mp.GPipe().tasks(2, 2, 2))
    # Mesh 1 runs F1.0 F1.1 B1.0 B1.1: F1.1 is followed by B1.0, another microbatch.
    assert [c.label for c in lowered if c.mesh == 1][1:] == ["F1.0", "F1.1", "B1.0", "B1.1"]
    assert fuse_forward_backward(lowered, ctx) == lowered


def test_fuse_forward_backward_leaves_forward_only_steps_alone():
    _, _, ctx = chain(with_grad=False)
    lowered = lower_schedule(ctx, one_f_one_b(ctx))
    assert fuse_forward_backward(lowered, ctx) == lowered


# -- insert_transfers --------------------------------------------------------------


def test_insert_transfers_moves_activations_and_cotangents_after_their_producer():
    _, _, ctx = chain()
    program = insert_transfers(
        fuse_forward_backward(lower_schedule(ctx, one_f_one_b(ctx)), ctx), ctx
    )
    assert labels(program)[2:8] == [
        "F0.0",
        "act s0->s1 mb0",
        "FB1.0",
        "grad s1->s0 mb0",
        "F0.1",
        "act s0->s1 mb1",
    ]
    moves = [ins for ins in program if isinstance(ins, Transfer)]
    assert [(t.src_mesh, t.dst_mesh, t.nbytes, t.per_microbatch) for t in moves] == [
        (0, 1, 128, True),
        (1, 0, 128, True),
    ] * 2
    assert moves[0].src == RegionValue("act", (0,), 0, 0) and moves[0].dst == moves[0].src.on(1)
    assert all(q == v for q, v in meshes_of_values(program))


def test_insert_transfers_is_idempotent_and_skips_stages_on_one_mesh():
    _, _, ctx = chain()
    once = insert_transfers(lower_schedule(ctx, one_f_one_b(ctx)), ctx)
    assert insert_transfers(once, ctx) == once
    _, _, same_mesh = chain(stage_mesh=(0, 0))
    tasks = mp.Interleaved1F1B().tasks(2, 1, 2)
    lowered = lower_schedule(same_mesh, tasks)
    assert insert_transfers(lowered, same_mesh) == lowered


def test_insert_transfers_rejects_a_value_nobody_makes():
    _, _, ctx = chain()
    lowered = lower_schedule(ctx, one_f_one_b(ctx))
    without_f0 = [ins for ins in lowered if ins.label != "F0.0"]
    with pytest.raises(mp.CompileError, match=r"F1.0 on mesh 1 reads act0.mb0, which no earlier"):
        insert_transfers(without_f0, ctx)


def test_insert_transfers_moves_only_activations_and_cotangents():
    _, _, ctx = chain()
    grad = ctx.grad_accumulators(0)[0]
    producer = Call(0, ProgramKey("F", 0), abs, (), grad, "made", mp.Task(0, 0, "F"))
    reader = Call(1, ProgramKey("F", 1), abs, (grad.on(1),), (), "reader", mp.Task(1, 0, "F"))
    with pytest.raises(mp.CompileError, match=r"reader on mesh 1 reads grad0.0, which made makes"):
        insert_transfers([producer, reader], ctx)


def test_insert_transfers_needs_stage_tasks_at_both_ends():
    _, _, ctx = chain()
    act = RegionValue("act", (0,), 0, 0)
    producer = Call(0, ProgramKey("F", 0), abs, (), act, "glue")
    reader = Call(1, ProgramKey("F", 1), abs, (act.on(1),), (), "reader", mp.Task(1, 0, "F"))
    with pytest.raises(mp.CompileError, match=r"act0.mb0 moves between meshes for 'glue'"):
        insert_transfers([producer, reader], ctx)


# -- region outputs ------------------------------------------------------------------


def test_collect_results_reads_the_loss_accumulator_or_stacks_forward_outputs():
    _, _, ctx = chain()
    assert collect_results(ctx) == ([], [[(1, RegionValue("acc", (1, 0), None, 1))]])
    _, _, inference = chain(with_grad=False, num_microbatches=3)
    (stack,), locations = collect_results(inference)
    assert stack.program == ProgramKey("stack", index=0, mesh=1)
    assert stack.args == tuple(RegionValue("out", (1, 0), i, 1) for i in range(3))
    assert locations == [[(1, RegionValue("stacked", (0,), None, 1))]]


def test_collect_results_rejects_an_output_that_no_stage_computes():
    plan, _, ctx = chain()
    plan.outputs[0] = OutputSource("input", input_index=0)
    with pytest.raises(
        mp.CompileError, match=r"region output 0 \(loss/aux\) does not come from a stage"
    ):
        collect_results(ctx)


def test_collect_results_of_a_forward_only_step_needs_stage_outputs():
    plan, _, ctx = chain(with_grad=False)
    plan.outputs[0] = OutputSource("literal", value=1.0)
    with pytest.raises(mp.CompileError, match=r"output 0 of the forward-only step does not come"):
        collect_results(ctx)


def test_reduce_shared_gradients_sums_on_the_home_mesh_and_zeros_unused():
    _, _, ctx = chain(num_stages=3, stage_mesh=(0, 1, 2), shared=True, unused=True)
    program, locations = reduce_shared_gradients(ctx, home_mesh=lambda r: 0)
    text = format_instructions(program)
    assert text.splitlines() == [
        "transfer grad2.1@2 -> grad2.1@0 label='shared grad s2' bytes=0",
        "call 0 sum.L0.mesh0 args=(grad0.0,grad2.1) outs=grad_sum0 label='sum shared grad 0'",
        "transfer grad1.0@1 -> grad1.0@0 label='shared grad s1' bytes=0",
        "transfer grad2.0@2 -> grad2.0@0 label='shared grad s2' bytes=0",
        "call 0 zeros.L3.mesh0 args=(input3,) outs=zero_grad3 label='zero grad 3'",
    ]
    assert [loc[0][1] for loc in locations] == [
        RegionValue("grad_sum", (0,), None, 0),
        RegionValue("grad", (1, 0), None, 0),
        RegionValue("grad", (2, 0), None, 0),
        RegionValue("zero_grad", (3,), None, 0),
    ]


def test_carry_state_home_moves_the_last_microbatchs_state():
    _, _, ctx = chain(state=True)
    (move,), locations = carry_state_home(ctx, home_mesh=lambda r: 0)
    final = RegionValue("carry", (2,), 2, 1)
    assert (move.src, move.dst, move.label) == (final, final.on(0), "state 0")
    assert locations == [[(0, final.on(0))]]
    assert carry_state_home(ctx, home_mesh=lambda r: 1) == ([], [[(1, final)]])


def test_carry_state_home_rejects_state_used_by_two_stages():
    plan, _, ctx = chain(state=True)
    plan.input_stages[2] = [0, 1]
    with pytest.raises(
        mp.CompileError, match=r"norm.mean is updated by stage 1 and used by stages \[0, 1\]"
    ):
        carry_state_home(ctx, home_mesh=lambda r: 0)


def test_region_outputs_appends_without_changing_its_input():
    _, _, ctx = chain(state=True)
    program = lower_schedule(ctx, one_f_one_b(ctx))
    before = list(program)
    result, locations = region_outputs(program, ctx, home_mesh=lambda r: 0)
    assert program == before and result[: len(program)] == program
    assert len(locations) == 1 + 2 + 1  # loss, two gradients, state
    assert labels(result[len(program) :]) == ["shared grad s1", "state 0"]


# -- assign_slots and the whole region -------------------------------------------------


def test_assign_slots_numbers_values_in_order_of_first_appearance():
    _, _, ctx = chain()
    program = lower_schedule(ctx, one_f_one_b(ctx))[:3]  # init0, init1, F0.0
    slots = SlotTable()
    slots("outer value")  # slot 0 belongs to the outer step
    inputs = {(0, 0): 100, (1, 1): 101, (2, 0): 102}
    mesh = make_mesh(2, 1)
    numbered = assign_slots(
        program,
        [[(1, ctx.result_accumulators(1)[0])]],
        slots,
        lambda r, q: inputs[r, q],
        mesh.submeshes,
    )
    assert format_instructions(numbered.instructions).splitlines() == [
        "call 0 init0 args=((100,),) outs=((1,),()) label=init0",
        "call 1 init1 args=((101,),) outs=((2,),(3,)) label=init1",
        # The sent activation (4) is numbered before the arguments (idx: 5).
        "call 0 F0 args=((100,),(),(102,),5,(),(),()) outs=((4,),6,(),()) label=F0.0 task=F0.0",
    ]
    assert numbered.output_slots == [[(1, 3)]]
    assert list(numbered.constants) == [5] and int(numbered.constants[5]) == 0
    assert numbered.constants[5].sharding.mesh == mesh.submesh(0)


ONE_F_ONE_B_REGION = """\
call 0 init0 args=((100,),) outs=((0,),()) label=init0
call 1 init1 args=((101,),) outs=((1,),(2,)) label=init1
call 0 F0 args=((100,),(),(102,),4,(),(),()) outs=((3,),5,(),()) label=F0.0 task=F0.0
transfer 3@0 -> 6@1 label='act s0->s1 mb0' bytes=128 per_microbatch
call 1 FB1 args=((101,),(),(),7,(6,),(),(),(1,),(2,)) outs=((),(8,),(1,),(2,),()) label=FB1.0 task=F1.0
transfer 8@1 -> 9@0 label='grad s1->s0 mb0' bytes=128 per_microbatch
call 0 F0 args=((100,),(),(102,),11,(),(),()) outs=((10,),12,(),()) label=F0.1 task=F0.1
transfer 10@0 -> 13@1 label='act s0->s1 mb1' bytes=128 per_microbatch
call 0 B0 args=(5,((100,),(),(102,),4,(),()),((9,),),(0,)) outs=((),(0,)) label=B0.0 task=B0.0
call 1 FB1 args=((101,),(),(),14,(13,),(),(),(1,),(2,)) outs=((),(15,),(1,),(2,),()) label=FB1.1 task=F1.1
transfer 15@1 -> 16@0 label='grad s1->s0 mb1' bytes=128 per_microbatch
call 0 B0 args=(12,((100,),(),(102,),11,(),()),((16,),),(0,)) outs=((),(0,)) label=B0.1 task=B0.1"""


def _build(ctx, plan, fns, tasks, num_meshes=2):
    inputs = {(0, 0): 100, (1, 1): 101, (2, 0): 102}
    mesh = make_mesh(num_meshes, 1)
    return build_region_program(
        plan,
        fns,
        tasks,
        list(ctx.stage_mesh),
        list(mesh.submeshes),
        SlotTable(),
        lambda r, q: inputs[r, q],
        lambda r: ctx.stage_mesh[r],
    )


def test_build_region_program_composes_the_passes():
    plan, fns, ctx = chain()
    region = _build(ctx, plan, fns, one_f_one_b(ctx))
    assert format_instructions(region.instructions) == ONE_F_ONE_B_REGION
    names = [name for name, _ in region.passes]
    assert names == [
        "lower_schedule",
        "overlap_tasks",
        "fuse_forward_backward",
        "insert_transfers",
        "region_outputs",
        "assign_slots",
    ]
    assert region.passes[-1][1] == region.instructions
    assert "call 1 FB1 args=((input1,),(),(),idx.mb0,(act0.mb0,)" in format_instructions(
        region.passes[2][1]
    )
    assert region.output_slots == [[(1, 2)], [(0, 0)], [(1, 1)]]  # loss, two gradients
    assert sorted(region.compiled) == sorted(f"{kind}{k}" for kind in KINDS for k in range(2))
    every_slot = {
        s
        for ins in region.instructions
        for s in slots_in((getattr(ins, "args", ()), getattr(ins, "outs", ())))
    }
    assert all(isinstance(s, int) for s in every_slot)


def test_build_region_program_for_inference_stacks_outputs():
    plan, fns, ctx = chain(with_grad=False)
    region = _build(ctx, plan, fns, one_f_one_b(ctx))
    (stack,) = [
        ins for ins in region.instructions if isinstance(ins, Call) and ins.program.kind == "stack"
    ]
    assert str(stack.program) in region.compiled and region.output_slots == [[(1, stack.outs)]]
    assert not any(
        isinstance(ins, Call) and ins.program.kind == "init" for ins in region.instructions
    )


def test_region_values_are_dataclasses_with_value_semantics():
    value = RegionValue("ct", (0, 1), 0, 1)
    assert dataclasses.replace(value, mesh=0) == value.on(0)
    assert {value, value.on(1)} == {value}
