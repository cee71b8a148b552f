"""Explicit and Auto mesh axes: stages that reshard equal the one-device nnx.jit run.

Each stage of a tiny two-stage model changes the sharding of its values in one
of three ways: ``jax.sharding.reshard`` (under Auto axes, JAX's form is
``with_sharding_constraint``), ``out_sharding=`` on ``jnp.einsum`` /
``jax.lax.dot_general``, or tensor-parallel parameters (``nnx.with_partitioning``
and ``nnx.Param(..., out_sharding=...)``). The pipelined step runs on a
``("stage", "data", "model")`` mesh of Explicit or Auto axes; the reference is
the same model under ``nnx.jit`` on one device, inside ``jax.set_mesh`` of a
one-device mesh with the submesh's axis names, as a user writes it.

``compile_step`` traces the step inside
``nnx_mpmd.compiler.trace.stage_programs.submesh_tracing(mesh)`` and ``MpmdMesh``
keeps the user's axis types on its submeshes. Ordinary (unannotated) model code
with data parallelism inside a stage is covered at the end: on an Explicit batch
axis each microbatch is traced sharded, and code that JAX's Explicit rules reject
on a sharded batch (``nnx.Embed``'s gather) runs with a replicated batch and a
``ReplicatedBatchWarning``.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_mpmd as mp
from nnx_mpmd.compiler.trace.trace_step import ReplicatedBatchWarning

WIDTH = 8
MICROBATCHES = 4
BATCH = 16  # 4 rows per microbatch: divisible by the data axis
STEPS = 2
AXES = ("stage", "data", "model")
AXIS_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}
SCHEDULES = {"1f1b": mp.OneFOneB, "gpipe": mp.GPipe, "zb-h1": mp.ZeroBubbleH1}
FORMS = ["reshard", "out_sharding", "param"]


def _explicit() -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh._any_axis_explicit


def _shard(x, spec):
    """``reshard`` under Explicit axes; under Auto axes JAX's form is a constraint."""
    if _explicit():
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)


def _matmul(x, kernel, spec, use_einsum):
    """``x @ kernel`` with its output sharding given on the op (Explicit) or after it."""
    if use_einsum:
        if _explicit():
            return jnp.einsum("bi,io->bo", x, kernel, out_sharding=spec)
        return _shard(jnp.einsum("bi,io->bo", x, kernel), spec)
    dims = (((1,), (0,)), ((), ()))
    if _explicit():
        return jax.lax.dot_general(x, kernel, dims, out_sharding=spec)
    return _shard(jax.lax.dot_general(x, kernel, dims), spec)


class Layer(nnx.Module):
    """One stage: a width-8 layer whose body changes shardings in the given form."""

    def __init__(self, form: str, index: int, *, rngs: nnx.Rngs) -> None:
        self.form, self.index = form, index
        init = nnx.initializers.lecun_normal()
        if form == "param" and index == 0:  # column-parallel, flax's annotation helper
            kernel_init = nnx.with_partitioning(init, (None, "model"))
            self.linear = nnx.Linear(WIDTH, WIDTH, kernel_init=kernel_init, rngs=rngs)
        else:
            self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        if form == "param" and index == 1:  # row-parallel, out_sharding metadata
            value = init(rngs.params(), (WIDTH, WIDTH))
            self.linear.kernel = nnx.Param(value, out_sharding=("model", None))

    def __call__(self, x):
        kernel, bias = self.linear.kernel[...], self.linear.bias[...]
        if self.form == "reshard":
            x = _shard(x, P("data", None))  # stage 1 receives P("data", "model")
            h = _shard(x @ kernel + bias, P("data", "model"))
        elif self.form == "out_sharding":
            spec = P("data", "model") if self.index == 0 else P("data", None)
            h = _matmul(x, kernel, spec, use_einsum=self.index == 0) + bias
        elif self.index == 1 and _explicit():
            # Row-parallel: both operands shard the contracted dim over "model",
            # so an Explicit mesh asks for the output sharding (the sum over "model").
            h = self.linear(x, out_sharding=P("data", None))
        else:
            h = self.linear(x)
        return jnp.tanh(h)


