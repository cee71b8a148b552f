"""`nnx.cached_partial` around an `mp.jit` step: equal results, no graph walk per call."""

from __future__ import annotations

import gc
import weakref

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from pipeline_models import build, make_batch, make_mesh, params_of, train_step_fn

import nnx_mpmd as mp
from nnx_mpmd.compiler.trace import trace_step
from nnx_mpmd.jit import arguments as api

STEPS = 3


def _cached(step, *nodes):
    return nnx.cached_partial(step, *nodes)  # flax's default graph mode and updates


def _reference(model_name: str, opt_name: str):
    """Losses and parameters of STEPS steps under `nnx.jit` on one device."""
    model, optimizer, loss_fn, kind = build(model_name, opt_name, 2)
    step = nnx.jit(train_step_fn(loss_fn, num_microbatches=4))
    losses = [float(step(model, optimizer, make_batch(kind, 8, seed=i))) for i in range(STEPS)]
    return losses, params_of(model)


@pytest.mark.parametrize("schedule", [mp.GPipe(), mp.OneFOneB()], ids=["gpipe", "1f1b"])
@pytest.mark.parametrize(
    "model_name, opt_name", [("mlp", "adamw"), ("lm_tied", "clip_adamw_cosine")]
)
def test_cached_partial_step_equals_nnx_jit(model_name, opt_name, schedule):
    model, optimizer, loss_fn, kind = build(model_name, opt_name, 2)
    data = 2 if model_name == "mlp" else 1  # an embedding lookup: batch replicated on 2
    step = mp.jit(
        train_step_fn(loss_fn), mesh=make_mesh(2, data), schedule=schedule, num_microbatches=4
    )
    cached = _cached(step, model, optimizer)
    losses = [float(cached(make_batch(kind, 8, seed=i))) for i in range(STEPS)]
    ref_losses, ref_params = _reference(model_name, opt_name)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for path, value in params_of(model).items():  # the user's own model was updated
        np.testing.assert_allclose(value, ref_params[path], rtol=2e-5, atol=2e-6, err_msg=path)
    assert step.num_compiled_steps == 1


def test_only_the_first_call_walks_the_graph(monkeypatch):
    model, optimizer, loss_fn, kind = build("mlp", "adamw", 2)
    step = mp.jit(train_step_fn(loss_fn), mesh=make_mesh(2, 1), schedule=mp.GPipe(),
                  num_microbatches=2)  # fmt: skip
    walks = []
    real = api.flatten_step_args
    monkeypatch.setattr(api, "flatten_step_args", lambda *a: walks.append(1) or real(*a))
    cached = _cached(step, model, optimizer)
    for i in range(STEPS):
        cached(make_batch(kind, 4, seed=i))
    assert len(walks) == 1
    step(model, optimizer, make_batch(kind, 4))  # called directly: walks, same program
    assert len(walks) == 2 and step.num_compiled_steps == 1


def test_values_the_user_sets_between_calls_are_used():
    model, optimizer, loss_fn, kind = build("mlp", "sgd", 2)
    twin, twin_opt, _, _ = build("mlp", "sgd", 2)
    step = mp.jit(train_step_fn(loss_fn), mesh=make_mesh(2, 1), schedule=mp.GPipe(),
                  num_microbatches=2)  # fmt: skip
    cached = _cached(step, model, optimizer)
    batch = make_batch(kind, 4)
    cached(batch)
    step(twin, twin_opt, batch)
    for m in (model, twin):  # the same new value in both, set on the user's own objects
        for _, variable in nnx.to_flat_state(nnx.state(m, nnx.Param)):
            variable.set_value(jnp.full(variable.get_value().shape, 0.01, jnp.float32))
    assert float(cached(batch)) == float(step(twin, twin_opt, batch))


def test_refresh_refuses_other_nodes_and_non_array_values():
    model, optimizer, loss_fn, _ = build("mlp", "sgd", 2)
    flat = trace_step.flatten_step_args(loss_fn, (model, optimizer, 1.0))
    assert trace_step.reusable_flat_args(flat, {model: 0, optimizer: 0}.keys())
    assert not trace_step.reusable_flat_args(flat, {model: 0}.keys())  # an uncached node
    fresh = trace_step.refreshed_flat_args(flat, loss_fn, (model, optimizer, 2.0))
    assert fresh is not None and fresh.other_leaves == [2.0]
    assert fresh.state_leaves == flat.state_leaves
    other, _, _, _ = build("mlp", "sgd", 2)
    assert trace_step.refreshed_flat_args(flat, loss_fn, (other, optimizer, 2.0)) is None
    assert trace_step.refreshed_flat_args(flat, loss_fn, (model, optimizer)) is None
    flat.variables[0].set_raw_value(np.zeros(3))  # no longer a jax.Array
    assert trace_step.refreshed_flat_args(flat, loss_fn, (model, optimizer, 2.0)) is None


def test_a_dropped_partial_releases_its_model_and_keeps_no_arrays():
    step = mp.jit(train_step_fn(build("mlp", "sgd", 2)[2]), mesh=make_mesh(2, 1),
                  schedule=mp.GPipe(), num_microbatches=2)  # fmt: skip
    model, optimizer, _, kind = build("mlp", "sgd", 2)
    cached = _cached(step, model, optimizer)
    cached(make_batch(kind, 4))
    cached(make_batch(kind, 4))
    [(_, structure)] = step._context.arguments._cached_partial_args.values()
    assert structure.state_leaves == [] and structure.args_leaves == []
    released = weakref.ref(model)
    del model, optimizer, cached
    gc.collect()
    assert released() is None and not step._context.arguments._cached_partial_args


def test_an_error_in_a_cached_call_is_ours_not_flax_s():
    model, optimizer, loss_fn, kind = build("mlp", "sgd", 2)
    step = mp.jit(train_step_fn(loss_fn), mesh=make_mesh(2, 1), schedule=mp.GPipe(),
                  num_microbatches=2)  # fmt: skip
    cached = _cached(step, model, optimizer)
    with pytest.raises(mp.CompileError, match="is not a profiling mode"):
        cached(make_batch(kind, 4), profile="sometimes")
    with pytest.raises(mp.CompileError, match="cannot call"):
        cached(make_batch(kind, 4), unknown=1)
    assert float(cached(make_batch(kind, 4))) > 0  # the partial still works
