"""RNG in every form a user writes: the pipelined step draws the reference's keys.

The reference is written with plain NNX under ``nnx.jit`` on one device: a Python
loop over the microbatches in order, ``nnx.value_and_grad`` with the ``nnx.Rngs``
passed explicitly, the mean loss and gradient. Each form must give the same
losses, parameters and final RNG counts over several steps, so no key is reused.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from pipeline_models import make_mesh

import nnx_mpmd as mp

WIDTH = 8
M = 4  # microbatches
RATE = 0.5


class Block(nnx.Module):
    """A Linear and a Dropout with no stream of its own: keys come at call time."""

    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.dropout = nnx.Dropout(RATE)

    def __call__(self, x, rngs=None):
        return self.dropout(jnp.tanh(self.linear(x)), rngs=rngs)


class Net(mp.PipelinedModel):
    """Two stages; dropout inside the stages, between them and after the last one.

    ``own_rngs``: the model holds the ``nnx.Rngs`` itself (one stream shared by
    both stages and the glue); otherwise the caller passes ``rngs`` to the call.
    """

    def __init__(self, *, own_rngs: bool, rngs: nnx.Rngs) -> None:
        self.blocks = nnx.List([mp.Stage(Block(rngs=rngs), stage=s) for s in range(2)])
        self.glue = nnx.Dropout(RATE)
        self.rngs = nnx.Rngs(dropout=11) if own_rngs else None

    def __call__(self, x, rngs=None):
        rngs = self.rngs if rngs is None else rngs
        h = self.blocks[0](x, rngs=rngs)
        h = self.glue(h, rngs=rngs)  # glue between stages
        h = self.blocks[1](h, rngs=rngs)
        return self.glue(h, rngs=rngs)  # glue after the last stage


def _loss(model, batch, rngs):
    return jnp.mean((model(batch["x"], rngs=rngs) - batch["y"]) ** 2)


def _batch(step):
    rng = np.random.default_rng(step)
    return {
        "x": jnp.asarray(rng.normal(size=(16, WIDTH)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(16, WIDTH)), jnp.float32),
    }


def _build(own_rngs):
    model = Net(own_rngs=own_rngs, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


@nnx.jit
def _reference_step(model, opt, rngs, batch):
    """Plain NNX: microbatches in order, the Rngs passed explicitly."""
    size = batch["x"].shape[0] // M
    total_loss, total_grads = 0.0, None
    for i in range(M):
        mb = jax.tree.map(lambda a, i=i: a[i * size : (i + 1) * size], batch)
        if rngs is None:  # the model's own Rngs
            loss, grads = nnx.value_and_grad(lambda m, b: _loss(m, b, None))(model, mb)
        else:
            loss, grads = nnx.value_and_grad(lambda m, r, b: _loss(m, b, r))(model, rngs, mb)
        total_loss += loss
        total_grads = grads if total_grads is None else jax.tree.map(jnp.add, total_grads, grads)
    opt.update(model, jax.tree.map(lambda g: g / M, total_grads))
    return total_loss / M


# Each form: how the pipelined step gets its keys. ``owned`` forms keep the Rngs in
# the model; the others pass one to the step.
def _step_rngs_closed_over(model, opt, rngs, batch):
    loss, grads = mp.value_and_grad(lambda m, b: _loss(m, b, rngs))(model, batch)
    opt.update(model, grads)
    return loss


def _step_stream_closed_over(model, opt, rngs, batch):
    stream = rngs.dropout  # an RngStream, not the Rngs
    loss, grads = mp.value_and_grad(lambda m, b: _loss(m, b, stream))(model, batch)
    opt.update(model, grads)
    return loss


def _step_partial(model, opt, rngs, batch):
    import functools

    loss_fn = functools.partial(_loss, rngs=rngs)
    loss, grads = mp.value_and_grad(loss_fn)(model, batch)
    opt.update(model, grads)
    return loss


def _step_model_owned(model, opt, batch):
    loss, grads = mp.value_and_grad(lambda m, b: _loss(m, b, None))(model, batch)
    opt.update(model, grads)
    return loss


FORMS = {
    "rngs-closed-over": (_step_rngs_closed_over, False),
    "stream-closed-over": (_step_stream_closed_over, False),
    "functools-partial": (_step_partial, False),
    "model-owned-shared-stream": (_step_model_owned, True),
}
SCHEDULES = {
    "1f1b": (mp.OneFOneB(), 2, 1),
    "gpipe-dp2": (mp.GPipe(), 2, 2),
    "zb-h1": (mp.ZeroBubbleH1(), 2, 1),
}


def _count(model, rngs):
    source = model.rngs if rngs is None else rngs
    return int(source.dropout.count.get_value())


@pytest.mark.parametrize("schedule", SCHEDULES, ids=list(SCHEDULES))
@pytest.mark.parametrize("form", FORMS, ids=list(FORMS))
def test_pipelined_step_draws_the_reference_keys(form, schedule):
    step_fn, owned = FORMS[form]
    sched, meshes, data = SCHEDULES[schedule]
    ref_model, ref_opt = _build(owned)
    model, opt = _build(owned)
    ref_rngs = None if owned else nnx.Rngs(dropout=7)
    rngs = None if owned else nnx.Rngs(dropout=7)
    step = mp.jit(step_fn, mesh=make_mesh(meshes, data), schedule=sched, num_microbatches=M)
    losses = []
    for i in range(3):
        batch = _batch(i)
        expected = _reference_step(ref_model, ref_opt, ref_rngs, batch)
        got = step(model, opt, batch) if owned else step(model, opt, rngs, batch)
        np.testing.assert_allclose(float(got), float(expected), rtol=1e-5)
        losses.append(float(got))
    # 4 draws per microbatch (two stages, two glue dropouts), 4 microbatches, 3 steps.
    assert _count(model, rngs) == _count(ref_model, ref_rngs) == 48
    for (path, want), (_, have) in zip(
        nnx.to_flat_state(nnx.state(ref_model, nnx.Param)),
        nnx.to_flat_state(nnx.state(mp.gather(model), nnx.Param)),
        strict=True,
    ):
        np.testing.assert_allclose(have.get_value(), want.get_value(), rtol=1e-5, err_msg=path)
    assert step.num_compiled_steps == 1


def test_unpipelined_value_and_grad_matches_the_reference_with_a_closed_over_rngs():
    """Outside mp.jit, mp.value_and_grad draws the same keys as the reference loop."""
    ref_model, ref_opt = _build(False)
    model, opt = _build(False)
    ref_rngs, rngs = nnx.Rngs(dropout=3), nnx.Rngs(dropout=3)

    @nnx.jit
    def step(model, opt, rngs, batch):
        loss, grads = mp.value_and_grad(lambda m, b: _loss(m, b, rngs), num_microbatches=M)(
            model, batch
        )
        opt.update(model, grads)
        return loss

    for i in range(2):
        batch = _batch(i)
        np.testing.assert_allclose(
            float(step(model, opt, rngs, batch)),
            float(_reference_step(ref_model, ref_opt, ref_rngs, batch)),
            rtol=1e-5,
        )
    assert int(rngs.dropout.count.get_value()) == int(ref_rngs.dropout.count.get_value()) == 32


def test_masks_differ_between_steps_and_microbatches():
    """No key is reused: the same batch twice gives different losses (params frozen)."""
    model, _ = _build(False)
    frozen = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    rngs = nnx.Rngs(dropout=1)
    step = mp.jit(
        _step_rngs_closed_over, mesh=make_mesh(2, 1), schedule=mp.OneFOneB(), num_microbatches=M
    )
    batch = _batch(0)
    first, second = float(step(model, frozen, rngs, batch)), float(step(model, frozen, rngs, batch))
    assert first != second


GLOBAL_RNGS = nnx.Rngs(dropout=5, noise=6)


def _global_loss(model, batch):
    return _loss(model, batch, GLOBAL_RNGS)


def _step_global(model, opt, batch):
    loss, grads = mp.value_and_grad(_global_loss)(model, batch)
    opt.update(model, grads)
    return loss


@pytest.mark.parametrize("cached", [False, True], ids=["direct", "cached_partial"])
def test_rngs_that_is_no_argument_of_the_step_draws_the_reference_keys(cached):
    """A module-level Rngs closed over by the loss: an implicit argument of the step.

    Through ``nnx.cached_partial`` the step walks the graph on every call (the
    global Rngs is no node of the partial), with the same keys.
    """
    ref_model, ref_opt = _build(False)
    model, opt = _build(False)
    ref_rngs = nnx.Rngs(dropout=5, noise=6)
    start = int(GLOBAL_RNGS.dropout.count.get_value())
    step = mp.jit(_step_global, mesh=make_mesh(2, 1), schedule=mp.OneFOneB(), num_microbatches=M)
    call = (nnx.cached_partial if cached else functools.partial)(step, model, opt)
    for i in range(2):
        if i == 0:  # the reference starts where the global is now
            ref_rngs.dropout.count.set_value(jnp.uint32(start))
        batch = _batch(i)
        np.testing.assert_allclose(
            float(call(batch)),
            float(_reference_step(ref_model, ref_opt, ref_rngs, batch)),
            rtol=1e-5,
        )
    assert int(GLOBAL_RNGS.dropout.count.get_value()) == start + 32
    assert step.num_compiled_steps == 1


def test_unpipelined_value_and_grad_with_a_global_rngs_under_nnx_jit_is_an_error():
    """nnx.jit cannot update an Rngs it does not receive; the error names the fix."""
    model, opt = _build(False)

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = mp.value_and_grad(_global_loss, num_microbatches=M)(model, batch)
        opt.update(model, grads)
        return loss

    with pytest.raises(mp.CompileError, match=r"GLOBAL_RNGS\.dropout\.count.*as an argument"):
        step(model, opt, _batch(0))


def test_rngs_unused_by_the_loss_is_not_region_state():
    """A captured Rngs the loss never draws from stays out of the step (no error)."""
    unused = nnx.Rngs(dropout=9)

    def step_fn(model, opt, batch):
        def loss_fn(m, b):
            _ = unused  # named, never drawn from
            return jnp.mean((m.blocks[1](m.blocks[0](b["x"])) - b["y"]) ** 2)

        loss, grads = mp.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss

    model, opt = _build(False)
    model.eval()  # dropout off: no keys drawn at all
    step = mp.jit(step_fn, mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=M)
    assert np.isfinite(float(step(model, opt, _batch(0))))
    assert int(unused.dropout.count.get_value()) == 0


def test_assigning_an_rng_counter_in_the_loss_is_an_error():
    def step_fn(model, opt, rngs, batch):
        def loss_fn(m, b):
            rngs.dropout.count.set_value(jnp.uint32(0))  # not a key draw
            return _loss(m, b, rngs)

        loss, grads = mp.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss

    model, opt = _build(False)
    step = mp.jit(step_fn, mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=M)
    with pytest.raises(mp.CompileError, match=r"RNG counter rngs\.dropout\.count is changed"):
        step(model, opt, nnx.Rngs(dropout=2), _batch(0))


class OwnStreams(mp.PipelinedModel):
    """Dropouts with streams of their own: in each stage and in glue after the last."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.a = mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=0)
        self.drop_a = mp.Stage(nnx.Dropout(RATE, rngs=nnx.Rngs(dropout=21)), stage=0)
        self.b = mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=1)
        self.drop_out = nnx.Dropout(RATE, rngs=nnx.Rngs(dropout=22))  # glue: no Stage

    def __call__(self, x):
        return self.drop_out(self.b(self.drop_a(jnp.tanh(self.a(x)))))