class TwoStages(mp.PipelinedModel):
    def __init__(self, form: str, *, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([mp.Stage(Layer(form, s, rngs=rngs), stage=s) for s in range(2)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def step_fn(num_microbatches=None):
    def step(model, optimizer, batch):
        grad_fn = mp.value_and_grad(loss_fn, num_microbatches=num_microbatches)
        loss, grads = grad_fn(model, batch)
        optimizer.update(model, grads)
        return loss

    return step


def pipeline_mesh(axis_type) -> mp.MpmdMesh:
    return mp.MpmdMesh(jax.make_mesh((2, 2, 2), AXES, axis_types=(axis_type,) * 3), "stage")


def one_device_mesh(axis_type) -> jax.sharding.Mesh:
    """The reference's mesh: the submesh's axis names, each of size 1, one device."""
    return jax.make_mesh((1, 1), AXES[1:], axis_types=(axis_type,) * 2, devices=jax.devices()[:1])


def build(form, mesh):
    """Model and optimizer, built under ``mesh`` (eager sharding of annotated params)."""
    with jax.set_mesh(mesh):
        model = TwoStages(form, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def batch(seed):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(BATCH, WIDTH)).astype(np.float32),
        "y": rng.normal(size=(BATCH, WIDTH)).astype(np.float32),
    }


def params_of(model):
    return {
        ".".join(map(str, path)): np.asarray(jax.device_get(var.get_value()))
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


@pytest.mark.parametrize("schedule", list(SCHEDULES), ids=list(SCHEDULES))
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("axis_type", list(AXIS_TYPES), ids=list(AXIS_TYPES))
def test_resharding_stage_equals_one_device_reference(axis_type, form, schedule):
    kind = AXIS_TYPES[axis_type]
    mesh = pipeline_mesh(kind)
    reference_mesh = one_device_mesh(kind)
    ref_model, ref_opt = build(form, reference_mesh)
    model, opt = build(form, mesh.jax_mesh)
    reference = nnx.jit(step_fn(MICROBATCHES))
    pipelined = mp.jit(
        step_fn(), mesh=mesh, schedule=SCHEDULES[schedule](), num_microbatches=MICROBATCHES
    )
    for step in range(STEPS):
        with jax.set_mesh(reference_mesh):
            ref_loss = reference(ref_model, ref_opt, batch(step))
        loss = pipelined(model, opt, batch(step))  # mp.jit sets each stage's mesh itself
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    expected, got = params_of(ref_model), params_of(model)
    assert expected.keys() == got.keys()
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-5, atol=1e-6, err_msg=path)
    # The stages ran with the user's axis types, and annotated parameters kept theirs.
    for submesh in mesh.submeshes:
        assert submesh.axis_types == (kind, kind)
    kernel = model.layers[0].module.linear.kernel[...]
    assert kernel.sharding.mesh.axis_types == (kind, kind)
    if form == "param":
        row = model.layers[1].module.linear.kernel[...]
        assert kernel.sharding.is_equivalent_to(
            NamedSharding(kernel.sharding.mesh, P(None, "model")), 2
        )
        assert row.sharding.is_equivalent_to(NamedSharding(row.sharding.mesh, P("model", None)), 2)


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES), ids=list(AXIS_TYPES))
def test_mpmd_mesh_keeps_axis_types_on_every_submesh(axis_type):
    kind = AXIS_TYPES[axis_type]
    mesh = pipeline_mesh(kind)
    assert mesh.axis_types == (kind, kind)
    assert [sub.axis_types for sub in mesh.submeshes] == [(kind, kind)] * 2
    assert [sub.axis_names for sub in mesh.submeshes] == [("data", "model")] * 2


class StageAxisReshard(mp.PipelinedModel):
    def __init__(self, how: str, *, rngs: nnx.Rngs) -> None:
        self.how = how
        self.a = mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=0)
        self.b = mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=1)

    def __call__(self, x):
        h = self.a(x)
        if self.how == "reshard":
            h = jax.sharding.reshard(h, P("stage"))
        else:
            h = jnp.einsum("bi,io->bo", h, jnp.eye(WIDTH), out_sharding=P("stage"))
        return self.b(h)


