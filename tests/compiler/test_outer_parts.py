"""The late mesh-inference passes `drop_unread_equations` and `split_common_parts`.

Each test traces a few ops with ``jax.make_jaxpr``, says by hand where the inputs
live, and checks the pass on its own and through `plan_outer_problem`, whose
instructions a small interpreter runs against the function jitted on one device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from pipeline_models import lm_on_four_meshes, make_batch, params_of, train_step_fn
from test_outer_passes import _assign, _problem, _run

import nnx_mpmd as mp
from nnx_mpmd.aot.stats import count_compilations
from nnx_mpmd.compiler.ir import Call, SlotTable
from nnx_mpmd.compiler.outer.mesh_inference import plan_outer_problem
from nnx_mpmd.compiler.outer.outer_emit import Part, kept_values, level_equations
from nnx_mpmd.compiler.outer.outer_parts import drop_unread_equations, split_common_parts


def _adam_like(x, g, count, norm):
    scale = jnp.where(norm < 1.0, 1.0, 1.0 / norm)
    step = 0.1 / (1.0 - 0.9 ** count.astype(jnp.float32))
    return x - step * jnp.sqrt(jnp.abs(g * scale) + 1e-3) * jnp.sign(g)


def _update(e, w0, g_e, g0, w1, g1, w2, f, g2, g_f, count):
    """Mesh 0: an extra leaf e and a block w0; mesh 1: the block w1; mesh 2: w2 and f."""
    grads = (g_e, g0, g1, g2, g_f)
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in grads))
    new = [_adam_like(x, g, count, norm) for x, g in ((e, g_e), (w0, g0), (w1, g1))]
    new += [_adam_like(x, g, count, norm) for x, g in ((w2, g2), (f, g_f))]
    return (*new, count + 1)


def _update_args():
    rng = np.random.default_rng(0)
    shapes = [(8,), (16, 4), (8,), (16, 4), (16, 4), (16, 4), (16, 4), (3,), (16, 4), (3,)]
    arrays = [jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in shapes]
    return [*arrays, jnp.int32(3)]


def _update_problem():
    where = [{0}, {0}, {0}, {0}, {1}, {1}, {2}, {2}, {2}, {2}, {0, 1, 2}]
    targets = [{0}, {0}, {1}, {2}, {2}, {0, 1, 2}]
    return _problem(_update, _update_args(), where, targets=targets)


def _calls(plan):
    return {str(ins.program): ins for ins in plan.instructions if isinstance(ins, Call)}


# -- drop_unread_equations ---------------------------------------------------------------


def test_an_equation_nothing_reads_on_a_mesh_is_dropped_there_only():
    problem = _problem(lambda a, b: (a + jnp.zeros(2), b * 2), [jnp.ones(2)] * 2, [{0}, {1}])
    problem = dataclasses.replace(problem, outvar_targets=[{0}, {1}])
    levels = level_equations(_assign(problem))
    on_1 = next(g for g in levels.groups if g.mesh == 1)
    extra = dataclasses.replace(levels, groups={**levels.groups, on_1: (0, *levels.groups[on_1])})
    dropped = drop_unread_equations(extra, kept_values(problem, extra))
    assert dropped.groups == levels.groups
    assert drop_unread_equations(levels, kept_values(problem, levels)) is levels


def test_an_equation_whose_result_leaves_its_mesh_is_kept():
    problem = _problem(
        lambda a, b: (jnp.sum(a * 2) + b,), [jnp.ones(256), jnp.ones(())], [{0}, {1}], [{1}]
    )
    levels = level_equations(_assign(problem))
    assert drop_unread_equations(levels, kept_values(problem, levels)) is levels


# -- split_common_parts ------------------------------------------------------------------


def test_the_update_of_equal_blocks_is_one_program_on_every_mesh():
    plan = plan_outer_problem(_update_problem(), SlotTable())
    calls = _calls(plan)
    by_part = {
        part: {c.mesh: c for name, c in calls.items() if name.startswith(f"{prefix}.L1.")}
        for part, prefix in (
            ("prologue", "pre_prologue"),
            ("rest", "pre"),
            ("common", "pre_common"),
        )
    }
    assert sorted(by_part["common"]) == [0, 1, 2], sorted(calls)
    structures = {c.structure for c in by_part["common"].values()}
    assert len(structures) == 1 and None not in structures
    # What is left: mesh 0 updates e, mesh 2 updates f, each with its prologue (the
    # norm, the count); mesh 1 has nothing else, and its prologue is a program.
    assert sorted(by_part["rest"]) == [0, 2] and sorted(by_part["prologue"]) == [1]
    assert all(len(c.outs) > 1 for c in by_part["rest"].values())
    # The part that computes the norm runs before the common part, on each mesh.
    order = [(c.mesh, str(c.program)) for c in plan.instructions if isinstance(c, Call)]
    for q in range(3):
        names = [name for mesh, name in order if mesh == q and ".L1." in name]
        assert len(names) == 2 and names[-1].startswith("pre_common."), names


def _sgd_update(e, w0, g_e, g0, w1, g1, w2, f, g2, g_f, count):
    """`_update` with SGD: no update reads the step count, which each mesh advances."""
    pairs = ((e, g_e), (w0, g0), (w1, g1), (w2, g2), (f, g_f))
    return (*(x - 0.1 * jnp.tanh(g) * jnp.sqrt(jnp.abs(x) + 1.0) for x, g in pairs), count + 1)


def _sgd_problem():
    where = [{0}, {0}, {0}, {0}, {1}, {1}, {2}, {2}, {2}, {2}, {0, 1, 2}]
    targets = [{0}, {0}, {1}, {2}, {2}, {0, 1, 2}]
    return _problem(_sgd_update, _update_args(), where, targets=targets)


def test_a_prologue_the_rest_does_not_read_runs_in_the_common_part():
    # The count is each mesh's whole prologue and no update reads it: it runs in the
    # common part on every mesh, so mesh 1 has no prologue program of its own.
    plan = plan_outer_problem(_sgd_problem(), SlotTable())
    calls = _calls(plan)
    assert not any(name.startswith("pre_prologue.") for name in calls), sorted(calls)
    common = [c for name, c in calls.items() if name.startswith("pre_common.")]
    assert sorted(c.mesh for c in common) == [0, 1, 2], sorted(calls)
    assert len({c.structure for c in common}) == 1 and common[0].structure is not None
    assert sorted(c.mesh for name, c in calls.items() if name.startswith("pre.")) == [0, 2]
    want = jax.jit(_sgd_update)(*_update_args())
    for j, (placed, w) in enumerate(zip(_run(plan, _update_args()), want, strict=True)):
        assert placed, j
        for q, g in placed:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{j}@{q}")


def test_split_programs_compute_what_the_function_computes():
    problem = _update_problem()
    plan = plan_outer_problem(problem, SlotTable())
    assert any(Part.COMMON.name.lower() in name for name in _calls(plan))
    want = jax.jit(_update)(*_update_args())
    got = _run(plan, _update_args())
    for j, (placed, w) in enumerate(zip(got, want, strict=True)):
        assert placed, j
        for q, g in placed:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{j}@{q}")


def test_every_value_is_written_by_one_program_per_mesh():
    plan = plan_outer_problem(_update_problem(), SlotTable())
    written = [slot for ins in plan.instructions if isinstance(ins, Call) for slot in ins.outs]
    assert len(written) == len(set(written))


def test_programs_that_are_equal_already_are_not_split():
    def update(w0, g0, w1, g1, count):
        norm = jnp.sqrt(jnp.sum(g0 * g0) + jnp.sum(g1 * g1))
        return _adam_like(w0, g0, count, norm), _adam_like(w1, g1, count, norm)

    x = jnp.ones((16, 4))
    problem = _problem(update, [x, x, x, x, jnp.int32(1)], [{0}, {0}, {1}, {1}, {0, 1}], [{0}, {1}])
    plan = plan_outer_problem(problem, SlotTable())
    assert not any("common" in name for name in _calls(plan))


def test_a_program_without_the_core_pieces_is_left_whole():
    # Mesh 1's leaf has another shape: no other mesh contains its piece.
    def update(e, w0, g_e, g0, v1, h1, count):
        norm = jnp.sqrt(jnp.sum(g_e * g_e) + jnp.sum(g0 * g0) + jnp.sum(h1 * h1))
        return (
            _adam_like(e, g_e, count, norm),
            _adam_like(w0, g0, count, norm),
            _adam_like(v1, h1, count, norm),
        )

    a, b, c = jnp.ones((16, 4)), jnp.ones((8,)), jnp.ones((4, 16))
    problem = _problem(
        update,
        [b, a, b, a, c, c, jnp.int32(1)],
        [{0}, {0}, {0}, {0}, {1}, {1}, {0, 1}],
        [{0}, {0}, {1}],
    )
    levels = level_equations(_assign(problem))
    assert split_common_parts(levels) is levels


def _own_update(w0, w1, w2, g0, g1, g2, count):
    """Each mesh holds every gradient (sent whole) and updates its own parameter."""
    norm = jnp.sqrt(jnp.sum(g0 * g0) + jnp.sum(g1 * g1) + jnp.sum(g2 * g2))
    return (*(_adam_like(w, g, count, norm) for w, g in ((w0, g0), (w1, g1), (w2, g2))), count + 1)


def _own_update_args():
    rng = np.random.default_rng(1)
    arrays = [jnp.asarray(rng.normal(size=(16,)).astype(np.float32)) for _ in range(6)]
    return [*arrays, jnp.int32(3)]


def test_equal_programs_that_read_their_own_gradient_apart_share_their_parts():
    # Mesh q's update reads gradient q at argument q: equal piece by piece, never as
    # a whole. Split, every mesh's prologue (the norm) and common part are one each.
    everywhere = {0, 1, 2}
    where = [{0}, {1}, {2}, everywhere, everywhere, everywhere, everywhere]
    problem = _problem(_own_update, _own_update_args(), where, [{0}, {1}, {2}, everywhere])
    plan = plan_outer_problem(problem, SlotTable())
    calls = [c for c in plan.instructions if isinstance(c, Call)]
    for kind in ("pre_prologue", "pre_common"):
        mine = [c for c in calls if c.program.kind == kind]
        assert sorted(c.mesh for c in mine) == [0, 1, 2], sorted(str(c.program) for c in calls)
        assert len({c.structure for c in mine}) == 1 and mine[0].structure is not None
    want = jax.jit(_own_update)(*_own_update_args())
    for j, (placed, w) in enumerate(zip(_run(plan, _own_update_args()), want, strict=True)):
        assert placed, j
        for q, g in placed:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{j}@{q}")


def test_updates_that_read_their_own_gradient_apart_stay_whole_with_several_processes(
    monkeypatch,
):
    # Programs are shared within one process only: split, each mesh would compile two.
    everywhere = {0, 1, 2}
    where = [{0}, {1}, {2}, everywhere, everywhere, everywhere, everywhere]
    problem = _problem(_own_update, _own_update_args(), where, [{0}, {1}, {2}, everywhere])
    levels = level_equations(_assign(problem))
    assert split_common_parts(levels) is not levels
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert split_common_parts(levels) is levels


# -- end to end ---------------------------------------------------------------------------


@pytest.mark.parametrize("axis_types", [None, jax.sharding.AxisType.Auto], ids=["explicit", "auto"])
def test_a_clipped_adam_update_compiles_its_block_part_once_and_equals_nnx_jit(
    axis_types, compiled_here
):
    # The LM's first mesh holds the embedding and a block, the last a block and the
    # head; with a global-norm clip, the block updates of all four meshes are one
    # program, compiled once.
    step, (model, opt), (ref_model, ref_opt), loss_fn, kind = lm_on_four_meshes(
        "clip_adamw_cosine", axis_types
    )
    with count_compilations() as compiled:
        lowered = step.lower(model, opt, make_batch(kind, 8))
        lowered.compile()
    calls = [c for c in lowered.compiled.instructions if isinstance(c, Call)]
    common = [c for c in calls if c.program.kind == "post_common"]
    assert sorted(c.mesh for c in common) == [0, 1, 2, 3], sorted(str(c.program) for c in calls)
    prologues = [c.mesh for c in calls if c.program.kind == "post_prologue"]
    assert sorted(prologues) == [1, 2]  # meshes 0 and 3 run theirs with the rest
    assert len({c.structure for c in common}) == 1
    assert sum("post_common" in name for name in compiled.names) == 1, compiled.names
    ref_step = nnx.jit(train_step_fn(loss_fn, num_microbatches=4))
    for seed in (0, 1):
        with count_compilations() as again:
            loss = float(step(model, opt, make_batch(kind, 8, seed=seed)))
        assert again.count == 0
        want = float(ref_step(ref_model, ref_opt, make_batch(kind, 8, seed=seed)))
        np.testing.assert_allclose(loss, want, rtol=1e-5)
    got, ref = params_of(mp.gather(model)), params_of(ref_model)
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-4, atol=1e-5, err_msg=name)
