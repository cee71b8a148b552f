"""``mp.jit(..., donate_argnums / donate_argnames)``: the update reuses the old state's buffers.

Every case compares with the same step under ``nnx.jit`` on one device (without
donation: donation must not change a number), checks that the old arrays are
gone after the step, that nothing recompiles, and that a mesh's update no
longer holds the old and the new state at once.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from pipeline_models import (
    WIDTH,
    build,
    make_batch,
    make_mesh,
    params_of,
    reference_run,
    train_step_fn,
)

import nnx_mpmd as mp
from nnx_mpmd.aot.stats import count_compilations
from nnx_mpmd.compiler.final.donate_inputs import donate_step_inputs, transfer_sources
from nnx_mpmd.compiler.ir import Call, Free, ProgramKey, Transfer, slots_in
from nnx_mpmd.errors import CompileError

CASES = [
    ("lm", mp.OneFOneB(), 4, 4, jax.sharding.AxisType.Auto),
    ("lm_tied", mp.ZeroBubbleH1(), 4, 4, jax.sharding.AxisType.Auto),
    ("mlp", mp.Interleaved1F1B(), 2, 4, None),
    ("mlp", mp.DualPipeV(), 2, 4, None),
]


def _id(case):
    model, schedule, meshes, stages, types = case
    return (
        f"{model}-{type(schedule).__name__}-M{meshes}-S{stages}-{'auto' if types else 'explicit'}"
    )


def _old_arrays(model, optimizer):
    """Every array of the model's parameters and the optimizer's state (copies per mesh)."""
    arrays = []
    for leaf in jax.tree.leaves(nnx.state((model, optimizer))):
        arrays += list(leaf.arrays.values()) if isinstance(leaf, mp.MpmdArray) else [leaf]
    return [a for a in arrays if isinstance(a, jax.Array)]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_donated_steps_equal_nnx_jit_and_consume_the_old_state(case):
    model_name, schedule, meshes, stages, axis_types = case
    ref_losses, expected = reference_run(model_name, "adamw", stages, 4, 16, 3)
    model, opt, loss_fn, kind = build(model_name, "adamw", stages)
    step = mp.jit(
        train_step_fn(loss_fn),
        mesh=make_mesh(meshes, 2, axis_types),
        schedule=schedule,
        num_microbatches=4,
        donate_argnums=(0, 1),
    )
    for i in range(3):
        batch = make_batch(kind, 16, seed=i)
        before = _old_arrays(model, opt) if i > 0 else []  # step 0 places the state first
        with count_compilations() as counter, warnings.catch_warnings():
            # JAX's "Some donated buffers were not usable" would mean a wasted donation.
            warnings.filterwarnings("error", message=".*donated buffers")
            loss = step(model, opt, batch)
        assert i == 0 or counter.count == 0, f"step {i} recompiled {counter.names}"
        np.testing.assert_allclose(float(loss), ref_losses[i], rtol=1e-5)
        kept = [a for a in before if not a.is_deleted()]
        assert not kept, f"{len(kept)} of {len(before)} old arrays not donated"
    got = params_of(model)
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-4, err_msg=path)
    text = step.lower(model, opt, make_batch(kind, 16)).pass_text("donate_step_inputs")
    donating = {
        line.split()[1] for line in text.splitlines() if "post" in line and "donate=" in line
    }
    assert donating == {str(q) for q in range(meshes)}, "every mesh's update donates"


def test_argnames_donate_like_argnums():
    def lowered(**donate):
        model, opt, loss_fn, kind = build("mlp", "sgd", 2)
        step = mp.jit(
            train_step_fn(loss_fn), mesh=make_mesh(2, 2), schedule=mp.OneFOneB(),
            num_microbatches=4, **donate,
        )  # fmt: skip
        return step.lower(model, opt, make_batch(kind, 16)).pass_text("donate_step_inputs")

    by_name = lowered(donate_argnames=("model", "optimizer"))
    assert by_name == lowered(donate_argnums=(0, 1))
    assert "donate=" in by_name

    def donated(text):
        return sum(
            len(line.split("donate=")[1].split(","))
            for line in text.splitlines()
            if "donate=" in line
        )

    assert 0 < donated(lowered(donate_argnames="model")) < donated(by_name)


def test_without_donation_the_old_arrays_stay_and_no_pass_runs():
    model, opt, loss_fn, kind = build("mlp", "adamw", 2)
    step = mp.jit(
        train_step_fn(loss_fn), mesh=make_mesh(2, 2), schedule=mp.OneFOneB(), num_microbatches=4
    )
    step(model, opt, make_batch(kind, 16))
    before = _old_arrays(model, opt)
    step(model, opt, make_batch(kind, 16, seed=1))
    assert not any(a.is_deleted() for a in before)
    passes = [p.name for p in step.lower(model, opt, make_batch(kind, 16)).passes]
    assert "donate_step_inputs" not in passes and "donate_dead_arguments" in passes


def test_frozen_parameters_are_not_donated():
    """A parameter the step does not update is returned as it came: never donated."""
    model, _, loss_fn, kind = build("mlp", "adamw", 2)
    ref_model, _, _, _ = build("mlp", "adamw", 2)
    only_kernels = nnx.All(nnx.Param, nnx.PathContains("kernel"))
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=only_kernels)
    ref_opt = nnx.Optimizer(ref_model, optax.adamw(1e-2), wrt=only_kernels)

    def step_fn(num_microbatches=None):
        def step(model, optimizer, batch):
            grad_fn = mp.value_and_grad(
                loss_fn, wrt=only_kernels, num_microbatches=num_microbatches
            )
            loss, grads = grad_fn(model, batch)
            optimizer.update(model, grads)
            return loss

        return step

    step = mp.jit(
        step_fn(), mesh=make_mesh(2, 2), schedule=mp.OneFOneB(), num_microbatches=4,
        donate_argnums=(0, 1),
    )  # fmt: skip
    reference = nnx.jit(step_fn(4))
    for i in range(2):
        batch = make_batch(kind, 16, seed=i)
        reference(ref_model, ref_opt, batch)
        biases = [layer.module.bias.get_value() for layer in model.layers] if i else []
        step(model, opt, batch)
        assert not any(b.is_deleted() for b in biases)
    expected, got = params_of(ref_model), params_of(model)
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-5, err_msg=path)


class Wide(mp.PipelinedModel):
    """Two wide layers and a small batch: the update, not the activations, is the peak."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.first = mp.Stage(nnx.Linear(WIDTH, 512, rngs=rngs), stage=0)
        self.second = mp.Stage(nnx.Linear(512, WIDTH, rngs=rngs), stage=1)

    def __call__(self, x):
        return self.second(jnp.tanh(self.first(x)))


