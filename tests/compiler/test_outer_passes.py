"""Mesh inference's passes, one by one, on tiny traced functions (no training).

Each test traces a few ops with ``jax.make_jaxpr``, says by hand where the inputs
live, and checks one pass: `needed_meshes`, `assign_meshes`, `level_equations`,
`defer_equations`, `pack_transfers`, `emit_outer_program`, `report_transfers`, and
`plan_outer_problem` composing them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_mpmd as mp
from nnx_mpmd.compiler.ir import (
    Call,
    ProgramKey,
    SlotTable,
    Transfer,
    format_instructions,
)
from nnx_mpmd.compiler.outer.mesh_inference import OuterPlan, plan_outer_problem
from nnx_mpmd.compiler.outer.outer_assign import (
    HOST,
    BatchOnMesh,
    OuterProblem,
    RegionPlacement,
    Segment,
    ValueOnMesh,
    assign_meshes,
    build_region,
    locate_region,
    needed_meshes,
)
from nnx_mpmd.compiler.outer.outer_emit import (
    CrossMeshTransfer,
    OuterGroup,
    OuterTransfer,
    defer_equations,
    emit_outer_program,
    kept_values,
    level_equations,
    report_transfers,
)
from nnx_mpmd.compiler.outer.outer_packing import PackedTransfer, pack_transfers
from nnx_mpmd.compiler.trace.region import region_p

MESHES = [jax.make_mesh((1,), ("data",), devices=[d]) for d in jax.devices()[:3]]


def _problem(fn, args, meshes, targets=None, names=None, **kw):
    closed = jax.make_jaxpr(fn)(*args)
    outs = len(closed.jaxpr.outvars)
    return OuterProblem(
        closed.jaxpr,
        meshes,
        targets if targets is not None else [None] * outs,
        names or [f"in{i}" for i in range(len(args))],
        MESHES,
        kw.pop("out_sharding", lambda j, q: None),
        **kw,
    )


def _assign(problem, region_needs=None, place_region=None):
    region_at = locate_region(problem.jaxpr)
    need = needed_meshes(problem, region_at, region_needs)
    return assign_meshes(problem, need, region_at, region_needs, place_region)


def _run(plan: OuterPlan, inputs):
    """A tiny interpreter: every input put on its meshes, the instructions in order."""
    store = {}
    for where, x in zip(plan.input_slots, inputs):
        for q, slot in where.items():
            store[slot] = x if q == HOST else jax.device_put(x, NamedSharding(MESHES[q], P()))
    for ins in plan.instructions:
        if isinstance(ins, Call):
            store.update(zip(ins.outs, ins.fn(*(store[a] for a in ins.args))))
        elif isinstance(ins, Transfer):
            target = NamedSharding(MESHES[ins.dst_mesh], P())
            store[ins.dst] = jax.device_put(store[ins.src], target)
    return [[(q, store[slot]) for q, slot in where] for where in plan.output_slots]


def _sum_two(a, b):
    return a + b


def _global_norm_scale(g0, g1, g2):
    norm = jnp.sqrt(jnp.sum(g0 * g0) + jnp.sum(g1 * g1) + jnp.sum(g2 * g2))
    return g0 / norm, g1 / norm, g2 / norm


GRADS = [jnp.arange(256.0) + k for k in range(3)]


def _norm_problem():
    """`_global_norm_scale` with g0, g1, g2 on meshes 0, 1, 2 and scaled in place."""
    names = ["g0", "g1", "g2"]
    return _problem(
        _global_norm_scale, GRADS, [{0}, {1}, {2}], targets=[{0}, {1}, {2}], names=names
    )


# -- locate_region / needed_meshes ---------------------------------------------------


def test_needed_meshes_flow_back_from_output_targets():
    problem = _problem(lambda a: jnp.sum(a * 2), [jnp.ones(4)], [{0}], targets=[{1}])
    need = needed_meshes(problem, locate_region(problem.jaxpr), None)
    assert need[problem.jaxpr.invars[0]] == {1}
    assert all(need[e.outvars[0]] == {1} for e in problem.jaxpr.eqns)


def test_needed_meshes_of_region_inputs_come_from_region_needs():
    problem = _region_problem()
    need = needed_meshes(problem, locate_region(problem.jaxpr), lambda r: frozenset({r % 2}))
    _, w1, x = problem.jaxpr.invars
    assert need[x] == {0} and need[w1] >= {1}


def test_two_regions_are_an_error():
    def two(x):
        a = region_p.bind(x, info=_FakeRegion((x.aval,)))
        return region_p.bind(*a, info=_FakeRegion((x.aval,)))

    closed = jax.make_jaxpr(two)(jnp.ones(2))
    with pytest.raises(mp.CompileError, match=r"2 times; one pipelined region per step"):
        locate_region(closed.jaxpr)


# -- assign_meshes -------------------------------------------------------------------


def test_sum_of_values_on_two_meshes_runs_once_and_moves_one_input():
    problem = _problem(_sum_two, [jnp.ones(4), jnp.ones(4)], [{0}, {1}], names=["a", "b"])
    assignment = _assign(problem)
    assert assignment.run_on == {0: {0}}
    (move,) = assignment.moves
    assert (move.dst, move.sources, move.segment) == (0, {1}, Segment.PRE)
    assert assignment.names[move.var] == "b"
    assert str(assignment) == (
        "  move 'b' float32[4] to mesh0 (held on mesh1)\n0 add: mesh0\noutputs on mesh0"
    )


def test_global_norm_is_partial_sums_per_mesh_and_scalar_moves():
    problem = _norm_problem()
    assignment = _assign(problem)
    eqns = problem.jaxpr.eqns
    sums = [i for i, e in enumerate(eqns) if e.primitive.name == "reduce_sum"]
    assert [assignment.run_on[i] for i in sums] == [{0}, {1}, {2}]
    assert all(m.var.aval.shape == () for m in assignment.moves), "only scalars move"
    sqrt = next(i for i, e in enumerate(eqns) if e.primitive.name == "sqrt")
    assert assignment.run_on[sqrt] == {0, 1, 2}  # cheaper than computing once and shipping


def test_global_norm_of_squares_moves_only_scalars():
    def norm_scale(g0, g1, g2):
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in (g0, g1, g2)))
        return g0 / norm, g1 / norm, g2 / norm

    problem = _problem(norm_scale, GRADS, [{0}, {1}, {2}], targets=[{0}, {1}, {2}])
    assignment = _assign(problem)
    assert all(m.var.aval.shape == () for m in assignment.moves), "only scalars move"


def test_value_needed_on_two_meshes_is_computed_on_both():
    def f(x):
        y = x * 2
        return y + 1, y - 1

    problem = _problem(f, [jnp.ones(8)], [{0}], targets=[{0}, {1}])
    assignment = _assign(problem)
    assert assignment.run_on[0] == {0, 1}  # the mul, where both results are needed
    assert [(m.var, m.dst) for m in assignment.moves] == [(problem.jaxpr.invars[0], 1)]


def test_reduction_runs_once_where_its_input_is_and_ships_the_scalar():
    problem = _problem(lambda a: jnp.sum(a), [jnp.ones(1024)], [{0}], targets=[{1}])
    assignment = _assign(problem)
    assert assignment.run_on == {0: {0}}
    (move,) = assignment.moves
    assert (move.dst, move.before, move.segment) == (1, 1, Segment.POST)  # an output move
    assert assignment.output_meshes == ((1,),)


def test_host_input_is_fetched_where_it_is_used():
    problem = _problem(_sum_two, [jnp.ones(4), jnp.ones(4)], [{HOST}, {1}])
    assignment = _assign(problem)
    assert assignment.run_on == {0: {1}}
    assert assignment.moves[0].sources == {HOST}


def test_literal_output_is_an_error():
    closed = jax.make_jaxpr(lambda a: (a, 1.0))(jnp.ones(2))
    problem = OuterProblem(closed.jaxpr, [{0}], [None, None], ["a"], MESHES, lambda j, q: None)
    with pytest.raises(mp.CompileError, match=r"step output 1 is a constant"):
        _assign(problem)


# -- the region ---------------------------------------------------------------------


class _FakeRegion:
    """Stands in for `RegionInfo`: all `region_p`'s abstract evaluation reads."""

    def __init__(self, out_avals):
        self.out_avals = tuple(out_avals)

    def __hash__(self):
        return id(self)


