"""Transfer batching: the tick passes over the IR and the batched move in the runtime.

``schedule_ticks`` reorders the list without changing what any mesh sees (its
calls, arrivals and frees in the same order), ``batch_transfers`` makes each
tick's independent transfers one `TransferBatch`, ``merge_frees`` joins a
tick's frees; the runtime makes a batch with one batched copy (or, with a
multi-process put hook or without a ``transfer_batch`` operation, member by
member) and gets the same arrays as ``jax.device_put``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from pipeline_models import (
    MLP,
    WIDTH,
    build,
    make_batch,
    make_mesh,
    mlp_loss,
    train_step_fn,
)

import nnx_mpmd as mp
from nnx_mpmd.compiler.final.transfer_batching import (
    batch_transfers,
    merge_frees,
    schedule_ticks,
    ticks,
)
from nnx_mpmd.compiler.ir import (
    Call,
    Free,
    ProgramKey,
    Transfer,
    TransferBatch,
    format_instructions,
    parse_instructions,
)
from nnx_mpmd.runtime import interpreter
from nnx_mpmd.runtime.batched_copy import FAST_COPY_AVAILABLE, BatchedCopier
from nnx_mpmd.runtime.executor import DeviceOperations, Shardings

F0, F1 = ProgramKey("F", stage=0), ProgramKey("F", stage=1)


def _fn(x):
    return x


# ------------------------------------------------------------------ the passes


def test_a_tick_s_transfers_from_different_meshes_become_one_batch():
    program = [
        Call(0, F0, _fn, (0,), 1, "F0.0"),
        Call(1, F1, _fn, (2,), 3, "F1.0"),
        Transfer(1, 4, 1, "a", src_mesh=0),
        Call(1, F1, _fn, (6,), 7, "F1.1"),
        Transfer(3, 5, 0, "b", src_mesh=1),
        Free((1,)),
        Free((3,)),
    ]
    out = merge_frees(batch_transfers(schedule_ticks(program)))
    assert out == [
        Call(0, F0, _fn, (0,), 1, "F0.0"),
        Call(1, F1, _fn, (2,), 3, "F1.0"),
        TransferBatch((Transfer(1, 4, 1, "a", src_mesh=0), Transfer(3, 5, 0, "b", src_mesh=1))),
        Free((1,)),
        Call(1, F1, _fn, (6,), 7, "F1.1"),  # after "a": both are mesh 1 events
        Free((3,)),
    ]


def test_chained_and_reshaping_transfers_stay_alone():
    chained = [Transfer(0, 1, 1, "a", src_mesh=0), Transfer(1, 2, 0, "b", src_mesh=1)]
    assert batch_transfers(chained) == chained
    reshaping = [
        Transfer(0, 1, 0, "batch", reshape_microbatches=2, spec=P(None, "data")),
        Transfer(2, 3, 1, "x", src_mesh=0),
    ]
    assert batch_transfers(reshaping) == reshaping


def test_each_mesh_keeps_its_calls_in_order():
    # mesh 0's second call is ready first, but runs after its first.
    program = [
        Call(1, F1, _fn, (0,), 1, "F1.0"),
        Transfer(1, 2, 0, "a", src_mesh=1),
        Call(0, F0, _fn, (2,), 3, "F0.0"),
        Call(0, F0, _fn, (4,), 5, "F0.1"),
    ]
    assert ticks(program) == [0, 1, 2, 3]
    assert schedule_ticks(program) == program


def test_a_reader_of_a_donated_slot_keeps_its_place():
    # Both read slot 0 (the call might donate it): the transfer stays first.
    program = [Transfer(0, 1, 1, "x", src_mesh=0), Call(0, F0, _fn, (0,), 2, "F0.0")]
    assert schedule_ticks(program) == program


def test_an_unknown_instruction_is_refused_by_the_tick_pass():
    with pytest.raises(mp.CompileError, match=r"schedule_ticks orders Call, Transfer"):
        ticks([object()])  # type: ignore[list-item]


def test_batches_round_trip_through_the_text_form():
    batch = TransferBatch(
        (
            Transfer(1, 2, 1, ";", src_mesh=0, nbytes=8, per_microbatch=True),
            Transfer(3, 4, 0, "b ; c", src_mesh=-1, spec=P(None, "data")),
        )
    )
    text = format_instructions([batch, Free((1, 3))])
    assert text.splitlines()[0].startswith("transfers 1@0 -> 2@1 label=';' bytes=8")
    assert parse_instructions(text, {}) == [batch, Free((1, 3))]


def test_a_batch_line_without_a_transfer_is_a_compile_error():
    with pytest.raises(mp.CompileError, match=r"line 1 .*cannot read ';'"):
        parse_instructions("transfers 1@0 -> 2@1 label=a ; nonsense", {})
    with pytest.raises(mp.CompileError, match=r"line 1 .*is not an instruction"):
        parse_instructions("transfers nonsense", {})
    with pytest.raises(mp.CompileError, match=r"line 1 .*a transfer needs label="):
        parse_instructions("transfer 1@0 -> 2@1 bytes=3", {})


def _events(program, mesh):
    """What ``mesh`` sees, in order: calls and frees, arrivals between them as a set."""
    slot_mesh = {}
    for ins in program:
        if isinstance(ins, Call):
            slot_mesh.update(dict.fromkeys(ins.writes(), ins.mesh))
        for t in getattr(ins, "transfers", (ins,)):
            if isinstance(t, Transfer):
                slot_mesh[t.dst] = t.dst_mesh
    events, arrivals = [], set()
    for ins in program:
        for t in getattr(ins, "transfers", (ins,)):
            if isinstance(t, Transfer) and t.dst_mesh == mesh:
                arrivals.add(t.label)
        freed = [s for s in getattr(ins, "slots", ()) if slot_mesh.get(s) == mesh]
        if (isinstance(ins, Call) and ins.mesh == mesh) or freed:
            events += [frozenset(arrivals), ins.label if isinstance(ins, Call) else "free"]
            arrivals = set()
    return [*events, frozenset(arrivals)]


def _freed(program):
    return [s for ins in program if isinstance(ins, Free) for s in ins.slots]


@pytest.mark.parametrize(
    "schedule,stages", [(mp.OneFOneB(), 4), (mp.ZeroBubbleH1(), 4)], ids=["1f1b", "zb-h1"]
)
def test_a_compiled_step_is_batched_and_every_mesh_sees_the_same_order(schedule, stages):
    model = MLP(stages, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def step(model, opt, batch):
        loss, grads = mp.value_and_grad(mlp_loss)(model, batch)
        opt.update(model, grads)
        return loss

    f = mp.jit(step, mesh=make_mesh(4, 1), schedule=schedule, num_microbatches=4)
    lowered = f.lower(model, opt, {"x": jnp.ones((8, WIDTH)), "y": jnp.ones((8, WIDTH))})
    names = [p.name for p in lowered.passes]
    assert names.index("insert_frees") < names.index("schedule_ticks")
    assert names.index("batch_transfers") < names.index("merge_frees")
    before = parse_instructions(lowered.pass_text("insert_frees"), lowered.programs)
    after = lowered.compiled.instructions
    assert any(isinstance(ins, TransferBatch) for ins in after)
    for q in range(4):
        assert _events(after, q) == _events(before, q), q
    assert sorted(_freed(after)) == sorted(_freed(before))
    assert parse_instructions(lowered.ir_text(), lowered.programs) == after


def test_a_global_norm_clip_moves_one_array_per_pair_of_meshes():
    # optax's clip_by_global_norm: every mesh adds up every leaf's partial sum of squares
    model, opt, loss_fn, kind = build("gated", "clip_adamw_cosine", 4)
    ref_model, ref_opt, _, _ = build("gated", "clip_adamw_cosine", 4)
    mesh, schedule = make_mesh(4, 1), mp.OneFOneB()
    step = mp.jit(train_step_fn(loss_fn), mesh=mesh, schedule=schedule, num_microbatches=4)
    batch = make_batch(kind, 16)
    lowered = step.lower(model, opt, batch)
    packs = [t for t in lowered.transfers if t.what.startswith("2 values (")]
    assert sorted((t.src, t.dst) for t in packs) == [
        (a, b) for a in range(4) for b in range(4) if a != b
    ]
    assert not [t for t in lowered.transfers if t.nbytes == 4], "no scalar moves alone"
    text = lowered.ir_text()
    assert text.count("packed values") == 12 and "type=float32[2]" in text
    reference = nnx.jit(train_step_fn(loss_fn, 4))
    for seed in range(2):
        batch = make_batch(kind, 16, seed=seed)
        got, want = float(step(model, opt, batch)), float(reference(ref_model, ref_opt, batch))
        np.testing.assert_allclose(got, want, rtol=1e-6)


# ------------------------------------------------------------------ the runtime


@pytest.fixture(scope="module")
def meshes():
    devices = jax.devices()
    return [jax.make_mesh((2,), ("data",), devices=devices[2 * q : 2 * q + 2]) for q in range(3)]


def _values(meshes):
    return {
        0: jax.device_put(jnp.arange(8.0).reshape(4, 2), NamedSharding(meshes[0], P("data"))),
        1: jax.jit(lambda: jnp.ones((2, 3)), out_shardings=NamedSharding(meshes[1], P()))(),
        2: np.float32(5.0),
        3: jax.device_put(jnp.arange(4.0), NamedSharding(meshes[0], P())),
    }


BATCH = TransferBatch(
    (
        Transfer(0, 10, 1, "kept spec", src_mesh=0),
        Transfer(1, 11, 2, "kept replicated", src_mesh=1),
        Transfer(2, 12, 2, "host", src_mesh=-1, spec=P()),
        Transfer(3, 13, 2, "another spec", src_mesh=0, spec=P("data")),
    )
)


def _expected(meshes, values):
    return {
        10: jax.device_put(values[0], NamedSharding(meshes[1], P("data"))),
        11: jax.device_put(values[1], NamedSharding(meshes[2], P())),
        12: jax.device_put(np.asarray(values[2]), NamedSharding(meshes[2], P())),
        13: jax.device_put(values[3], NamedSharding(meshes[2], P("data"))),
    }


def _check(store, expected):
    for slot, want in expected.items():
        got = store[slot]
        assert got.sharding == want.sharding, slot
        assert jax.typeof(got) == jax.typeof(want), slot
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_batch_moves_like_device_put_in_one_copy(meshes):
    values = _values(meshes)
    ops = DeviceOperations(Shardings(meshes))
    calls = []

    class Counting(BatchedCopier):
        def __call__(self, values, targets):
            calls.append(len(values))
            return super().__call__(values, targets)

    ops.copier = Counting()
    prepared = interpreter.prepare([BATCH], ops)
    for _ in range(2):  # the second run finds its destinations cached
        store = [None] * 14
        for slot, value in values.items():
            store[slot] = value
        interpreter.run(prepared, store)
        _check(store, _expected(meshes, values))
    assert calls == [4, 4]


def test_the_batched_copy_takes_equal_layouts_only(meshes):
    copier = BatchedCopier()
    x = _values(meshes)[0]
    same = NamedSharding(meshes[1], P("data"))
    assert copier.fast_path(x.sharding, same, x.shape) == FAST_COPY_AVAILABLE
    assert not copier.fast_path(x.sharding, NamedSharding(meshes[1], P()), x.shape)
    wider = jax.make_mesh((4,), ("data",), devices=jax.devices()[4:8])
    assert not copier.fast_path(x.sharding, NamedSharding(wider, P("data")), x.shape)


def test_a_single_transfer_takes_the_same_path(meshes):
    values = _values(meshes)
    ops = DeviceOperations(Shardings(meshes))
    store = [None] * 14
    for slot, value in values.items():
        store[slot] = value
    for member in BATCH.transfers:
        ops.transfer(0, member)(store)
    _check(store, _expected(meshes, values))


#: BATCH's members whose sources are jax.Arrays and keep their spec: a batch with a plan.
ARRAY_BATCH = TransferBatch(BATCH.transfers[:2])


def _run_array_batch(prepared, first, second):
    store = [None] * 14
    store[0], store[1] = first, second
    interpreter.run(prepared, store)
    return store


@pytest.mark.skipif(not FAST_COPY_AVAILABLE, reason="no batched copy in this jaxlib")
def test_a_batch_that_runs_again_decides_nothing_per_value(meshes):
    values = _values(meshes)
    decided = []

    class Counting(BatchedCopier):
        def fast_path(self, source, target, shape):
            decided.append(shape)
            return super().fast_path(source, target, shape)

    ops = DeviceOperations(Shardings(meshes))
    ops.copier = Counting()
    prepared = interpreter.prepare([ARRAY_BATCH], ops)
    expected = {k: v for k, v in _expected(meshes, values).items() if k in (10, 11)}
    _check(_run_array_batch(prepared, values[0], values[1]), expected)
    after_first = len(decided)
    for _ in range(2):  # the plan holds: one batched copy, no decision per value
        _check(_run_array_batch(prepared, values[0], values[1]), expected)
    assert after_first > 0 and len(decided) == after_first


def test_a_planned_batch_follows_a_source_that_changed(meshes):
    values = _values(meshes)
    replicated = jax.device_put(values[0], NamedSharding(meshes[0], P()))
    prepared = interpreter.prepare([ARRAY_BATCH], DeviceOperations(Shardings(meshes)))
    # planned, then a source with another spec (kept), then a host value, then planned again
    for first in (values[0], replicated, np.asarray(values[0]), values[0]):
        store = _run_array_batch(prepared, first, values[1])
        spec = first.sharding.spec if isinstance(first, jax.Array) else P()
        want = jax.device_put(first, NamedSharding(meshes[1], spec))
        _check(store, {10: want, 11: jax.device_put(values[1], NamedSharding(meshes[2], P()))})


def test_a_multi_process_put_hook_moves_each_member(meshes):
    values = _values(meshes)
    moves = []

    def put(value, sharding, from_host):
        moves.append(from_host)
        return jax.device_put(np.asarray(value) if from_host else value, sharding)

    store = [None] * 14
    for slot, value in values.items():
        store[slot] = value
    interpreter.run(
        interpreter.prepare([BATCH], DeviceOperations(Shardings(meshes), put=put)), store
    )
    assert moves == [False, False, True, False]
    _check(store, _expected(meshes, values))


def test_operations_without_transfer_batch_run_the_members():
    seen = []

    class MembersOnly:
        def transfer(self, index, ins):
            return lambda store: seen.append((index, ins.label))

    steps = interpreter.prepare([BATCH, BATCH], MembersOnly())  # type: ignore[arg-type]
    interpreter.run(steps, [])
    assert seen == [(n, t.label) for n in (0, 1) for t in BATCH.transfers]


def _batched_by_the_rule(program):
    """`batch_transfers` as its docstring states it, one member at a time (the reference)."""
    out, run = [], []
    for ins in [*program, None]:
        joins = isinstance(ins, Transfer) and not ins.reshape_microbatches
        if joins and not any(ins.src == t.dst or ins.dst == t.dst or ins.dst == t.src for t in run):
            run.append(ins)
            continue
        out += [TransferBatch(tuple(run))] if len(run) > 1 else run
        run = [ins] if joins else []
        if ins is not None and not joins:
            out.append(ins)
    return out


@pytest.mark.parametrize(
    "schedule", [mp.GPipe(), mp.OneFOneB(), mp.Interleaved1F1B(), mp.ZeroBubbleH1()]
)
def test_batching_a_lowered_step_follows_the_rule(schedule):
    # A guard for the pass's set-based check: each run splits where the rule says.
    stages = 8 if isinstance(schedule, mp.Interleaved1F1B) else 4
    model = MLP(stages, rngs=nnx.Rngs(0))
    f = mp.jit(_sgd_step, mesh=make_mesh(4, 1), schedule=schedule, num_microbatches=4)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    lowered = f.lower(model, opt, {"x": jnp.ones((8, WIDTH)), "y": jnp.ones((8, WIDTH))})
    ticked = parse_instructions(lowered.pass_text("schedule_ticks"), lowered.programs)
    batched = batch_transfers(ticked)
    assert any(isinstance(ins, TransferBatch) for ins in batched)
    assert batched == _batched_by_the_rule(ticked)
    # A member that overwrites what an earlier one reads starts a new run.
    overwrite = [Transfer(1, 2, 1, "a", src_mesh=0), Transfer(3, 1, 0, "b", src_mesh=1)]
    assert batch_transfers(overwrite) == overwrite == _batched_by_the_rule(overwrite)


def _sgd_step(model, opt, batch):
    loss, grads = mp.value_and_grad(mlp_loss)(model, batch)
    opt.update(model, grads)
    return loss
