"""BI/BW split: BI gives the input cotangent, BW the weight gradient, nothing twice."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnx_mpmd.compiler.trace.split_backward import run_bi, run_bw, split_backward


def _two_layers(params, xd):
    (w1, w2), (x,) = params, xd
    return (jnp.tanh(jnp.tanh(x @ w1) @ w2),)


def _count(program, name):
    return sum(eqn.primitive.name == name for eqn in program.jaxpr.eqns)


@pytest.fixture
def vjp_and_inputs():
    rng = np.random.default_rng(0)
    w1, w2 = (jnp.asarray(rng.normal(size=(8, 8)), jnp.float32) for _ in range(2))
    x = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)
    out, vjp_fn = jax.vjp(_two_layers, (w1, w2), (x,))
    seed = jnp.asarray(rng.normal(size=out[0].shape), jnp.float32)
    return vjp_fn, (w1, w2), x, seed


def test_bi_and_bw_equal_the_full_backward(vjp_and_inputs):
    vjp_fn, _, _, seed = vjp_and_inputs
    (g_params, ct_x) = vjp_fn((seed,))
    bi_ct, extras = run_bi(vjp_fn, [seed], num_params=2)
    grads = run_bw(vjp_fn, extras, [jax.ShapeDtypeStruct(seed.shape, seed.dtype)], num_params=2)
    np.testing.assert_allclose(bi_ct[0], ct_x[0], rtol=1e-6)
    for got, want in zip(grads, g_params):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_bw_does_not_recompute_the_cotangent_chain(vjp_and_inputs):
    vjp_fn, _, _, seed = vjp_and_inputs
    split = split_backward(vjp_fn, [jax.ShapeDtypeStruct(seed.shape, seed.dtype)], 2)
    full = jax.make_jaxpr(lambda s: vjp_fn((s,)))(seed)
    full_dots = sum(e.primitive.name == "dot_general" for e in full.jaxpr.eqns)
    bi_dots = _count(split.bi_program, "dot_general")
    bw_dots = _count(split.bw_program, "dot_general")
    # Two matmuls carry the cotangent to x (BI), two give the weight gradients (BW).
    assert (bi_dots, bw_dots) == (2, 2)
    assert bi_dots + bw_dots == full_dots
    assert _count(split.bw_program, "tanh") == 0 and split.num_extras >= 1
