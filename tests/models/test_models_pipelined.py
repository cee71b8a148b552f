"""Each zoo model, pipelined with mp.jit, equals its nnx.jit run.

The GPT on 4 meshes accumulates gradients with ``optax.MultiSteps``: its
``lax.cond`` runs on every mesh, and the two middle meshes are equal-shaped
(their copies of the update once shared an executable that read the wrong
mesh's arguments).
"""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx
from pipeline_models import make_mesh

import nnx_mpmd as mp
from nnx_mpmd.models import build_model, lm_loss


def _step(num_microbatches=None):
    def step(model, opt, batch):
        loss, grads = mp.value_and_grad(lm_loss, num_microbatches=num_microbatches)(model, batch)
        opt.update(model, grads)
        return loss

    return step


def _params(model):
    return {
        ".".join(map(str, path)): np.asarray(var.get_value())
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def _multi_steps():
    return optax.MultiSteps(optax.adamw(1e-3), every_k_schedule=2)


@pytest.mark.parametrize(
    "name,overrides,schedule,meshes,stages,make_tx",
    [
        ("gpt", {"tie_embeddings": True}, mp.OneFOneB(), 2, 2, None),
        ("gpt", {"tie_embeddings": False}, mp.ZeroBubbleH1(), 2, 2, None),
        ("llama", {"n_layers": 4}, mp.Interleaved1F1B(), 2, 4, None),
        ("gpt", {"n_layers": 4}, mp.OneFOneB(), 4, 4, _multi_steps),
        ("gpt", {"n_layers": 6, "scan_layers": True}, mp.ZeroBubbleH1(), 2, 2, None),
        ("llama", {"n_layers": 6, "scan_layers": True}, mp.Interleaved1F1B(), 2, 4, None),
    ],
    ids=[
        "gpt-tied-1f1b",
        "gpt-untied-zb-h1",
        "llama-interleaved",
        "gpt-4-meshes-multi-steps",
        "gpt-scanned-zb-h1",
        "llama-scanned-interleaved",
    ],
)
def test_zoo_model_pipelined_equals_nnx_jit(name, overrides, schedule, meshes, stages, make_tx):
    def build():
        model = build_model(name, "tiny", num_stages=stages, rngs=nnx.Rngs(0), **overrides)
        tx = make_tx() if make_tx else optax.adamw(1e-3)
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    ref_model, ref_opt = build()
    model, opt = build()
    vocab = ref_model.config.vocab_size
    reference = nnx.jit(_step(4))
    pipelined = mp.jit(_step(), mesh=make_mesh(meshes, 2), schedule=schedule, num_microbatches=4)
    rng = np.random.default_rng(0)
    for _ in range(2):
        tokens = rng.integers(0, vocab, size=(16, 17)).astype(np.int32)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        np.testing.assert_allclose(
            pipelined(model, opt, batch), reference(ref_model, ref_opt, batch), rtol=1e-5
        )
    expected, got = _params(ref_model), _params(model)
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-4, err_msg=path)
