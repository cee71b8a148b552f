"""One data-parallel gradient reduction per step (nnx_mpmd.compiler.trace.grad_reduction).

A stage on a submesh with a data axis of 2 accumulates its gradients unreduced
over the microbatches and reduces them once per step. Counted from the
compiled HLO of the programs a step executes (each program's all-reduce bytes
times how many times the instruction list calls it), the bytes all-reduced per
step are at most 1.25x the parameter bytes, where they were about m times the
parameter bytes before (one full-gradient all-reduce in every backward), on
Explicit axes (unreduced values) and on Auto axes (stacked per-device partials,
`grad_reduction_auto`; more in tests/compiler/test_grad_reduction_auto.py). Every
configuration still equals the one-device ``nnx.jit`` reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from pipeline_models import WIDTH, build, make_batch, make_mesh, params_of, train_step_fn

import nnx_mpmd as mp
from nnx_mpmd.compiler.trace.grad_reduction import (
    GradientReduction,
    all_reduce_bytes,
    program_calls,
    run_deferring,
    step_all_reduce_bytes,
)

MICROBATCHES = 4
SCHEDULES = {
    "1f1b": (mp.OneFOneB, 2),
    "gpipe": (mp.GPipe, 2),
    "zb-h1": (mp.ZeroBubbleH1, 2),
    "interleaved": (mp.Interleaved1F1B, 4),
}
AXIS_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


def _param_bytes(model) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _lowered(schedule_cls, stages, axis_type, model_name="mlp"):
    model, opt, loss_fn, kind = build(model_name, "sgd", stages)
    mesh = make_mesh(2, 2, AXIS_TYPES[axis_type])
    f = mp.jit(
        train_step_fn(loss_fn), mesh=mesh, schedule=schedule_cls(), num_microbatches=MICROBATCHES
    )
    return model, f.lower(model, opt, make_batch(kind, MICROBATCHES * 4))


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_all_reduce_bytes_per_step(schedule, axis_type):
    schedule_cls, stages = SCHEDULES[schedule]
    model, lowered = _lowered(schedule_cls, stages, axis_type)
    executables = lowered.compile().executables()
    instructions = lowered.compiled.instructions
    ratio = step_all_reduce_bytes(instructions, executables) / _param_bytes(model)
    calls = program_calls(instructions)
    assert ratio <= 1.25, ratio
    # One reduce per stage and step; the backward programs all-reduce no gradient.
    assert sorted(n for n in calls if n.startswith("reduce")) == [
        f"reduce{k}" for k in range(stages)
    ]
    assert all(calls[f"reduce{k}"] == 1 for k in range(stages))
    for name in calls:
        if name.startswith(("B", "FB")):
            assert all_reduce_bytes(executables[name][0].as_text()) <= 8, name


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_equals_one_device_reference(schedule, axis_type):
    schedule_cls, stages = SCHEDULES[schedule]
    ref_model, ref_opt, loss_fn, kind = build("mlp", "adamw", stages)
    model, opt, _, _ = build("mlp", "adamw", stages)
    mesh = make_mesh(2, 2, AXIS_TYPES[axis_type])
    reference = nnx.jit(train_step_fn(loss_fn, MICROBATCHES))
    pipelined = mp.jit(
        train_step_fn(loss_fn), mesh=mesh, schedule=schedule_cls(), num_microbatches=MICROBATCHES
    )
    for step in range(2):
        batch = make_batch(kind, MICROBATCHES * 4, seed=step)
        np.testing.assert_allclose(
            float(pipelined(model, opt, batch)), float(reference(ref_model, ref_opt, batch)), 1e-5
        )
    expected, got = params_of(ref_model), params_of(model)
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-5, err_msg=path)


class NormStage(nnx.Module):
    """A batch-coupled stage: BatchNorm normalises over the (data-sharded) batch."""

    def __init__(self, *, rngs: nnx.Rngs) -> None:
        # No bias: BatchNorm removes it, so its gradient is zero up to rounding.
        self.linear = nnx.Linear(WIDTH, WIDTH, use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(WIDTH, use_running_average=False, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.norm(self.linear(x)))


class Head(nnx.Module):
    """The last stage, tied to the first stage's kernel (a parameter shared across meshes)."""

    def __init__(self, first: nnx.Linear, *, rngs: nnx.Rngs) -> None:
        self.first = first
        self.scale = nnx.Param(jnp.ones((WIDTH,)))

    def __call__(self, x):
        return (x * self.scale[...]) @ self.first.kernel[...].T


class TiedNormModel(mp.PipelinedModel):
    def __init__(self, *, rngs: nnx.Rngs, remat: bool = False) -> None:
        self.first = mp.Stage(NormStage(rngs=rngs), stage=0, remat=remat)
        self.head = mp.Stage(Head(self.first.module.linear, rngs=rngs), stage=1)

    def __call__(self, x):
        return self.head(self.first(x))