def test_donation_lowers_each_meshs_peak_when_the_update_is_the_peak():
    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    peaks = {}
    for donate in ((), (0, 1)):
        model = Wide(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        step = mp.jit(
            train_step_fn(loss_fn), mesh=make_mesh(2, 1), schedule=mp.OneFOneB(),
            num_microbatches=2, donate_argnums=donate,
        )  # fmt: skip
        batch = make_batch("regression", 4)
        step(model, opt, batch)
        step(model, opt, batch, memory=True)
        peaks[donate] = step.last_memory["peak_bytes"]
    # Adam: parameters and two moments (3P) plus the gradient (P); without donation
    # the new 3P are written beside the old, with it into them.
    for q, (kept, donated) in enumerate(zip(peaks[()], peaks[(0, 1)], strict=True)):
        assert donated < 0.8 * kept, (
            f"mesh {q}: {donated} bytes at peak with donation, {kept} without"
        )


def test_cached_partial_with_donation_equals_nnx_jit():
    model, opt, loss_fn, kind = build("lm", "adamw", 2)
    ref_model, ref_opt, _, _ = build("lm", "adamw", 2)
    step = mp.jit(
        train_step_fn(loss_fn), mesh=make_mesh(2, 2, jax.sharding.AxisType.Auto),
        schedule=mp.OneFOneB(), num_microbatches=4, donate_argnums=(0, 1),
    )  # fmt: skip
    cached = nnx.cached_partial(step, model, opt)
    reference = nnx.jit(train_step_fn(loss_fn, num_microbatches=4))
    for i in range(3):
        batch = make_batch(kind, 16, seed=i)
        np.testing.assert_allclose(
            float(cached(batch)), float(reference(ref_model, ref_opt, batch)), rtol=1e-5
        )
    expected, got = params_of(ref_model), params_of(model)
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-4, err_msg=path)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"donate_argnums": -1}, r"donate_argnums=.*positions \(ints >= 0\), got -1"),
        ({"donate_argnums": ("model",)}, r"got 'model'; pass e.g. donate_argnums=\(0, 1\)"),
        ({"donate_argnums": True}, r"got True"),
        ({"donate_argnames": "params"}, r"names \['params'\], which step has no positional"),
    ],
)
def test_bad_donation_arguments_raise(kwargs, match):
    with pytest.raises(CompileError, match=match):
        mp.jit(
            train_step_fn(lambda m, b: 0.0), mesh=make_mesh(2, 1), schedule=mp.GPipe(),
            num_microbatches=2, **kwargs,
        )  # fmt: skip


def _update_call(aliases=(0,)):
    update = jax.jit(lambda p, g: (p - g,))
    return Call(
        0, ProgramKey("post", index=0, mesh=0), update, (0, 1), (2,), "post", aliases=aliases
    )


@pytest.mark.parametrize(
    "program,keep,donated,expected",
    [
        ([_update_call(), Free((0, 1))], {2}, {0}, (0,)),
        ([_update_call(), Free((0, 1))], {2}, set(), ()),  # not a donated input
        ([_update_call(), Free((1,))], {0, 2}, {0}, ()),  # the step returns it
        ([_update_call(), Transfer(0, 3, 1, "p"), Free((0, 1, 3))], {2}, {0}, ()),  # read later
        ([_update_call(aliases=()), Free((0, 1))], {2}, {0}, ()),  # no result to write into
    ],
    ids=["donates", "not-donated", "returned", "read-later", "no-alias"],
)
def test_donate_step_inputs_pass(program, keep, donated, expected):
    (call, *_) = donate_step_inputs(program, keep, donated)
    assert call.donated == expected
    p, g = jnp.ones(3), jnp.ones(3)
    np.testing.assert_allclose(call.fn(p, g)[0], np.zeros(3))
    assert p.is_deleted() == bool(expected)


