"""The one interpreter of the instruction list, over hand-written lists.

Two submeshes of two devices each, trivial jitted programs: the loop runs calls,
transfers (microbatch reshape, explicit and kept PartitionSpecs) and frees;
observers see every step; a multi-process run's ``put`` hook moves every
transfer; precompile compiles exactly the programs the run then uses.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_mpmd as mp
from nnx_mpmd.aot.precompile import precompile
from nnx_mpmd.aot.stats import count_compilations
from nnx_mpmd.compiler.ir import (
    Call,
    ProgramKey,
    Transfer,
    format_instructions,
    parse_instructions,
)
from nnx_mpmd.runtime import interpreter
from nnx_mpmd.runtime.executor import DeviceOperations, Shardings, execute
from nnx_mpmd.runtime.observers import MemoryRecorder, Profiler


@pytest.fixture(scope="module")
def meshes():
    devices = jax.devices()
    return [jax.make_mesh((2,), ("data",), devices=devices[2 * q : 2 * q + 2]) for q in range(2)]


def _programs():
    """Fresh jitted programs (nothing compiled yet), by name."""
    return {
        "F0": jax.jit(lambda x: 2.0 * x),
        "F1": jax.jit(lambda x: (x + 1.0, jnp.sum(x))),
        "B0": jax.jit(lambda x, y: x * y),
    }


# Host batch (slot 0) -> mesh 0 as 2 microbatches sharded over data; F0 on mesh 0;
# its result goes to mesh 1 keeping its spec; F1 on mesh 1 returns two values; the
# sum comes back to mesh 0, where B0 multiplies. Frees after every last use.
PROGRAM = """
transfer 0@-1 -> 1@0 label=batch reshape=2 spec=[None,data]
free 0
call 0 F0 args=(1,) outs=2 label=F0.0 task=F0.0
free 1
transfer 2@0 -> 3@1 label=act
call 1 F1 args=(3,) outs=(4,5) label=F1.0 task=F1.0
free 3
transfer 5@1 -> 6@0 label=total
free 5
call 0 B0 args=(2,6) outs=7 label=B0.0 task=B0.0
free 2 6
"""
NUM_SLOTS = 8
BATCH = np.arange(24, dtype=np.float32).reshape(4, 6)


def _step(programs):
    """A compiled step as far as the runtime reads it: slots, inputs, outputs."""
    return SimpleNamespace(
        instructions=parse_instructions(PROGRAM, programs),
        num_slots=NUM_SLOTS,
        constants={},
        input_slots=[{-1: 0}],
        output_slots=[[(1, 4)], [(0, 7)]],
        batch_axis="data",
    )


def _on(x, mesh, spec):
    """Whether array ``x`` lies on ``mesh`` as ``spec`` says."""
    return x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)


def _expected():
    mb = BATCH.reshape(2, 2, 6)
    doubled = 2.0 * mb
    return doubled + 1.0, doubled * np.sum(doubled)


def test_the_loop_runs_calls_transfers_and_frees(meshes):
    step = _step(_programs())
    prepared = interpreter.prepare(step.instructions, DeviceOperations(Shardings(meshes)))
    store = interpreter.load_store(step, [BATCH])
    interpreter.run(prepared, store)
    plus_one, product = _expected()
    np.testing.assert_allclose(store[4], plus_one)
    np.testing.assert_allclose(store[7], product)
    assert [i for i, v in enumerate(store) if v is not None] == [4, 7]  # the rest was freed
    assert _on(store[4], meshes[1], P(None, "data"))  # the kept spec
    assert store[7].sharding.mesh == meshes[0]


def test_a_transfer_reshapes_microbatches_and_applies_its_spec(meshes):
    ins = Transfer(0, 1, 1, "batch", reshape_microbatches=2, spec=P(None, "data"))
    prepared = interpreter.prepare([ins], DeviceOperations(Shardings(meshes)))
    store = [BATCH, None]
    interpreter.run(prepared, store)
    assert store[1].shape == (2, 2, 6)
    assert _on(store[1], meshes[1], P(None, "data"))
    np.testing.assert_array_equal(store[1], BATCH.reshape(2, 2, 6))


@pytest.mark.parametrize("spec", [P("data"), P()], ids=["sharded", "replicated"])
def test_a_transfer_without_spec_keeps_the_source_spec(meshes, spec):
    source = jax.device_put(BATCH, NamedSharding(meshes[0], spec))
    moves = [Transfer(0, 1, 1, "x", src_mesh=0), Transfer(1, 2, 0, "back", src_mesh=1)]
    store = [source, None, None]
    interpreter.run(interpreter.prepare(moves, DeviceOperations(Shardings(meshes))), store)
    assert store[1].sharding == NamedSharding(meshes[1], spec)
    assert store[2].sharding == NamedSharding(meshes[0], spec)  # the cached target, reused


def test_a_transfer_with_a_known_spec_moves_host_values(meshes):
    ins = Transfer(0, 1, 0, "lr", spec=P())
    store = [0.5, None]
    interpreter.run(interpreter.prepare([ins], DeviceOperations(Shardings(meshes))), store)
    assert _on(store[1], meshes[0], P()) and float(store[1]) == 0.5


def test_the_text_form_of_the_test_program_round_trips():
    programs = _programs()
    instructions = parse_instructions(PROGRAM, programs)
    assert parse_instructions(format_instructions(instructions), programs) == instructions


def test_execute_keeps_the_prepared_steps_in_the_callers_cache_not_on_the_step(meshes):
    step, prepared = _step(_programs()), interpreter.PreparedCache()
    fields = dict(vars(step))
    shardings = Shardings(meshes)
    for _ in range(2):
        _, product = execute(step, [BATCH], meshes, shardings, prepared=prepared)
    np.testing.assert_allclose(product, _expected()[1])
    assert prepared.keys(step) == [("single", shardings)]
    made = prepared.get(step, ("single", shardings), list)
    execute(step, [BATCH], meshes, prepared=prepared)  # no shardings: the cached ones
    assert prepared.keys(step) == [("single", shardings)]
    assert prepared.get(step, ("single", shardings), list) is made  # prepared once
    assert vars(step) == fields  # nothing hung on the step


def test_a_prepared_cache_holds_one_step_and_its_newest_keys():
    first, second = SimpleNamespace(instructions=[]), SimpleNamespace(instructions=[])
    cache = interpreter.PreparedCache(max_entries=2)
    for key in "abc":
        cache.get(first, key, object)
    assert cache.keys(first) == ["b", "c"] and cache.keys(second) == []
    cache.get(second, "a", object)  # another step (a routed copy): starts afresh
    assert cache.keys(second) == ["a"] and cache.keys(first) == []


class _Seen(interpreter.Observer):
    def __init__(self):
        self.events = []

    def start(self, store):
        self.events.append("start")

    def before(self, index, ins, store):
        self.events.append(("before", index))

    def after(self, index, ins, result, store):
        self.events.append(("after", index, type(ins).__name__))


def test_observers_wrap_every_step(meshes):
    step = _step(_programs())
    ops = DeviceOperations(Shardings(meshes))
    prepared = interpreter.prepare(step.instructions, ops)
    seen, records, memory = _Seen(), [], MemoryRecorder(meshes)
    interpreter.run(
        prepared, interpreter.load_store(step, [BATCH]), [seen, Profiler(records), memory]
    )
    n = len(step.instructions)
    assert seen.events[0] == "start" and len(seen.events) == 1 + 2 * n
    assert seen.events[1:3] == [("before", 0), ("after", 0, "Transfer")]
    assert [(r[0], r[1]) for r in records] == [(0, "F0.0"), (1, "F1.0"), (0, "B0.0")]
    assert all(0 <= r[3] <= r[4] for r in records)
    assert len(memory.timeline) == n + 1 and memory.timeline[2][1] == "free"
    assert [label for _, label, _, _ in memory.output_bytes] == ["F0.0", "F1.0", "B0.0"]
    assert memory.peak_bytes[0] > 0 and memory.peak_bytes[1] > 0


def test_execute_profiles_and_measures_through_observers(meshes):
    step = _step(_programs())
    records, memory = [], MemoryRecorder(meshes)
    _, product = execute(step, [BATCH], meshes, profile=records, memory=memory)
    np.testing.assert_allclose(product, _expected()[1])
    assert [r[1] for r in records] == ["F0.0", "F1.0", "B0.0"]
    assert memory.summary()["timeline"][0][1] == "start"


def test_an_operation_may_skip_an_instruction():
    class CallsOnly:
        def call(self, index, ins):
            return interpreter.call_step(ins)

        def transfer(self, index, ins):
            return None

        def free(self, index, ins):
            return None

    prepared = interpreter.prepare(_step(_programs()).instructions, CallsOnly())
    assert [entry.index for entry in prepared.entries] == [2, 5, 9]


def test_an_unknown_instruction_is_refused():
    with pytest.raises(mp.CompileError, match=r"instruction 0 .* is a str, which the runtime"):
        interpreter.prepare(["jump"], DeviceOperations(Shardings([])))


def test_a_program_returning_too_few_values_is_a_compiler_bug():
    call = Call(0, ProgramKey("F", stage=1), lambda x: (x,), (0,), (1, 2), "F1.0")
    with pytest.raises(mp.CompileError, match=r"program F1 \(F1.0, mesh 0\) returned 1 values"):
        interpreter.call_step(call)([1, None, None])


# ------------------------------------------------------------------ how transfers move


def test_every_transfer_goes_through_the_put_hook_of_a_multi_process_run(meshes):
    """Multi-process runs give ``put`` (cross-process moves); the loop is the same."""
    step = _step(_programs())
    moves = []

    def put(value, sharding, from_host):
        moves.append((from_host, sharding.mesh is meshes[0]))
        return jax.device_put(np.asarray(value) if from_host else value, sharding)

    ops = DeviceOperations(Shardings(meshes), put=put)
    store = interpreter.load_store(step, [BATCH])
    interpreter.run(interpreter.prepare(step.instructions, ops), store)
    transfers = [i for i in step.instructions if isinstance(i, Transfer)]
    assert len(moves) == len(transfers) and moves[0][0]  # the batch comes from the host
    plus_one, product = _expected()
    np.testing.assert_allclose(store[4], plus_one)
    np.testing.assert_allclose(store[7], product)


# ------------------------------------------------------------------ ahead of time


def test_precompile_compiles_exactly_what_the_run_uses(meshes):
    step = _step(_programs())
    shardings = Shardings(meshes)
    with count_compilations() as ahead:
        compiled = precompile(step, [BATCH], meshes, shardings, max_workers=2)
    assert compiled == 3  # F0, F1, B0: one each
    with count_compilations() as running:
        _, product = execute(step, [BATCH], meshes, shardings)
        jax.block_until_ready(product)
    assert running.count == 0, "the run compiled again what precompile compiled"
    assert ahead.count >= compiled
    np.testing.assert_allclose(product, _expected()[1])


def test_precompile_leaves_a_failing_program_to_the_run(meshes):
    programs = _programs()
    programs["F1"] = jax.jit(lambda x: (x @ jnp.ones((3, 3)), jnp.sum(x)))  # wrong shape
    step = _step(programs)
    assert precompile(step, [BATCH], meshes, max_workers=2) == 1  # F0 only; F1, B0 unknown
    with pytest.raises(TypeError, match=r"dot_general requires contracting dimensions"):
        execute(step, [BATCH], meshes)


def _typed_total(step):
    """The step with its "total" transfer typed, as a packed transfer is."""
    typed = [
        dataclasses.replace(ins, spec=P(), value_type=((), "float32", False))
        if isinstance(ins, Transfer) and ins.label == "total"
        else ins
        for ins in step.instructions
    ]
    return SimpleNamespace(**{**vars(step), "instructions": typed})


def test_a_typed_transfer_lets_its_reader_compile_without_waiting_for_the_sender(meshes):
    programs = _programs()
    programs["F1"] = jax.jit(lambda x: (x @ jnp.ones((3, 3)), jnp.sum(x)))  # fails to compile
    # untyped, B0 waits for F1's types and is left to the run; typed, it compiles
    assert precompile(_step(programs), [BATCH], meshes, max_workers=2) == 1
    assert precompile(_typed_total(_step(_programs())), [BATCH], meshes, max_workers=2) == 3
    assert precompile(_typed_total(_step(programs)), [BATCH], meshes, max_workers=2) == 2


def test_a_typed_transfer_types_its_value_as_the_run_moves_it(meshes):
    step = _typed_total(_step(_programs()))
    shardings = Shardings(meshes)
    assert precompile(step, [BATCH], meshes, shardings, max_workers=2) == 3
    with count_compilations() as running:
        _, product = execute(step, [BATCH], meshes, shardings)
        jax.block_until_ready(product)
    assert running.count == 0, "B0 was compiled for another type than the run gave it"
    np.testing.assert_allclose(product, _expected()[1])


def test_precompile_models_host_scalars_as_the_run_puts_them(meshes):
    scale = jax.jit(lambda x, lr: x * lr)
    step = SimpleNamespace(
        instructions=[
            Transfer(0, 2, 0, "x", spec=P("data")),
            Transfer(1, 3, 0, "lr"),
            Call(0, ProgramKey("post", index=0, mesh=0), scale, (2, 3), 4, "post.L0.mesh0"),
        ],
        num_slots=5,
        constants={},
        input_slots=[{-1: 0}, {-1: 1}],
        output_slots=[[(0, 4)]],
        batch_axis="data",
    )
    inputs = [np.ones(4, np.float32), 0.5]  # a Python float: device_put of np.asarray(0.5)
    assert precompile(step, inputs, meshes, max_workers=1) == 1
    with count_compilations() as running:
        (out,) = execute(step, inputs, meshes)
    assert running.count == 0 and out.dtype == np.float32 and not out.weak_type
