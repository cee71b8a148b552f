"""One reduce-scatter per step for FSDP parameters (nnx_mpmd.compiler.trace.grad_reduction).

A parameter whose ``out_sharding`` names the stage's data axis (FSDP) on an
Explicit submesh keeps its gradient unreduced at full size over the
microbatches and is reduce-scattered to its own sharding once per step, in the
stage's ``reduce`` program. Counted from the compiled HLO of the programs a
step executes, the bytes reduced per step (all-reduce plus reduce-scatter) are
at most 1.25x the parameter bytes, where they were about m times them before.
Auto axes keep the per-microbatch reduce-scatter. Every configuration equals
the one-device ``nnx.jit`` reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from pipeline_models import (
    VOCAB,
    WIDTH,
    lm_loss,
    make_batch,
    make_mesh,
    mlp_loss,
    params_of,
    train_step_fn,
)
from test_grad_reduction import AXIS_TYPES, MICROBATCHES, SCHEDULES

import nnx_mpmd as mp
from nnx_mpmd.compiler.trace.grad_reduction import (
    GradientReduction,
    all_reduce_bytes,
    program_calls,
    reduce_scatter_bytes,
    run_deferring,
    step_all_reduce_bytes,
    step_reduce_scatter_bytes,
    step_reduced_bytes,
)

FSDP = {"out_sharding": ("data", None), "eager_sharding": False}
BACKWARD_KINDS = ("B", "FB", "BI", "BW")


def _explicit() -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh._any_axis_explicit


class FsdpMLP(mp.PipelinedModel):
    """One Linear+tanh per stage: the kernel FSDP-sharded over "data", the bias replicated."""

    def __init__(self, num_stages: int, *, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List(
            [
                mp.Stage(nnx.Linear(WIDTH, WIDTH, kernel_metadata=FSDP, rngs=rngs), stage=s)
                for s in range(num_stages)
            ]
        )

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


def _param_bytes(model, fsdp_only=False) -> int:
    leaves = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return sum(
        v.get_value().nbytes
        for path, v in leaves
        if not fsdp_only or v.get_metadata().get("out_sharding") == FSDP["out_sharding"]
    )


def _pipelined(loss_fn, schedule_cls=mp.OneFOneB, axis_type="explicit"):
    mesh = make_mesh(2, 2, AXIS_TYPES[axis_type])
    return mp.jit(
        train_step_fn(loss_fn), mesh=mesh, schedule=schedule_cls(), num_microbatches=MICROBATCHES
    )


def _build(make, opt=None):
    models = [make(nnx.Rngs(0)) for _ in range(2)]
    opt = optax.adamw(1e-2) if opt is None else opt
    return models, [nnx.Optimizer(m, opt, wrt=nnx.Param) for m in models]


def _assert_equal_to_reference(models, opts, pipelined, batches, loss_fn):
    reference = nnx.jit(train_step_fn(loss_fn, MICROBATCHES))
    for batch in batches:
        expected = float(reference(models[0], opts[0], batch))
        np.testing.assert_allclose(float(pipelined(models[1], opts[1], batch)), expected, 1e-5)
    expected, got = params_of(models[0]), params_of(models[1])
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-5, err_msg=path)


def _assert_backward_scatters_nothing(executables, calls):
    """The backward programs reduce no gradient (a loss scalar's all-reduce at most)."""
    for name in calls:
        if name.rstrip("0123456789") in BACKWARD_KINDS:
            text = executables[name][0].as_text()
            assert reduce_scatter_bytes(text) == 0, name
            assert all_reduce_bytes(text) <= 8, name


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_fsdp_gradients_reduce_scatter_once_per_step(schedule, axis_type):
    schedule_cls, stages = SCHEDULES[schedule]
    (model, _), (opt, _) = _build(lambda rngs: FsdpMLP(stages, rngs=rngs))
    step = _pipelined(mlp_loss, schedule_cls, axis_type)
    lowered = step.lower(model, opt, make_batch("regression", MICROBATCHES * 4))
    compiled = lowered.compile()
    executables = compiled.executables()
    instructions = lowered.compiled.instructions
    calls = program_calls(instructions)
    ratio = step_reduced_bytes(instructions, executables) / _param_bytes(model)
    assert compiled.reduce_scatter_bytes() == step_reduce_scatter_bytes(instructions, executables)
    if axis_type == "auto":
        # The FSDP kernels: one reduce-scatter (an all-reduce and a slice on CPU) per
        # microbatch, as before; the replicated biases are summed once per step, in
        # reduce{k} (stacked partials: grad_reduction_auto).
        fsdp_share = _param_bytes(model, fsdp_only=True) / _param_bytes(model)
        assert ratio >= (MICROBATCHES - 0.5) * fsdp_share, ratio
        assert sorted(n for n in calls if n.startswith("reduce")) == [
            f"reduce{k}" for k in range(stages)
        ]
        return
    assert ratio <= 1.25, ratio
    # The kernels (and only they) are reduce-scattered, each once: in `reduce{k}`.
    scattered = step_reduce_scatter_bytes(instructions, executables)
    assert scattered == _param_bytes(model, fsdp_only=True), scattered
    assert sorted(n for n in calls if n.startswith("reduce")) == [
        f"reduce{k}" for k in range(stages)
    ]
    assert all(calls[f"reduce{k}"] == 1 for k in range(stages))
    _assert_backward_scatters_nothing(executables, calls)
    for k in range(stages):
        assert reduce_scatter_bytes(executables[f"reduce{k}"][0].as_text()) == WIDTH * WIDTH * 4


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_fsdp_equals_one_device_reference(schedule, axis_type):
    schedule_cls, stages = SCHEDULES[schedule]
    models, opts = _build(lambda rngs: FsdpMLP(stages, rngs=rngs))
    pipelined = _pipelined(mlp_loss, schedule_cls, axis_type)
    batches = [make_batch("regression", MICROBATCHES * 4, seed=s) for s in range(2)]
    _assert_equal_to_reference(models, opts, pipelined, batches, mlp_loss)
    kernel = models[1].layers[0].module.kernel[...]
    # Still FSDP-sharded after the update: each device holds half the rows.
    assert {shard.data.shape for shard in kernel.addressable_shards} == {(WIDTH // 2, WIDTH)}


class First(nnx.Module):
    """A replicated scale, then an FSDP kernel (nnx.Linear, batch over "data")."""

    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.scale = nnx.Param(jnp.linspace(0.5, 1.5, WIDTH))
        self.linear = nnx.Linear(WIDTH, WIDTH, kernel_metadata=FSDP, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.linear(x * self.scale[...]))


class TiedHead(nnx.Module):
    """The last stage, tied to the first stage's FSDP kernel (gathered before use)."""

    def __init__(self, first: nnx.Linear, *, rngs: nnx.Rngs) -> None:
        self.first = first
        self.bias = nnx.Param(jnp.zeros((WIDTH,)))

    def __call__(self, x):
        kernel = self.first.kernel[...]
        if _explicit():  # FSDP: all-gather the kernel for this stage's matmul
            kernel = jax.sharding.reshard(kernel, P())
        return x @ kernel.T + self.bias[...]


class TiedFsdpModel(mp.PipelinedModel):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.first = mp.Stage(First(rngs=rngs), stage=0)
        self.head = mp.Stage(TiedHead(self.first.module.linear, rngs=rngs), stage=1)

    def __call__(self, x):
        return self.head(self.first(x))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_mixed_and_tied_fsdp_parameters_equal_reference(schedule):
    """Replicated and FSDP parameters in one stage, and an FSDP kernel shared by both
    meshes (each mesh reduce-scatters its contribution once, then they are summed)."""
    schedule_cls, _ = SCHEDULES[schedule]
    models, opts = _build(lambda rngs: TiedFsdpModel(rngs=rngs), optax.sgd(0.1))
    pipelined = _pipelined(mlp_loss, schedule_cls)
    batches = [make_batch("regression", MICROBATCHES * 4, seed=s) for s in range(2)]
    lowered = pipelined.lower(models[1], opts[1], batches[0])
    executables = lowered.compile().executables()
    instructions = lowered.compiled.instructions
    calls = program_calls(instructions)
    _assert_backward_scatters_nothing(executables, calls)
    # The shared kernel is reduce-scattered once on each mesh that uses it.
    kernel_bytes = WIDTH * WIDTH * 4
    assert step_reduce_scatter_bytes(instructions, executables) == 2 * kernel_bytes
    # All-reduced: the replicated scale and the two biases, and loss scalars.
    assert step_all_reduce_bytes(instructions, executables) <= 3 * WIDTH * 4 + 16
    _assert_equal_to_reference(models, opts, pipelined, batches, mlp_loss)


class Lookup(nnx.Module):
    """An FSDP embedding table, gathered before the lookup; then an FSDP column kernel."""

    def __init__(self, *, rngs: nnx.Rngs) -> None:
        table = jax.random.normal(rngs.params(), (VOCAB, WIDTH)) * 0.3
        kernel = jax.random.normal(rngs.params(), (WIDTH, WIDTH)) * 0.3
        self.table = nnx.Param(table, out_sharding=("data", None), eager_sharding=False)
        self.kernel = nnx.Param(kernel, out_sharding=(None, "data"), eager_sharding=False)

    def __call__(self, ids):
        table, kernel = self.table[...], self.kernel[...]
        if not _explicit():
            return jnp.tanh(table[ids] @ kernel)
        table, kernel = jax.sharding.reshard(table, P()), jax.sharding.reshard(kernel, P())
        sharding = jax.typeof(ids).sharding
        rows = table.at[ids].get(out_sharding=NamedSharding(sharding.mesh, P(*sharding.spec, None)))
        return jnp.tanh(rows @ kernel)


class LookupModel(mp.PipelinedModel):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.embed = mp.Stage(Lookup(rngs=rngs), stage=0)
        self.out = mp.Stage(nnx.Linear(WIDTH, VOCAB, rngs=rngs), stage=1)

    def __call__(self, tokens):
        return self.out(self.embed(tokens))


def test_fsdp_embedding_table_and_column_kernel_reduce_once():
    """The gradient of a gathered FSDP table (a scatter-add of the batch's rows) and of a
    kernel sharded on its second dimension: each reduce-scattered once, in ``reduce0``."""
    models, opts = _build(lambda rngs: LookupModel(rngs=rngs))
    pipelined = _pipelined(lm_loss)
    batches = [make_batch("tokens", MICROBATCHES * 4, seed=s) for s in range(2)]
    lowered = pipelined.lower(models[1], opts[1], batches[0])
    executables = lowered.compile().executables()
    instructions = lowered.compiled.instructions
    _assert_backward_scatters_nothing(executables, program_calls(instructions))
    fsdp_bytes = (VOCAB * WIDTH + WIDTH * WIDTH) * 4
    assert reduce_scatter_bytes(executables["reduce0"][0].as_text()) == fsdp_bytes
    assert step_reduced_bytes(instructions, executables) <= 1.25 * _param_bytes(models[1])
    _assert_equal_to_reference(models, opts, pipelined, batches, lm_loss)


def _data_mesh(n=2):
    return jax.make_mesh(
        (n,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:n]
    )


def test_run_deferring_keeps_an_fsdp_gradient_unreduced_at_full_size():
    mesh = _data_mesh()
    w = jax.device_put(jnp.arange(12.0).reshape(4, 3) / 10, NamedSharding(mesh, P("data")))
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4) / 10, NamedSharding(mesh, P("data")))
    red = GradientReduction("data")

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    @jax.jit
    def deferred(w, x):
        _, vjp = jax.vjp(loss, w, x)
        gw, gx = run_deferring(vjp, jnp.ones(()), reduction=red)
        return gw, red.reduce(gx, like=x)

    gw, gx = deferred(w, x)
    assert jax.typeof(gw).sharding.spec == P(None, None, unreduced={"data"})
    text = deferred.lower(w, x).compile().as_text()
    assert reduce_scatter_bytes(text) == 0 and all_reduce_bytes(text) == 0
    reduced = jax.jit(lambda g, w: red.reduce(g, like=w))(gw, w)
    assert reduced.sharding.spec == P("data", None)
    ref_w, ref_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(w, x)
    np.testing.assert_allclose(reduced, ref_w, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(gx, ref_x, rtol=1e-5, atol=1e-7)
    text = jax.jit(lambda g, w: red.reduce(g, like=w)).lower(gw, w).compile().as_text()
    assert reduce_scatter_bytes(text) == 4 * 3 * 4 and all_reduce_bytes(text) == 0


def test_reduce_scatter_bytes_counts_operands():
    mesh = _data_mesh()
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))
    scatter = jax.shard_map(
        lambda x: jax.lax.psum_scatter(x.T @ x, "data", tiled=True),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P("data"),
    )
    text = jax.jit(scatter).lower(x).compile().as_text()
    assert reduce_scatter_bytes(text) == 4 * 4 * 4  # the f32[4,4] operand, not the result
    assert all_reduce_bytes(text) == 0
    # The async form names its operands first in its result tuple.
    start = (
        "%rs = ((f32[8,16]{1,0}), f32[4,16]{1,0}) reduce-scatter-start(%g), "
        "replica_groups=[1,2]<=[2], dimensions={0}"
    )
    assert reduce_scatter_bytes(start) == 8 * 16 * 4
    # Without the operand's definition: the result's size times the group size.
    plain = "%rs = f32[4,16]{1,0} reduce-scatter(%g), replica_groups=[1,2]<=[2], dimensions={0}"
    assert reduce_scatter_bytes(plain) == 8 * 16 * 4


