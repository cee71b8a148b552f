"""RNG streams and batch statistics inside stages equal the sequential reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from pipeline_models import WIDTH, make_batch, make_mesh, params_of

import nnx_mpmd as mp


class DropoutBatchNorm(mp.PipelinedModel):
    """Dropout in every stage (each forks its own RNG stream), BatchNorm on the last."""

    def __init__(self, num_stages, *, rngs):
        self.layers = nnx.List(
            [
                mp.Stage(
                    nnx.Sequential(
                        nnx.Linear(WIDTH, WIDTH, rngs=rngs), nnx.Dropout(0.3, rngs=rngs)
                    ),
                    stage=s,
                )
                for s in range(num_stages)
            ]
        )
        self.norm = mp.Stage(nnx.BatchNorm(WIDTH, rngs=rngs), stage=num_stages - 1)

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return self.norm(x)


def _loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _step(num_microbatches=None):
    def step(model, opt, batch):
        loss, grads = mp.value_and_grad(_loss, num_microbatches=num_microbatches)(model, batch)
        opt.update(model, grads)
        return loss

    return step


def _build(num_stages):
    model = DropoutBatchNorm(num_stages, rngs=nnx.Rngs(0, dropout=1))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


def _state(model):
    return {
        ".".join(map(str, path)): np.asarray(var.get_value())
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Any(nnx.BatchStat, nnx.RngCount)))
    }


@pytest.mark.parametrize(
    "schedule,meshes,stages",
    [(mp.OneFOneB(), 2, 2), (mp.ZeroBubbleH1(), 2, 2), (mp.Interleaved1F1B(), 2, 4)],
    ids=["1f1b", "zb-h1", "interleaved"],
)
@pytest.mark.parametrize("donate", [(), (0, 1)], ids=["kept", "donating"])
def test_dropout_and_batchnorm_equal_reference(schedule, meshes, stages, donate):
    ref_model, ref_opt = _build(stages)
    model, opt = _build(stages)
    reference = nnx.jit(_step(4))
    pipelined = mp.jit(
        _step(), mesh=make_mesh(meshes, 1), schedule=schedule, num_microbatches=4,
        donate_argnums=donate,
    )  # fmt: skip
    for step in range(3):
        batch = make_batch("regression", 8, seed=step)
        np.testing.assert_allclose(
            pipelined(model, opt, batch), reference(ref_model, ref_opt, batch), rtol=1e-5
        )
    expected, got = _state(ref_model), _state(model)
    assert expected.keys() == got.keys() and any("count" in k for k in got)
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-5, err_msg=path)
    # 3 steps x 4 microbatches: every dropout stream advanced 12 times.
    assert all(int(v) == 12 for k, v in got.items() if k.endswith("count"))
    for path, value in params_of(ref_model).items():
        np.testing.assert_allclose(params_of(model)[path], value, atol=1e-4, err_msg=path)


class SharedRngs(mp.PipelinedModel):
    """One RNG stream drawn from by both stages' glue code."""

    def __init__(self, rngs):
        self.a = mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=0)
        self.b = mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=1)
        self.rngs = rngs

    def __call__(self, x):
        x = self.a(x) + 0.01 * jax.random.normal(self.rngs.noise(), x.shape)
        return self.b(x) + 0.01 * jax.random.normal(self.rngs.noise(), x.shape)


def test_rng_stream_shared_by_two_stages_equals_reference():
    """Counters are derived from the microbatch index, so stages may share a stream."""
    models = [SharedRngs(nnx.Rngs(0, noise=1)) for _ in range(2)]
    opts = [nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param) for m in models]
    reference = nnx.jit(_step(2))
    f = mp.jit(_step(), mesh=make_mesh(2, 1), schedule=mp.OneFOneB(), num_microbatches=2)
    for step in range(2):
        batch = make_batch("regression", 4, seed=step)
        np.testing.assert_allclose(
            f(models[1], opts[1], batch), reference(models[0], opts[0], batch), rtol=1e-5
        )
    assert int(models[1].rngs.noise.count.get_value()) == 8
    assert _state(models[0]).keys() == _state(models[1]).keys()
    for path, value in _state(models[0]).items():
        np.testing.assert_array_equal(_state(models[1])[path], value, err_msg=path)


