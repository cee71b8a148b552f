"""Inputs meet computed values inside a stage, on Explicit and Auto axes.

A stage's inputs (its batch leaves, its state, the step's extra arguments) are
traced with the sharding they have at run time on the stage's submesh, so an op
that combines an input with a value computed in the stage types as under
``nnx.jit`` inside ``jax.set_mesh``. Before, inputs were traced without the
submesh's mesh and JAX's Explicit rules rejected ``dynamic_update_slice`` (and
others) with a raw ``ShardingTypeError``, also with ``batch_axis=None``.

Each op class below mixes inputs with a computed value in the few ways models
do (a KV cache update, a gather by computed indices, a where, an einsum with and
without ``out_sharding``, ...). Every case runs forward only (``m(x, inputs)``
under `mp.jit`) and under `mp.value_and_grad`, on a 2-stage x 2-device mesh of
Explicit or Auto axes, and equals the same model under ``nnx.jit`` inside
``jax.set_mesh``.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_mpmd as mp
from nnx_mpmd.compiler.trace.trace_step import ReplicatedBatchWarning

WIDTH = 4
CACHE = 8
BATCH = 8  # 2 microbatches of 4 rows: divisible by the data axis
MICROBATCHES = 2
AXIS_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}
SORTING = {"gather", "scan"}  # argsort, sort: see the value_and_grad test


def _update(h, inputs):
    """dynamic_update_slice into an input cache, dynamic_slice at a computed start, .at[].set."""
    new_cache = lax.dynamic_update_slice(inputs["cache"], h[:, None, :], (0, 2, 0))
    start = jnp.int32(3) + (jnp.sum(h) > 1e9).astype(jnp.int32)  # computed, always 3
    window = lax.dynamic_slice_in_dim(new_cache, start - 2, WIDTH, axis=1).sum(1)
    read = lax.dynamic_slice_in_dim(inputs["cache"], start, 2, axis=1).sum(1)
    scattered = inputs["vals"].at[:, 1:3].set(h[:, :2]).at[:, jnp.array([0, 3])].add(h[:, 2:])
    return window + read * h + scattered, new_cache


def _gather(h, inputs):
    """take_along_axis of computed values by input indices and of inputs by computed
    indices, one_hot of input ids, argmax of a mixed value."""
    table = jnp.concatenate([h, 2.0 * h], axis=1)
    by_input = jnp.take_along_axis(table, inputs["idx"], axis=1)
    by_computed = jnp.take_along_axis(inputs["cache"][:, :WIDTH, 0], jnp.argsort(h, axis=1), 1)
    picked = jax.nn.one_hot(inputs["ids"], WIDTH) * h
    best = jax.nn.one_hot(jnp.argmax(h + inputs["vals"], axis=1), WIDTH) * inputs["vals"]
    taken = jnp.take(inputs["vals"], jnp.array([3, 2, 1, 0]), axis=1) * h
    return by_input + by_computed + picked + best + taken, None


def _combine(h, inputs):
    """concatenate and where of an input with a computed value."""
    joined = jnp.concatenate([h, inputs["vals"]], axis=1)
    chosen = jnp.where(inputs["vals"] > 0, h, 0.5 * inputs["vals"])
    return joined[:, :WIDTH] * joined[:, WIDTH:] + chosen, None


def _contract(h, inputs):
    """einsum of an input with a computed value, with and without out_sharding."""
    outer = jnp.einsum("bi,bj->bi", h, inputs["vals"])
    typed = jnp.einsum(
        "bi,bci->bc", h, inputs["cache"][:, :WIDTH, :], out_sharding=jax.typeof(h).sharding
    )
    return outer + typed, None


def _scan(h, inputs):
    """cumsum and sort of values mixing an input with a computed one."""
    return jnp.cumsum(h * inputs["vals"], axis=1) + jnp.sort(h - inputs["vals"], axis=1), None


OPS = {
    "update": _update,
    "gather": _gather,
    "combine": _combine,
    "contract": _contract,
    "scan": _scan,
}


class Mixer(nnx.Module):
    """Stage 0: a computed value ``h`` combined with the step's inputs by one op class."""

    def __init__(self, op: str, *, rngs: nnx.Rngs) -> None:
        self.op = op
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x, inputs):
        h = jnp.tanh(self.linear(x))
        seen = [x, self.linear.kernel[...], *inputs.values(), h]
        MESHES_SEEN.append([jax.typeof(v).sharding.mesh.axis_names for v in seen])
        return OPS[self.op](h, inputs)