@pytest.mark.parametrize("cached", [False, True], ids=["direct", "cached_partial"])
def test_glue_dropout_with_its_own_stream_equals_the_reference(cached):
    def loss_fn(m, b):
        return jnp.mean((m(b["x"]) - b["y"]) ** 2)

    @nnx.jit
    def reference(model, opt, batch):
        size = batch["x"].shape[0] // M
        losses, grads = [], []
        for i in range(M):
            mb = jax.tree.map(lambda a, i=i: a[i * size : (i + 1) * size], batch)
            loss, g = nnx.value_and_grad(loss_fn)(model, mb)
            losses.append(loss)
            grads.append(g)
        opt.update(model, jax.tree.map(lambda *g: sum(g) / M, *grads))
        return sum(losses) / M

    def step(model, opt, batch):
        loss, grads = mp.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss

    models = [OwnStreams(nnx.Rngs(0)) for _ in range(2)]
    opts = [nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param) for m in models]
    pipelined = mp.jit(step, mesh=make_mesh(2, 2), schedule=mp.OneFOneB(), num_microbatches=M)
    # Through nnx.cached_partial the RNG counters are read from the same Variables.
    call = (nnx.cached_partial if cached else functools.partial)(pipelined, models[1], opts[1])
    for i in range(2):
        batch = _batch(i)
        np.testing.assert_allclose(
            float(call(batch)),
            float(reference(models[0], opts[0], batch)),
            rtol=1e-5,
        )
    for model in models:
        assert int(model.drop_out.rngs.count.get_value()) == 2 * M


