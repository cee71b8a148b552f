"""One gradient reduction per step on Auto data axes (nnx_mpmd.compiler.trace.grad_reduction_auto).

On a 2-stage x 2-data mesh of Auto axes, a stage accumulates its gradients as
stacked per-device partial sums (``[2, *param.shape]``, sharded over the data
axis) and reduces them once per step. Counted from the compiled HLO of the
programs a step executes (each program's all-reduce bytes times how many
times the instruction list calls it), the bytes all-reduced per step are at
most 1.25x the parameter bytes, where they were m (= 4) times the parameter
bytes before; every configuration equals the one-device ``nnx.jit`` reference.
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
from test_grad_reduction import MICROBATCHES, SCHEDULES, TiedNormModel, _param_bytes

import nnx_mpmd as mp
from nnx_mpmd.compiler.trace.grad_reduction import (
    all_reduce_bytes,
    program_calls,
    step_all_reduce_bytes,
)
from nnx_mpmd.compiler.trace.grad_reduction_auto import StackedReduction, run_stacking, split_dims


def _step(loss_fn, schedule_cls, axis_type=AxisType.Auto):
    return mp.jit(
        train_step_fn(loss_fn),
        mesh=make_mesh(2, 2, axis_type),
        schedule=schedule_cls(),
        num_microbatches=MICROBATCHES,
    )


def _check_equal(models, opts, loss_fn, schedule_cls, batches, axis_type=AxisType.Auto):
    """Trains models[1] pipelined and models[0] with nnx.jit; asserts equal losses and params."""
    reference = nnx.jit(train_step_fn(loss_fn, MICROBATCHES))
    pipelined = _step(loss_fn, schedule_cls, axis_type)
    for batch in batches:
        ref = float(reference(models[0], opts[0], batch))
        np.testing.assert_allclose(float(pipelined(models[1], opts[1], batch)), ref, rtol=1e-5)
    expected, got = params_of(models[0]), params_of(models[1])
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-5, err_msg=path)


def _step_ratio(model, opt, loss_fn, schedule_cls, batch, axis_type=AxisType.Auto):
    """(step all-reduce bytes / parameter bytes, calls per program, executables)."""
    lowered = _step(loss_fn, schedule_cls, axis_type).lower(model, opt, batch)
    executables = lowered.compile().executables()
    instructions = lowered.compiled.instructions
    total = step_all_reduce_bytes(instructions, executables)
    return total / _param_bytes(model), program_calls(instructions), executables


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_one_reduction_per_step_and_equal_to_reference(schedule):
    schedule_cls, stages = SCHEDULES[schedule]
    model, opt, loss_fn, kind = build("mlp", "sgd", stages)
    ratio, calls, executables = _step_ratio(
        model, opt, loss_fn, schedule_cls, make_batch(kind, MICROBATCHES * 4)
    )
    assert ratio <= 1.25, ratio
    assert sorted(n for n in calls if n.startswith("reduce")) == [
        f"reduce{k}" for k in range(stages)
    ]
    assert all(calls[f"reduce{k}"] == 1 for k in range(stages))
    for name in calls:
        if name.startswith(("B", "FB")):  # B, BI, BW, FB: no gradient all-reduce
            assert all_reduce_bytes(executables[name][0].as_text()) <= 8, name
    built = [build("mlp", "adamw", stages) for _ in range(2)]
    batches = [make_batch(kind, MICROBATCHES * 4, seed=s) for s in range(2)]
    _check_equal([b[0] for b in built], [b[1] for b in built], loss_fn, schedule_cls, batches)


@pytest.mark.parametrize("model_name", ["lm", "lm_tied"])
def test_embedding_and_tied_weights(model_name):
    """Embedding lookups (a scatter-add of the batch's rows, split per device) and a
    table tied across meshes (reduced on each mesh, summed once): still equal."""
    model, opt, loss_fn, kind = build(model_name, "sgd", 2)
    ratio, _, executables = _step_ratio(
        model, opt, loss_fn, mp.OneFOneB, make_batch(kind, MICROBATCHES * 4)
    )
    assert ratio <= 1.25, ratio
    assert all_reduce_bytes(executables["B0"][0].as_text()) == 0
    built = [build(model_name, "adamw", 2) for _ in range(2)]
    batches = [make_batch(kind, MICROBATCHES * 4, seed=s) for s in range(2)]
    _check_equal([b[0] for b in built], [b[1] for b in built], loss_fn, mp.OneFOneB, batches)


def _loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


@pytest.mark.parametrize(
    ("schedule", "remat", "axis_type"),
    [
        ("1f1b", False, AxisType.Auto),
        ("zb-h1", False, AxisType.Auto),
        ("1f1b", True, AxisType.Auto),
        ("1f1b", True, AxisType.Explicit),  # a remat stage's backward is inlined there too
    ],
)
def test_batch_coupled_and_tied_parameters_stay_exact(schedule, remat, axis_type):
    schedule_cls, _ = SCHEDULES[schedule]
    models = [TiedNormModel(rngs=nnx.Rngs(0), remat=remat) for _ in range(2)]
    opts = [nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param) for m in models]
    batches = [make_batch("regression", MICROBATCHES * 4, seed=s) for s in range(2)]
    _, calls, executables = _step_ratio(
        models[1], opts[1], _loss, schedule_cls, batches[0], axis_type
    )
    assert calls["reduce0"] == calls["reduce1"] == 1
    # Per microbatch only BatchNorm's batch statistics (mean and variance, recomputed
    # by a remat backward) are all-reduced, not the 16x16 kernel's gradient.
    limit = 2 * WIDTH * 4 * (2 if remat else 1)
    for name in calls:
        if name.startswith(("F", "B")):
            assert all_reduce_bytes(executables[name][0].as_text()) <= limit, name
    _check_equal(models, opts, _loss, schedule_cls, batches, axis_type)
    np.testing.assert_allclose(
        np.asarray(models[1].first.module.norm.mean[...]),
        np.asarray(models[0].first.module.norm.mean[...]),
        atol=1e-5,
    )


def _two_devices():
    return jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])


def _batch_coupled_loss(p, x):
    h = x @ p[0] + p[1]
    return jnp.mean(jnp.tanh(h - h.mean(0)) ** 2)


@pytest.mark.parametrize("rows", [8, 3])
def test_run_stacking_gives_partials_that_sum_to_the_gradient(rows):
    """8 rows: the weight gradient's batch sum is split per device (only the batch mean's
    3 floats are all-reduced); 3 rows (not divisible): the gradient lies on device 0."""
    mesh = _two_devices()
    w = jax.device_put(jnp.full((4, 3), 0.5), NamedSharding(mesh, P()))
    b = jax.device_put(jnp.ones((3,)), NamedSharding(mesh, P()))
    x = jnp.arange(rows * 4.0).reshape(rows, 4) / 10
    x = jax.device_put(x, NamedSharding(mesh, P("data" if rows % 2 == 0 else None)))
    red = StackedReduction("data", 2)

    @jax.jit
    def stacked(p, x):
        _, vjp = jax.vjp(_batch_coupled_loss, p, x)
        return run_stacking(vjp, jnp.ones(()), reduction=red, stacked=[0, 1])

    (gw, gb), gx = stacked((w, b), x)
    assert gw.shape == (2, 4, 3) and gb.shape == (2, 3)
    assert gw.sharding.spec[0] == "data"
    ref = jax.jit(jax.grad(_batch_coupled_loss, argnums=(0, 1)))((w, b), x)
    np.testing.assert_allclose(red.reduce(gw), ref[0][0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(red.reduce(gb), ref[0][1], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(gx, ref[1], rtol=1e-5, atol=1e-7)
    if rows == 8:
        text = stacked.lower((w, b), x).compile().as_text()
        assert all_reduce_bytes(text) <= 3 * 4 * 2, all_reduce_bytes(text)
        assert float(jnp.abs(gw[1]).max()) > 0  # both devices hold a share
    else:
        np.testing.assert_array_equal(gw[1], 0.0)


def test_split_dims_picks_the_first_divisible_summed_dimension():
    def eqn(fn, *args):
        return jax.make_jaxpr(fn)(*args).jaxpr.eqns[-1]

    x, y = jnp.ones((8, 3)), jnp.ones((8, 5))
    dot = eqn(lambda x, y: jnp.einsum("bi,bo->io", x, y), x, y)
    assert split_dims(dot, [x, y], 2) == (0, 0)
    assert split_dims(dot, [x, y], 3) is None  # 8 rows do not split over 3 devices
    total = eqn(lambda x: jnp.sum(x, axis=(0, 1)), x)
    assert split_dims(total, [x], 2) == (0,)
    outer = eqn(lambda x, y: jnp.einsum("i,o->io", x, y), x[0], y[0])
    assert split_dims(outer, [x[0], y[0]], 2) is None  # nothing is summed
    assert split_dims(eqn(jnp.tanh, x), [x], 2) is None


def test_which_parameters_accumulate_stacked():
    mesh = _two_devices()
    red = StackedReduction("data", 2)
    replicated = jax.device_put(jnp.ones((4, 2)), NamedSharding(mesh, P()))
    sharded = jax.device_put(jnp.ones((4, 2)), NamedSharding(mesh, P("data")))
    counter = jax.device_put(jnp.ones((4,), jnp.int32), NamedSharding(mesh, P()))
    assert red.defers(replicated)
    assert not red.defers(sharded)  # FSDP over the data axis: reduce-scattered as before
    assert not red.defers(counter)
    assert red.accumulator_sharding(replicated).spec == P("data", None, None)
    assert red.zeros(replicated).shape == (2, 4, 2)


def test_stacking_outside_any_mesh_raises():
    red = StackedReduction("data", 2)
    with pytest.raises(mp.MeshError, match=r"no mesh with the axis 'data'.*use_abstract_mesh"):
        red.stack(np.ones(3, np.float32))
