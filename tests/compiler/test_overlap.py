"""Overlapped tasks (``F0.2+B1.0``): one program per group, equal to the reference.

The pass tests use the hand-made plans of ``test_region_passes`` (no tracing);
the end-to-end tests compare pipelined steps with the ``nnx.jit`` reference.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from pipeline_models import build, make_batch, make_mesh, train_step_fn
from test_jit_equivalence import run_equivalence
from test_region_passes import chain

import nnx_mpmd as mp
from nnx_mpmd.compiler.ir import (
    Call,
    ProgramKey,
    format_instructions,
    parse_instructions,
)
from nnx_mpmd.compiler.region.overlap import overlap_tasks
from nnx_mpmd.compiler.region.schedule_lowering import dispatch_order, lower_schedule
from nnx_mpmd.schedules import Custom, Task, parse_tasks

# 2 stages on 2 meshes, 3 microbatches: 1F1B with a backward and the next
# forward of the first mesh, and of the last mesh, joined.
ONE_F_ONE_B_JOINED = """
mesh 0: F0.0 F0.1 B0.0+F0.2 B0.1 B0.2
mesh 1: F1.0 B1.0+F1.1 B1.1+F1.2 B1.2
"""
# The same with split backwards: a forward joined with a whole backward (BI, BW).
ZB_JOINED = """
mesh 0: F0.0 F0.1 F0.2+BI0.0+BW0.0 BI0.1 BW0.1 BI0.2 BW0.2
mesh 1: F1.0 BI1.0 BW1.0 F1.1 F1.2+BI1.1+BW1.1 BI1.2 BW1.2
"""


def _calls(program):
    return [ins for ins in program if isinstance(ins, Call) and ins.task is not None]


# -- the IR ------------------------------------------------------------------------


def test_overlapped_program_key_text_round_trips():
    key = ProgramKey.overlapped([ProgramKey("F", 0), ProgramKey("B", 3)])
    assert str(key) == "F0+B3" and key.kind == "F+B"
    assert ProgramKey.parse("F0+B3") == key
    assert [str(k) for k in key.parts()] == ["F0", "B3"]
    assert ProgramKey("F", 0).parts() == (ProgramKey("F", 0),)


# -- dispatch order ----------------------------------------------------------------


def test_dispatch_order_emits_a_group_as_one_unit():
    plan, fns, _ = chain(num_microbatches=3)
    order = [str(t) for _, t in dispatch_order(plan, parse_tasks(ONE_F_ONE_B_JOINED), fns)]
    # Each group's tasks come out together, when all of them are ready.
    for group in ("B0.0 F0.2", "B1.0 F1.1", "B1.1 F1.2"):
        assert group in " ".join(order), (group, order)
    assert sorted(order) == sorted(str(t) for row in parse_tasks(ONE_F_ONE_B_JOINED) for t in row)


def test_dispatch_order_lets_a_bw_follow_its_own_bi_in_a_group():
    plan, fns, _ = chain(num_microbatches=3)
    order = dispatch_order(plan, parse_tasks(ZB_JOINED), fns)
    assert "F0.2 BI0.0 BW0.0" in " ".join(str(t) for _, t in order)


def test_a_group_whose_tasks_depend_on_each_other_deadlocks():
    plan, fns, _ = chain()
    tasks = parse_tasks("mesh 0: F0.0+B0.0 F0.1 B0.1\nmesh 1: F1.0 B1.0 F1.1 B1.1")
    with pytest.raises(mp.ScheduleError, match=r"deadlocks.*F0\.0\+B0\.0.*must not depend"):
        dispatch_order(plan, tasks, fns)


# -- the overlap_tasks pass --------------------------------------------------------


def test_overlap_tasks_makes_one_call_per_group():
    _, _, ctx = chain(num_microbatches=3)
    program = overlap_tasks(lower_schedule(ctx, parse_tasks(ONE_F_ONE_B_JOINED)), ctx)
    joined = [c for c in _calls(program) if c.program.members]
    assert [c.label for c in joined] == ["B1.0+F1.1", "B0.0+F0.2", "B1.1+F1.2"]
    first = joined[1]
    assert str(first.program) == "B0+F0" and first.program in ctx.programs
    assert first.task == (Task(0, 0, "B"), Task(0, 2, "F"))
    # The members' arguments one after the other; their results as a tuple.
    alone = {c.label: c for c in _calls(lower_schedule(ctx, parse_tasks(ONE_F_ONE_B_JOINED)))}
    assert first.args == alone["B0.0"].args + alone["F0.2"].args
    assert first.outs == (alone["B0.0"].outs, alone["F0.2"].outs)
    # One program for equal groups of different microbatches (B1.0+F1.1, B1.1+F1.2).
    assert joined[0].program == joined[2].program and joined[0].fn is joined[2].fn


def test_overlap_tasks_runs_a_grouped_bi_and_bw_as_one_backward():
    _, _, ctx = chain(num_microbatches=3)
    program = overlap_tasks(lower_schedule(ctx, parse_tasks(ZB_JOINED)), ctx)
    joined = [c for c in _calls(program) if c.program.members]
    assert [c.label for c in joined] == ["F0.2+B0.0", "F1.2+B1.1"]
    assert [str(c.program) for c in joined] == ["F0+B0", "F1+B1"]
    assert joined[0].task == (Task(0, 2, "F"), Task(0, 0, "BI"), Task(0, 0, "BW"))
    assert "ext0.mb0" not in repr(joined[0].outs)  # BI's extras for BW stay inside


def test_overlap_tasks_without_groups_changes_nothing():
    _, _, ctx = chain()
    program = lower_schedule(ctx, mp.OneFOneB().tasks(2, 2, 2))
    assert overlap_tasks(program, ctx) == program


def test_a_forward_only_step_runs_grouped_forwards_one_by_one():
    _, _, ctx = chain(num_microbatches=3, with_grad=False)
    program = overlap_tasks(lower_schedule(ctx, parse_tasks(ONE_F_ONE_B_JOINED)), ctx)
    assert [c.label for c in _calls(program)] == ["F0.0", "F1.0", "F0.1", "F1.1", "F0.2", "F1.2"]


def test_tasks_that_write_the_same_accumulator_cannot_be_overlapped():
    _, _, ctx = chain(num_microbatches=3)
    tasks = parse_tasks("mesh 0: F0.0 F0.1 B0.0+B0.1 F0.2 B0.2\nmesh 1: " + _last_1f1b(3))
    with pytest.raises(mp.CompileError, match=r"B0\.0\+B0\.1 on mesh 0 cannot run as one program"):
        overlap_tasks(lower_schedule(ctx, tasks), ctx)


def _last_1f1b(m):
    return " ".join(f"F1.{i} B1.{i}" for i in range(m))


def test_overlapped_calls_round_trip_through_the_text_form():
    _, _, ctx = chain(num_microbatches=3)
    program = overlap_tasks(lower_schedule(ctx, parse_tasks(ZB_JOINED)), ctx)
    text = format_instructions(program)
    assert "call 0 F0+B0 " in text and "task=F0.2+BI0.0+BW0.0" in text
    line = "call 0 F0+B0 args=(1,(2,)) outs=((3,),(4,)) label=F0.2+B0.0 task=F0.2+BI0.0+BW0.0"
    (call,) = parse_instructions(line, {"F0+B0": abs})
    assert call.program == ProgramKey.overlapped([ProgramKey("F", 0), ProgramKey("B", 0)])
    assert call.task == (Task(0, 2, "F"), Task(0, 0, "BI"), Task(0, 0, "BW"))
    assert format_instructions([call]) == line


# -- end to end: equal to nnx.jit -------------------------------------------------

# DualPipeV's own layout runs with every model in tests/jit/test_jit_equivalence.py.
SCHEDULES = {
    "1f1b-joined": (functools.partial(Custom, text=ONE_F_ONE_B_JOINED), 2, 2, 3, 2),
    "zb-joined": (functools.partial(Custom, text=ZB_JOINED), 2, 2, 3, 1),
}


@pytest.mark.parametrize("model_name", ["mlp", "lm_tied", "gated"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_overlapped_schedules_equal_nnx_jit(model_name, schedule):
    run_equivalence(model_name, "adamw", SCHEDULES[schedule])


def test_dualpipev_overlaps_a_forward_with_a_backward_in_one_program():
    tasks = mp.DualPipeV().tasks(4, 2, 8)
    assert any(t.with_next for row in tasks for t in row)
    assert not any(t.with_next for row in mp.DualPipeV(overlap=False).tasks(4, 2, 8) for t in row)
    programs = {}
    for m in (4, 8):
        model, opt, loss_fn, kind = build("mlp", "sgd", 4)
        step = mp.jit(
            train_step_fn(loss_fn),
            mesh=make_mesh(2, 1),
            schedule=mp.DualPipeV(),
            num_microbatches=m,
        )
        lowered = step.lower(model, opt, make_batch(kind, 2 * m))
        calls = [i for i in lowered.compiled.instructions if isinstance(i, Call)]
        programs[m] = {str(c.program) for c in calls}
        joined = [c for c in calls if c.program.members]
        assert joined and all(c.program.kind == "F+B" for c in joined)
        # Each joins the forward of one stage with the backward of another on one mesh.
        assert all(a.stage != b.stage for c in joined for a, b in [c.program.parts()])
    # One program per pair of stages: the number of programs does not grow with m.
    assert programs[4] == programs[8]


def test_overlapped_inference_equals_nnx_jit():
    model, _, _, kind = build("lm_tied", "sgd", 4)
    x = make_batch(kind, 16)["inputs"]
    expected = nnx.jit(lambda m, x: m(x))(model, x)
    f = mp.jit(lambda m, x: m(x), mesh=make_mesh(2, 1), schedule=mp.DualPipeV(), num_microbatches=4)
    np.testing.assert_allclose(f(model, x), expected, atol=1e-6)


def test_overlapping_tasks_that_share_an_accumulator_is_refused_by_mp_jit():
    model, opt, loss_fn, kind = build("mlp", "sgd", 2)
    text = "mesh 0: F0.0 F0.1 B0.0+B0.1\nmesh 1: F1.0 B1.0 F1.1 B1.1"
    step = mp.jit(
        train_step_fn(loss_fn), mesh=make_mesh(2, 1), schedule=Custom(text=text), num_microbatches=2
    )
    with pytest.raises(
        mp.CompileError,
        match=r"B0\.0\+B0\.1 on mesh 0 cannot run as one program: B0\.1 writes grad0",
    ):
        step(model, opt, make_batch(kind, 4))
    assert jnp.isfinite(model.layers[0].kernel[...]).all()  # the model was not touched


def test_a_profiled_overlapped_step_splits_each_program_among_its_tasks():
    model, opt, loss_fn, kind = build("mlp", "sgd", 4)
    step = mp.jit(
        train_step_fn(loss_fn), mesh=make_mesh(2, 1), schedule=mp.DualPipeV(), num_microbatches=4
    )
    batch = make_batch(kind, 8)
    step(model, opt, batch)
    step(model, opt, batch, profile=True)
    records = list(step.last_profile)
    assert any(isinstance(r[2], tuple) for r in records)  # one record per overlapped program
    measured = step.last_profile.timeline()
    scheduled = sorted(str(t) for row in mp.DualPipeV().tasks(4, 2, 4) for t in row)
    assert sorted(str(t) for _, t, _, _ in measured.entries) == scheduled
    comparison = step.last_profile.compare()
    assert comparison.simulated.makespan > 0 and comparison.measured.makespan > 0