@pytest.mark.parametrize("how", ["reshard", "out_sharding"])
def test_sharding_over_the_stage_axis_inside_a_step_is_a_mesh_error(how):
    mesh = pipeline_mesh(AxisType.Explicit)
    model = StageAxisReshard(how, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = mp.jit(step_fn(), mesh=mesh, schedule=mp.GPipe(), num_microbatches=2)
    with pytest.raises(
        mp.MeshError, match=r"shards over the mpmd axis 'stage'.*\('data', 'model'\)"
    ):
        step(model, opt, batch(0))


def test_calling_a_step_under_set_mesh_is_a_mesh_error():
    mesh = pipeline_mesh(AxisType.Explicit)
    model, opt = build("reshard", mesh.jax_mesh)
    step = mp.jit(step_fn(), mesh=mesh, schedule=mp.GPipe(), num_microbatches=2)
    with (
        jax.set_mesh(mesh.jax_mesh),
        pytest.raises(
            mp.MeshError, match=r"called under the mesh context .*outside the `with jax.set_mesh"
        ),
    ):
        step(model, opt, batch(0))


def test_reshard_over_auto_axes_fails_as_under_jax_jit():
    """Auto stays Auto: JAX rejects reshard onto Auto axes, pipelined or not."""

    class AutoReshard(mp.PipelinedModel):
        def __init__(self, rngs):
            self.a = mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=0)
            self.b = mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=1)

        def __call__(self, x):
            return self.b(jax.sharding.reshard(self.a(x), P("data")))

    message = "cannot contain axis names that are of type Auto"
    reference_mesh = one_device_mesh(AxisType.Auto)
    with jax.set_mesh(reference_mesh), pytest.raises(ValueError, match=message):
        model = AutoReshard(nnx.Rngs(0))
        nnx.jit(step_fn(2))(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), batch(0))
    mesh = pipeline_mesh(AxisType.Auto)
    model = AutoReshard(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = mp.jit(step_fn(), mesh=mesh, schedule=mp.GPipe(), num_microbatches=2)
    with pytest.raises(ValueError, match=message):
        step(model, opt, batch(0))


def test_submesh_tracing_resolves_partition_specs_on_the_submesh():
    from nnx_mpmd.compiler.trace.stage_programs import submesh_tracing

    mesh = pipeline_mesh(AxisType.Explicit)
    with submesh_tracing(mesh):
        jaxpr = jax.make_jaxpr(lambda x: jax.sharding.reshard(x, P("data", "model")))(
            jax.ShapeDtypeStruct((4, 4), jnp.float32)
        )
    assert jaxpr.out_avals[0].sharding.mesh == mesh.submesh(0).abstract_mesh
    assert jaxpr.out_avals[0].sharding.spec == P("data", "model")
    with (
        jax.set_mesh(mesh.jax_mesh),
        pytest.raises(mp.MeshError, match=r"mesh context .*'stage': 2"),
        submesh_tracing(mesh),
    ):
        pass  # the conflicting context is reported before anything is traced


def test_state_outputs_are_resharded_on_explicit_axes_and_constrained_on_auto_axes():
    from nnx_mpmd.compiler.outer.mesh_inference import constrain_to

    mixed = jax.make_mesh(
        (2, 2),
        ("data", "model"),
        axis_types=(AxisType.Explicit, AxisType.Auto),
        devices=jax.devices()[:4],
    )
    target = NamedSharding(mixed, P("data", "model"))
    x = jax.device_put(jnp.arange(16.0).reshape(4, 4), NamedSharding(mixed, P()))
    y = jax.jit(lambda x: constrain_to(x + 1, target))(x)
    assert y.sharding.is_equivalent_to(target, 2)
    assert jax.typeof(y).sharding.spec == P("data", None)  # only Explicit axes are typed
    np.testing.assert_array_equal(y, np.arange(16.0).reshape(4, 4) + 1)


# -- ordinary (unannotated) model code, data parallel inside a stage ---------------

VOCAB, SEQ = 16, 4


class PlainLM(mp.PipelinedModel):
    """Unannotated: nnx.Embed's gather, dropout, a Linear head; nothing names a mesh axis."""

    def __init__(self, *, embed: bool, rngs: nnx.Rngs) -> None:
        self.embed = mp.Stage(nnx.Embed(VOCAB, WIDTH, rngs=rngs), stage=0) if embed else None
        self.body = mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=0)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.head = mp.Stage(nnx.Linear(WIDTH, VOCAB, rngs=rngs), stage=1)

    def __call__(self, x):
        h = self.embed(x) if self.embed is not None else x
        return self.head(self.drop(jnp.tanh(self.body(h))))


