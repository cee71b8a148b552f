"""Arrays held as plain module attributes (``self.table = jnp...``), which Flax treats as data.

A Stage's plain array attributes go to its stage's mesh, as its Variables do,
and the model's own (outside every Stage) to every mesh, as a Variable of no
parameter: a constant table and a counter the forward updates train like
``nnx.jit`` on one device, `mp.gather` brings them back and checkpoints keep
them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from pipeline_models import WIDTH, make_mesh, mlp_loss, train_step_fn

import nnx_mpmd as mp
from nnx_mpmd.aot.stats import count_compilations


class Tabled(nnx.Module):
    """A Linear, a constant table added to its output, and a call counter."""

    def __init__(self, offset: float, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.table = jnp.linspace(offset, offset + 1.0, WIDTH)
        self.calls = jnp.zeros((), jnp.float32)

    def __call__(self, x):
        self.calls = self.calls + 1.0
        return jnp.tanh(self.linear(x) + self.table)


class TwoTabled(mp.PipelinedModel):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.first = mp.Stage(Tabled(0.0, rngs), stage=0)
        self.second = mp.Stage(Tabled(1.0, rngs), stage=1)

    def __call__(self, x):
        return self.second(self.first(x))


def _batch(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(16, WIDTH)).astype(np.float32),
        "y": rng.normal(size=(16, WIDTH)).astype(np.float32),
    }


def _trained(schedule, steps=3):
    models = [TwoTabled(nnx.Rngs(0)) for _ in range(2)]
    optimizers = [nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param) for m in models]
    reference = nnx.jit(train_step_fn(mlp_loss, num_microbatches=4))
    mesh = make_mesh(2, 2)
    step = mp.jit(train_step_fn(mlp_loss), mesh=mesh, schedule=schedule, num_microbatches=4)
    for i in range(steps):
        with count_compilations() as counter:
            loss = step(models[1], optimizers[1], _batch(i))
        assert i == 0 or counter.count == 0, f"step {i} recompiled {counter.names}"
        np.testing.assert_allclose(
            float(loss), float(reference(models[0], optimizers[0], _batch(i))), rtol=1e-6
        )
    return mesh, step, models, optimizers


@pytest.mark.parametrize(
    "schedule", [mp.GPipe(), mp.OneFOneB(), mp.ZeroBubbleH1()], ids=["gpipe", "1f1b", "zb-h1"]
)
def test_plain_array_attributes_of_stages_train_like_nnx_jit(schedule):
    mesh, _, (reference, model), _ = _trained(schedule)
    for k, name in enumerate(["first", "second"]):
        got, want = getattr(model, name).module, getattr(reference, name).module
        assert got.table.sharding.mesh.devices.tolist() == mesh.submesh(k).devices.tolist()
        np.testing.assert_array_equal(got.table, want.table)
        assert float(got.calls) == float(want.calls) == 3 * 4  # steps x microbatches
        np.testing.assert_allclose(got.linear.kernel[...], want.linear.kernel[...], atol=1e-6)


def test_plain_array_attributes_are_gathered_and_checkpointed(tmp_path):
    _, step, (reference, model), (ref_optimizer, optimizer) = _trained(mp.OneFOneB(), steps=1)
    mp.checkpoint.save(tmp_path / "ckpt", {"model": model})
    restored = TwoTabled(nnx.Rngs(1))
    mp.checkpoint.restore(tmp_path / "ckpt", {"model": restored})
    mp.gather(model)
    default = {jax.devices()[0]}
    for name in ("first", "second"):
        module = getattr(model, name).module
        assert module.table.devices() == module.calls.devices() == default
        again = getattr(restored, name).module
        np.testing.assert_array_equal(again.table, module.table)
        assert float(again.calls) == float(module.calls) == 4
    # A table changed between steps is read again (it is an input, not a constant).
    model.second.module.table = model.second.module.table + 1.0
    reference.second.module.table = reference.second.module.table + 1.0
    reference_step = nnx.jit(train_step_fn(mlp_loss, num_microbatches=4))
    np.testing.assert_allclose(
        float(step(model, optimizer, _batch(5))),
        float(reference_step(reference, ref_optimizer, _batch(5))),
        rtol=1e-6,
    )


class TableOutside(mp.PipelinedModel):
    """Plain array attributes of the model itself, outside every Stage: read and updated in glue."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.first = mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=0)
        self.second = mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=1)
        self.scale = jnp.linspace(0.5, 1.5, WIDTH)
        self.calls = jnp.zeros((), jnp.float32)

    def __call__(self, x):
        self.calls = self.calls + 1.0
        return self.second(jnp.tanh(self.first(x))) * self.scale


def test_array_attributes_outside_every_stage_go_to_every_mesh_and_train_like_nnx_jit():
    models = [TableOutside(nnx.Rngs(0)) for _ in range(2)]
    optimizers = [nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param) for m in models]
    reference = nnx.jit(train_step_fn(mlp_loss, num_microbatches=2))
    step = mp.jit(
        train_step_fn(mlp_loss), mesh=make_mesh(2, 2), schedule=mp.OneFOneB(), num_microbatches=2
    )
    for i in range(3):
        np.testing.assert_allclose(
            float(step(models[1], optimizers[1], _batch(i))),
            float(reference(models[0], optimizers[0], _batch(i))),
            rtol=1e-6,
        )
    assert isinstance(models[1].calls, mp.MpmdArray) and models[1].calls.mesh_ids == (0, 1)
    assert float(models[1].calls) == float(models[0].calls) == 3 * 2
    mp.gather(models[1])
    assert models[1].scale.devices() == models[1].calls.devices() == {jax.devices()[0]}
