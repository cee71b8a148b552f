"""Tests of partition/merge_partitions, place, placement_of, leaf_sharding, gather."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.nnx.training.optimizer import OptVariable
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_mpmd.annotate.annotate import PipelinedModel, Stage, assign_stages, variable_stage
from nnx_mpmd.errors import PartitionError, PlacementError
from nnx_mpmd.placement.mesh import MpmdMesh
from nnx_mpmd.placement.mpmd_array import MpmdArray, normalize_spec
from nnx_mpmd.placement.partition import (
    leaf_mesh_ids,
    leaf_sharding,
    merge_partitions,
    partition,
    placement_of,
)
from nnx_mpmd.placement.place import gather, place

VOCAB, DIM = 16, 8


class Dense(nnx.Module):
    def __init__(self, n_in, n_out, kernel_axes, bias_axes, *, rngs):
        init = nnx.initializers.lecun_normal()
        self.kernel = nnx.Param(
            init(rngs.params(), (n_in, n_out)), out_sharding=kernel_axes, eager_sharding=False
        )
        self.bias = nnx.Param(jnp.zeros(n_out), out_sharding=bias_axes, eager_sharding=False)

    def __call__(self, x):
        return x @ self.kernel[...] + self.bias[...]


class Block(nnx.Module):
    def __init__(self, *, rngs):
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.up = Dense(DIM, 2 * DIM, (None, "data"), ("data",), rngs=rngs)
        self.down = Dense(2 * DIM, DIM, ("data", None), None, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class TiedHead(nnx.Module):
    def __init__(self, embed, *, rngs):
        self.embed = embed
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)

    def __call__(self, x):
        return self.embed.attend(self.norm(x))


class Head(nnx.Module):
    def __init__(self, *, rngs):
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.out = Dense(DIM, VOCAB, (None, "data"), None, rngs=rngs)

    def __call__(self, x):
        return self.out(self.norm(x))


class GPT(PipelinedModel):
    """Embedding on stage 0, one block per stage, the head on the last stage."""

    def __init__(self, num_stages, *, tied=False, rngs):
        embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.embed = Stage(embed, stage=0)
        self.blocks = nnx.List([Stage(Block(rngs=rngs), stage=s) for s in range(num_stages)])
        head = TiedHead(embed, rngs=rngs) if tied else Head(rngs=rngs)
        self.head = Stage(head, stage=num_stages - 1)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class VShape:
    """Stages go down the meshes and back up: 0 1 2 3 3 2 1 0."""

    def mesh_of(self, stage, num_stages, num_meshes):
        rank = stage % (2 * num_meshes)
        return rank if rank < num_meshes else 2 * num_meshes - 1 - rank


class Looped:
    def mesh_of(self, stage, num_stages, num_meshes):
        return stage % num_meshes


class OffByOne:
    def mesh_of(self, stage, num_stages, num_meshes):
        return stage + 1


TOKENS = jnp.array([[1, 2, 3, 4], [5, 6, 7, 8]])


def make_mesh(axis_type=AxisType.Explicit):
    return MpmdMesh(jax.make_mesh((4, 2), ("stage", "data"), axis_types=(axis_type,) * 2), "stage")


def make_gpt(num_stages=4, tied=False):
    model = GPT(num_stages, tied=tied, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    return model, optimizer


def flat(state):
    return list(nnx.to_flat_state(state))


# ---------------------------------------------------------------- partition


@pytest.mark.parametrize("num_meshes", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True])
def test_partition_merge_round_trip_is_exact(num_meshes, tied):
    model, optimizer = make_gpt(4, tied=tied)
    for state in (nnx.state(model), nnx.state(optimizer)):
        parts = partition(state, num_meshes)
        assert len(parts) == num_meshes
        for index, part in enumerate(parts):
            for path, leaf in flat(part):
                stage = variable_stage(leaf)
                assert stage is None or stage % num_meshes == index, path
        merged = merge_partitions(parts)
        assert [p for p, _ in flat(merged)] == [p for p, _ in flat(state)]
        assert all(a is b for (_, a), (_, b) in zip(flat(merged), flat(state), strict=True))
        assert jax.tree.structure(merged) == jax.tree.structure(state)
        for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(state), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_partition_puts_unstaged_leaves_on_every_mesh():
    _, optimizer = make_gpt(4)
    parts = partition(optimizer, 4)  # an NNX object is accepted too
    for part in parts:
        paths = {p for p, _ in flat(part)}
        assert ("step",) in paths and ("opt_state", 0, "count") in paths


def test_partition_with_custom_mesh_of():
    model, _ = make_gpt(8)
    parts = partition(nnx.state(model), 4, lambda s: VShape().mesh_of(s, 8, 4))
    stages = [{variable_stage(v) for _, v in flat(part)} for part in parts]
    assert stages == [{0, 7}, {1, 6}, {2, 5}, {3, 4}]


def test_partition_errors():
    model, _ = make_gpt(2)
    with pytest.raises(PartitionError, match=r"expects an nnx\.State .* got dict"):
        partition({"a": 1}, 2)
    with pytest.raises(PartitionError, match="num_meshes >= 1, got 0"):
        partition(nnx.state(model), 0)
    with pytest.raises(PartitionError, match=r"stage 1, which mesh_of maps to mesh 2, outside"):
        partition(nnx.state(model), 2, lambda s: 2 * s)
    with pytest.raises(PartitionError, match=r"maps to mesh -1"):
        partition(nnx.state(model), 2, lambda s: "zero")


def test_merge_partitions_errors():
    model, _ = make_gpt(2)
    a = nnx.State({"x": nnx.Variable(jnp.zeros(2))})
    b = nnx.State({"x": nnx.Variable(jnp.ones(2))})
    with pytest.raises(PartitionError, match=r"x differs between state 0 and state 1"):
        merge_partitions([a, b])
    same = nnx.State({"x": nnx.Variable(jnp.zeros(2))})
    assert len(flat(merge_partitions([a, same]))) == 1
    with pytest.raises(PartitionError, match=r"item 1 is a dict, not an nnx\.State"):
        merge_partitions([nnx.state(model), {}])


# ---------------------------------------------------------------- place


def expected_spec(variable):
    out = variable.get_metadata().get("out_sharding")
    return normalize_spec(P() if out is None else P(*out))


def check_placed(model, optimizer, mesh, mesh_of):
    params = {}
    for path, variable in nnx.iter_graph(model):
        if isinstance(variable, nnx.Param):
            value = variable.get_value()
            target = mesh_of(variable_stage(variable))
            assert isinstance(value, jax.Array), path
            assert mesh.mesh_id_of(value) == target, path
            assert normalize_spec(value.sharding.spec) == expected_spec(variable), path
            params[tuple(path)] = (target, expected_spec(variable))
    assert params
    replicated = []
    for path, variable in nnx.iter_graph(optimizer):
        if not isinstance(variable, nnx.Variable):
            continue
        value = variable.get_value()
        match = [v for p, v in params.items() if tuple(path[-len(p) :]) == p]
        if match:
            target, spec = match[0]
            assert mesh.mesh_id_of(value) == target, path
            assert normalize_spec(value.sharding.spec) == spec, path
        else:
            assert isinstance(value, MpmdArray), path
            assert value.mesh_ids == tuple(range(mesh.num_meshes))
            replicated.append(tuple(path))
    assert sorted(replicated) == [("opt_state", 0, "count"), ("step",)]


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize(
    ("schedule", "num_stages"), [(None, 4), (None, 8), (Looped(), 8), (VShape(), 8)]
)
def test_place_gpt_and_adamw(axis_type, schedule, num_stages):
    mesh = make_mesh(axis_type)
    model, optimizer = make_gpt(num_stages)
    result = place((model, optimizer), mesh, schedule)
    assert result[0] is model and result[1] is optimizer
    if isinstance(schedule, VShape):

        def mesh_of(stage):
            return schedule.mesh_of(stage, num_stages, 4)

    else:

        def mesh_of(stage):
            return stage % 4

    check_placed(model, optimizer, mesh, mesh_of)
    kernel = model.blocks[0].module.up.kernel.get_value()
    assert kernel.sharding.mesh.axis_types == (axis_type,)  # the user's axis types
    assert [s.data.shape for s in kernel.addressable_shards] == [(DIM, DIM), (DIM, DIM)]


def test_tied_embedding_lives_on_its_owner_mesh():
    mesh = make_mesh()
    model, optimizer = make_gpt(4, tied=True)
    place((model, optimizer), mesh)
    embedding = model.embed.module.embedding
    assert embedding.get_metadata()["mpmd_stages"] == (0, 3)
    assert leaf_mesh_ids(embedding.get_value(), mesh) == (0,)
    assert model.head.module.embed.embedding is embedding
    assert leaf_mesh_ids(optimizer.opt_state[0].mu["embed"]["module"]["embedding"][...], mesh) == (
        0,
    )


def test_place_is_idempotent():
    mesh = make_mesh()
    model, optimizer = make_gpt(4)
    place((model, optimizer), mesh)
    before = [
        v.get_value() for _, v in nnx.iter_graph((model, optimizer)) if isinstance(v, nnx.Variable)
    ]
    place({"m": model, "o": [optimizer]}, mesh)
    after = [
        v.get_value() for _, v in nnx.iter_graph((model, optimizer)) if isinstance(v, nnx.Variable)
    ]
    assert all(a is b for a, b in zip(before, after, strict=True))


def test_place_moves_between_layouts():
    mesh = make_mesh()
    model, optimizer = make_gpt(8)
    place((model, optimizer), mesh)
    place((model, optimizer), mesh, VShape())
    check_placed(model, optimizer, mesh, lambda s: VShape().mesh_of(s, 8, 4))


def test_place_state_returns_new_placed_state_and_keeps_the_model():
    mesh = make_mesh()
    model, _ = make_gpt(4)
    state = nnx.state(model)
    placed, marker = place((state, "keep"), mesh)
    assert marker == "keep" and placed is not state
    kernel = placed["blocks"][2]["module"]["up"]["kernel"].get_value()
    assert leaf_mesh_ids(kernel, mesh) == (2,)
    assert leaf_mesh_ids(model.blocks[2].module.up.kernel.get_value(), mesh) is None


def test_place_plain_state_leaves_go_everywhere():
    mesh = make_mesh()
    state = nnx.State({"x": jnp.arange(4.0)})
    placed = place(state, mesh)
    value = placed["x"]
    assert isinstance(value, MpmdArray) and value.mesh_ids == (0, 1, 2, 3)
    np.testing.assert_array_equal(np.asarray(value), np.arange(4.0))


def test_optimizer_state_without_metadata_follows_param_by_path_suffix():
    class Plain(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(4, 4, rngs=rngs)
            self.b = nnx.Linear(4, 4, rngs=rngs)

    mesh = make_mesh()
    model = Plain(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    assign_stages(model, {"a": 1, "b": 2})
    mu = optimizer.opt_state[0].mu
    assert variable_stage(mu["a"]["kernel"]) is None
    place((model, optimizer), mesh)
    assert leaf_mesh_ids(mu["a"]["kernel"].get_value(), mesh) == (1,)
    assert leaf_mesh_ids(mu["b"]["bias"].get_value(), mesh) == (2,)


def test_factored_optimizer_state_is_replicated_inside_its_mesh():
    mesh = make_mesh()
    param = nnx.Param(
        jnp.zeros((4, 6)), mpmd_stage=1, out_sharding=(None, "data"), eager_sharding=False
    )
    factored = OptVariable(jnp.zeros((3,)), **param.get_metadata())
    assert placement_of(factored, ("opt", "w"), mesh) == ((1,), P())
    bad_axis = OptVariable(
        jnp.zeros((3,)), mpmd_stage=1, out_sharding=("stage",), eager_sharding=False
    )
    with pytest.raises(PlacementError, match="names the mpmd axis 'stage'"):
        placement_of(bad_axis, ("opt", "w"), mesh)


def test_placement_of_matches_place_decisions():
    mesh = make_mesh()
    model, _ = make_gpt(8)
    kernel = model.blocks[5].module.up.kernel
    assert placement_of(kernel, ("blocks", 5, "module", "up", "kernel"), mesh) == (
        (1,),
        P(None, "data"),
    )
    assert placement_of(kernel, "blocks.5.module.up.kernel", mesh, VShape(), 8) == (
        (2,),
        P(None, "data"),
    )
    step = nnx.Variable(jnp.zeros((), jnp.int32))
    assert placement_of(step, "step", mesh) == ((0, 1, 2, 3), P())


def test_sharding_rules_map_logical_axes():
    mesh = make_mesh()
    param = nnx.Param(
        jnp.zeros((4, 6)),
        mpmd_stage=0,
        out_sharding=("embed", None),
        sharding_rules=(("embed", "data"),),
        eager_sharding=False,
    )
    assert placement_of(param, "w", mesh)[1] == P("data", None)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_leaf_sharding(axis_type):
    mesh = make_mesh(axis_type)
    sub = mesh.submesh(2)
    param = nnx.Param(jnp.zeros((4, 6)), out_sharding=P(None, "data"), eager_sharding=False)
    assert leaf_sharding(param, sub) == NamedSharding(sub, P(None, "data"))
    assert leaf_sharding({}, sub) == NamedSharding(sub, P())
    assert leaf_sharding({"out_sharding": "data"}, sub).spec == P("data")
    assert leaf_sharding({"out_sharding": NamedSharding(sub, P("data"))}, sub).spec == P("data")
    assert leaf_sharding({"out_sharding": ((), None)}, sub).spec == P((), None)


def test_leaf_mesh_ids():
    mesh = make_mesh()
    on_one = jax.device_put(jnp.ones(4), NamedSharding(mesh.submesh(3), P("data")))
    assert leaf_mesh_ids(on_one, mesh) == (3,)
    assert leaf_mesh_ids(MpmdArray({1: on_one}), mesh) == (1,)
    assert leaf_mesh_ids(jnp.ones(2), mesh) is None
    assert leaf_mesh_ids(np.ones(2), mesh) is None


# ---------------------------------------------------------------- placement errors


def test_place_lists_every_param_without_stage():
    mesh = make_mesh()
    model = nnx.Dict(
        a=Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=0), b=nnx.Linear(2, 2, rngs=nnx.Rngs(1))
    )
    before = model["a"].module.kernel.get_value()
    with pytest.raises(
        PlacementError, match=r"2 parameter\(s\) have no stage: b\.bias, b\.kernel.*Stage"
    ):
        place(model, mesh)
    assert model["a"].module.kernel.get_value() is before  # nothing moved
    with pytest.raises(PlacementError, match=r"parameter b\.kernel has no stage.*assign_stages"):
        placement_of(model["b"].kernel, "b.kernel", mesh)


@pytest.mark.parametrize(
    ("out_sharding", "shape", "message"),
    [
        (("stage", None), (4, 6), r"names the mpmd axis 'stage'"),
        ((None, "data"), (4, 5), r"dimension 1 of shape \(4, 5\) is not divisible by 2"),
        ((None, None, "data"), (4, 6), r"has 3 entries but the value has shape \(4, 6\)"),
        ((1, None), (4, 6), r"entry 1 is not an axis name"),
        (5, (4, 6), r"out_sharding=5 is not a tuple of axis names"),
    ],
)
def test_bad_out_sharding(out_sharding, shape, message):
    mesh = make_mesh()
    param = nnx.Param(
        jnp.zeros(shape), mpmd_stage=0, out_sharding=out_sharding, eager_sharding=False
    )
    model = nnx.Dict(w=param)
    with pytest.raises(PlacementError, match=message):
        place(model, mesh)
    with pytest.raises(PlacementError, match=message):
        leaf_sharding(param, mesh.submesh(0), "w", mpmd_axis="stage")


def test_stage_mapped_outside_the_mesh():
    mesh = make_mesh()
    model, _ = make_gpt(4)
    with pytest.raises(PlacementError, match=r"stage 3 of 4 maps to mesh 4 under OffByOne"):
        place(model, mesh, OffByOne())


def test_placement_of_with_schedule_needs_num_stages():
    mesh = make_mesh()
    with pytest.raises(PlacementError, match="needs num_stages"):
        placement_of(nnx.Param(jnp.zeros(2), mpmd_stage=0), "w", mesh, VShape())


def test_place_needs_an_mpmd_mesh():
    model, _ = make_gpt(2)
    with pytest.raises(PlacementError, match="place expects an MpmdMesh, got Mesh"):
        place(model, make_mesh().jax_mesh)


# ---------------------------------------------------------------- gather


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_gather_round_trip(axis_type):
    mesh = make_mesh(axis_type)
    model, optimizer = make_gpt(4, tied=True)
    expected = model(TOKENS)
    originals = [np.asarray(x) for x in jax.tree.leaves(nnx.state((model, optimizer)))]
    place((model, optimizer), mesh)
    state_copy = place(nnx.state(model), mesh)
    assert gather((model, optimizer)) == (model, optimizer)
    device = jax.devices()[0]
    gathered = jax.tree.leaves(nnx.state((model, optimizer)))
    assert len(gathered) == len(originals)
    for value, original in zip(gathered, originals, strict=True):
        assert isinstance(value, jax.Array) and value.devices() == {device}
        np.testing.assert_array_equal(np.asarray(value), original)
    np.testing.assert_allclose(model(TOKENS), expected, rtol=1e-6)
    plain = gather(state_copy)
    assert all(x.devices() == {device} for x in jax.tree.leaves(plain))
    tree = gather(
        {"loss": MpmdArray({2: jax.device_put(jnp.float32(2.5), mesh.devices(2)[0])}), "n": 3}
    )
    assert tree["n"] == 3 and float(tree["loss"]) == 2.5 and tree["loss"].devices() == {device}
