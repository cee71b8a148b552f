"""Checkpoints of state placed with `nnx_mpmd.placement.place.place` (MpmdArray leaves)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_helpers import Net, batches, make_mesh, make_optimizer, param_values, run_steps
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_mpmd.annotate.annotate import Stage
from nnx_mpmd.checkpoint import CheckpointManager, restore, save
from nnx_mpmd.placement.mpmd_array import MpmdArray
from nnx_mpmd.placement.place import gather, place

STAGES_4 = (0, 1, 2, 3)
STAGES_2 = (0, 0, 1, 1)


def placed(stages, num_meshes, seed):
    model = Net(stages, seed=seed)
    optimizer = make_optimizer(model)
    if num_meshes:
        place((model, optimizer), make_mesh(num_meshes))
    return model, optimizer


def shardings(tree) -> dict[int, object]:
    out = {}
    for _, node in nnx.iter_graph(tree):
        if isinstance(node, nnx.Variable):
            value = node.get_value()
            if isinstance(value, MpmdArray):
                out[id(node)] = {i: value.array(i).sharding for i in value.mesh_ids}
            else:
                out[id(node)] = value.sharding
    return out


def assert_same_values(a, b) -> None:
    va, vb = param_values(a), param_values(b)
    assert sorted(va) == sorted(vb)
    for key in va:
        np.testing.assert_array_equal(va[key], vb[key], err_msg=str(key))


def test_replicated_step_count_is_saved_once_from_the_lowest_mesh(tmp_path):
    model, optimizer = placed(STAGES_4, 4, seed=1)
    step = optimizer.step.get_value()
    assert isinstance(step, MpmdArray) and step.mesh_ids == (0, 1, 2, 3)
    save(tmp_path / "c", {"model": model, "optimizer": optimizer})
    entries = json.loads((tmp_path / "c" / "manifest" / "metadata").read_text())["entries"]
    assert [name for name in entries if name.endswith(".step")] == ["optimizer.step"]
    assert entries["optimizer.step"]["layout"]["meshes"] == [0, 1, 2, 3]
    assert entries["model.blocks.2.linear.kernel"]["layout"]["meshes"] is None


@pytest.mark.parametrize(
    "source, target",
    [
        ((STAGES_4, 4), (STAGES_4, 4)),
        ((STAGES_4, 4), (STAGES_2, 2)),
        ((STAGES_4, 4), (None, 0)),
        ((None, 0), (STAGES_4, 4)),
        ((STAGES_2, 2), (STAGES_4, 4)),
    ],
)
def test_placed_checkpoints_restore_into_any_layout(tmp_path, source, target):
    src_model, src_opt = placed(*source, seed=1)
    gathered_model, gathered_opt = Net(source[0], seed=1), None
    gathered_opt = make_optimizer(gathered_model)
    # advance the step count so restoring it is visible
    run_steps(gathered_model, gathered_opt, batches(0, 1))
    restore_tree = {"model": src_model, "optimizer": src_opt}
    save(tmp_path / "src", {"model": gathered_model, "optimizer": gathered_opt})
    restore(tmp_path / "src", restore_tree)
    save(tmp_path / "c", restore_tree)

    dst_model, dst_opt = placed(*target, seed=5)
    before = shardings((dst_model, dst_opt))
    restore(tmp_path / "c", {"model": dst_model, "optimizer": dst_opt})
    assert shardings((dst_model, dst_opt)) == before
    assert_same_values(gathered_model, dst_model)
    step = dst_opt.step.get_value()
    assert int(np.asarray(step)) == 1
    if target[1]:
        assert isinstance(step, MpmdArray) and step.mesh_ids == tuple(range(target[1]))
        for mesh_id in step.mesh_ids:
            assert step.array(mesh_id).sharding.mesh == make_mesh(target[1]).submesh(mesh_id)
            assert int(step.array(mesh_id)) == 1


def test_mpmd_array_copies_keep_their_partition_spec(tmp_path):
    mesh = make_mesh(4)
    copies = {
        i: jax.device_put(jnp.arange(8.0) * (i + 1), NamedSharding(mesh.submesh(i), P("data")))
        for i in (1, 3)
    }
    save(tmp_path / "c", {"x": MpmdArray(copies)})
    target_copies = {
        i: jax.device_put(jnp.zeros(8), NamedSharding(make_mesh(2).submesh(i), P())) for i in (0, 1)
    }
    out = restore(tmp_path / "c", {"x": MpmdArray(target_copies)})["x"]
    assert out.mesh_ids == (0, 1)
    for i in (0, 1):
        assert out.array(i).sharding == target_copies[i].sharding
        assert out.array(i).tolist() == list(np.arange(8.0) * 2)  # mesh 1 was the lowest copy


def test_training_after_restore_into_placed_layout(tmp_path):
    data = batches(3, 4)
    model, optimizer = Net(STAGES_4, seed=2), None
    optimizer = make_optimizer(model)
    run_steps(model, optimizer, data[:2])
    place((model, optimizer), make_mesh(4))
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(2, {"model": model, "optimizer": optimizer}, metadata={"data_position": 2})
        gather((model, optimizer))
        uninterrupted = run_steps(model, optimizer, data[2:])

        resumed_model, resumed_opt = placed(STAGES_2, 2, seed=13)
        mgr.restore({"model": resumed_model, "optimizer": resumed_opt})
        position = mgr.metadata()["data_position"]
    gather((resumed_model, resumed_opt))
    resumed = run_steps(resumed_model, resumed_opt, data[position:])
    assert resumed == uninterrupted
    assert_same_values(model, resumed_model)


class WithDropout(nnx.Module):
    def __init__(self, stages, seed):
        rngs = nnx.Rngs(seed, dropout=seed + 1)
        self.a = Stage(nnx.Linear(2, 2, rngs=rngs), stage=stages[0])
        self.b = Stage(nnx.Dropout(0.5, rngs=rngs), stage=stages[1])
        self.rngs = rngs


@pytest.mark.parametrize("target_meshes", [4, 2, 0])
def test_placed_rng_keys_restore_across_layouts(tmp_path, target_meshes):
    source = WithDropout((0, 3), seed=0)
    source.rngs.dropout()  # advance the counter: a fresh target differs
    place(source, make_mesh(4))
    assert isinstance(source.rngs.dropout.key.get_value(), MpmdArray)
    save(tmp_path / "c", {"m": source})

    target = WithDropout((0, 1), seed=7)
    if target_meshes:
        place(target, make_mesh(target_meshes))
    restore(tmp_path / "c", {"m": target})
    key = target.rngs.dropout.key.get_value()
    if target_meshes:
        assert isinstance(key, MpmdArray) and key.mesh_ids == tuple(range(target_meshes))
    assert jax.random.key_impl(primary(key)) == jax.random.key_impl(
        primary(source.rngs.dropout.key.get_value())
    )
    np.testing.assert_array_equal(
        jax.random.key_data(primary(key)),
        jax.random.key_data(primary(source.rngs.dropout.key.get_value())),
    )
    saved_count = int(np.asarray(source.rngs.dropout.count.get_value()))
    assert int(np.asarray(target.rngs.dropout.count.get_value())) == saved_count > 0


def primary(value):
    return value.array(value.mesh_ids[0]) if isinstance(value, MpmdArray) else value
