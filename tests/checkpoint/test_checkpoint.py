"""save / restore: round trips, logical paths, layouts, training continuation."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_helpers import (
    Net,
    batches,
    hand_place,
    make_mesh,
    make_optimizer,
    param_values,
    run_steps,
    spec_for,
)
from flax import nnx
from jax.sharding import NamedSharding

from nnx_mpmd.checkpoint import restore, save
from nnx_mpmd.checkpoint.layout import collect

STAGES_4 = (0, 1, 2, 3)
STAGES_2 = (0, 0, 1, 1)


def manifest_of(path) -> dict:
    return json.loads((path / "manifest" / "metadata").read_text())


def assert_same_params(a: nnx.Module, b: nnx.Module) -> None:
    va, vb = param_values(a), param_values(b)
    assert sorted(va) == sorted(vb)
    for key in va:
        np.testing.assert_array_equal(va[key], vb[key], err_msg=str(key))


def test_round_trip_of_every_leaf_kind(tmp_path):
    model = Net(STAGES_4, seed=1)
    optimizer = make_optimizer(model)
    run_steps(model, optimizer, batches(0, 2))
    rngs = nnx.Rngs(params=3, dropout=jax.random.key(5, impl="rbg"))
    rngs.dropout()  # advance a counter so it differs from a fresh Rngs
    tree = {
        "model": model,
        "optimizer": optimizer,
        "rngs": rngs,
        "step": 2,
        "lr": 0.5,
        "name": "run-a",
        "table": np.arange(6, dtype=np.int16).reshape(2, 3),
        "bias": jnp.full((3,), 2.0, jnp.bfloat16),
    }
    save(tmp_path / "c", tree)

    model2 = Net(STAGES_4, seed=7)
    optimizer2 = make_optimizer(model2)
    rngs2 = nnx.Rngs(params=0, dropout=jax.random.key(0, impl="rbg"))
    target = {
        "model": model2,
        "optimizer": optimizer2,
        "rngs": rngs2,
        "step": 0,
        "lr": 0.0,
        "name": "",
        "table": np.zeros((2, 3), np.int16),
        "bias": jnp.zeros((3,), jnp.bfloat16),
    }
    out = restore(tmp_path / "c", target)

    assert out["model"] is model2 and out["optimizer"] is optimizer2
    assert (out["step"], out["lr"], out["name"]) == (2, 0.5, "run-a")
    assert out["table"].dtype == np.int16 and out["table"].tolist() == tree["table"].tolist()
    assert out["bias"].dtype == jnp.bfloat16 and out["bias"].tolist() == [2.0] * 3
    assert_same_params(model, model2)
    assert int(optimizer2.step[...]) == 2
    np.testing.assert_array_equal(
        optimizer2.opt_state[0].mu["blocks"][1]["module"]["linear"]["kernel"][...],
        optimizer.opt_state[0].mu["blocks"][1]["module"]["linear"]["kernel"][...],
    )
    assert jax.random.key_impl(rngs2.dropout.key[...]) == jax.random.key_impl(rngs.dropout.key[...])
    for stream in ("params", "dropout"):
        np.testing.assert_array_equal(
            jax.random.key_data(getattr(rngs2, stream).key[...]),
            jax.random.key_data(getattr(rngs, stream).key[...]),
        )
        assert int(getattr(rngs2, stream).count[...]) == int(getattr(rngs, stream).count[...])
    assert rngs2.dropout().dtype == rngs.dropout().dtype


def test_arrays_are_saved_under_logical_paths(tmp_path):
    model = Net(STAGES_4)
    save(tmp_path / "c", {"model": model, "optimizer": make_optimizer(model)})
    names = set(manifest_of(tmp_path / "c")["entries"])
    assert "model.blocks.3.linear.kernel" in names
    assert "optimizer.opt_state.0.mu.blocks.3.linear.kernel" in names
    assert "optimizer.opt_state.0.nu.head.kernel" in names
    assert not any(".module." in name for name in names)


def test_optimizer_alone_keeps_module_components():
    model = Net(STAGES_4)
    names = [e.name for e in collect({"optimizer": make_optimizer(model)}).entries]
    assert "optimizer.opt_state.0.mu.blocks.3.module.linear.kernel" in names


def test_state_and_model_in_one_tree_save_each_variable_once():
    model = Net(STAGES_2)
    names = [e.name for e in collect({"a_state": nnx.state(model), "model": model}).entries]
    assert len(names) == len(set(names))
    # the State comes first in tree order; the suffix rule strips its `module` too
    assert "a_state.blocks.0.linear.kernel" in names
    assert not any(name.startswith("model.") for name in names)


@pytest.mark.parametrize(
    "source_stages, source_meshes, target_stages, target_meshes",
    [
        (STAGES_4, 4, STAGES_4, 4),  # same layout
        (STAGES_4, 4, STAGES_2, 2),  # fewer meshes, different Stage numbering
        (STAGES_4, 4, None, 0),  # plain unplaced model on one device
        (None, 0, STAGES_4, 4),  # plain checkpoint into a placed pipelined model
    ],
)
def test_restore_into_other_layouts(
    tmp_path, source_stages, source_meshes, target_stages, target_meshes
):
    source = Net(source_stages, seed=1)
    source_opt = make_optimizer(source)
    run_steps(source, source_opt, batches(0, 1))
    if source_meshes:
        hand_place({"m": source, "o": source_opt}, make_mesh(source_meshes))
    save(tmp_path / "c", {"model": source, "optimizer": source_opt})

    target = Net(target_stages, seed=9)
    target_opt = make_optimizer(target)
    if target_meshes:
        hand_place({"m": target, "o": target_opt}, make_mesh(target_meshes))
    before = {
        id(node): node.get_value().sharding
        for _, node in nnx.iter_graph((target, target_opt))
        if isinstance(node, nnx.Variable)
    }
    restore(tmp_path / "c", {"model": target, "optimizer": target_opt})

    assert_same_params(source, target)
    np.testing.assert_array_equal(target_opt.step[...], source_opt.step[...])
    for _, node in nnx.iter_graph((target, target_opt)):
        if isinstance(node, nnx.Variable):
            assert node.get_value().sharding == before[id(node)]
    if target_meshes == 2:
        kernel = target.blocks[3].module.linear.kernel[...]
        assert kernel.sharding == NamedSharding(make_mesh(2).submesh(1), spec_for(kernel))


def test_restore_onto_abstract_targets(tmp_path):
    save(tmp_path / "c", {"w": jnp.arange(8.0), "model": Net(STAGES_2, seed=3)})
    sharding = NamedSharding(make_mesh(4).submesh(2), jax.sharding.PartitionSpec("data"))
    abstract_model = nnx.eval_shape(lambda: Net(STAGES_2))
    out = restore(
        tmp_path / "c",
        {"w": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sharding), "model": abstract_model},
    )
    assert out["w"].sharding == sharding and out["w"].tolist() == list(range(8))
    kernel = abstract_model.blocks[0].module.linear.kernel[...]
    assert isinstance(kernel, jax.Array) and kernel.sharding.device_set == {jax.devices()[0]}
    assert_same_params(abstract_model, Net(STAGES_2, seed=3))


def test_partial_restore_of_the_model_only(tmp_path):
    model = Net(STAGES_2, seed=4)
    save(tmp_path / "c", {"model": model, "optimizer": make_optimizer(model), "step": 5})
    target = Net(None)
    restore(tmp_path / "c", {"model": target}, partial=True)
    assert_same_params(model, target)


@pytest.mark.parametrize("target_stages, target_meshes", [(STAGES_4, 4), (None, 0)])
def test_training_after_restore_equals_uninterrupted(tmp_path, target_stages, target_meshes):
    data = batches(0, 4)
    model = Net(STAGES_4, seed=2)
    optimizer = make_optimizer(model)
    run_steps(model, optimizer, data[:2])
    save(tmp_path / "c", {"model": model, "optimizer": optimizer})
    uninterrupted = run_steps(model, optimizer, data[2:])

    resumed_model = Net(target_stages, seed=11)
    resumed_opt = make_optimizer(resumed_model)
    if target_meshes:
        # restore into a placed layout, then gather onto one device to train under nnx.jit
        hand_place((resumed_model, resumed_opt), make_mesh(target_meshes))
    restore(tmp_path / "c", {"model": resumed_model, "optimizer": resumed_opt})
    for _, node in nnx.iter_graph((resumed_model, resumed_opt)):
        if isinstance(node, nnx.Variable):
            node.set_value(jax.device_put(np.asarray(node.get_value()), jax.devices()[0]))
    resumed = run_steps(resumed_model, resumed_opt, data[2:])
    assert resumed == uninterrupted
    assert_same_params(model, resumed_model)
