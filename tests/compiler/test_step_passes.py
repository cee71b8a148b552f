"""The step-level passes of `compiler/final/step.py` and `compiler/trace/trace_step.py`, one by one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from pipeline_models import MLP, WIDTH, make_mesh, mlp_loss

import nnx_mpmd as mp
from nnx_mpmd.compiler.final.step import dedupe_programs, describe_inputs, schedule_tasks
from nnx_mpmd.compiler.ir import Call, Free, ProgramKey
from nnx_mpmd.compiler.trace.stages import cut_stages
from nnx_mpmd.compiler.trace.trace_step import flatten_step_args, trace_step
from nnx_mpmd.placement.abstract import PlacedAval, placed_aval, planned_avals


def _traced(fn, *args, mesh=None, m=2):
    mesh = mesh or make_mesh(2, 1)
    flat = flatten_step_args(fn, args)
    avals = (
        [placed_aval(x, mesh).aval for x in flat.state_leaves],
        [placed_aval(x, mesh).aval for x in flat.other_leaves],
    )
    return flat, mesh, trace_step(fn, flat, avals, mesh, m, None)


def _train(model, batch):
    loss, grads = mp.value_and_grad(mlp_loss)(model, batch)
    return loss, grads


def _batch(n=4):
    return {"x": np.ones((n, WIDTH), np.float32), "y": np.zeros((n, WIDTH), np.float32)}


def test_trace_records_one_region_for_a_training_step():
    _, _, traced = _traced(_train, MLP(2, rngs=nnx.Rngs(0)), _batch())
    assert len(traced.regions) == 1 and not traced.forward_only
    assert traced.num_user_outputs == len(traced.jaxpr.outvars) - 4  # 2 kernels, 2 biases
    assert len(traced.used) == len(traced.jaxpr.invars)


def test_trace_reads_a_forward_only_step_from_its_stage_calls():
    _, _, traced = _traced(lambda m, x: m(x), MLP(2, rngs=nnx.Rngs(0)), _batch()["x"])
    assert traced.forward_only and len(traced.regions) == 1
    assert not traced.regions[0].with_grad


def test_trace_of_a_step_without_stages_has_no_region():
    _, _, traced = _traced(lambda x: (x * 2).sum(), jnp.ones((4, 2)))
    assert traced.regions == () and not traced.forward_only


def test_describe_inputs_names_state_by_path_and_finds_its_meshes():
    model = MLP(2, rngs=nnx.Rngs(0))
    flat, mesh, traced = _traced(_train, model, _batch())
    state = planned_avals(flat.nodes, flat.state_leaves, mesh, mp.GPipe())
    other = [placed_aval(x, mesh) for x in flat.other_leaves]
    inputs = describe_inputs(traced, flat, mesh, state, other)
    assert "0.layers.1.module.kernel" in inputs.names
    meshes = dict(zip(inputs.names, inputs.meshes))
    assert meshes["0.layers.0.module.kernel"] == {0}
    assert meshes["0.layers.1.module.kernel"] == {1}
    assert all(m == {-1} for n, m in meshes.items() if n.startswith("argument"))


def test_planned_avals_say_where_place_would_put_state_without_moving_it():
    model = MLP(2, rngs=nnx.Rngs(0))
    mesh = make_mesh(2, 2)
    flat = flatten_step_args(_train, (model, _batch()))
    before = list(flat.state_leaves)
    avals = planned_avals(flat.nodes, flat.state_leaves, mesh, mp.OneFOneB())
    assert [a.mesh_ids for a in avals] == [(0,), (0,), (1,), (1,)]
    assert all(a.sharding(a.mesh_ids[0]).mesh == mesh.submesh(a.mesh_ids[0]) for a in avals)
    assert all(x is y for x, y in zip(before, jax.tree.leaves(nnx.state(model))))


def test_placed_avals_key_placements_not_layout_spellings():
    mesh = make_mesh(2, 2)
    sub = mesh.submesh(1)
    x = jax.device_put(
        jnp.ones((4, 4)), jax.sharding.NamedSharding(sub, jax.sharding.PartitionSpec())
    )
    spelled = jax.sharding.NamedSharding(sub, jax.sharding.PartitionSpec(None, None))
    planned = PlacedAval((4, 4), x.dtype, ((1, spelled),))
    assert placed_aval(x, mesh).key() == planned.key()
    assert placed_aval(x, mesh).on(1).sharding == x.sharding


@pytest.mark.parametrize("stages,meshes,m", [(2, 2, 4), (4, 2, 2)])
def test_schedule_tasks_gives_every_mesh_its_tasks(stages, meshes, m):
    _, _, traced = _traced(_train, MLP(stages, rngs=nnx.Rngs(0)), _batch(8), m=m)
    plan = cut_stages(traced.regions[0])
    tasks, stage_mesh = schedule_tasks(plan, mp.Interleaved1F1B(), make_mesh(meshes, 1), m)
    assert len(tasks) == meshes and stage_mesh == [s % meshes for s in range(stages)]
    assert sum(len(t) for t in tasks) == 2 * stages * m


def test_schedule_tasks_says_which_schedule_cannot_run_the_model():
    _, _, traced = _traced(_train, MLP(3, rngs=nnx.Rngs(0)), _batch())
    plan = cut_stages(traced.regions[0])
    with pytest.raises(mp.ScheduleError, match=r"^OneFOneB cannot run this model's 3 stages on 2"):
        schedule_tasks(plan, mp.OneFOneB(), make_mesh(2, 1), 2)


def test_dedupe_programs_keeps_the_called_programs_by_name():
    f0, b0 = ProgramKey("F", 0), ProgramKey("B", 0)
    program = [Call(0, f0, abs, (0,), 1, "F0.0"), Free((0,)), Call(0, f0, abs, (1,), 2, "F0.1")]
    assert dedupe_programs(program) == {"F0": abs}
    clash = [*program, Call(0, b0, abs, (2,), 3, "B0.0"), Call(1, f0, round, (3,), 4, "F0.2")]
    with pytest.raises(AssertionError, match="two programs are named F0"):
        dedupe_programs(clash)


def test_lowering_a_parameter_without_a_stage_names_it():
    model = MLP(2, rngs=nnx.Rngs(0))
    model.extra = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
    step = mp.jit(_train, mesh=make_mesh(2, 1), schedule=mp.OneFOneB(), num_microbatches=2)
    with pytest.raises(mp.PlacementError, match=r"2 parameter\(s\) have no stage: .*extra"):
        step.lower(model, _batch())


def test_lowering_runs_with_the_collector_paused_and_restores_it(monkeypatch):
    # Full collections walk every object the passes made so far: lowering pauses them.
    import gc

    import nnx_mpmd.compiler.final.step as step_module

    seen = []
    real = step_module.schedule_ticks
    monkeypatch.setattr(
        step_module, "schedule_ticks", lambda p: seen.append(gc.isenabled()) or real(p)
    )
    step = mp.jit(_train, mesh=make_mesh(2, 1), schedule=mp.OneFOneB(), num_microbatches=2)
    assert gc.isenabled()
    step.lower(MLP(2, rngs=nnx.Rngs(0)), _batch())
    assert seen == [False] and gc.isenabled()
    model = MLP(2, rngs=nnx.Rngs(0))
    model.extra = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
    with pytest.raises(mp.PlacementError, match=r"have no stage"):
        step.lower(model, _batch())
    assert gc.isenabled()  # back on after a lowering that raised
    gc.disable()
    try:
        mp.jit(_train, mesh=make_mesh(2, 1), schedule=mp.OneFOneB(), num_microbatches=2).lower(
            MLP(2, rngs=nnx.Rngs(0)), _batch()
        )
        assert not gc.isenabled()  # a collector the caller turned off stays off
    finally:
        gc.enable()