def _region_step(w0, w1, x):
    loss, g0, g1 = region_p.bind(
        w0, w1, x, info=_FakeRegion((jax.core.ShapedArray((), jnp.float32), w0.aval, w1.aval))
    )
    return loss * 2, w0 - g0, w1 - g1


def _region_problem(**kw):
    args = [jnp.ones(4), jnp.ones(4), jnp.ones((8, 2))]
    return _problem(
        _region_step,
        args,
        [{0}, {1}, {HOST}],
        targets=[None, {0}, {1}],
        names=["w0", "w1", "batch"],
        batch_inputs=frozenset({2}),
        num_microbatches=4,
        batch_spec=lambda aval: P(None, "data"),
        **kw,
    )


def _region_needs(r):
    return frozenset({0: {0}, 1: {1}, 2: {0}}[r])


def _fake_region_builder(seen):
    """The region's passes, faked: one call on mesh 0; loss on 1, gradients at home."""

    def builder(input_slot, home):
        seen.update(homes=[home(r) for r in range(2)], batch=input_slot(2, 0))
        slots = [input_slot(0, 0), input_slot(2, 0)]
        call = Call(0, ProgramKey("F", 0), lambda *a: a, tuple(slots), (), "F0.0")
        return [call], [[(1, 100)], [(0, 101)], [("input", 1)]]

    return builder


def _placer(problem, slots, builder):
    """`assign_meshes`'s place_region: the region's (fake) passes at its place."""
    return functools.partial(build_region, problem, slots, builder, locate_region(problem.jaxpr))