# The mesh axes each value in Mixer is typed on, per trace: under nnx.jit inside
# jax.set_mesh every input names the mesh, as a computed value does.
MESHES_SEEN: list[list[tuple[str, ...]]] = []


def assert_inputs_typed_on_the_submesh():
    assert MESHES_SEEN
    for meshes in MESHES_SEEN:
        assert meshes == [("data",)] * len(meshes), meshes


class MixNet(nnx.Module):
    def __init__(self, op: str, *, rngs: nnx.Rngs) -> None:
        self.mixer = Mixer(op, rngs=rngs)
        self.head = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x, inputs):
        mixed, cache = self.mixer(x, inputs)
        return self.head(mixed), cache


def make_model(op: str) -> MixNet:
    model = MixNet(op, rngs=nnx.Rngs(0))
    mp.assign_stages(model, {"mixer": 0, "head": 1})
    return model


def make_inputs(seed: int = 0) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, WIDTH)).astype(np.float32)
    return x, {
        "cache": rng.normal(size=(BATCH, CACHE, WIDTH)).astype(np.float32),
        "vals": rng.normal(size=(BATCH, WIDTH)).astype(np.float32),
        "ids": rng.integers(0, WIDTH, size=(BATCH,)).astype(np.int32),
        "idx": rng.integers(0, 2 * WIDTH, size=(BATCH, WIDTH)).astype(np.int32),
    }


def pipeline_mesh(kind: AxisType, data: int = 2) -> mp.MpmdMesh:
    devices = jax.devices()[: 2 * data]
    mesh = jax.make_mesh((2, data), ("stage", "data"), axis_types=(kind,) * 2, devices=devices)
    return mp.MpmdMesh(mesh, "stage")


def reference_mesh(kind: AxisType) -> jax.sharding.Mesh:
    """The reference's mesh: the submesh's axis name on two other devices."""
    return jax.make_mesh((2,), ("data",), axis_types=(kind,), devices=jax.devices()[4:6])


def on_reference(mesh: jax.sharding.Mesh, *trees):
    """Inputs for the reference, replicated on its mesh (as a user puts them there)."""
    return jax.device_put(trees, NamedSharding(mesh, P()))


def forward(model, x, inputs):
    return model(x, inputs)


def loss_fn(model, batch):
    out, _ = model(batch["x"], batch["inputs"])
    return jnp.mean(out**2)


def grad_step(num_microbatches=None):
    def step(model, batch):
        return mp.value_and_grad(loss_fn, num_microbatches=num_microbatches)(model, batch)

    return step


def assert_trees_close(got, expected):
    got_leaves, got_tree = jax.tree.flatten(got)
    want_leaves, want_tree = jax.tree.flatten(expected)
    assert got_tree == want_tree
    for a, b in zip(got_leaves, want_leaves):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def pipelined(fn, mesh, **kwargs):
    return mp.jit(fn, mesh=mesh, schedule=mp.GPipe(), num_microbatches=MICROBATCHES, **kwargs)


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
@pytest.mark.parametrize("op", list(OPS))
def test_forward_mixing_inputs_with_computed_values_equals_nnx_jit(op, axis_type, recwarn):
    kind = AXIS_TYPES[axis_type]
    x, inputs = make_inputs()
    ref_mesh = reference_mesh(kind)
    with jax.set_mesh(ref_mesh):
        expected = nnx.jit(forward)(make_model(op), *on_reference(ref_mesh, x, inputs))
    MESHES_SEEN.clear()
    got = pipelined(forward, pipeline_mesh(kind))(make_model(op), x, inputs)
    assert_trees_close(got, expected)
    assert_inputs_typed_on_the_submesh()
    assert not [w for w in recwarn if issubclass(w.category, ReplicatedBatchWarning)]