def test_an_async_checkpoint_is_unchanged_by_donating_steps_after_it(tmp_path):
    """Steps that donate the arrays an asynchronous save is writing leave the checkpoint as saved."""
    from nnx_mpmd.checkpoint import CheckpointManager

    model, opt, loss_fn, kind = build("mlp", "adamw", 2)
    step = mp.jit(
        train_step_fn(loss_fn), mesh=make_mesh(2, 2), schedule=mp.OneFOneB(), num_microbatches=4,
        donate_argnums=(0, 1),
    )  # fmt: skip
    step(model, opt, make_batch(kind, 16))
    saved = params_of(model)
    with CheckpointManager(tmp_path, async_save=True) as manager:
        big = jax.random.normal(jax.random.key(1), (24 * 1024 * 1024,))  # keeps the save busy
        manager.save(1, {"model": model, "optimizer": opt, "big": big})
        # On CPU Orbax's host copy can be a view of the device buffer, and XLA then
        # copies instead of donating; either way the checkpoint must not change.
        for i in range(3):
            step(model, opt, make_batch(kind, 16, seed=i + 1))
        in_flight_after_steps = manager.is_saving_in_progress()
        manager.wait_until_finished()
        assert in_flight_after_steps, "the save finished before the steps ran"
        restored, restored_opt, _, _ = build("mlp", "adamw", 2, seed=5)
        manager.restore({"model": restored, "optimizer": restored_opt, "big": big})
    got = params_of(restored)
    for path, value in saved.items():
        np.testing.assert_array_equal(got[path], value, err_msg=path)


def test_each_donation_pass_shows_its_own_result():
    model, opt, loss_fn, kind = build("mlp", "adamw", 2)
    step = mp.jit(
        train_step_fn(loss_fn), mesh=make_mesh(2, 2), schedule=mp.OneFOneB(), num_microbatches=4,
        donate_argnums=(0, 1),
    )  # fmt: skip
    lowered = step.lower(model, opt, make_batch(kind, 16))
    before, after = (lowered.pass_text(n) for n in ("donate_dead_arguments", "donate_step_inputs"))
    posts = [[line for line in text.splitlines() if " post" in line] for text in (before, after)]
    assert not any("donate=" in line for line in posts[0])
    assert all("donate=" in line for line in posts[1])


@pytest.mark.parametrize("processes", [1, 2])
def test_a_multi_process_step_donates_nothing_a_transfer_reads(monkeypatch, processes):
    """Tied weights: mesh 0's embedding is sent to mesh 3, then updated on mesh 0.

    One process orders the update's donation after the copy; across processes the
    receiver reads the sender's buffer when it asks, possibly after the update ran
    (tests/integration/test_multiprocess.py failed so with "called on deleted or donated
    buffer"), so a multi-process step keeps every buffer a transfer reads.
    """
    model, opt, loss_fn, kind = build("lm_tied", "adamw", 4)
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    step = mp.jit(
        train_step_fn(loss_fn), mesh=make_mesh(4, 2), schedule=mp.OneFOneB(),
        num_microbatches=4, donate_argnums=(0, 1),
    )  # fmt: skip
    program = step.lower(model, opt, make_batch(kind, 16)).compiled.instructions
    donated = {
        slot
        for ins in program
        if isinstance(ins, Call) and ins.label.startswith("post")
        for n in ins.donated
        for slot in slots_in(ins.args[n])
    }
    sent = transfer_sources(program)
    assert len(donated) > 20  # the parameters and Adam moments of every mesh
    assert bool(donated & sent) is (processes == 1), sorted(donated & sent)


@pytest.mark.parametrize("own_buffers", [False, True])
def test_a_clone_shares_the_donated_arrays_unless_given_its_own(own_buffers):
    # docs/guides/remat-memory.md: a clone of a donated model loses the arrays the
    # step consumed; `jax.tree.map(jnp.copy, ...)` gives it buffers of its own.
    model, opt, loss_fn, kind = build("mlp", "adamw", 2)
    reference = nnx.clone(model)
    if own_buffers:
        nnx.update(reference, jax.tree.map(jnp.copy, nnx.state(reference)))
    step = mp.jit(
        train_step_fn(loss_fn), mesh=make_mesh(2, 2), schedule=mp.OneFOneB(),
        num_microbatches=2, donate_argnums=(0, 1),
    )  # fmt: skip
    step(model, opt, make_batch(kind, 8))
    step(model, opt, make_batch(kind, 8, seed=1))
    deleted = [a.is_deleted() for a in jax.tree.leaves(nnx.state(reference, nnx.Param))]
    assert any(deleted) != own_buffers, f"{sum(deleted)} of {len(deleted)} deleted"