def _loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_batch_coupled_and_tied_parameters_stay_exact(schedule):
    """BatchNorm over the sharded batch and a kernel shared by both meshes (its
    contributions are reduced on each mesh, then summed once) equal the reference."""
    schedule_cls, _ = SCHEDULES[schedule]
    models = [TiedNormModel(rngs=nnx.Rngs(0)) for _ in range(2)]
    opts = [nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param) for m in models]
    reference = nnx.jit(train_step_fn(_loss, MICROBATCHES))
    mesh = make_mesh(2, 2, AxisType.Explicit)
    pipelined = mp.jit(
        train_step_fn(_loss), mesh=mesh, schedule=schedule_cls(), num_microbatches=MICROBATCHES
    )
    for step in range(2):
        batch = make_batch("regression", MICROBATCHES * 4, seed=step)
        ref = float(reference(models[0], opts[0], batch))
        np.testing.assert_allclose(float(pipelined(models[1], opts[1], batch)), ref, rtol=1e-5)
    lowered = pipelined.lower(models[1], opts[1], batch)
    assert "reduce0" in lowered.compiled.programs and "reduce1" in lowered.compiled.programs
    expected, got = params_of(models[0]), params_of(models[1])
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-5, err_msg=path)
    np.testing.assert_allclose(
        np.asarray(models[1].first.module.norm.mean[...]),
        np.asarray(models[0].first.module.norm.mean[...]),
        atol=1e-5,
    )


def test_run_deferring_leaves_a_data_reduction_unreduced():
    mesh = jax.make_mesh(
        (2,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2]
    )
    w = jax.device_put(jnp.full((4, 3), 0.5), NamedSharding(mesh, P()))
    b = jax.device_put(jnp.ones((3,)), NamedSharding(mesh, P()))
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4) / 10, NamedSharding(mesh, P("data")))
    red = GradientReduction("data")

    def loss(p, x):
        h = x @ p[0] + p[1]
        return jnp.mean(jnp.tanh(h - h.mean(0)) ** 2)  # batch-coupled: a mean over the batch

    @jax.jit
    def deferred(p, x):
        _, vjp = jax.vjp(loss, p, x)
        (gw, gb), gx = run_deferring(vjp, jnp.ones(()), reduction=red)
        return (gw, gb), red.reduce(gx)

    (gw, gb), gx = deferred((w, b), x)
    assert red.is_unreduced(gw) and red.is_unreduced(gb)
    text = deferred.lower((w, b), x).compile().as_text()
    ref = jax.jit(jax.grad(loss, argnums=(0, 1)))((w, b), x)
    np.testing.assert_allclose(jax.jit(red.reduce)(gw), ref[0][0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(jax.jit(red.reduce)(gb), ref[0][1], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(gx, ref[1], rtol=1e-5, atol=1e-7)
    # Only the batch mean's own reduction (3 floats) is all-reduced in the backward.
    assert all_reduce_bytes(text) <= 3 * 4 * 2, all_reduce_bytes(text)


class Lookup(nnx.Module):
    """An embedding lookup whose rows come out sharded like the ids (Explicit axes)."""

    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.table = nnx.Param(jax.random.normal(rngs.params(), (32, WIDTH)) * 0.1)

    def __call__(self, ids):
        sharding = jax.typeof(ids).sharding
        out = NamedSharding(sharding.mesh, P(*sharding.spec, None))
        return self.table[...].at[ids].get(out_sharding=out)


class LookupModel(mp.PipelinedModel):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.embed = mp.Stage(Lookup(rngs=rngs), stage=0)
        self.out = mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=1)

    def __call__(self, ids):
        return self.out(jnp.tanh(self.embed(ids)))


def _lookup_loss(model, batch):
    return jnp.mean((model(batch["ids"]).mean(1) - batch["y"]) ** 2)


def test_embedding_lookup_gradient_is_reduced_once():
    """The transpose of a lookup (a scatter-add of the batch's rows) is scattered per
    device and reduced with the other gradients, once per step."""
    models = [LookupModel(rngs=nnx.Rngs(0)) for _ in range(2)]
    opts = [nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param) for m in models]
    rng = np.random.default_rng(0)
    batches = [
        {
            "ids": rng.integers(0, 32, size=(MICROBATCHES * 4, 3)).astype(np.int32),
            "y": rng.normal(size=(MICROBATCHES * 4, WIDTH)).astype(np.float32),
        }
        for _ in range(2)
    ]
    reference = nnx.jit(train_step_fn(_lookup_loss, MICROBATCHES))
    mesh = make_mesh(2, 2, AxisType.Explicit)
    pipelined = mp.jit(
        train_step_fn(_lookup_loss), mesh=mesh, schedule=mp.OneFOneB(), num_microbatches=4
    )
    lowered = pipelined.lower(models[1], opts[1], batches[0])
    executables = lowered.compile().executables()
    total = step_all_reduce_bytes(lowered.compiled.instructions, executables)
    assert total / _param_bytes(models[1]) <= 1.25
    assert all_reduce_bytes(executables["B0"][0].as_text()) == 0
    for batch in batches:
        ref = float(reference(models[0], opts[0], batch))
        np.testing.assert_allclose(float(pipelined(models[1], opts[1], batch)), ref, rtol=1e-5)
    expected, got = params_of(models[0]), params_of(models[1])
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-5, err_msg=path)