@pytest.mark.parametrize("axis_type", list(AXIS_TYPES))
@pytest.mark.parametrize("op", list(OPS))
def test_value_and_grad_mixing_inputs_with_computed_values_equals_nnx_jit(op, axis_type, recwarn):
    kind = AXIS_TYPES[axis_type]
    x, inputs = make_inputs(1)
    ref_mesh = reference_mesh(kind)
    with jax.set_mesh(ref_mesh):
        batch = {"x": x, "inputs": inputs}
        expected = nnx.jit(grad_step(MICROBATCHES))(
            make_model(op), on_reference(ref_mesh, batch)[0]
        )
    step = pipelined(grad_step(), pipeline_mesh(kind))
    MESHES_SEEN.clear()
    got = step(make_model(op), {"x": x, "inputs": inputs})
    assert_trees_close(got, expected)
    assert_inputs_typed_on_the_submesh()
    replicated = [w for w in recwarn if issubclass(w.category, ReplicatedBatchWarning)]
    compiled = next(iter(step._cache.values())).compiled
    if op in SORTING and kind == AxisType.Explicit:
        # sort's derivative adds a replicated operand: JAX rejects it on a sharded
        # batch (jax.grad under jax.set_mesh too), so the batch is replicated.
        assert len(replicated) == 1 and "sort" in str(replicated[0].message)
        assert compiled.batch_axis is None
    else:
        assert not replicated
        assert compiled.batch_axis == "data"  # the batch stayed sharded


def test_sort_gradient_on_a_sharded_explicit_batch_is_rejected_by_jax_itself():
    """Why the sorting ops replicate their batch under mp.value_and_grad: plain JAX."""
    mesh = reference_mesh(AxisType.Explicit)
    with jax.set_mesh(mesh):
        h, v = jax.device_put((jnp.ones((4, WIDTH)), jnp.ones((4, WIDTH))), P("data"))
        with pytest.raises(Exception, match="sort must have equal shardings"):
            jax.jit(jax.grad(lambda h, v: jnp.sort(h - v, axis=1).sum()))(h, v)


# -- the reproducer: a layer that takes and returns a cache -------------------


class CacheLayer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x, cache):
        y = self.lin(x)
        return y, lax.dynamic_update_slice(cache, y, (0, 0, 0))


class CacheNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([CacheLayer(rngs), CacheLayer(rngs)])

    def __call__(self, x, caches):
        new = []
        for layer, cache in zip(self.layers, caches):
            x, cache = layer(x, cache)
            new.append(cache)
        return x, new