def test_region_inputs_move_before_it_and_batches_get_their_own_copy():
    problem, slots, seen = _region_problem(), SlotTable(), {}
    place = _placer(problem, slots, _fake_region_builder(seen))
    assignment = _assign(problem, _region_needs, place)
    (move,) = assignment.moves[:1]
    assert (move.dst, move.sources, move.as_batch, move.before) == (0, {HOST}, True, 0)
    assert seen["homes"] == [0, 1]
    x = problem.jaxpr.invars[2]
    assert slots.index[BatchOnMesh(x, 0)] == seen["batch"]
    assert assignment.region is not None
    assert assignment.region.output_meshes == ({1}, {0}, {1})
    w1 = problem.jaxpr.invars[1]
    g1 = problem.jaxpr.eqns[0].outvars[2]
    assert slots.index[ValueOnMesh(g1, 1)] == slots.index[ValueOnMesh(w1, 1)]  # an input output
    assert "0 region: outputs on mesh1 | mesh0 | mesh1" in str(assignment)


def test_region_without_callbacks_is_an_error():
    problem = _region_problem()
    with pytest.raises(mp.CompileError, match=r"equation 0 of the step is a pipelined region"):
        _assign(problem)


def test_literal_region_output_is_an_error():
    problem, slots = _region_problem(), SlotTable()

    def builder(input_slot, home):
        return [], [[("literal", 1.0)], [(0, 1)], [(1, 2)]]

    with pytest.raises(mp.CompileError, match=r"literal region outputs are not supported"):
        _assign(problem, _region_needs, _placer(problem, slots, builder))


def test_region_input_on_no_mesh_is_an_error():
    problem, slots = _region_problem(), SlotTable()

    def builder(input_slot, home):
        home(2)  # the batch is on the host only: it has no home mesh
        return [], []

    with pytest.raises(mp.CompileError, match=r"region input 2 is not on any mesh; place"):
        _assign(problem, lambda r: frozenset(), _placer(problem, slots, builder))


def test_region_placing_too_few_outputs_is_an_error():
    problem = _region_problem()
    with pytest.raises(mp.CompileError, match=r"placed 0 outputs, but the region has 3"):
        _assign(problem, _region_needs, lambda placement: RegionPlacement((), ()))


# -- level_equations -----------------------------------------------------------------


def test_levels_end_where_a_value_arrives_from_another_mesh():
    problem = _norm_problem()
    levels = level_equations(_assign(problem))
    # Partial sums at level 0 on each mesh, gathered on mesh 0 (level 1), where the
    # norm is computed, then sent back (level 2).
    assert [str(g.program_key) for g in levels.groups] == [
        *(f"pre.L0.mesh{q}" for q in range(3)),
        "pre.L1.mesh0",
        "pre.L2.mesh1",
        "pre.L2.mesh2",
    ]
    assert [(t.src, t.dst, t.level) for t in levels.transfers] == [
        (1, 0, 1),
        (2, 0, 1),
        (0, 1, 2),
        (0, 2, 2),
    ]
    assert "transfer 'g1' float32[] mesh1->mesh0 before pre.L1" in str(levels)


def test_levels_restart_after_the_region():
    problem, slots = _region_problem(), SlotTable()
    place = _placer(problem, slots, _fake_region_builder({}))
    levels = level_equations(_assign(problem, _region_needs, place))
    assert all(g.segment == Segment.POST and g.level == 0 for g in levels.groups)
    (batch, *post) = levels.transfers
    assert (batch.segment, batch.level, batch.src, batch.as_batch) == (Segment.PRE, 0, HOST, True)
    assert all(t.segment == Segment.POST for t in post)


def test_moves_copy_from_the_lowest_level_holder():
    def f(a, b, c):
        s = jnp.sum(a) + jnp.sum(b)  # on mesh 0 at level 1 (b's sum arrives)
        return s * c  # on mesh 2: s is shipped from mesh 0 at level 1 -> arrives at level 2

    problem = _problem(f, [jnp.ones(64), jnp.ones(64), jnp.ones(64)], [{0}, {1}, {2}])
    levels = level_equations(_assign(problem))
    assert [(t.src, t.dst, t.level) for t in levels.transfers] == [(1, 0, 1), (0, 2, 2)]
    assert OuterGroup(Segment.PRE, 2, 2) in levels.groups


# -- defer_equations -----------------------------------------------------------------


def _clipped_momentum(g0, g1, mu0, mu1):
    """Adam's first moment after a global-norm clip: ``b1 * mu`` need not wait for the norm."""
    norm = jnp.sqrt(jnp.sum(g0 * g0) + jnp.sum(g1 * g1))
    return 0.9 * mu0 + 0.1 * (g0 / norm), 0.9 * mu1 + 0.1 * (g1 / norm)


