"""NNX's lifted transforms inside a stage's body equal the same model under ``nnx.jit``.

A stage's body is ordinary NNX code: `nnx.vmap` ensembles (created with
`nnx.split_rngs`), `nnx.remat`, `nnx.cond` and `nnx.fori_loop` over submodules
run inside one `Stage` and are differentiated with the rest of the stage,
including the split backward of zero-bubble schedules (BI and BW are separate
programs). Each case trains three steps against the microbatched step under
``nnx.jit`` on one device, with nothing recompiled after the first step.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from pipeline_models import WIDTH, make_mesh, params_of, train_step_fn

import nnx_mpmd as mp
from nnx_mpmd.compiler.stats import count_compilations


class Ensemble(nnx.Module):
    """Three Linear layers stacked by `nnx.vmap`; the output is their mean."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return nnx.Linear(WIDTH, WIDTH, rngs=rngs)

        self.members = create(rngs)

    def __call__(self, x):
        @nnx.vmap(in_axes=(0, None), out_axes=0)
        def forward(member, x):
            return jnp.tanh(member(x))

        return forward(self.members, x).mean(axis=0)


class Rematted(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.first = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.second = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        layer = nnx.remat(lambda module, x: jnp.tanh(module(x)))
        return layer(self.second, layer(self.first, x))


class Branching(nnx.Module):
    """A branch per microbatch: its mean decides, and the batches below have both signs."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.down = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return nnx.cond(
            jnp.mean(x) > 0,
            lambda up, down, x: jnp.tanh(up(x)),
            lambda up, down, x: jnp.sin(down(x)),
            self.up,
            self.down,
            x,
        )


class Looped(nnx.Module):
    """One Linear applied three times (weights shared across the iterations)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layer = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        def body(_, carry):
            layer, x = carry
            return layer, jnp.tanh(layer(x))

        _, x = nnx.fori_loop(0, 3, body, (self.layer, x))
        return x


class TwoStages(mp.PipelinedModel):
    def __init__(self, body: type[nnx.Module], rngs: nnx.Rngs) -> None:
        self.first = mp.Stage(body(rngs), stage=0)
        self.second = mp.Stage(body(rngs), stage=1)

    def __call__(self, x):
        return self.second(self.first(x))


def _loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _batch(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    rows = rng.normal(size=(16, WIDTH)).astype(np.float32)
    rows[:8] += 0.5  # microbatches of both signs of mean, for the cond case
    rows[8:] -= 0.5
    return {"x": rows, "y": rng.normal(size=(16, WIDTH)).astype(np.float32)}


@pytest.mark.parametrize("body", [Ensemble, Rematted, Branching, Looped])
@pytest.mark.parametrize("schedule", [mp.OneFOneB(), mp.ZeroBubbleH1()], ids=["1F1B", "ZB-H1"])
def test_transform_in_a_stage_equals_nnx_jit(body, schedule):
    models = [TwoStages(body, nnx.Rngs(0)) for _ in range(2)]
    optimizers = [nnx.Optimizer(m, optax.adamw(1e-2), wrt=nnx.Param) for m in models]
    reference = nnx.jit(train_step_fn(_loss, num_microbatches=4))
    step = mp.jit(train_step_fn(_loss), mesh=make_mesh(2, 2), schedule=schedule, num_microbatches=4)
    for i in range(3):
        batch = _batch(i)
        ref_loss = reference(models[0], optimizers[0], batch)
        with count_compilations() as counter:
            loss = step(models[1], optimizers[1], batch)
        assert i == 0 or counter.count == 0, f"step {i} recompiled {counter.names}"
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    expected, got = params_of(models[0]), params_of(models[1])
    assert expected.keys() == got.keys()
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-6, err_msg=path)