class Sowing(mp.PipelinedModel):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.a = mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=0)
        self.b = mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=1)

    def __call__(self, x):
        h = self.a(x)
        self.sow(nnx.Intermediate, "hidden_mean", jnp.mean(h))
        return self.b(h)


@pytest.mark.parametrize("pipelined", [True, False], ids=["mp.jit", "nnx.jit"])
def test_sow_inside_the_loss_is_an_error_naming_the_variable(pipelined):
    def step(model, opt, batch):
        loss_fn = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)  # noqa: E731
        loss, grads = mp.value_and_grad(loss_fn, num_microbatches=None if pipelined else M)(
            model, batch
        )
        opt.update(model, grads)
        return loss

    model = Sowing(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    if pipelined:
        f = mp.jit(step, mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=M)
    else:
        f = nnx.jit(step)
    with pytest.raises(
        mp.CompileError, match=r"added or removed state at hidden_mean.*nnx\.capture.*has_aux"
    ):
        f(model, opt, _batch(0))


class SowingStages(mp.PipelinedModel):
    """Each stage sows a value (a load-balancing term, say), and so does glue between them."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.a = mp.Stage(SowingLinear(rngs), stage=0)
        self.b = mp.Stage(SowingLinear(rngs), stage=1)

    def __call__(self, x):
        h = self.a(x)
        self.sow(nnx.Intermediate, "glue", jnp.mean(h))
        return self.b(h)


class SowingLinear(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(self.linear(x))
        self.sow(nnx.Intermediate, "balance", jnp.mean(h**2))
        return h


def _captured_loss(model, batch):
    out, sown = nnx.capture(model, nnx.Intermediate)(batch["x"])
    extra = sum(jnp.sum(v) for v in jax.tree.leaves(sown))
    return jnp.mean((out - batch["y"]) ** 2) + 0.1 * extra, jax.tree.map(jnp.mean, sown)


def _popped_loss(model, batch):
    out = model(batch["x"])
    sown = nnx.pop(model, nnx.Intermediate)
    extra = sum(jnp.sum(v) for v in jax.tree.leaves(sown))
    return jnp.mean((out - batch["y"]) ** 2) + 0.1 * extra, jax.tree.map(jnp.mean, sown)


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)' outside:DeprecationWarning")
@pytest.mark.parametrize("schedule", [mp.OneFOneB(), mp.ZeroBubbleH1()], ids=["1f1b", "zb-h1"])
@pytest.mark.parametrize("loss_fn", [_captured_loss, _popped_loss], ids=["capture", "pop"])
def test_values_sown_in_stages_and_collected_in_the_loss_equal_nnx_jit(loss_fn, schedule):
    def step(model, opt, batch, num_microbatches=None):
        (loss, sown), grads = mp.value_and_grad(
            loss_fn, has_aux=True, num_microbatches=num_microbatches
        )(model, batch)
        opt.update(model, grads)
        return loss, sown

    models = [SowingStages(nnx.Rngs(0)) for _ in range(2)]
    opts = [nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param) for m in models]
    pipelined = mp.jit(step, mesh=make_mesh(2, 2), schedule=schedule, num_microbatches=M)
    reference = nnx.jit(functools.partial(step, num_microbatches=M))
    for i in range(2):
        (loss, sown), (want, want_sown) = [
            f(m, o, _batch(i)) for f, m, o in zip((pipelined, reference), models, opts)
        ]
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
        assert jax.tree.structure(sown) == jax.tree.structure(want_sown)
        for got, expected in zip(jax.tree.leaves(sown), jax.tree.leaves(want_sown)):
            np.testing.assert_allclose(float(got), float(expected), rtol=1e-6)
    for model in models:  # nothing sown is left behind
        assert not nnx.state(model, nnx.Intermediate)
    np.testing.assert_allclose(
        models[0].b.module.linear.kernel[...], models[1].b.module.linear.kernel[...], atol=1e-6
    )


def test_step_drawing_from_an_rngs_it_does_not_receive_advances_it():
    def noisy(batch, rngs):
        return {**batch, "x": batch["x"] + jax.random.normal(rngs.noise(), (16, WIDTH))}

    def step_fn(model, opt, batch):  # draws from the global outside the region
        loss_fn = lambda m, b: _loss(m, b, None)  # noqa: E731
        loss, grads = mp.value_and_grad(loss_fn)(model, noisy(batch, GLOBAL_RNGS))
        opt.update(model, grads)
        return loss

    @nnx.jit
    def reference(model, opt, rngs, batch):
        loss_fn = lambda m, b: _loss(m, b, None)  # noqa: E731
        loss, grads = mp.value_and_grad(loss_fn, num_microbatches=M)(model, noisy(batch, rngs))
        opt.update(model, grads)
        return loss

    (model, opt), (ref_model, ref_opt) = _build(False), _build(False)
    model.eval()
    ref_model.eval()
    start = int(GLOBAL_RNGS.noise.count.get_value())
    ref_rngs = nnx.Rngs(noise=6)
    ref_rngs.noise.count.set_value(jnp.uint32(start))
    step = mp.jit(step_fn, mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=M)
    for i in range(2):
        np.testing.assert_allclose(
            float(step(model, opt, _batch(i))),
            float(reference(ref_model, ref_opt, ref_rngs, _batch(i))),
            rtol=1e-5,
        )
    assert int(GLOBAL_RNGS.noise.count.get_value()) == start + 2