def _momentum_problem():
    args = [GRADS[0], GRADS[1], jnp.ones(256), jnp.full(256, 2.0)]
    return _problem(
        _clipped_momentum,
        args,
        [{0}, {1}, {0}, {1}],
        targets=[{0}, {1}],
        names=["g0", "g1", "mu0", "mu1"],
    ), args


def _group_of(levels, primitive, mesh):
    eqns = levels.assignment.jaxpr.eqns
    return {
        g.level
        for g, members in levels.groups.items()
        for i in members
        if g.mesh == mesh and eqns[i].primitive.name == primitive
    }


def test_deferred_work_runs_with_its_readers():
    problem, _ = _momentum_problem()
    levels = level_equations(_assign(problem))
    # As early as possible, ``0.9 * mu`` (6, 10) runs before the norm arrives and is
    # passed to level 1; deferred, it runs in the program that reads it. The partial
    # sums (0-3) that the other mesh reads stay before their transfer.
    assert str(levels).splitlines()[:4] == [
        "pre.L0.mesh0: 0:mul 1:reduce_sum 6:mul",
        "pre.L0.mesh1: 2:mul 3:reduce_sum 10:mul 13:convert_element_type",
        "pre.L1.mesh0: 4:add 5:sqrt 7:div 8:mul 9:add",
        "pre.L1.mesh1: 4:add 5:sqrt 11:div 12:mul 14:add",
    ]
    deferred = defer_equations(levels)
    assert str(deferred).splitlines()[:4] == [
        "pre.L0.mesh0: 0:mul 1:reduce_sum",
        "pre.L0.mesh1: 2:mul 3:reduce_sum",
        "pre.L1.mesh0: 4:add 5:sqrt 6:mul 7:div 8:mul 9:add",
        "pre.L1.mesh1: 4:add 5:sqrt 10:mul 11:div 12:mul 13:convert_element_type 14:add",
    ]
    assert deferred.transfers == levels.transfers


def test_a_value_sent_on_stays_one_level_before_its_transfer():
    problem = _norm_problem()
    levels = level_equations(_assign(problem))
    deferred = defer_equations(levels)
    # mesh 1 has levels 0 and 2 only: its work that waits goes to 2, never to a new 1
    assert {(g.level, g.mesh) for g in deferred.groups} <= {
        (g.level, g.mesh) for g in levels.groups
    }
    level_of = {(i, g.mesh): g.level for g, members in deferred.groups.items() for i in members}
    for t in deferred.transfers:
        if t.src != HOST:
            (producer,) = [i for i, e in enumerate(problem.jaxpr.eqns) if t.var in e.outvars]
            assert level_of[(producer, t.src)] <= t.level - 1


