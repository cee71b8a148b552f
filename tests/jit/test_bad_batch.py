"""Batches that cannot be split into microbatches get a CompileError naming the keys."""

from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from pipeline_models import MLP, WIDTH, make_mesh, mlp_loss

import nnx_mpmd as mp


def _step(num_microbatches=None):
    def step(model, opt, batch):
        loss, grads = mp.value_and_grad(mlp_loss, num_microbatches=num_microbatches)(model, batch)
        opt.update(model, grads)
        return loss

    return step


BAD_BATCHES = {
    "sizes-disagree": (
        {"x": jnp.ones((16, WIDTH)), "y": jnp.zeros((12, WIDTH))},
        r"different leading \(batch\) sizes \(\['x'\]: 16, \['y'\]: 12\).*same number of rows",
    ),
    "not-divisible": (
        {"x": jnp.ones((6, WIDTH)), "y": jnp.zeros((6, WIDTH))},
        r"\['x'\] has 6 rows.*num_microbatches=4.*multiple of num_microbatches",
    ),
    "scalar-leaf": (
        {"x": jnp.ones((8, WIDTH)), "y": jnp.zeros((8, WIDTH)), "scale": jnp.float32(2.0)},
        r"\['scale'\] is a scalar.*leading \(batch\) axis",
    ),
}


@pytest.mark.parametrize("pipelined", [True, False], ids=["mp.jit", "unpipelined"])
@pytest.mark.parametrize("case", BAD_BATCHES, ids=list(BAD_BATCHES))
def test_bad_batch_is_a_compile_error_naming_the_leaves(case, pipelined):
    batch, message = BAD_BATCHES[case]
    model = MLP(2, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    if pipelined:
        step = mp.jit(_step(), mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=4)
    else:
        step = _step(num_microbatches=4)
    with pytest.raises(mp.CompileError, match=message):
        step(model, opt, batch)
