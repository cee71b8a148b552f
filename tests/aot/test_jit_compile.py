"""Compilation behaviour, inspection and profiling of mp.jit steps."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from pipeline_models import build, make_batch, make_mesh, train_step_fn

import nnx_mpmd as mp
from nnx_mpmd.aot import program_sharing
from nnx_mpmd.aot.stats import count_compilations


def _first_step_compilations(num_microbatches: int, schedule) -> int:
    program_sharing.forget_kept()  # the other count's step would lend its executables
    model, opt, loss_fn, kind = build("lm", "adamw", 4)
    step = mp.jit(
        train_step_fn(loss_fn),
        mesh=make_mesh(4, 1),
        schedule=schedule,
        num_microbatches=num_microbatches,
    )
    batch = make_batch(kind, 2 * num_microbatches)
    with count_compilations() as counter:
        step(model, opt, batch)
    with count_compilations() as again:
        step(model, opt, make_batch(kind, 2 * num_microbatches, seed=1))
    assert again.count == 0
    return counter.count


@pytest.mark.parametrize("schedule", [mp.GPipe(), mp.OneFOneB()], ids=["gpipe", "1f1b"])
def test_compilations_do_not_grow_with_microbatches(schedule, compiled_here):
    assert _first_step_compilations(4, schedule) == _first_step_compilations(16, schedule)


def test_one_program_per_stage_and_task_kind(compiled_here):
    model, opt, loss_fn, kind = build("mlp", "sgd", 4)
    step = mp.jit(
        train_step_fn(loss_fn), mesh=make_mesh(4, 1), schedule=mp.OneFOneB(), num_microbatches=8
    )
    lowered = step.lower(model, opt, make_batch(kind, 16))
    labels = [line.split("run ", 1)[1] for line in lowered.instructions() if " run " in line]
    tasks = [label for label in labels if label[0] in "FB" and "." in label]
    # 8 microbatches x 4 stages x (F, B): the last stage's F and B fuse.
    assert sum(label.startswith("FB3.") for label in tasks) == 8
    assert sum(label.startswith("F0.") for label in tasks) == 8
    assert sum(label.startswith("B0.") for label in tasks) == 8
    assert {"F0", "B0", "FB3"} <= set(lowered.programs)
    # The stages' parameters are alike: the last stage's init (which also makes the loss
    # accumulator) is the others' program too (they make an unused loss): compiled once.
    assert {f"init{k}" for k in range(4)} <= set(lowered.programs)
    with count_compilations() as compiled:
        lowered.compile()
    inits = [name for name in compiled.names if name.startswith("jit(init")]
    assert len(inits) == 1, compiled.names


def test_lowered_prints_every_mesh_and_transfers():
    model, opt, loss_fn, kind = build("mlp", "sgd", 2)
    step = mp.jit(
        train_step_fn(loss_fn), mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2
    )
    text = str(step.lower(model, opt, make_batch(kind, 4)))
    assert "== mesh 0 ==" in text and "== mesh 1 ==" in text
    assert "run F0.0" in text and "receive act s0->s1 mb1" in text
    assert step.lower(model, opt, make_batch(kind, 4)).transfers == []  # optimizer stays local


def test_profile_records_each_task_on_its_mesh():
    model, opt, loss_fn, kind = build("mlp", "sgd", 2)
    step = mp.jit(
        train_step_fn(loss_fn), mesh=make_mesh(2, 1), schedule=mp.OneFOneB(), num_microbatches=4
    )
    step(model, opt, make_batch(kind, 8), profile=True)
    records = [r for r in step.last_profile if r[2] is not None]
    assert {(r[0], str(r[2])) for r in records} >= {(0, "F0.0"), (1, "F1.3"), (0, "B0.3")}
    assert all(end >= start for *_, start, end in records)


def test_data_parallel_batch_is_sharded_inside_stages():
    model, opt, loss_fn, kind = build("mlp", "sgd", 2)
    step = mp.jit(
        train_step_fn(loss_fn), mesh=make_mesh(2, 2), schedule=mp.GPipe(), num_microbatches=2
    )
    lowered = step.lower(model, opt, make_batch(kind, 8))
    batch_transfers = [
        ins for ins in lowered.compiled.instructions if getattr(ins, "reshape_microbatches", None)
    ]
    assert batch_transfers and all(
        str(ins.spec) == str(jax_spec("data")) for ins in batch_transfers
    )


def jax_spec(axis):
    from jax.sharding import PartitionSpec as P

    return P(None, axis)


def test_large_transfer_outside_region_is_reported():
    class Two(mp.PipelinedModel):
        def __init__(self, rngs):
            self.a = mp.Stage(nnx.Linear(512, 512, rngs=rngs), stage=0)
            self.b = mp.Stage(nnx.Linear(512, 512, rngs=rngs), stage=1)

        def __call__(self, x):
            return self.b(self.a(x))

    model = Two(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def step(model, opt, batch):
        loss, grads = mp.value_and_grad(lambda m, b: jnp.mean(m(b) ** 2))(model, batch)
        opt.update(model, grads)
        # A metric that mixes both stages' full kernels: crosses meshes every step.
        return loss, jnp.sum(model.a.module.kernel[...] * model.b.module.kernel[...])

    f = mp.jit(
        step,
        mesh=make_mesh(2, 1),
        schedule=mp.GPipe(),
        num_microbatches=2,
        transfer_warning_bytes=1 << 16,
    )
    with pytest.warns(mp.MpmdTransferWarning, match=r"kernel.*MiB.*moves from mesh"):
        lowered = f.lower(model, opt, np.ones((4, 512), np.float32))
    assert any("kernel" in t.what and t.nbytes == 512 * 512 * 4 for t in lowered.transfers)


def _compilations(schedule, data, compile_threads, axis_types=None):
    """(compilations while lowering and compiling, while then running step 1, the loss)."""
    stages = schedule.default_num_stages(4)
    model, opt, loss_fn, kind = build("lm", "adamw", stages)
    step = mp.jit(
        train_step_fn(loss_fn),
        mesh=make_mesh(4, data, axis_types),
        schedule=schedule,
        num_microbatches=8,
        compile_threads=compile_threads,
    )
    batch = make_batch(kind, 16)
    with count_compilations() as lowering:
        lowered = step.lower(model, opt, batch)
        if compile_threads != 1:
            lowered.compile()
    with count_compilations() as running:
        loss = float(step(model, opt, batch))
    return lowering.count, running.count, loss


@pytest.mark.parametrize(
    "schedule, data",
    [(mp.OneFOneB(), 2), (mp.ZeroBubbleH1(), 1), (mp.Interleaved1F1B(), 2), (mp.DualPipeV(), 1)],
    ids=["1f1b-dp2", "zb-h1", "interleaved-dp2", "dualpipev"],
)
def test_concurrent_compilation_compiles_every_program_of_the_first_run_once(schedule, data):
    lowered, ran, loss = _compilations(schedule, data, compile_threads=4)
    assert lowered > 0 and ran == 0  # every program of the run was compiled ahead
    serial_lowered, serial_ran, serial_loss = _compilations(schedule, data, compile_threads=1)
    # and nothing twice: equal programs on equal submeshes even compile once
    # (tests/aot/test_program_sharing.py), where the serial run compiles each
    assert serial_lowered == 0 and 0 < lowered <= serial_ran
    assert loss == serial_loss


def test_a_wrong_sharding_guess_only_costs_compilations(monkeypatch):
    # On Auto axes XLA chooses an activation's sharding when it compiles its
    # producer; its receiver is compiled for a guess meanwhile.
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    from nnx_mpmd.aot import precompile

    auto = AxisType.Auto
    _, _, expected = _compilations(mp.OneFOneB(), 2, compile_threads=1, axis_types=auto)

    guesses = []

    def wrong(self, shape):  # the last dimension sharded: what XLA does not choose here
        guesses.append(shape)
        return P(*[None] * (len(shape) - 1), "data") if shape and shape[-1] % 2 == 0 else P()

    monkeypatch.setattr(precompile._Guess, "spec", wrong)
    lowered, _, loss = _compilations(mp.OneFOneB(), 2, compile_threads=2, axis_types=auto)
    # Receivers compiled for the guess are compiled again for the real sharding at
    # the first call where it differs (how many depends on which producer's
    # compilation finished first); the results are right either way.
    assert guesses and lowered > 0 and loss == expected


def test_explicit_axes_need_no_sharding_guess(monkeypatch):
    # On Explicit axes the traced types are the shardings: receivers are
    # compiled for them, and a guess (here always wrong) is never consulted.
    from jax.sharding import PartitionSpec as P

    from nnx_mpmd.aot import precompile

    monkeypatch.setattr(precompile._Guess, "spec", lambda self, shape: P(*[None] * len(shape)))
    lowered, ran, _ = _compilations(mp.OneFOneB(), 2, compile_threads=2)
    assert lowered > 0 and ran == 0


@pytest.mark.parametrize("bad", [0, -1, 2.0, "4"])
def test_compile_threads_must_be_a_positive_int(bad):
    with pytest.raises(mp.CompileError, match=r"compile_threads must be an int >= 1 or None, got"):
        mp.jit(
            lambda m: m,
            mesh=make_mesh(2, 1),
            schedule=mp.GPipe(),
            num_microbatches=2,
            compile_threads=bad,
        )


def test_a_first_call_runs_its_first_tasks_while_later_programs_compile(monkeypatch, compiled_here):
    from nnx_mpmd.aot import precompile
    from nnx_mpmd.compiler.ir import Call

    events = []
    wait_for, finish = precompile.Precompiling.wait_for, precompile.Precompiling.finish
    monkeypatch.setattr(
        precompile.Precompiling,
        "wait_for",
        lambda self, name: (events.append(name), wait_for(self, name))[1],
    )
    monkeypatch.setattr(
        precompile.Precompiling, "finish", lambda self: (events.append("finish"), finish(self))[1]
    )
    ahead, ran, expected = _compilations(mp.OneFOneB(), 2, compile_threads=4)
    assert ran == 0 and events[0] == "finish"  # lower().compile() waits for every program
    events.clear()
    program_sharing.forget_kept()  # compile as many programs as that step did

    model, opt, loss_fn, kind = build("lm", "adamw", 4)
    step = mp.jit(
        train_step_fn(loss_fn),
        mesh=make_mesh(4, 2),
        schedule=mp.OneFOneB(),
        num_microbatches=8,
        compile_threads=4,
    )
    batch = make_batch(kind, 16)
    with count_compilations() as first:
        loss = float(step(model, opt, batch))
    assert loss == expected
    # Each program's first call waited for its own compilation, then all were awaited;
    # nothing compiled twice (as many compilations as lower().compile() makes).
    assert "F0" in events and events.index("F0") < events.index("finish")
    assert first.count == ahead
    (lowered,) = step._cache.values()
    routed = lowered.compile().bound_programs.step  # the Compiled the call made
    calls = [ins.fn for ins in routed.instructions if isinstance(ins, Call)]
    assert calls and not any(isinstance(fn, precompile.AwaitedProgram) for fn in calls)
    with count_compilations() as second:
        step(model, opt, batch)
    assert second.count == 0


@pytest.fixture
def unfrozen_collector():
    """The test run freezes what collection left (tests/conftest.py), and a step then
    leaves the collector alone; these tests check a step's own freezing, so they start
    unfrozen and freeze again (after a collection, so no garbage is frozen) when done."""
    import gc

    collect, freeze, unfreeze = gc.collect, gc.freeze, gc.unfreeze  # not the counting ones
    unfreeze()
    yield
    collect()
    freeze()


def _counting_freezes(monkeypatch) -> list[str]:
    import gc

    events: list[str] = []
    freeze, unfreeze = gc.freeze, gc.unfreeze
    monkeypatch.setattr(gc, "freeze", lambda: (events.append("freeze"), freeze())[1])
    monkeypatch.setattr(gc, "unfreeze", lambda: (events.append("unfreeze"), unfreeze())[1])
    return events


def test_compiling_calls_leave_older_objects_to_the_collector_only_while_they_compile(
    monkeypatch, unfrozen_collector
):
    import gc

    events = _counting_freezes(monkeypatch)
    model, opt, loss_fn, kind = build("mlp", "sgd", 2)
    step = mp.jit(
        train_step_fn(loss_fn), mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2
    )
    step(model, opt, make_batch(kind, 4))
    assert events == ["freeze", "unfreeze"] and gc.get_freeze_count() == 0
    step(model, opt, make_batch(kind, 4, seed=1))  # no compilation: nothing frozen
    assert events == ["freeze", "unfreeze"]
    compiled = step.lower(model, opt, make_batch(kind, 8)).compile()
    assert events == ["freeze", "unfreeze"] * 3 and gc.get_freeze_count() == 0
    assert compiled is not None


def test_a_failed_compilation_unfreezes_and_a_caller_s_collector_settings_stand(
    monkeypatch, unfrozen_collector
):
    import gc

    events = _counting_freezes(monkeypatch)
    model, opt, loss_fn, kind = build("mlp", "sgd", 2)

    def broken(model, opt, batch):
        loss, _ = mp.value_and_grad(loss_fn)(model, batch)
        return loss + jnp.ones(3) @ jnp.ones(4)  # a shape error while tracing

    step = mp.jit(broken, mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2)
    with pytest.raises(TypeError, match="dot_general requires contracting dimensions"):
        step(model, opt, make_batch(kind, 4))
    assert events == ["freeze", "unfreeze"] and gc.get_freeze_count() == 0

    gc.disable()
    try:
        with pytest.raises(TypeError, match="dot_general"):
            step(model, opt, make_batch(kind, 4))
    finally:
        gc.enable()
    assert events == ["freeze", "unfreeze"] and gc.isenabled()

    gc.freeze()  # the caller's own frozen objects stay frozen
    try:
        events.clear()
        frozen = gc.get_freeze_count()
        with pytest.raises(TypeError, match="dot_general"):
            step(model, opt, make_batch(kind, 4))
        assert events == [] and frozen > 0 and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
