"""NNX's lifted transforms inside a stage's body equal the same model under ``nnx.jit``.

A stage's body is ordinary NNX code: `nnx.vmap` ensembles (created with
`nnx.split_rngs`), `nnx.remat`, `nnx.cond` and `nnx.fori_loop` over submodules,
`nnx.MultiHeadAttention` with a causal mask, ``jax.lax.scan`` (next to
parameters nothing reads) and a ``jax.custom_vjp`` run inside one `Stage` and
are differentiated with the rest of the stage, including the split backward of
zero-bubble schedules (BI and BW are separate programs). The submeshes have 2
devices on an Explicit ``data`` axis.
Each case trains three steps against the microbatched step under ``nnx.jit``
on one device, with nothing recompiled after the first step.

The custom_vjp clips its cotangent, a backward that is not linear in the
cotangent: both the pipeline and the unpipelined `mp.value_and_grad` start each
microbatch's backward from ``1/m`` (``d mean / d loss_i``), so such a rule sees
what ``jax.grad`` of the full batch's mean gives it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from pipeline_models import WIDTH, make_mesh, params_of, train_step_fn

import nnx_mpmd as mp
from nnx_mpmd.aot.stats import count_compilations


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


class Attending(nnx.Module):
    """Causal self-attention over the row seen as 4 positions of 4 features."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        # No biases: the key bias's true gradient is zero (softmax ignores a shift
        # shared by every key), and Adam turns its rounding noise into full steps.
        self.attention = nnx.MultiHeadAttention(
            num_heads=2, in_features=4, qkv_features=8, decode=False, use_bias=False, rngs=rngs
        )
        self.norm = nnx.LayerNorm(4, rngs=rngs)

    def __call__(self, x):
        seq = x.reshape(x.shape[0], 4, 4)
        seq = seq + self.attention(self.norm(seq), mask=nnx.make_causal_mask(seq[..., 0]))
        return seq.reshape(x.shape)


class Scanned(nnx.Module):
    """``jax.lax.scan`` over one kernel (its bias and the extra Param are never read).

    A parameter no stage reads gets a zero gradient from a program of its own,
    whose only input is unused (it failed on Explicit meshes of several devices).
    """

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layer = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.unused = nnx.Param(jnp.ones((3,)))

    def __call__(self, x):
        kernel = self.layer.kernel.get_value()

        def body(carry, _):
            return jnp.tanh(carry @ kernel), jnp.sum(carry)

        y, sums = jax.lax.scan(body, x, None, length=3)
        return y + 0.01 * sums.mean()


CLIP = 0.01


@jax.custom_vjp
def clip_cotangent(x):
    return x


def _clip_forward(x):
    return x, None


def _clip_backward(_, cotangent):
    return (jnp.clip(cotangent, -CLIP, CLIP),)


clip_cotangent.defvjp(_clip_forward, _clip_backward)


class GradientClipped(nnx.Module):
    """A Linear whose output's cotangent is clipped (at a size that full-batch
    cotangents of the loss below mostly stay under, and per-microbatch ones do not)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layer = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return clip_cotangent(jnp.tanh(self.layer(x)))


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


@pytest.mark.parametrize(
    "body", [Ensemble, Rematted, Branching, Looped, Attending, GradientClipped, Scanned]
)
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


def test_a_cotangent_clipping_custom_vjp_sees_the_full_batch_mean_cotangents():
    """Unpipelined, 4 microbatches: the full batch's gradient (each backward starts at 1/m).

    Started at 1 and averaged afterwards, the clip would cut cotangents 4 times
    larger than the full batch's (the pipelined step never did).
    """
    model = TwoStages(GradientClipped, nnx.Rngs(0))
    batch = _batch(0)
    _, full = nnx.value_and_grad(_loss)(model, batch)
    _, microbatched = mp.value_and_grad(_loss, num_microbatches=4)(model, batch)
    _, per_microbatch_clip = mp.value_and_grad(lambda m, b: 4 * _loss(m, b), num_microbatches=4)(
        model, batch
    )
    for (path, want), got, scaled in zip(
        nnx.to_flat_state(full), jax.tree.leaves(microbatched), jax.tree.leaves(per_microbatch_clip)
    ):
        np.testing.assert_allclose(got, want.get_value(), atol=1e-7, err_msg=str(path))
        # The clip is active: a loss 4x larger is not a gradient 4x larger.
        assert not np.allclose(scaled, 4 * want.get_value(), atol=1e-5), path
