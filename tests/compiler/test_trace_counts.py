"""How often a first step traces the user's code: each trace costs every test its Python time.

`mp.value_and_grad` outside `mp.jit` (the reference every numeric test compares
with) needs the loss's and aux's types before its microbatch loop; the forward
alone gives them, so the backward is traced once, by the loop. With a captured
Rngs, the probe that finds the used Variables gives them too: the loss function
is traced twice (probe and loop), not three times.

Under `mp.jit`, the first step's ahead-of-time compilation traces and lowers
each program once (equivalent argument shardings are one job), and a
zero-bubble BW program traces its stage's forward once for its seeds' types.
"""

from __future__ import annotations

import collections
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from pipeline_models import MLP, make_batch, make_mesh, mlp_loss, train_step_fn
from pipeline_models import WIDTH as MLP_WIDTH

import nnx_mpmd as mp
from nnx_mpmd.aot.compile_jobs import ProgramCompiler
from nnx_mpmd.aot.stats import count_compilations
from nnx_mpmd.compiler.trace.stage_programs import StageFunctions

M = 2  # microbatches
WIDTH = 4


class _Counts:
    """Calls of the loss function and of a custom_vjp's backward rule (each is one trace)."""

    loss = 0
    backward = 0


@jax.custom_vjp
def _counted_identity(x):
    return x


def _identity_fwd(x):
    return x, None


def _identity_bwd(_, ct):
    _Counts.backward += 1
    return (ct,)


_counted_identity.defvjp(_identity_fwd, _identity_bwd)


def _model() -> nnx.Linear:
    return nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))


def _batch() -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    x, y = (jnp.asarray(rng.normal(size=(4, WIDTH)), jnp.float32) for _ in range(2))
    return {"x": x, "y": y}


def _mse(model, x, y):
    return jnp.mean((_counted_identity(model(x)) - y) ** 2)


def _loss(model, batch):
    _Counts.loss += 1
    return _mse(model, batch["x"], batch["y"])


def _mean_of_microbatches(model, batch):
    """The reference: the mean of the microbatches' losses, as one nnx function."""
    halves = [jax.tree.map(lambda v, i=i: v[i * 2 : (i + 1) * 2], batch) for i in range(M)]
    return sum(_mse(model, h["x"], h["y"]) for h in halves) / M


def test_unpipelined_value_and_grad_traces_the_backward_once():
    _Counts.loss = _Counts.backward = 0
    got_loss, got_grads = nnx.jit(mp.value_and_grad(_loss, num_microbatches=M))(_model(), _batch())
    assert (_Counts.loss, _Counts.backward) == (2, 1)  # forward types, then the loop
    want_loss, want_grads = nnx.jit(nnx.value_and_grad(_mean_of_microbatches))(_model(), _batch())
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


_NOISE = nnx.Rngs(noise=3)  # captured by name: the probe finds that the loss draws from it


def _noisy_mse(model, x, y, key):
    return jnp.mean((model(x) + 0.1 * jax.random.normal(key, y.shape) - y) ** 2)


def _captured_loss(model, batch):
    _Counts.loss += 1
    return _noisy_mse(model, batch["x"], batch["y"], _NOISE.noise())


