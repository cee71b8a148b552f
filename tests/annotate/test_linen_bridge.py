"""Linen modules wrapped by ``nnx.bridge.ToNNX`` train in stages like under ``nnx.jit``.

A bridged Linen module has no variables until ``nnx.bridge.lazy_init`` (or its
first call) makes them, so a `Stage` built around it cannot tag them when it is
constructed; placement tags them with the stage of the Stage that holds them
(`nnx_mpmd.annotate.stage.tag_variables_created_later`). They once failed with
"parameter(s) have no stage ... Wrap the modules that own them in Stage",
though they were wrapped.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from flax.nnx import bridge
from pipeline_models import WIDTH, make_batch, make_mesh, mlp_loss, params_of, train_step_fn

import nnx_mpmd as mp
from nnx_mpmd.aot.stats import count_compilations


class LinenBlock(linen.Module):
    @linen.compact
    def __call__(self, x):
        return jnp.tanh(linen.LayerNorm()(linen.Dense(WIDTH)(x)))


class LinenTower(linen.Module):
    """A whole Linen model, for `assign_stages` by submodule name."""

    @linen.compact
    def __call__(self, x):
        return LinenBlock(name="second")(LinenBlock(name="first")(x))


class BridgedStages(mp.PipelinedModel):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.first = mp.Stage(bridge.ToNNX(LinenBlock(), rngs=rngs), stage=0)
        self.second = mp.Stage(bridge.ToNNX(LinenBlock(), rngs=rngs), stage=1)
        sample = jnp.zeros((1, WIDTH))
        bridge.lazy_init(self.first.module, sample)
        bridge.lazy_init(self.second.module, sample)

    def __call__(self, x):
        return self.second(self.first(x))


class LinenThenHead(mp.PipelinedModel):
    """A Linen model as one stage and an NNX head as the next, staged by `assign_stages`."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.tower = bridge.ToNNX(LinenTower(), rngs=rngs)
        bridge.lazy_init(self.tower, jnp.zeros((1, WIDTH)))
        self.head = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return self.head(self.tower(x))


def _train_both(make_model, schedule, steps=3):
    """Trains twins under mp.jit and nnx.jit; returns (pipelined, reference) models."""
    models = [make_model() for _ in range(2)]
    optimizers = [nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param) for m in models]
    reference = nnx.jit(train_step_fn(mlp_loss, num_microbatches=4))
    step = mp.jit(
        train_step_fn(mlp_loss), mesh=make_mesh(2, 2), schedule=schedule, num_microbatches=4
    )
    for i in range(steps):
        batch = make_batch("mlp", 16, i)
        with count_compilations() as counter:
            loss = step(models[0], optimizers[0], batch)
        assert i == 0 or counter.count == 0, f"step {i} recompiled {counter.names}"
        np.testing.assert_allclose(
            float(loss), float(reference(models[1], optimizers[1], batch)), rtol=1e-6
        )
    return models


def _assert_same_params(model, reference):
    got, want = params_of(model), params_of(reference)
    assert got.keys() == want.keys()
    for path in got:
        np.testing.assert_allclose(got[path], want[path], atol=1e-6, err_msg=path)


@pytest.mark.parametrize(
    "schedule", [mp.GPipe(), mp.OneFOneB(), mp.ZeroBubbleH1()], ids=["gpipe", "1f1b", "zb-h1"]
)
def test_bridged_linen_modules_in_stages_train_like_nnx_jit(schedule):
    model, reference = _train_both(lambda: BridgedStages(nnx.Rngs(0)), schedule)
    _assert_same_params(model, reference)
    assert model.first.module.Dense_0["kernel"].get_metadata()["mpmd_stage"] == 0
    assert model.second.module.LayerNorm_0["scale"].get_metadata()["mpmd_stage"] == 1


def test_a_whole_bridged_linen_model_is_one_stage_of_assign_stages():
    def make():
        return mp.assign_stages(LinenThenHead(nnx.Rngs(0)), {"tower": 0, "head": 1})

    model, reference = _train_both(make, mp.OneFOneB())
    _assert_same_params(model, reference)
    rows = mp.annotate.stage_summary(model).splitlines()[1:3]
    assert [row.split()[:2] for row in rows] == [["0", "608"], ["1", "272"]]


@pytest.mark.parametrize(
    ("inside", "pattern", "where"),
    [(True, "first", "the model itself"), (False, "tower.second.Dense_0", "'tower'")],
    ids=["root-tonnx", "nested-tonnx"],
)
def test_assign_stages_inside_a_linen_module_is_an_error(inside, pattern, where):
    model = LinenThenHead(nnx.Rngs(0))
    with pytest.raises(
        mp.PartitionError, match=rf"inside the Linen module at {where}.*whole ToNNX"
    ):
        mp.assign_stages(model.tower if inside else model, {pattern: 0})


def test_bridged_linen_modules_restore_into_another_layout(tmp_path):
    model, _ = _train_both(lambda: BridgedStages(nnx.Rngs(0)), mp.OneFOneB(), steps=1)
    mp.checkpoint.save(tmp_path / "ckpt", {"model": model})
    restored = BridgedStages(nnx.Rngs(1))
    mp.place(restored, make_mesh(1, 4))
    mp.checkpoint.restore(tmp_path / "ckpt", {"model": restored})
    _assert_same_params(mp.gather(restored), mp.gather(model))


def test_assign_stages_before_lazy_init_says_to_run_it():
    tower = bridge.ToNNX(LinenTower(), rngs=nnx.Rngs(0))
    with pytest.raises(mp.PartitionError, match=r"ToNNX wraps a Linen module.*lazy_init"):
        mp.assign_stages(tower, {"first": 0})
