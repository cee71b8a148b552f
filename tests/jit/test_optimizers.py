"""Optimizers beyond AdamW give the reference's step when the update is split over meshes.

The outer passes place each optimizer equation on the meshes that read its
result, pack the per-leaf partial sums of global norms, drop what no mesh reads
and split the update into a part common to several meshes and a rest
(`nnx_mpmd.compiler.outer.outer_parts`). None of that may change what an optimizer
computes: per-leaf trust ratios (LAMB), factored moments (Adafactor), masks
and labels (`multi_transform`, masked weight decay), chained clipping and EMA,
random noise from a key in the optimizer state (`add_noise`), injected
hyperparameters, schedule-free averaging, Muon's orthogonalized matrices, and
`lax.cond` on a global condition (`MultiSteps`, `apply_if_finite`). Each runs
three steps of the 3-stage LM on 3 meshes x 2 data against ``nnx.jit`` and
compares the parameters and every copy of every optimizer-state leaf. (The
middle mesh's update is contained in the others', so for most of these the
update is split into a common part and a rest.)

A global ``lax.cond`` also runs on equal-shaped meshes, where each mesh's copy
of the update reads its own half of equal-shaped arguments: the copies lower to
one module text and must still not share an executable (they once did, and
each mesh took the first mesh's optimizer state).
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from pipeline_models import (
    MLP,
    TinyLM,
    lm_loss,
    make_batch,
    make_mesh,
    mlp_loss,
    params_of,
    train_step_fn,
)

import nnx_mpmd as mp
from nnx_mpmd.aot.stats import count_compilations


def _kernels_only(params):
    return jax.tree.map(lambda x: x.ndim > 1, params)


def _labels(params):
    return jax.tree.map(lambda x: "matrix" if x.ndim > 1 else "vector", params)


OPTIMIZERS = {
    "lamb": lambda: optax.lamb(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
    "masked_adamw": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=_kernels_only),
    "multi_transform": lambda: optax.multi_transform(
        {"matrix": optax.adam(1e-2), "vector": optax.sgd(0.05)}, _labels
    ),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.exponential_decay(1e-2, 1, 0.5)
    ),
    "clip_chain": lambda: optax.chain(
        optax.zero_nans(),
        optax.clip(0.5),
        optax.clip_by_block_rms(1.0),
        optax.scale_by_adam(),
        optax.ema(0.9),
        optax.scale(-1e-2),
    ),
    "add_noise": lambda: optax.chain(optax.add_noise(0.01, 0.55, key=3), optax.sgd(0.05)),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=2),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "schedule_free": lambda: optax.contrib.schedule_free_adamw(1e-2),
    "muon": lambda: optax.contrib.muon(1e-2),
}
STEPS = 3
STAGES = 3


def _lm_and_optimizer(make_tx):
    model = TinyLM(STAGES, tied=False, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, make_tx(), wrt=nnx.Param)


def _as_numpy(x) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _optimizer_leaves(optimizer) -> list[list[np.ndarray]]:
    """Every optimizer-state leaf; a leaf kept on several meshes once per copy."""
    leaves = []
    for leaf in jax.tree.leaves(nnx.state(optimizer, nnx.OptState)):
        copies = [leaf.array(q) for q in leaf.mesh_ids] if isinstance(leaf, mp.MpmdArray) else []
        leaves.append([_as_numpy(c) for c in copies] or [_as_numpy(leaf)])
    return leaves


@pytest.mark.filterwarnings("ignore::nnx_mpmd.ReplicatedBatchWarning")
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_pipelined_update_equals_reference(name):
    ref_model, ref_opt = _lm_and_optimizer(OPTIMIZERS[name])
    model, opt = _lm_and_optimizer(OPTIMIZERS[name])
    reference = nnx.jit(train_step_fn(lm_loss, 2))
    step = mp.jit(
        train_step_fn(lm_loss), mesh=make_mesh(STAGES, 2), schedule=mp.OneFOneB(),
        num_microbatches=2,
    )  # fmt: skip
    for i in range(STEPS):
        batch = make_batch("tokens", 8, seed=i)
        ref_loss = reference(ref_model, ref_opt, batch)
        with count_compilations() as counter:
            loss = step(model, opt, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
        assert i == 0 or counter.count == 0, f"step {i} recompiled {counter.names}"
    expected, got = params_of(ref_model), params_of(model)
    assert expected.keys() == got.keys()
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-4, err_msg=path)
    for want, copies in zip(_optimizer_leaves(ref_opt), _optimizer_leaves(opt), strict=True):
        for have in copies:
            np.testing.assert_allclose(have, want[0], rtol=1e-4, atol=1e-5)


def _doubled_by_cond(loss_fn, num_microbatches=None):
    """A step whose gradients pass through one ``lax.cond`` on the loss (every leaf)."""

    def step(model, optimizer, batch):
        loss, grads = mp.value_and_grad(loss_fn, num_microbatches=num_microbatches)(model, batch)
        grads = jax.lax.cond(
            loss > 0, lambda g: jax.tree.map(lambda x: 2 * x, g), lambda g: g, grads
        )
        optimizer.update(model, grads)
        return loss

    return step


GLOBAL_CONDS = {
    "apply_if_finite": (lambda: optax.apply_if_finite(optax.adam(1e-2), 2), train_step_fn),
    "multi_steps": (lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2), train_step_fn),
    "cond_in_step": (lambda: optax.sgd(0.1), _doubled_by_cond),
}


@pytest.mark.parametrize("meshes", [2, 4])
@pytest.mark.parametrize("name", sorted(GLOBAL_CONDS))
def test_a_global_cond_on_equal_shaped_meshes_updates_each_meshs_own_state(name, meshes):
    make_tx, make_step = GLOBAL_CONDS[name]
    models = [MLP(meshes, rngs=nnx.Rngs(0)) for _ in range(2)]
    optimizers = [nnx.Optimizer(m, make_tx(), wrt=nnx.Param) for m in models]
    reference = nnx.jit(make_step(mlp_loss, 2))
    step = mp.jit(
        make_step(mlp_loss), mesh=make_mesh(meshes, 1), schedule=mp.GPipe(), num_microbatches=2
    )
    for i in range(STEPS):
        batch = make_batch("regression", 8, seed=i)
        np.testing.assert_allclose(
            float(step(models[1], optimizers[1], batch)),
            float(reference(models[0], optimizers[0], batch)),
            rtol=1e-6,
        )
    expected, got = params_of(models[0]), params_of(models[1])
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-6, err_msg=path)
    for want, copies in zip(
        _optimizer_leaves(optimizers[0]), _optimizer_leaves(optimizers[1]), strict=True
    ):
        for have in copies:
            np.testing.assert_allclose(have, want[0], rtol=1e-5, atol=1e-7)
