"""The compiled-step cache of `mp.jit` is bounded and keeps no dropped model alive."""

from __future__ import annotations

import gc
import weakref

import jax.numpy as jnp
import optax
from flax import nnx
from pipeline_models import MLP, WIDTH, make_mesh, mlp_loss

import nnx_mpmd as mp
from nnx_mpmd.jit import jit as api


def _step(model, opt, batch):
    loss, grads = mp.value_and_grad(mlp_loss)(model, batch)
    opt.update(model, grads)
    return loss


def _batch(rows):
    return {"x": jnp.ones((rows, WIDTH)), "y": jnp.zeros((rows, WIDTH))}


def test_cache_keeps_the_most_recent_signatures_only(monkeypatch):
    monkeypatch.setattr(api, "MAX_COMPILED_STEPS", 2)
    model = MLP(2, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = mp.jit(_step, mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2)
    for rows in (4, 8, 12):
        step(model, opt, _batch(rows))
    assert step.num_compiled_steps == 2
    step(model, opt, _batch(12))  # still cached: no new entry, the oldest is gone
    assert step.num_compiled_steps == 2
    assert [k[-1][0][1] for k in step._cache] == [(8, WIDTH), (12, WIDTH)]


def test_models_trained_by_one_step_function_are_released():
    step = mp.jit(_step, mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2)
    tx = optax.sgd(0.1)  # one transformation: one signature for every model
    refs = []
    for seed in range(30):
        model = MLP(2, rngs=nnx.Rngs(seed))
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
        step(model, opt, _batch(4))
        refs.append(weakref.ref(model))
        del model, opt
    gc.collect()
    assert step.num_compiled_steps == 1
    assert sum(r() is not None for r in refs) == 0