def test_deferring_adds_no_level_to_a_mesh_and_keeps_the_results():
    problem, args = _momentum_problem()
    levels = level_equations(_assign(problem))
    deferred = defer_equations(levels)
    mesh_levels = lambda lv: {(g.segment, g.level, g.mesh) for g in lv.groups}  # noqa: E731
    assert mesh_levels(deferred) <= mesh_levels(levels)
    for members in deferred.groups.values():
        assert list(members) == sorted(members)
    plan = plan_outer_problem(problem, SlotTable())
    for ((_, got),), want in zip(_run(plan, args), _clipped_momentum(*args)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_deferring_leaves_a_level_with_nothing_to_wait_for_out():
    problem = _problem(
        lambda a, b: (a * 2) + jnp.sum(b), [jnp.ones(2), jnp.ones(2)], [{0}, {1}], names=["a", "b"]
    )
    levels = level_equations(_assign(problem))
    assert OuterGroup(Segment.PRE, 0, 0) in levels.groups
    deferred = defer_equations(levels)
    assert OuterGroup(Segment.PRE, 0, 0) not in deferred.groups
    assert str(deferred).splitlines()[:2] == [
        "pre.L0.mesh1: 1:reduce_sum",
        "pre.L1.mesh0: 0:mul 2:add",
    ]


def test_equations_with_effects_keep_their_level():
    def f(a, b):
        jax.debug.callback(lambda x: None, a)
        return a + jnp.sum(b)

    problem = _problem(f, [jnp.ones(2), jnp.ones(2)], [{0}, {1}], names=["a", "b"])
    levels = level_equations(_assign(problem))
    deferred = defer_equations(levels)
    assert _group_of(levels, "debug_callback", 0) == _group_of(deferred, "debug_callback", 0) == {0}


# -- pack_transfers ------------------------------------------------------------------

LEAVES = [jnp.arange(64.0) * 0.01 + k for k in range(6)]
LEAF_MESHES = [{0}, {0}, {1}, {1}, {2}, {2}]
LEAF_NAMES = ["a0", "a1", "b0", "b1", "c0", "c1"]


def _leafwise_norm_scale(*leaves):
    """optax's global norm: one partial sum per leaf, added in leaf order."""
    total = functools.reduce(jnp.add, [jnp.sum(x * x) for x in leaves])
    norm = jnp.sqrt(total)
    return tuple(x / norm for x in leaves)


def _leaf_problem(fn=_leafwise_norm_scale, targets=None):
    return _problem(fn, LEAVES, LEAF_MESHES, targets=targets or LEAF_MESHES, names=LEAF_NAMES)


def _packed(problem):
    deferred = defer_equations(level_equations(_assign(problem)))
    return deferred, pack_transfers(deferred, kept_values(problem, deferred))


def test_scalars_one_program_sends_to_one_mesh_move_as_one_array():
    deferred, packed = _packed(_leaf_problem())
    # meshes 1 and 2 send their two partial sums each to mesh 0, which adds them up
    # in leaf order and sends the total back (one scalar per mesh: not packed)
    assert len(deferred.transfers) == 6
    packs = [t for t in packed.transfers if isinstance(t, PackedTransfer)]
    assert sorted((t.src, t.dst) for t in packs) == [(1, 0), (2, 0)]
    for t in packs:
        sent = [d.var for d in deferred.transfers if (d.src, d.dst) == (t.src, t.dst)]
        assert list(t.vars) == sent  # in the order they were needed
        assert t.nbytes == 8 and t.level == 1 and t.source.mesh == t.src
    singles = [t for t in packed.transfers if not isinstance(t, PackedTransfer)]
    assert [(t.src, t.dst) for t in singles] == [(0, 1), (0, 2)]
    assert str(packed).splitlines()[5:7] == [
        "transfer packed 2 values ('b0', 'b1') float32 mesh1->mesh0 before pre.L1",
        "transfer packed 2 values ('c0', 'c1') float32 mesh2->mesh0 before pre.L1",
    ]
    assert packed.groups == deferred.groups


def test_packed_programs_return_and_read_one_array_and_the_numbers_are_equal():
    problem = _leaf_problem()
    plan, unpacked = plan_outer_problem(problem, SlotTable()), _unpacked_plan(problem)
    text = format_instructions(plan.instructions)
    assert text.count("packed values") == 2, text
    assert "label='2 packed values 1->0' bytes=8 spec=[None] type=float32[2]\n" in text
    packed = [i for i in plan.instructions if isinstance(i, Transfer) and "packed" in i.label]
    # typed: ahead-of-time compilation need not wait for the sender (Explicit axes here)
    assert {(t.spec, t.value_type) for t in packed} == {(P(None), ((2,), "float32", False))}
    count = lambda p: sum(isinstance(i, Transfer) for i in p.instructions)  # noqa: E731
    assert (count(unpacked), count(plan)) == (6, 4)
    mesh0 = next(i for i in plan.instructions if isinstance(i, Call) and i.mesh == 0)
    assert len(mesh0.args) == 2 + 2, "its own two leaves and two arrays"
    for got, want in zip(_run(plan, LEAVES), _run(unpacked, LEAVES)):
        np.testing.assert_array_equal(got[0][1], want[0][1])  # copies only: same bits


def test_a_sender_returns_one_array_whatever_mesh_it_goes_to():
    def everywhere(*leaves):  # as optax's tree_norm: every mesh adds up all partial sums
        norm = jnp.sqrt(sum(jnp.sum(x * x) for x in leaves))
        return tuple(x / norm for x in leaves)

    problem = _leaf_problem(everywhere)
    plan = plan_outer_problem(problem, SlotTable())
    transfers = [i for i in plan.instructions if isinstance(i, Transfer)]
    assert all("packed values" in t.label for t in transfers)
    sources = {(t.src_mesh, t.src) for t in transfers}
    assert len(transfers) == 6 and len(sources) == 3
    # a mesh reads its own values from its array too: meshes 1 and 2 (equal leaves)
    # run programs of equal structure, read the same way
    calls = {c.label: c for c in plan.instructions if isinstance(c, Call)}
    receiving = [calls["pre.L1.mesh1"], calls["pre.L1.mesh2"]]
    assert receiving[0].structure is not None
    assert receiving[0].structure == receiving[1].structure
    assert [len(c.args) for c in receiving] == [5, 5], "its two leaves, three arrays"
    for got, want in zip(_run(plan, LEAVES), _run(_unpacked_plan(problem), LEAVES)):
        np.testing.assert_array_equal(got[0][1], want[0][1])


def test_a_pack_on_auto_axes_is_moved_as_replicated():
    auto = [
        jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=[d])
        for d in jax.devices()[:3]
    ]
    closed = jax.make_jaxpr(_leafwise_norm_scale)(*LEAVES)
    problem = OuterProblem(
        closed.jaxpr, LEAF_MESHES, LEAF_MESHES, LEAF_NAMES, auto, lambda j, q: None
    )
    plan = plan_outer_problem(problem, SlotTable())
    packed = [i for i in plan.instructions if isinstance(i, Transfer) and "packed" in i.label]
    assert len(packed) == 2 and {t.spec for t in packed} == {P()}  # as XLA returns it there


def _unpacked_plan(problem):
    import nnx_mpmd.compiler.outer.mesh_inference as mesh_inference

    original = mesh_inference.pack_transfers
    mesh_inference.pack_transfers = lambda levels, kept: levels
    try:
        return plan_outer_problem(problem, SlotTable())
    finally:
        mesh_inference.pack_transfers = original


