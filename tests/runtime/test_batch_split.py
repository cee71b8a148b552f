"""A one-device batch split into microbatches without ``jax.device_put`` (runtime/batch_split).

The splitter must give exactly the array ``jax.device_put`` of the reshaped
batch gives (values, dtype, shape, sharding), decline every batch it does not
handle, and a pipelined step fed a ``jnp`` batch must equal the same step fed
the NumPy batch and the ``nnx.jit`` reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from pipeline_models import build, make_batch, make_mesh, params_of, train_step_fn

import nnx_mpmd as mp
from nnx_mpmd.aot.stats import count_compilations
from nnx_mpmd.runtime import batch_split
from nnx_mpmd.runtime.batch_split import MicrobatchSplitter, microbatched_shape


def _target(kind: str) -> NamedSharding:
    devices = jax.devices()
    if kind == "explicit-data":
        return NamedSharding(jax.make_mesh((2,), ("data",), devices=devices[2:4]), P(None, "data"))
    if kind == "auto-data-model":  # replicated over "model": two devices per shard
        mesh = jax.make_mesh(
            (2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=devices[4:8]
        )
        return NamedSharding(mesh, P(None, "data"))
    if kind == "sequence":  # the rows and the sequence both sharded
        mesh = jax.make_mesh((2, 2), ("data", "seq"), devices=devices[4:8])
        return NamedSharding(mesh, P(None, "data", "seq"))
    assert kind == "replicated"
    return NamedSharding(jax.make_mesh((2,), ("data",), devices=devices[6:8]), P())


def _source(kind: str, dtype) -> jax.Array:
    values = np.arange(16 * 4).reshape(16, 4) % 7
    array = jnp.asarray(values.astype(dtype))
    if kind == "committed":
        return jax.device_put(array, jax.devices()[5])
    assert kind == "uncommitted"
    return array


@pytest.mark.parametrize(
    "target_kind", ["explicit-data", "auto-data-model", "sequence", "replicated"]
)
@pytest.mark.parametrize("source_kind", ["uncommitted", "committed"])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int32, np.bool_])
def test_split_equals_device_put_of_the_reshaped_batch(target_kind, source_kind, dtype):
    target, batch = _target(target_kind), _source(source_kind, dtype)
    split = MicrobatchSplitter().split(batch, 4, target)
    expected = jax.device_put(batch.reshape(4, 4, 4), target)
    assert split is not None
    assert split.sharding == expected.sharding == target
    assert (split.shape, split.dtype, split.weak_type) == (expected.shape, expected.dtype, False)
    assert split.committed
    np.testing.assert_array_equal(np.asarray(split), np.asarray(expected))
    for got, want in zip(split.addressable_shards, expected.addressable_shards, strict=True):
        assert got.device == want.device and got.index == want.index
        np.testing.assert_array_equal(np.asarray(got.data), np.asarray(want.data))


def test_the_plan_is_made_once_per_kind_of_batch(monkeypatch):
    made = []
    monkeypatch.setattr(batch_split, "_PLANS", {})
    monkeypatch.setattr(batch_split, "_plan", lambda *a: made.append(a) or None)
    target = _target("explicit-data")
    for seed in range(3):  # a step prepared again gets a new splitter: plans are shared
        MicrobatchSplitter().split(jnp.full((8, 2), seed, jnp.float32), 4, target)
    MicrobatchSplitter().split(jnp.zeros((8, 2), jnp.int32), 4, target)
    assert len(made) == 2


def test_a_new_splitter_compiles_nothing_for_a_known_kind_of_batch(monkeypatch):
    monkeypatch.setattr(batch_split, "_PLANS", {})
    monkeypatch.setattr(batch_split, "_PROGRAMS", {})
    target, batch = _target("explicit-data"), jnp.zeros((8, 6), jnp.float32)
    with count_compilations() as first:
        MicrobatchSplitter().split(batch, 2, target)
    other = jnp.ones((8, 6), jnp.float32)
    with count_compilations() as second:
        MicrobatchSplitter().split(other, 2, target)
    assert first.names == ["jit(microbatch_split)"] and second.count == 0


def test_batches_for_two_meshes_cut_alike_share_one_split_program(monkeypatch):
    # Inputs to the first stage's mesh, labels to the last one's: one compilation.
    monkeypatch.setattr(batch_split, "_PLANS", {})
    monkeypatch.setattr(batch_split, "_PROGRAMS", {}, raising=False)
    first, last = (jax.make_mesh((1,), ("data",), devices=[d]) for d in jax.devices()[2:8:5])
    x, y = jnp.zeros((8, 6), jnp.float32), jnp.ones((8, 6), jnp.float32)
    with count_compilations() as counter:
        split_x = MicrobatchSplitter().split(x, 2, NamedSharding(first, P(None, "data")))
        split_y = MicrobatchSplitter().split(y, 2, NamedSharding(last, P(None, "data")))
    assert counter.names == ["jit(microbatch_split)"]
    assert split_x is not None and split_y is not None
    assert split_y.sharding.mesh == last and float(split_y.sum()) == 48.0


def _declined():
    devices = jax.devices()
    two = NamedSharding(jax.make_mesh((2,), ("data",), devices=devices[:2]), P("data"))
    return {
        "numpy": np.zeros((8, 2), np.float32),
        "weak-typed": jnp.zeros((8, 2)) + 0.5 * jnp.ones((8, 2)).sum(),
        "python-scalar-weak": jnp.full((8, 2), 0.1),
        "on two devices": jax.device_put(jnp.zeros((8, 2)), two),
        "prng keys": jax.random.split(jax.random.key(0), 8),
        "rows not divisible": jnp.zeros((6, 2), jnp.float32),
        "a scalar": jnp.float32(1.0),
    }


@pytest.mark.parametrize("name", list(_declined()))
def test_batches_it_does_not_handle_are_declined(name):
    value = _declined()[name]
    if name == "weak-typed":
        value = jax.lax.convert_element_type(value, jnp.float32)  # not weak: must be split
        assert MicrobatchSplitter().split(value, 4, _target("explicit-data")) is not None
        return
    if name == "python-scalar-weak":
        assert value.weak_type
    assert MicrobatchSplitter().split(value, 4, _target("explicit-data")) is None


def test_declined_when_the_target_is_not_a_named_sharding():
    single = jax.sharding.SingleDeviceSharding(jax.devices()[3])
    assert MicrobatchSplitter().split(jnp.zeros((8, 2), jnp.float32), 4, single) is None


def test_microbatched_shape():
    assert microbatched_shape((12, 3, 5), 4) == (4, 3, 3, 5)


def _counting_splits(monkeypatch) -> list[bool]:
    """Records, for every split the runtime asks for, whether the splitter did it."""
    seen: list[bool] = []
    original = MicrobatchSplitter.split

    def split(self, value, m, target):
        result = original(self, value, m, target)
        seen.append(result is not None)
        return result

    monkeypatch.setattr(MicrobatchSplitter, "split", split)
    return seen


@pytest.mark.parametrize(
    "model_name,schedule,axis_types",
    [("mlp", mp.OneFOneB(), None), ("lm", mp.ZeroBubbleH1(), AxisType.Auto)],
    ids=["mlp-1F1B-explicit", "lm-ZBH1-auto"],
)
def test_a_step_fed_device_batches_equals_numpy_batches_and_nnx_jit(
    monkeypatch, model_name, schedule, axis_types
):
    monkeypatch.setattr(batch_split, "_PLANS", {})  # earlier tests' plans would compile nothing
    monkeypatch.setattr(batch_split, "_PROGRAMS", {})
    seen = _counting_splits(monkeypatch)
    ref_model, ref_opt, loss_fn, kind = build(model_name, "adamw", 2)
    model, opt, _, _ = build(model_name, "adamw", 2)
    reference = nnx.jit(train_step_fn(loss_fn, num_microbatches=4))
    step = mp.jit(
        train_step_fn(loss_fn),
        mesh=make_mesh(2, 2, axis_types),
        schedule=schedule,
        num_microbatches=4,
    )
    feeds = [
        lambda b: b,  # NumPy
        lambda b: jax.tree.map(jnp.asarray, b),  # one device, uncommitted
        lambda b: jax.device_put(b, jax.devices()[7]),  # committed to a device of no stage
        lambda b: jax.tree.map(jnp.asarray, b),
    ]
    for i, feed in enumerate(feeds):
        batch = make_batch(kind, 16, seed=i)
        ref_loss = reference(ref_model, ref_opt, batch)
        fed = feed(batch)
        with count_compilations() as counter:
            loss = step(model, opt, fed)
        # Only the split programs compile, once per source device and kind of leaf (leaves
        # cut alike share one); the step's never again.
        names = counter.names
        if i in (1, 2):
            assert set(names) == {"jit(microbatch_split)"}, f"step {i} compiled {names}"
            assert len(names) <= len(batch), f"step {i} compiled {names}"
        elif i == 3:
            assert names == [], f"step {i} compiled {names}"
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert seen.count(True) == 3 * len(make_batch(kind, 16)), seen  # the three device feeds
    expected, got = params_of(ref_model), params_of(model)
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-5, err_msg=path)


def _placements(mesh):
    """Batches already placed by the caller: none of them is the splitter's."""
    jax_mesh = mesh.jax_mesh
    return {
        "whole mesh, rows over data": NamedSharding(jax_mesh, P("data")),
        "whole mesh, rows over stage": NamedSharding(jax_mesh, P("stage")),
        "first submesh, rows over data": NamedSharding(mesh.submesh(0), P("data")),
        "last submesh, replicated": NamedSharding(mesh.submesh(1), P()),
    }


@pytest.mark.parametrize("axis_types", [None, AxisType.Auto], ids=["explicit", "auto"])
def test_batches_the_caller_placed_equal_nnx_jit(monkeypatch, axis_types):
    seen = _counting_splits(monkeypatch)
    mesh = make_mesh(2, 2, axis_types)
    ref_model, ref_opt, loss_fn, kind = build("mlp", "adamw", 2)
    model, opt, _, _ = build("mlp", "adamw", 2)
    reference = nnx.jit(train_step_fn(loss_fn, num_microbatches=4))
    step = mp.jit(train_step_fn(loss_fn), mesh=mesh, schedule=mp.OneFOneB(), num_microbatches=4)
    for i, (name, sharding) in enumerate(_placements(mesh).items()):
        batch = make_batch(kind, 16, seed=i)
        ref_loss = reference(ref_model, ref_opt, batch)
        loss = step(model, opt, jax.device_put(batch, sharding))
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5, err_msg=name)
    assert seen and not any(seen), seen  # all went through jax.device_put
    expected, got = params_of(ref_model), params_of(model)
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-5, err_msg=path)