def test_unpipelined_value_and_grad_with_a_captured_rngs_traces_the_loss_twice():
    _Counts.loss = 0
    start = int(_NOISE.noise.count.get_value())
    got_loss, got_grads = mp.value_and_grad(_captured_loss, num_microbatches=M)(_model(), _batch())
    assert _Counts.loss == 2  # the probe (which Variables it uses, and its types), the loop
    assert int(_NOISE.noise.count.get_value()) == start + M

    def reference(model, batch, rngs):  # the same keys, the Rngs passed in
        halves = [jax.tree.map(lambda v, i=i: v[i * 2 : (i + 1) * 2], batch) for i in range(M)]
        return sum(_noisy_mse(model, h["x"], h["y"], rngs.noise()) for h in halves) / M

    rngs = nnx.Rngs(noise=3)
    rngs.noise.count.set_value(jnp.uint32(start))
    want_loss, want_grads = nnx.jit(nnx.value_and_grad(reference))(_model(), _batch(), rngs)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_first_step_traces_each_program_once(monkeypatch):
    """A gradient accumulator comes typed ``P()`` from its init and ``P(None, None)`` from
    the backward that updated it: one program for both, traced and lowered once."""
    traced: list[str] = []
    trace_and_compile = ProgramCompiler._trace_and_compile

    def counted(self, fn, args, on_traced, name, *rest):
        traced.append(name)
        return trace_and_compile(self, fn, args, on_traced, name, *rest)

    monkeypatch.setattr(ProgramCompiler, "_trace_and_compile", counted)
    models = [MLP(2, rngs=nnx.Rngs(0)) for _ in range(2)]
    opts = [nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param) for m in models]
    step = mp.jit(
        train_step_fn(mlp_loss),
        mesh=make_mesh(2, 1),
        schedule=mp.OneFOneB(),
        num_microbatches=4,
    )
    batch = make_batch("mlp", 8)
    with count_compilations() as counter:
        loss = step(models[0], opts[0], batch)
    assert traced and sorted(set(traced)) == sorted(traced)
    assert sorted(counter.names) == sorted(set(counter.names))  # nor compiled twice
    reference = nnx.jit(train_step_fn(mlp_loss, 4))(models[1], opts[1], batch)
    np.testing.assert_allclose(float(loss), float(reference), rtol=1e-5)


class _TwoSendsBlock(nnx.Module):
    """Sends two differentiated values to the next stage."""

    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(MLP_WIDTH, MLP_WIDTH, rngs=rngs)

    def __call__(self, xs):
        x, h = xs
        y = jnp.tanh(self.linear(x))
        return y + h, y * x


class _TwoSends(mp.PipelinedModel):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.blocks = nnx.List([mp.Stage(_TwoSendsBlock(rngs=rngs), stage=s) for s in range(3)])

    def __call__(self, x):
        xs = (x, x)
        for block in self.blocks:
            xs = block(xs)
        return xs[0] * xs[1]


def _two_sends_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def test_weight_backward_traces_its_forward_once_for_all_its_sends(monkeypatch):
    """ZB-H1's BW program needs its forward's output types: one forward trace, not one
    per differentiated send (stages 0 and 1 send two)."""
    # Programs are traced on several compile threads at once: count each thread's own.
    forwards: collections.Counter[int] = collections.Counter()
    per_bw: list[int] = []
    forward, backward_weight = StageFunctions._forward, StageFunctions.backward_weight

    def counted_forward(self, *args):
        forwards[threading.get_ident()] += 1
        return forward(self, *args)

    def counted_backward_weight(self, *args):
        before = forwards[threading.get_ident()]
        out = backward_weight(self, *args)
        per_bw.append(forwards[threading.get_ident()] - before)
        return out

    monkeypatch.setattr(StageFunctions, "_forward", counted_forward)
    monkeypatch.setattr(StageFunctions, "backward_weight", counted_backward_weight)
    models = [_TwoSends(rngs=nnx.Rngs(0)) for _ in range(2)]
    opts = [nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param) for m in models]
    step = mp.jit(
        train_step_fn(_two_sends_loss),
        mesh=make_mesh(3, 1),
        schedule=mp.ZeroBubbleH1(),
        num_microbatches=4,
    )
    batch = make_batch("mlp", 8)
    loss = step(models[0], opts[0], batch)
    assert per_bw and per_bw == [1] * len(per_bw)
    reference = nnx.jit(train_step_fn(_two_sends_loss, 4))(models[1], opts[1], batch)
    np.testing.assert_allclose(float(loss), float(reference), rtol=1e-5)