def plain_loss(model, batch):
    logits = model(batch["x"])
    if model.embed is None:
        return jnp.mean((logits - batch["y"]) ** 2)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def plain_batch(embed: bool, seed: int):
    rng = np.random.default_rng(seed)
    if embed:
        tokens = rng.integers(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
        return {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    return {
        "x": rng.normal(size=(BATCH, WIDTH)).astype(np.float32),
        "y": rng.normal(size=(BATCH, VOCAB)).astype(np.float32),
    }


def plain_step(model, optimizer, batch, num_microbatches=None):
    grad_fn = mp.value_and_grad(plain_loss, num_microbatches=num_microbatches)
    loss, grads = grad_fn(model, batch)
    optimizer.update(model, grads)
    return loss


def data_parallel_mesh(axis_type) -> mp.MpmdMesh:
    return mp.MpmdMesh(
        jax.make_mesh((2, 4), ("stage", "data"), axis_types=(axis_type,) * 2), "stage"
    )


@pytest.mark.parametrize(
    "schedule", [mp.OneFOneB(), mp.ZeroBubbleH1()], ids=["1f1b", "zb-h1"]
)  # ZB-H1: the split backward types its cotangents with their shardings
@pytest.mark.parametrize("embed", [False, True], ids=["dense", "embed"])
@pytest.mark.parametrize("axis_type", list(AXIS_TYPES), ids=list(AXIS_TYPES))
def test_unannotated_data_parallel_stage_equals_reference(axis_type, embed, schedule, recwarn):
    """No annotation, batch sharded over "data": the same numbers on both axis types.

    On an Explicit mesh the dense model traces with each microbatch sharded (its
    type says ``f32[4@data, 8]``); nnx.Embed's gather with data-sharded ids is
    rejected by JAX's Explicit rules, so that step replicates its batch and warns.
    """
    kind = AXIS_TYPES[axis_type]
    models = [PlainLM(embed=embed, rngs=nnx.Rngs(0)) for _ in range(2)]
    ref_opt, opt = (nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param) for m in models)
    reference = nnx.jit(functools.partial(plain_step, num_microbatches=MICROBATCHES))
    pipelined = mp.jit(
        plain_step, mesh=data_parallel_mesh(kind), schedule=schedule, num_microbatches=4
    )
    for step in range(STEPS):
        ref_loss = reference(models[0], ref_opt, plain_batch(embed, step))
        loss = pipelined(models[1], opt, plain_batch(embed, step))
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    expected, got = params_of(models[0]), params_of(models[1])
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-5, atol=1e-6, err_msg=path)
    replicated = [w for w in recwarn if issubclass(w.category, ReplicatedBatchWarning)]
    assert len(replicated) == (1 if embed and kind == AxisType.Explicit else 0)
    compiled = next(iter(pipelined._cache.values())).compiled
    assert compiled.batch_axis == (None if replicated else "data")


def test_replicated_batch_warning_names_the_op_and_the_fixes():
    model = PlainLM(embed=True, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    mesh = data_parallel_mesh(AxisType.Explicit)
    step = mp.jit(plain_step, mesh=mesh, schedule=mp.GPipe(), num_microbatches=2)
    with pytest.warns(
        ReplicatedBatchWarning,
        match=r"sharded over the Explicit mesh axis 'data' of MpmdMesh\('stage': 2.*"
        r"\.at\[\.\.\.\]\.get\(out_sharding=\).*replicated on every device.*"
        r"out_sharding=P\(\.\.\.\).*AxisType\.Auto.*batch_axis=None",
    ):
        step.lower(model, opt, plain_batch(True, 0))
    quiet = mp.jit(plain_step, mesh=mesh, schedule=mp.GPipe(), num_microbatches=2, batch_axis=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicatedBatchWarning)
        quiet.lower(model, opt, plain_batch(True, 0))


def test_forward_only_step_on_explicit_data_parallel_mesh_equals_reference():
    """Forward-only outputs ``[m, B/m@data, ...]`` merge into ``[B, ...]`` (replicated)."""
    model = PlainLM(embed=False, rngs=nnx.Rngs(0))
    model.eval()  # no dropout
    x = plain_batch(False, 0)["x"]
    expected = nnx.jit(lambda m, x: m(x))(model, x)
    infer = mp.jit(
        lambda m, x: m(x),
        mesh=data_parallel_mesh(AxisType.Explicit),
        schedule=mp.GPipe(),
        num_microbatches=MICROBATCHES,
    )
    np.testing.assert_allclose(
        np.asarray(infer(model, x)), np.asarray(expected), rtol=1e-5, atol=1e-6
    )


def test_microbatches_are_typed_sharded_on_an_explicit_batch_axis():
    seen = []

    class Probe(mp.PipelinedModel):
        def __init__(self, rngs):
            self.a = mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=0)

        def __call__(self, x):
            seen.append(jax.typeof(x).sharding.spec)
            return self.a(x)

    model = Probe(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    for kind, spec in [(AxisType.Explicit, P("data", None)), (AxisType.Auto, P(None, None))]:
        seen.clear()
        mesh = mp.MpmdMesh(
            jax.make_mesh((1, 4), ("stage", "data"), axis_types=(kind,) * 2), "stage"
        )
        step = mp.jit(
            lambda m, o, x: mp.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2))(m, x)[0],
            mesh=mesh,
            schedule=mp.GPipe(),
            num_microbatches=2,
        )
        step.lower(model, opt, jnp.ones((8, WIDTH)))
        assert seen[0] == spec, kind