class Cumulative(nnx.Module):
    """An FSDP kernel, gathered, then used through a cumulative sum: ``cumsum`` has no
    unreduced rule, so its gradient is reduced in every backward, then gathered and
    added into the full-size accumulator (the fallback)."""

    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(WIDTH, WIDTH, kernel_metadata=FSDP, rngs=rngs)

    def __call__(self, x):
        kernel = self.linear.kernel[...]
        if _explicit():
            kernel = jax.sharding.reshard(kernel, P())
        kernel = jnp.cumsum(kernel, axis=1) / WIDTH
        return jnp.tanh(x @ kernel + self.linear.bias[...])


class CumulativeModel(mp.PipelinedModel):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.first = mp.Stage(Cumulative(rngs=rngs), stage=0)
        self.second = mp.Stage(nnx.Linear(WIDTH, WIDTH, kernel_metadata=FSDP, rngs=rngs), stage=1)

    def __call__(self, x):
        return self.second(self.first(x))


def test_fsdp_gradient_reduced_in_the_backward_still_equals_reference():
    models, opts = _build(lambda rngs: CumulativeModel(rngs=rngs))
    pipelined = _pipelined(mlp_loss)
    batches = [make_batch("regression", MICROBATCHES * 4, seed=s) for s in range(2)]
    lowered = pipelined.lower(models[1], opts[1], batches[0])
    executables = lowered.compile().executables()
    # Stage 0's kernel gradient is all-reduced in B0 (the fallback); stage 1's is deferred.
    assert all_reduce_bytes(executables["B0"][0].as_text()) == WIDTH * WIDTH * 4
    assert reduce_scatter_bytes(executables["reduce0"][0].as_text()) == WIDTH * WIDTH * 4
    assert reduce_scatter_bytes(executables["FB1"][0].as_text()) == 0
    assert all_reduce_bytes(executables["FB1"][0].as_text()) <= 8
    _assert_equal_to_reference(models, opts, pipelined, batches, mlp_loss)