def test_a_scalar_also_needed_as_it_is_on_its_destination_keeps_its_own_transfer():
    def norm_and_a_partial(*leaves):
        partials = [jnp.sum(x * x) for x in leaves]
        norm = jnp.sqrt(functools.reduce(jnp.add, partials))
        return (*(x / norm for x in leaves), partials[2])

    # b0's partial sum is also a step output on mesh 0
    _, packed = _packed(_leaf_problem(norm_and_a_partial, targets=[*LEAF_MESHES, {0}]))
    to_mesh0 = [t for t in packed.transfers if t.dst == 0 and t.src == 1]
    # b0's partial keeps its transfer; b1's, left alone, is not packed
    assert [type(t) for t in to_mesh0] == [OuterTransfer, OuterTransfer]
    (pack,) = [t for t in packed.transfers if isinstance(t, PackedTransfer)]
    assert (pack.src, pack.dst, len(pack.vars)) == (2, 0, 2)


def test_one_scalar_per_mesh_pair_is_not_packed():
    problem = _norm_problem()
    deferred, packed = _packed(problem)
    assert packed.transfers == deferred.transfers


def test_scalars_of_different_dtypes_are_packed_apart():
    def mixed(a, b):
        n = a.astype(jnp.int32)
        return a * jnp.sum(b) + a * jnp.sum(b * b), n * jnp.argmax(b) + n * jnp.argmin(b)

    problem = _problem(
        mixed, [jnp.ones(4), jnp.arange(4.0)], [{0}, {1}], targets=[{0}, {0}], names=["a", "b"]
    )
    _, packed = _packed(problem)
    kinds = sorted(
        (str(t.vars[0].aval.dtype), len(t.vars))
        for t in packed.transfers
        if isinstance(t, PackedTransfer)
    )
    assert kinds == [("float32", 2), ("int32", 2)]
    plan, unpacked = plan_outer_problem(problem, SlotTable()), _unpacked_plan(problem)
    for got, want in zip(
        _run(plan, [jnp.ones(4), jnp.arange(4.0)]), _run(unpacked, [jnp.ones(4), jnp.arange(4.0)])
    ):
        np.testing.assert_array_equal(got[0][1], want[0][1])
        assert got[0][1].dtype == want[0][1].dtype


def _column_norms(a, b0, b1):
    c0 = jnp.sum(b0 * b0, axis=0)  # [3], on b0's mesh
    c1 = jnp.sum(b1 * b1, axis=0)  # [2, 2]
    return a[:3] * c0, a[:4].reshape(2, 2) * c1


COLUMN_ARGS = [jnp.arange(8.0), jnp.arange(12.0).reshape(4, 3), jnp.arange(20.0).reshape(5, 2, 2)]


def test_small_arrays_are_packed_flat_and_come_back_in_shape():
    problem = _problem(
        _column_norms, COLUMN_ARGS, [{0}, {1}, {1}], targets=[{0}, {0}], names=["a", "b0", "b1"]
    )
    _, packed = _packed(problem)
    (pack,) = packed.transfers
    assert pack.layout() == ((0, (3,)), (3, (2, 2))) and pack.nbytes == 28
    plan, unpacked = plan_outer_problem(problem, SlotTable()), _unpacked_plan(problem)
    for got, want in zip(_run(plan, COLUMN_ARGS), _run(unpacked, COLUMN_ARGS)):
        assert got[0][1].shape == want[0][1].shape
        np.testing.assert_array_equal(got[0][1], want[0][1])


def test_large_or_sharded_values_move_on_their_own(monkeypatch):
    problem = _problem(
        _column_norms, COLUMN_ARGS, [{0}, {1}, {1}], targets=[{0}, {0}], names=["a", "b0", "b1"]
    )
    import nnx_mpmd.compiler.outer.outer_packing as outer_packing

    monkeypatch.setattr(outer_packing, "PACK_MAX_BYTES", 12)  # c0 fits, c1 (16 B) does not
    deferred, packed = _packed(problem)
    assert packed.transfers == deferred.transfers
    monkeypatch.undo()

    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    sharded = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    aval = jax.make_jaxpr(lambda x: x)(sharded).jaxpr.outvars[0]
    t = OuterTransfer(aval, 1, 0, Segment.PRE, 1)
    assert not outer_packing._packable(t, set())
    assert outer_packing._packable(dataclasses.replace(t, var=deferred.transfers[0].var), set())


def test_a_pack_is_reported_as_one_transfer():
    _, packed = _packed(_leaf_problem())
    report = report_transfers(_leaf_problem(), packed)
    assert report[:2] == [
        CrossMeshTransfer("2 values (b0, b1)", 1, 0, 8),
        CrossMeshTransfer("2 values (c0, c1)", 2, 0, 8),
    ]
    assert len(report) == 4