def test_state_shared_by_two_stages_is_rejected():
    class SharedCounter(mp.PipelinedModel):
        def __init__(self, rngs):
            self.a = mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=0)
            self.b = mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=1)
            self.calls = nnx.BatchStat(jnp.zeros(()))

        def __call__(self, x):
            x = self.a(x)
            self.calls.set_value(self.calls.get_value() + jnp.mean(x))
            x = self.b(x)
            self.calls.set_value(self.calls.get_value() + jnp.mean(x))
            return x

    model = SharedCounter(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    f = mp.jit(_step(), mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2)
    with pytest.raises(mp.CompileError, match=r"calls.*stages \[0, 1\].*one stage"):
        f(model, opt, make_batch("regression", 4))


def test_new_state_is_written_into_the_callers_variables_without_nnx_update(monkeypatch):
    ref_model, ref_opt = _build(2)
    model, opt = _build(2)
    pipelined = mp.jit(_step(), mesh=make_mesh(2, 1), schedule=mp.OneFOneB(), num_microbatches=4)
    pipelined(model, opt, make_batch("regression", 8, seed=0))  # compiles (and places)
    nnx.jit(_step(4))(ref_model, ref_opt, make_batch("regression", 8, seed=0))
    kernel = model.layers[0].layers[0].kernel

    def no_update(*args, **kwargs):
        raise AssertionError("the steady-state step should not walk the graph with nnx.update")

    monkeypatch.setattr(nnx, "update", no_update)
    before = kernel.get_raw_value()
    pipelined(model, opt, make_batch("regression", 8, seed=1))
    monkeypatch.undo()
    nnx.jit(_step(4))(ref_model, ref_opt, make_batch("regression", 8, seed=1))
    assert model.layers[0].layers[0].kernel is kernel and kernel.get_raw_value() is not before
    for path, value in params_of(ref_model).items():
        np.testing.assert_allclose(params_of(model)[path], value, atol=1e-5, err_msg=path)
    assert int(np.asarray(opt.step.get_value())) == 2


class _PairState(nnx.Variable):
    pass


def test_variable_holding_a_pytree_is_written_back_through_nnx_update():
    from nnx_mpmd.compiler.trace.trace_step import flatten_args

    model, opt = _build(2)
    model.pair = _PairState((jnp.zeros(3), jnp.ones(3)))

    def step(model, opt, batch):
        loss, grads = mp.value_and_grad(_loss)(model, batch)
        opt.update(model, grads)
        first, second = model.pair.get_value()
        model.pair.set_value((first + 1, second * 2))
        return loss

    assert flatten_args((model, opt)).variables is None
    assert flatten_args((_build(2)[0],)).variables is not None
    pipelined = mp.jit(step, mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2)
    for seed in range(2):
        pipelined(model, opt, make_batch("regression", 4, seed=seed))
    first, second = model.pair.get_value()
    np.testing.assert_allclose(np.asarray(first), 2.0)
    np.testing.assert_allclose(np.asarray(second), 4.0)


class _StatisticOfTwoStages(mp.PipelinedModel):
    """A batch statistic updated after stage 0 and again after stage 1."""

    def __init__(self, rngs):
        self.a = mp.Stage(nnx.Linear(4, 4, rngs=rngs), stage=0)
        self.b = mp.Stage(nnx.Linear(4, 4, rngs=rngs), stage=1)
        self.total = nnx.BatchStat(jnp.zeros(()))

    def __call__(self, x):
        x = self.a(x)
        self.total[...] += jnp.mean(x)
        x = self.b(x)
        self.total[...] += jnp.mean(x)
        return x


def test_state_updated_by_two_stages_is_an_error_naming_it():
    # Stage 1 carries `total` without reading it as a region input: the stage
    # programs' keys (StageFunctions.structure) must not fail first.
    model = _StatisticOfTwoStages(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def step(model, optimizer, batch):
        loss, grads = mp.value_and_grad(lambda m, b: jnp.mean(m(b) ** 2))(model, batch)
        optimizer.update(model, grads)
        return loss

    f = mp.jit(step, mesh=make_mesh(2, 1), schedule=mp.OneFOneB(), num_microbatches=2)
    with pytest.raises(mp.CompileError, match=r"total is updated by stage 1 and used by stages"):
        f(model, optimizer, jnp.ones((8, 4)))
