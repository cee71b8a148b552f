"""Tests of `MpmdMesh`: submeshes, lookups, equality, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_mpmd.errors import MeshError
from nnx_mpmd.placement.mesh import MpmdMesh

AXIS_TYPES = [AxisType.Explicit, AxisType.Auto]


def make(shape, names, axis_type=AxisType.Explicit, mpmd_axis="stage"):
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))
    return MpmdMesh(mesh, mpmd_axis)


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_submeshes_of_2d_mesh_keep_other_axes_and_their_types(axis_type):
    mesh = make((4, 2), ("stage", "data"), axis_type)
    assert mesh.num_meshes == 4
    assert mesh.axis_names == ("data",)
    assert mesh.axis_types == (axis_type,)
    assert len(mesh.submeshes) == 4
    for i, sub in enumerate(mesh.submeshes):
        assert sub.axis_names == ("data",)
        # Each submesh keeps the user's axis types: Explicit stays Explicit.
        assert sub.axis_types == (axis_type,)
        assert [d.id for d in mesh.devices(i)] == [2 * i, 2 * i + 1]
        assert mesh.submesh(i) is sub


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_mpmd_axis_need_not_be_first(axis_type):
    mesh = make((2, 4), ("data", "stage"), axis_type)
    assert mesh.num_meshes == 4
    assert [d.id for d in mesh.devices(1)] == [1, 5]
    assert mesh.submesh(1).shape == {"data": 2}


def test_one_dimensional_mesh_gives_zero_axis_submeshes_that_hold_arrays():
    mesh = make((8,), ("stage",))
    assert mesh.num_meshes == 8
    assert mesh.axis_names == ()
    sub = mesh.submesh(5)
    assert sub.axis_names == () and sub.size == 1
    x = jax.device_put(jnp.arange(4.0), NamedSharding(sub, P()))
    assert mesh.mesh_id_of(x) == 5
    np.testing.assert_array_equal(np.asarray(x), np.arange(4.0))


def test_three_axis_mesh():
    mesh = make((2, 2, 2), ("stage", "data", "model"))
    assert mesh.num_meshes == 2
    assert mesh.submesh(1).shape == {"data": 2, "model": 2}
    assert [d.id for d in mesh.devices(1)] == [4, 5, 6, 7]


def test_mesh_id_of_arrays_shardings_and_device_sets():
    mesh = make((4, 2), ("stage", "data"))
    sharding = NamedSharding(mesh.submesh(2), P("data"))
    x = jax.device_put(jnp.zeros(4), sharding)
    assert mesh.mesh_id_of(x) == 2
    assert mesh.mesh_id_of(sharding) == 2
    assert mesh.mesh_id_of(set(mesh.devices(3))) == 3
    assert mesh.mesh_id_of(jax.devices()[:1]) is None  # part of a submesh
    assert mesh.mesh_id_of(jax.devices()[:4]) is None  # two submeshes
    whole = jax.device_put(jnp.zeros(8), NamedSharding(mesh.jax_mesh, P()))
    assert mesh.mesh_id_of(whole) is None
    assert mesh.mesh_id_of(3.0) is None
    assert mesh.mesh_id_of(["not a device"]) is None


def test_processes_and_locality_single_process():
    mesh = make((4, 2), ("stage", "data"))
    assert all(mesh.process_indices(i) == {0} for i in range(4))
    assert mesh.local_mesh_ids == (0, 1, 2, 3)
    assert mesh.is_multi_process is False


def test_equality_and_hash():
    a = make((4, 2), ("stage", "data"))
    b = make((4, 2), ("stage", "data"))
    auto = make((4, 2), ("stage", "data"), AxisType.Auto)
    other_axis = make((4, 2), ("stage", "data"), mpmd_axis="data")
    assert a == b and hash(a) == hash(b)
    assert a != auto
    assert a != other_axis
    assert a != make((2, 4), ("stage", "data"))
    assert len({a, b, auto}) == 2
    assert (a == "mesh") is False


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_repr_is_readable(axis_type):
    text = repr(make((4, 2), ("stage", "data"), axis_type))
    assert text.startswith("MpmdMesh('stage': 4, submesh=('data': 2)")
    assert axis_type.name in text
    assert "[[0, 1], [2, 3], [4, 5], [6, 7]]" in text


def test_other_axis_as_mpmd_axis():
    mesh = make((4, 2), ("stage", "data"), mpmd_axis="data")
    assert mesh.num_meshes == 2
    assert mesh.axis_names == ("stage",)
    assert [d.id for d in mesh.devices(1)] == [1, 3, 5, 7]


@pytest.mark.parametrize(
    "bad", [None, "stage", np.array(jax.devices()), jax.sharding.AbstractMesh((8,), ("stage",))]
)
def test_non_mesh_argument_is_rejected(bad):
    with pytest.raises(MeshError, match=r"expects a concrete jax\.sharding\.Mesh"):
        MpmdMesh(bad, "stage")


@pytest.mark.parametrize("axis", ["pipe", 0, None])
def test_missing_axis_lists_the_axes(axis):
    with pytest.raises(MeshError, match=r"no axis named .*its axes are \('stage', 'data'\)"):
        MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), axis)


@pytest.mark.parametrize("index", [-1, 4, 10, 1.0, True, "0"])
def test_index_out_of_range(index):
    mesh = make((4, 2), ("stage", "data"))
    with pytest.raises(MeshError, match=r"submesh index .* out of range .* \[0, 4\)"):
        mesh.submesh(index)
    with pytest.raises(MeshError, match="out of range"):
        mesh.devices(index)
    with pytest.raises(MeshError, match="out of range"):
        mesh.process_indices(index)


def test_numpy_integer_index_is_accepted():
    mesh = make((4, 2), ("stage", "data"))
    assert mesh.submesh(np.int64(2)) is mesh.submeshes[2]


def test_submesh_is_a_plain_jax_mesh():
    mesh = make((4, 2), ("stage", "data"))
    assert all(isinstance(s, Mesh) for s in mesh.submeshes)
    assert mesh.jax_mesh.shape == {"stage": 4, "data": 2}
    assert mesh.mpmd_axis == "stage"


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_computation_on_a_submesh_stays_on_it(axis_type):
    mesh = make((2, 2, 2), ("stage", "data", "model"), axis_type)
    sub = mesh.submesh(1)
    x = jax.device_put(jnp.ones((4, 4)), NamedSharding(sub, P("data", "model")))
    y = jax.jit(lambda a: a * 2.0)(x)
    assert mesh.mesh_id_of(y) == 1
    assert [s.data.shape for s in y.addressable_shards] == [(2, 2)] * 4
    np.testing.assert_array_equal(np.asarray(y), np.full((4, 4), 2.0))


def test_mesh_id_of_accepts_any_iterable_of_devices():
    mesh = make((4, 2), ("stage", "data"))
    assert mesh.mesh_id_of(d for d in jax.devices() if d.id in (6, 7)) == 3
    assert mesh.mesh_id_of(tuple(reversed(mesh.devices(1)))) == 1
    assert mesh.mesh_id_of([]) is None


def test_check_submesh_axis_accepts_a_submesh_axis():
    mesh = make((4, 2), ("stage", "data"))
    assert mesh.check_submesh_axis("data", argument="batch_axis") == "data"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("dp", r"batch_axis='dp' is not an axis of the submeshes of MpmdMesh\('stage': 4"),
        ("stage", r"batch_axis='stage' names the mpmd axis .* does not exist inside a stage"),
        (("data",), r"batch_axis=\('data',\) must be one mesh axis name \(a str\)"),
        (None, r"batch_axis=None must be one mesh axis name"),
    ],
    ids=["unknown", "mpmd-axis", "tuple", "none"],
)
def test_check_submesh_axis_names_the_axis_the_submesh_axes_and_the_fix(name, message):
    mesh = make((4, 2), ("stage", "data"))
    with pytest.raises(MeshError, match=message + r".*pass one of the submesh axes \('data',\), "):
        mesh.check_submesh_axis(name, argument="batch_axis", fix="or drop it")
    with pytest.raises(MeshError, match=r"or drop it\.$"):
        mesh.check_submesh_axis(name, argument="batch_axis", fix="or drop it")


def test_check_submesh_axis_on_a_mesh_with_only_the_mpmd_axis():
    mesh = make((8,), ("stage",))
    with pytest.raises(MeshError, match=r"the submeshes have no axes .*\('stage', 'data'\)"):
        mesh.check_submesh_axis("data", argument="batch_axis")