# -- emit_outer_program --------------------------------------------------------------


def test_emitted_program_of_a_sum():
    problem = _problem(_sum_two, [jnp.ones(4), jnp.ones(4)], [{0}, {1}], names=["a", "b"])
    slots = SlotTable()
    program = emit_outer_program(problem, level_equations(_assign(problem)), slots)
    assert format_instructions(program.instructions) == (
        "transfer 3@1 -> 2@0 label='b 1->0' bytes=16\n"
        "call 0 pre.L1.mesh0 args=(1,2) outs=(0,) label=pre.L1.mesh0"
    )
    assert program.output_slots == [[(0, 0)]] and program.input_slots == [{0: 1}, {1: 3}]
    assert set(program.programs) == {"pre.L1.mesh0"}


def test_region_instructions_sit_between_pre_and_post():
    problem, slots = _region_problem(), SlotTable()
    place = _placer(problem, slots, _fake_region_builder({}))
    program = emit_outer_program(
        problem, level_equations(_assign(problem, _region_needs, place)), slots
    )
    text = format_instructions(program.instructions)
    assert text.splitlines()[:2] == [
        "transfer 9@-1 -> 0@0 label='batch host->0' bytes=64 reshape=4 spec=[None,data]",
        "call 0 F0 args=(1,0) outs=() label=F0.0",
    ], text
    assert "call 0 post.L0.mesh0" in text and "call 1 post.L0.mesh1" in text
    assert "pre." not in text


def test_state_outputs_take_their_sharding_and_the_numbers_are_right():
    asked = []

    def out_sharding(j, q):
        asked.append((j, q))
        return NamedSharding(MESHES[q], P())

    problem = _problem(
        _global_norm_scale,
        GRADS,
        [{0}, {1}, {2}],
        targets=[{0}, {1}, {2}],
        out_sharding=out_sharding,
    )
    plan = plan_outer_problem(problem, SlotTable())
    assert sorted(asked) == [(0, 0), (1, 1), (2, 2)]
    expected = _global_norm_scale(*GRADS)
    for ((_, got),), want, mesh in zip(_run(plan, GRADS), expected, MESHES):
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert got.sharding.mesh == mesh


def test_program_without_inputs_is_pinned_to_its_mesh():
    problem = _problem(lambda a: (a, jnp.zeros(3)), [jnp.ones(2)], [{1}], targets=[None, {2}])
    plan = plan_outer_problem(problem, SlotTable())
    ((_, zeros),) = _run(plan, [jnp.ones(2)])[1]
    assert zeros.sharding.mesh == MESHES[2]


# -- report_transfers ----------------------------------------------------------------


def test_large_transfers_are_reported_and_warned_about():
    problem = _problem(
        _sum_two,
        [jnp.ones(1024), jnp.ones(1024)],
        [{0}, {1}],
        names=["w0", "w1"],
        transfer_warning_bytes=1000,
    )
    levels = level_equations(_assign(problem))
    with pytest.warns(mp.MpmdTransferWarning, match=r"w1 \(0.0 MiB\) moves from mesh 1 to mesh 0"):
        report = report_transfers(problem, levels)
    assert report == [CrossMeshTransfer("w1", 1, 0, 4096)]


def test_host_and_batch_transfers_are_not_reported():
    problem, slots = _region_problem(), SlotTable()
    place = _placer(problem, slots, _fake_region_builder({}))
    levels = level_equations(_assign(problem, _region_needs, place))
    report = report_transfers(problem, levels)
    assert all(t.src != HOST for t in report)
    assert not any(t.what == "batch" for t in report)


# -- plan_outer_problem and the transitional plan_outer -------------------------------


def test_plan_records_every_pass():
    problem = _problem(_sum_two, [jnp.ones(4), jnp.ones(4)], [{0}, {1}])
    plan = plan_outer_problem(problem, SlotTable())
    assert [name for name, _ in plan.passes] == [
        "needed_meshes",
        "assign_meshes",
        "level_equations",
        "defer_equations",
        "pack_transfers",
        "drop_unread_equations",
        "split_common_parts",
        "emit_outer_program",
        "report_transfers",
    ]
    passes = dict(plan.passes)
    assert passes["emit_outer_program"] == plan.instructions
    assert "0 add: mesh0" in str(passes["assign_meshes"])
    assert "pre.L1.mesh0: 0:add" in str(passes["level_equations"])


# -- OuterProblem's checks -----------------------------------------------------------


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(invar_meshes=[{0}]), r"got 1 input meshes for a step with 2 inputs"),
        (dict(names=["a"]), r"got 1 input names for a step with 2 inputs"),
        (dict(outvar_targets=[None, None]), r"got 2 output targets for a step with 1 outputs"),
        (dict(invar_meshes=[{0}, set()]), r"step input 1 \(b\) is said to live on meshes \[\]"),
        (dict(invar_meshes=[{0}, {7}]), r"mesh ids below 3"),
    ],
)
def test_bad_problem_is_an_error(change, message):
    closed = jax.make_jaxpr(_sum_two)(jnp.ones(2), jnp.ones(2))
    fields = dict(
        jaxpr=closed.jaxpr,
        invar_meshes=[{0}, {1}],
        outvar_targets=[None],
        names=["a", "b"],
        submeshes=MESHES,
        out_sharding=lambda j, q: None,
    )
    with pytest.raises(mp.CompileError, match=message):
        OuterProblem(**{**fields, **change})


