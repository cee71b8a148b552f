"""Tests of `MpmdArray`: API, repr, checks, and use inside NNX Variables."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_mpmd.errors import PlacementError
from nnx_mpmd.placement.mesh import MpmdMesh
from nnx_mpmd.placement.mpmd_array import MpmdArray, normalize_spec


def make_mesh(axis_type=AxisType.Explicit):
    return MpmdMesh(jax.make_mesh((4, 2), ("stage", "data"), axis_types=(axis_type,) * 2), "stage")


def copies(mesh, value, spec, mesh_ids):
    return {i: jax.device_put(value, NamedSharding(mesh.submesh(i), spec)) for i in mesh_ids}


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("mesh_ids", [(0,), (1, 3), (0, 1, 2, 3)])
def test_api(axis_type, mesh_ids):
    mesh = make_mesh(axis_type)
    value = jnp.arange(24.0).reshape(4, 6)
    arrays = copies(mesh, value, P("data", None), reversed(mesh_ids))
    a = MpmdArray(arrays, mesh=mesh)
    assert a.mesh_ids == mesh_ids
    assert a.shape == (4, 6) and a.ndim == 2 and a.size == 24 and a.dtype == jnp.float32
    assert a.nbytes == 24 * 4
    assert a.sharding == arrays[mesh_ids[0]].sharding
    assert normalize_spec(a.spec) == P("data")
    assert a.array(mesh_ids[-1]) is arrays[mesh_ids[-1]]
    assert dict(a.arrays) == arrays
    with pytest.raises(TypeError):
        a.arrays[0] = value  # read-only
    np.testing.assert_array_equal(np.asarray(a), np.asarray(value))
    assert np.asarray(a, dtype=np.int32).dtype == np.int32
    assert a.block_until_ready() is a


def test_repr_matches_the_documented_form():
    mesh = make_mesh()
    a = MpmdArray(copies(mesh, jnp.zeros((1024, 4096)), P("data", None), [0]))
    assert (
        repr(a) == "MpmdArray(shape=(1024, 4096), dtype=float32, meshes=(0,), spec=P('data', None))"
    )
    step = MpmdArray(copies(mesh, jnp.zeros((), jnp.uint32), P(), range(4)))
    assert repr(step) == "MpmdArray(shape=(), dtype=uint32, meshes=(0, 1, 2, 3), spec=P())"
    single = MpmdArray({5: jax.device_put(jnp.ones(3), jax.devices()[5])})
    assert repr(single) == "MpmdArray(shape=(3,), dtype=float32, meshes=(5,), spec=None)"


def test_delete():
    mesh = make_mesh()
    a = MpmdArray(copies(mesh, jnp.ones(4), P(), [0, 2]))
    assert not a.is_deleted()
    a.array(0).delete()
    assert not a.is_deleted()  # one copy left
    a.delete()
    assert a.is_deleted()
    a.delete()  # deleting twice is harmless


def test_is_a_pytree_leaf():
    a = MpmdArray({0: jnp.ones(2)})
    tree = {"a": a, "b": [a, 1]}
    assert jax.tree.leaves(tree) == [a, a, 1]
    assert jax.tree.map(lambda x: x, tree)["a"] is a


def test_inside_nnx_variables_split_merge_state():
    mesh = make_mesh()
    model = nnx.Linear(4, 6, rngs=nnx.Rngs(0))
    kernel = MpmdArray(copies(mesh, model.kernel.get_value(), P(None, "data"), [1, 2]))
    model.kernel.set_value(kernel)
    graphdef, state = nnx.split(model)
    assert state["kernel"].get_value() is kernel
    rebuilt = nnx.merge(graphdef, state)
    assert rebuilt.kernel.get_value() is kernel
    assert nnx.state(model, nnx.Param)["kernel"].get_value() is kernel
    assert any(leaf is kernel for leaf in jax.tree.leaves(nnx.state(model)))
    assert "value=MpmdArray(shape=(4, 6), dtype=float32, meshes=(1, 2)" in repr(model.kernel)
    assert "# 24 (96 B)" in repr(model.kernel)


def test_empty_or_non_mapping_is_rejected():
    with pytest.raises(PlacementError, match="needs a non-empty mapping"):
        MpmdArray({})
    with pytest.raises(PlacementError, match="needs a non-empty mapping"):
        MpmdArray([jnp.ones(2)])


@pytest.mark.parametrize("key", [-1, "0", 1.0, True])
def test_bad_keys(key):
    with pytest.raises(PlacementError, match="is not a submesh index"):
        MpmdArray({key: jnp.ones(2)})


def test_non_array_values():
    with pytest.raises(PlacementError, match=r"value for mesh 0 is a ndarray, not a jax\.Array"):
        MpmdArray({0: np.ones(2)})


def test_copies_must_agree():
    mesh = make_mesh()
    a = copies(mesh, jnp.ones((4, 2)), P("data"), [0])[0]
    with pytest.raises(PlacementError, match=r"float32\[4, 2\] but mesh 1 has float32\[2, 4\]"):
        MpmdArray({0: a, 1: copies(mesh, jnp.ones((2, 4)), P("data"), [1])[1]})
    with pytest.raises(PlacementError, match=r"but mesh 1 has int32\[4, 2\]"):
        MpmdArray({0: a, 1: copies(mesh, jnp.ones((4, 2), jnp.int32), P("data"), [1])[1]})
    with pytest.raises(PlacementError, match=r"has spec .* but mesh 1 has .*same PartitionSpec"):
        MpmdArray({0: a, 1: copies(mesh, jnp.ones((4, 2)), P(None, "data"), [1])[1]})
    # trailing None entries do not count as a difference
    same = copies(mesh, jnp.ones((4, 2)), P("data", None), [1])[1]
    assert MpmdArray({0: a, 1: same}).mesh_ids == (0, 1)


def test_copy_on_the_wrong_submesh():
    mesh = make_mesh()
    on_two = copies(mesh, jnp.ones(4), P(), [2])[2]
    with pytest.raises(PlacementError, match=r"copy for mesh 1 lies on devices \[4, 5\], not on"):
        MpmdArray({1: on_two}, mesh=mesh)


@pytest.mark.parametrize("missing", [1, "x", None])
def test_array_of_missing_mesh(missing):
    a = MpmdArray({0: jnp.ones(2)})
    with pytest.raises(PlacementError, match=r"has no copy on mesh .*lives on meshes \(0,\)"):
        a.array(missing)


def test_normalize_spec():
    assert normalize_spec(None) is None
    assert normalize_spec(P(None, None)) == P()
    assert normalize_spec(P("a", None, "b", None)) == P("a", None, "b")


def test_holds_typed_prng_keys_and_sharded_copies():
    mesh = make_mesh()
    keys = MpmdArray(copies(mesh, jax.random.key(0), P(), [0, 3]), mesh=mesh)
    assert keys.shape == () and jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)
    assert (
        jax.random.key_data(keys.array(3)).tolist() == jax.random.key_data(keys.array(0)).tolist()
    )
    sharded = MpmdArray(copies(mesh, jnp.arange(8.0), P("data"), [2]), mesh=mesh)
    assert [s.data.shape for s in sharded.array(2).addressable_shards] == [(4,), (4,)]
    assert {d.id for d in sharded.sharding.device_set} == {4, 5}