@pytest.mark.parametrize("data", [1, 2])
@pytest.mark.parametrize("batch_axis", ["data", None], ids=["sharded", "replicated"])
def test_layers_taking_and_returning_a_cache_on_explicit_axes(batch_axis, data):
    """The issue's reproducer on ``jax.make_mesh``'s default (Explicit) axes."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3, WIDTH)), jnp.float32)
    caches = [jnp.zeros((4, 8, WIDTH))] * 2
    ref_mesh = jax.make_mesh((data,), ("data",), devices=jax.devices()[4 : 4 + data])
    with jax.set_mesh(ref_mesh):
        expected = nnx.jit(lambda m, x, c: m(x, c))(
            CacheNet(nnx.Rngs(0)), *on_reference(ref_mesh, x, caches)
        )
    net = CacheNet(nnx.Rngs(0))
    mp.assign_stages(net, {"layers.0": 0, "layers.1": 1})
    mesh = mp.MpmdMesh(
        jax.make_mesh((2, data), ("stage", "data"), devices=jax.devices()[: 2 * data]), "stage"
    )
    assert set(mesh.axis_types) == {AxisType.Explicit}
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicatedBatchWarning)
        got = pipelined(lambda m, x, c: m(x, c), mesh, batch_axis=batch_axis)(net, x, caches)
    assert_trees_close(got, expected)


def test_code_rejected_with_any_batch_sharding_is_a_compile_error_without_a_warning():
    """An op JAX rejects whatever the batch's sharding (as under nnx.jit) names the fix."""

    class Mismatch(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
            self.b = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

        def __call__(self, x):
            h = jax.sharding.reshard(self.a(x), P(None, "data"))  # columns over "data"
            return self.b(lax.dynamic_update_slice(h, x[:, :1], (0, 0)))  # rows replicated

    model = Mismatch(nnx.Rngs(0))
    mp.assign_stages(model, {"a": 0, "b": 1})
    step = pipelined(lambda m, x: m(x), pipeline_mesh(AxisType.Explicit))
    with (
        warnings.catch_warnings(),
        pytest.raises(
            mp.CompileError,
            match=r"Explicit sharding rules reject an op of the step.*dynamic_update_slice.*"
            r"nnx\.jit inside jax\.set_mesh.*reshard.*out_sharding=.*AxisType\.Auto",
        ),
    ):
        warnings.simplefilter("error", ReplicatedBatchWarning)
        step(model, jnp.ones((BATCH, WIDTH)))


# -- state meeting computed values: a sharded buffer each microbatch writes ------------


class Recorder(nnx.Module):
    """Writes each microbatch's mean activation into a state buffer sharded over "data"."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.means = nnx.BatchStat(jnp.zeros((CACHE, WIDTH)), out_sharding=("data", None))

    def __call__(self, x):
        h = jnp.tanh(self.linear(x))
        row = jnp.mean(h, axis=0, keepdims=True)
        rows = jax.sharding.reshard(jnp.broadcast_to(row, (4, WIDTH)), P("data", None))
        self.means[...] = lax.dynamic_update_slice(0.5 * self.means[...], rows, (2, 0))
        return h


class RecordingNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.recorder = Recorder(rngs)
        self.head = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return self.head(self.recorder(x))


def recording_loss(model, x):
    return jnp.mean(model(x) ** 2)


def test_sharded_state_updated_with_a_computed_value_equals_nnx_jit():
    """A state buffer placed ``P("data", None)`` takes a dynamic_update_slice of rows
    computed and sharded the same way: its input type must carry its placement."""
    x, _ = make_inputs(2)
    ref_mesh = reference_mesh(AxisType.Explicit)
    with jax.set_mesh(ref_mesh):  # Flax shards the annotated buffer eagerly here
        reference = RecordingNet(nnx.Rngs(0))
        mp.assign_stages(reference, {"recorder": 0, "head": 1})
        ref_step = mp.value_and_grad(recording_loss, num_microbatches=MICROBATCHES)
        expected = nnx.jit(ref_step)(reference, on_reference(ref_mesh, x)[0])
    mesh = pipeline_mesh(AxisType.Explicit)
    with jax.set_mesh(mesh.jax_mesh):  # as the sharding guide says for annotated state
        model = RecordingNet(nnx.Rngs(0))
    mp.assign_stages(model, {"recorder": 0, "head": 1})
    step = pipelined(lambda m, x: mp.value_and_grad(recording_loss)(m, x), mesh)
    got = step(model, x)
    assert_trees_close(got, expected)
    np.testing.assert_allclose(
        np.asarray(mp.gather(model.recorder.means[...])),
        np.asarray(reference.recorder.means[...]),
        rtol=1e-5,
        atol=1e-6,
    )