def test_jaxpr_with_constvars_is_an_error():
    const = np.arange(3.0)
    closed = jax.make_jaxpr(lambda a: a + jnp.asarray(const))(jnp.ones(3))
    if not closed.jaxpr.constvars:
        pytest.skip("this JAX inlines the constant")
    with pytest.raises(mp.CompileError, match=r"constvars; turn them into inputs"):
        OuterProblem(closed.jaxpr, [{0}], [None], ["a"], MESHES, lambda j, q: None)


# -- structure keys: equal programs on equal-shaped meshes ----------------------------


def _key(fn, *args):
    from nnx_mpmd.compiler.jaxpr_utils import structure_key

    j = jax.make_jaxpr(fn)(*args).jaxpr
    return structure_key(j.eqns, j.invars, j.outvars)


@pytest.mark.parametrize(
    "other",
    [
        lambda a, b: a * 2.0 + b,  # the same function, other names
    ],
)
def test_equal_slices_have_equal_structure_keys(other):
    first = _key(lambda x, y: x * 2.0 + y, jnp.ones(3), jnp.ones(3))
    assert first is not None and first == _key(other, jnp.ones(3), jnp.ones(3))
    assert hash(first) == hash(_key(other, jnp.ones(3), jnp.ones(3)))


@pytest.mark.parametrize(
    "fn,args",
    [
        (lambda a, b: b * 2.0 + a, (jnp.ones(3), jnp.ones(3))),  # wired otherwise
        (lambda a, b: a * 3.0 + b, (jnp.ones(3), jnp.ones(3))),  # another literal
        (lambda a, b: a * 2.0 - b, (jnp.ones(3), jnp.ones(3))),  # another primitive
        (lambda a, b: a * 2.0 + b, (jnp.ones(4), jnp.ones(4))),  # another shape
        (lambda a, b: a * 2.0 + b, (jnp.ones(3, jnp.int32), jnp.ones(3, jnp.int32))),
        (lambda a, b: jnp.sum(a * 2.0 + b, keepdims=True), (jnp.ones(3), jnp.ones(3))),
    ],
    ids=["wiring", "literal", "primitive", "shape", "dtype", "extra-equation"],
)
def test_different_slices_have_different_structure_keys(fn, args):
    assert _key(lambda x, y: x * 2.0 + y, jnp.ones(3), jnp.ones(3)) != _key(fn, *args)


def test_structure_keys_compare_floats_by_their_bits():
    zero = _key(lambda a: a * 0.0, jnp.ones(3))
    assert zero != _key(lambda a: a * -0.0, jnp.ones(3))
    nan = _key(lambda a: a * jnp.nan, jnp.ones(3))
    assert nan is not None and nan == _key(lambda a: a * jnp.nan, jnp.ones(3))


def test_structure_keys_see_shardings():
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    sharded = jax.device_put(jnp.ones(4), NamedSharding(mesh, P("data")))
    replicated = jax.device_put(jnp.ones(4), NamedSharding(mesh, P()))
    assert _key(lambda a: a + 1.0, sharded) != _key(lambda a: a + 1.0, replicated)


def test_a_parameter_without_value_equality_gives_no_key():
    from nnx_mpmd.compiler.jaxpr_utils import structure_key

    j = jax.make_jaxpr(lambda a: a + 1.0)(jnp.ones(3)).jaxpr
    eqn = j.eqns[0].replace(params={"array": jnp.ones(2)})  # a device array
    assert structure_key([eqn], j.invars, j.outvars) is None


def test_outer_programs_of_equal_work_on_two_meshes_share_a_structure():
    def f(g0, g1, g2):
        norm = jnp.sqrt(jnp.sum(g0 * g0) + jnp.sum(g1 * g1) + jnp.sum(g2 * g2))
        return g0 / norm, g1 / norm, jnp.sum(g2) / norm

    problem = _problem(f, GRADS, [{0}, {1}, {2}], targets=[{0}, {1}, {2}])
    plan = plan_outer_problem(problem, SlotTable())
    calls = {str(ins.program): ins for ins in plan.instructions if isinstance(ins, Call)}
    level2 = [calls[name].structure for name in ("pre.L2.mesh1", "pre.L2.mesh2")]
    assert level2[0] is not None and level2[0] != level2[1]  # g1 / norm against a sum
    level0 = [calls[f"pre.L0.mesh{q}"].structure for q in (1, 2)]
    assert level0[0] is not None and level0[0] == level0[1]  # sum(g * g)
    assert calls["pre.L1.mesh0"].structure not in level0
