"""Every error path of mp.jit / mp.value_and_grad, with its message."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from pipeline_models import MLP, build, make_batch, make_mesh, mlp_loss, params_of, train_step_fn

import nnx_mpmd as mp


def _step(loss_fn=mlp_loss):
    return train_step_fn(loss_fn)


def test_batch_not_divisible_by_microbatches():
    model, opt, _loss_fn, kind = build("mlp", "sgd", 2)
    f = mp.jit(_step(), mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=4)
    with pytest.raises(mp.CompileError, match=r"(shape \(6, 16\)|has 6 rows).*num_microbatches=4"):
        f(model, opt, make_batch(kind, 6))


def test_unannotated_parameters():
    model = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    f = mp.jit(
        _step(lambda m, b: jnp.mean(m(b["x"]) ** 2)),
        mesh=make_mesh(2, 1),
        schedule=mp.GPipe(),
        num_microbatches=2,
    )
    with pytest.raises(mp.PlacementError, match=r"kernel.*Stage|assign_stages"):
        f(model, opt, make_batch("regression", 4))


def test_interleaved_needs_stages_multiple_of_meshes():
    model, opt, _loss_fn, kind = build("mlp", "sgd", 3)
    f = mp.jit(_step(), mesh=make_mesh(2, 1), schedule=mp.Interleaved1F1B(), num_microbatches=4)
    with pytest.raises(
        mp.ScheduleError,
        match=r"Interleaved1F1B cannot place.*2 meshes.*num_stages \(3\).*multiple",
    ):
        f(model, opt, make_batch(kind, 8))


def test_stage_count_must_match_schedule_and_meshes():
    model, opt, _loss_fn, kind = build("mlp", "sgd", 4)
    f = mp.jit(_step(), mesh=make_mesh(2, 1), schedule=mp.OneFOneB(), num_microbatches=4)
    with pytest.raises(mp.ScheduleError, match=r"OneFOneB cannot run.*4 stages on 2 meshes"):
        f(model, opt, make_batch(kind, 8))


def test_stage_called_outside_the_region():
    model, opt, loss_fn, kind = build("mlp", "sgd", 2)

    def step(model, opt, batch):
        loss, grads = mp.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss, model(batch["x"])  # evaluates the model outside the region

    f = mp.jit(step, mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2)
    with pytest.raises(mp.PartitionError, match=r"Stage 0 \(Linear\).*outside mp.value_and_grad"):
        f(model, opt, make_batch(kind, 4))


def test_stages_called_out_of_order():
    class Backwards(mp.PipelinedModel):
        def __init__(self, rngs):
            self.a = mp.Stage(nnx.Linear(16, 16, rngs=rngs), stage=0)
            self.b = mp.Stage(nnx.Linear(16, 16, rngs=rngs), stage=1)

        def __call__(self, x):
            return self.a(self.b(x))

    model = Backwards(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    f = mp.jit(_step(), mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2)
    with pytest.raises(mp.PartitionError, match=r"stage 0 uses a value computed by stage 1"):
        f(model, opt, make_batch("regression", 4))


def test_stage_gap():
    class Gap(mp.PipelinedModel):
        def __init__(self, rngs):
            self.a = mp.Stage(nnx.Linear(16, 16, rngs=rngs), stage=0)
            self.b = mp.Stage(nnx.Linear(16, 16, rngs=rngs), stage=2)

        def __call__(self, x):
            return self.b(self.a(x))

    model = Gap(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    f = mp.jit(_step(), mesh=make_mesh(3, 1), schedule=mp.GPipe(), num_microbatches=2)
    with pytest.raises(mp.PartitionError, match=r"stages \[1\] are never called, but stage 2"):
        f(model, opt, make_batch("regression", 4))


def test_one_stage_called_twice_points_to_a_stage_per_position():
    class CalledTwice(mp.PipelinedModel):
        def __init__(self, rngs):
            self.a = mp.Stage(nnx.Linear(16, 16, rngs=rngs), stage=0)
            self.b = mp.Stage(nnx.Linear(16, 16, rngs=rngs), stage=1)

        def __call__(self, x):
            return self.a(self.b(self.a(x)))

    model = CalledTwice(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    f = mp.jit(_step(), mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2)
    with pytest.raises(
        mp.PartitionError, match=r"stage 0 uses a value computed by stage 1.*Stage of its own"
    ):
        f(model, opt, make_batch("regression", 4))


def test_nested_stages_with_different_numbers():
    class Nested(mp.PipelinedModel):
        def __init__(self, rngs):
            inner = mp.Stage(nnx.Linear(16, 16, rngs=rngs), stage=1)
            self.outer = mp.Stage(nnx.Sequential(inner), stage=0)
            self.last = mp.Stage(nnx.Linear(16, 16, rngs=rngs), stage=1)

        def __call__(self, x):
            return self.last(self.outer(x))

    model = Nested(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    f = mp.jit(_step(), mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2)
    with pytest.raises(mp.PartitionError, match=r"called inside the body of stage 0"):
        f(model, opt, make_batch("regression", 4))


def test_loss_must_be_a_scalar():
    model, opt, _, kind = build("mlp", "sgd", 2)
    f = mp.jit(
        _step(lambda m, b: m(b["x"])), mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2
    )
    with pytest.raises(mp.CompileError, match=r"float scalar.*float32\[2,16\]"):
        f(model, opt, make_batch(kind, 4))


def test_one_region_per_step():
    model, opt, loss_fn, kind = build("mlp", "sgd", 2)

    def step(model, opt, batch):
        loss, grads = mp.value_and_grad(loss_fn)(model, batch)
        loss2, _ = mp.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss + loss2

    f = mp.jit(step, mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2)
    with pytest.raises(mp.CompileError, match=r"2 times; one pipelined region per step"):
        f(model, opt, make_batch(kind, 4))


def test_conflicting_microbatch_counts():
    model, opt, loss_fn, kind = build("mlp", "sgd", 2)
    f = mp.jit(
        train_step_fn(loss_fn, num_microbatches=4),
        mesh=make_mesh(2, 1),
        schedule=mp.GPipe(),
        num_microbatches=2,
    )
    with pytest.raises(mp.CompileError, match=r"num_microbatches=4.*num_microbatches=2"):
        f(model, opt, make_batch(kind, 8))


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_num_microbatches_must_be_positive_int(bad):
    with pytest.raises(mp.CompileError, match=r"num_microbatches must be an int >= 1"):
        mp.jit(_step(), mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=bad)


def test_mesh_must_be_an_mpmd_mesh():
    mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    with pytest.raises(mp.MeshError, match=r"needs an mp.MpmdMesh, got Mesh"):
        mp.jit(_step(), mesh=mesh, schedule=mp.GPipe(), num_microbatches=2)


def test_no_stage_called_in_the_region():
    model, opt, _, kind = build("mlp", "sgd", 2)
    f = mp.jit(
        _step(lambda m, b: jnp.mean(b["x"] ** 2)),
        mesh=make_mesh(2, 1),
        schedule=mp.GPipe(),
        num_microbatches=2,
    )
    with pytest.raises(mp.PartitionError, match=r"called no Stage"):
        f(model, opt, make_batch(kind, 4))


def test_a_stage_reached_only_through_another_method_names_the_gap():
    model, opt, _, kind = build("mlp", "sgd", 3)

    def skipping(m, b):  # stage 1's module is called directly, not through its Stage
        x = m.layers[0](b["x"])
        x = m.layers[1].module(x)
        return mlp_loss_of(m.layers[2](x), b)

    f = mp.jit(_step(skipping), mesh=make_mesh(3, 1), schedule=mp.GPipe(), num_microbatches=2)
    with pytest.raises(
        mp.PartitionError,
        match=r"stages \[1\] are never called, but stage 2 is: stage numbers must be 0..2 "
        r"without gaps.*runs as its stage only when it is called itself, stage\(x\)",
    ):
        f(model, opt, make_batch(kind, 4))


def test_a_constant_aux_value_is_named_with_the_fix():
    model, opt, _, kind = build("mlp", "sgd", 2)

    def step(m, o, b):
        (loss, _), grads = mp.value_and_grad(lambda mm, bb: (mlp_loss(mm, bb), 0.5), has_aux=True)(
            m, b
        )
        o.update(m, grads)
        return loss

    f = mp.jit(step, mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2)
    with pytest.raises(
        mp.CompileError,
        match=r"region output 1 \(loss/aux\) is the constant 0.5; compute it from the model's "
        r"outputs, or return a value that does not depend on the model from the step itself",
    ):
        f(model, opt, make_batch(kind, 4))


def test_an_aux_value_no_array_can_hold_is_named():
    """A string in the aux (a label for logging, say) is refused with its path, before JAX
    fails on the region's outputs."""
    model, opt, _, kind = build("mlp", "sgd", 2)

    def loss_with_label(m, b):
        return mlp_loss(m, b), {"loss": mlp_loss(m, b), "name": "mse"}

    def step(m, o, b):
        (loss, _), grads = mp.value_and_grad(loss_with_label, has_aux=True)(m, b)
        o.update(m, grads)
        return loss

    f = mp.jit(step, mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2)
    with pytest.raises(
        mp.CompileError, match=r"aux value at \['name'\] is a str, not an array or a number"
    ):
        f(model, opt, make_batch(kind, 4))


class _Unannotated(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(2)])

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


def test_an_optimizer_made_before_assign_stages_is_named():
    """``assign_stages`` wraps modules in ``Stage`` (``module`` joins the paths); an
    optimizer created before keeps the old tree: the error says to create it after."""
    model = _Unannotated(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    mp.assign_stages(model, {"layers.0": 0, "layers.1": 1})
    step = mp.jit(_step(), mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2)
    with pytest.raises(
        mp.CompileError, match=r"created before mp.assign_stages.*create the optimizer after"
    ):
        step(model, optimizer, make_batch("regression", 4))


def test_parameters_changed_after_the_optimizer_are_not_called_a_stale_optimizer():
    """A layer replaced between steps (its bias gone) is a different tree, not an
    optimizer created before assign_stages: the error names the differing key."""
    model, optimizer, loss_fn, _ = build("mlp", "adamw", 2)
    step = mp.jit(
        train_step_fn(loss_fn), mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2
    )
    step(model, optimizer, make_batch("regression", 4))
    model.layers[1] = mp.Stage(nnx.Linear(16, 16, use_bias=False, rngs=nnx.Rngs(1)), stage=1)
    with pytest.raises(mp.CompileError) as raised:
        step(model, optimizer, make_batch("regression", 4))
    message = str(raised.value)
    assert "before mp.assign_stages" not in message
    assert re.search(
        r"two trees of the step differ at tree_map tree\['layers'\]\[1\]\['module'\]: "
        r"\['bias'\] is in one and not the other\. .*parameters changed .* create a new "
        r"optimizer for the model as it is now",
        message,
    ), message


def mlp_loss_of(out, batch):
    return jnp.mean((out - batch["y"]) ** 2)


def test_value_and_grad_outside_jit_matches_nnx():
    model = MLP(2, rngs=nnx.Rngs(0))
    batch = make_batch("regression", 8)
    loss, grads = mp.value_and_grad(mlp_loss, num_microbatches=4)(model, batch)
    ref_loss, ref_grads = nnx.value_and_grad(mlp_loss)(model, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for (_, a), (_, b) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)):
        np.testing.assert_allclose(a.get_value(), b.get_value(), atol=1e-6)


def test_schedule_by_name_equals_the_reference():
    model, opt, loss_fn, kind = build("mlp", "sgd", 2)
    ref_model, ref_opt, _, _ = build("mlp", "sgd", 2)
    f = mp.jit(_step(), mesh=make_mesh(2, 1), schedule="1F1B", num_microbatches=2)
    assert f.schedule == mp.OneFOneB()
    batch = make_batch(kind, 4)
    loss = f(model, opt, batch)
    ref_loss = nnx.jit(train_step_fn(loss_fn, 2))(ref_model, ref_opt, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    expected, got = params_of(ref_model), params_of(model)
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-5, err_msg=path)


def test_unknown_schedule_name():
    with pytest.raises(mp.ScheduleError, match=r"mp.jit\(schedule=...\): unknown schedule 'ifb'"):
        mp.jit(_step(), mesh=make_mesh(2, 1), schedule="ifb", num_microbatches=2)


@pytest.mark.parametrize("bad", [None, 3])
def test_schedule_must_be_a_schedule(bad):
    with pytest.raises(mp.ScheduleError, match=r"not a schedule: it has no .*mp.OneFOneB\(\)"):
        mp.jit(_step(), mesh=make_mesh(2, 1), schedule=bad, num_microbatches=2)


def test_schedule_class_instead_of_an_instance():
    with pytest.raises(mp.ScheduleError, match=r"got the class GPipe, not a schedule.*GPipe\(\)"):
        mp.jit(_step(), mesh=make_mesh(2, 1), schedule=mp.GPipe, num_microbatches=2)


def test_place_reads_a_schedule_name_and_rejects_other_objects():
    model, opt, _, _ = build("mlp", "sgd", 4)
    mesh = make_mesh(2, 1)  # submesh q is device q
    mp.place((model, opt), mesh, "dualpipev")
    placed = [layer.module.kernel.get_value().sharding for layer in model.layers]
    expected = [mp.DualPipeV().mesh_of(s, 4, 2) for s in range(4)]
    assert [sharding.mesh.devices.flat[0].id for sharding in placed] == expected == [0, 1, 1, 0]
    with pytest.raises(mp.PlacementError, match=r"schedule=3 \(int\), which has no mesh_of"):
        mp.place((model, opt), mesh, 3)
    with pytest.raises(mp.PlacementError, match=r"\(ABCMeta\), which has no mesh_of.*instance"):
        mp.place((model, opt), mesh, mp.GPipe)


def test_arguments_by_keyword_equal_the_reference():
    model, opt, loss_fn, kind = build("mlp", "sgd", 2)
    ref_model, ref_opt, _, _ = build("mlp", "sgd", 2)

    def step(model, optimizer, scale=1.0, batch=None):
        loss, grads = mp.value_and_grad(loss_fn, num_microbatches=2)(model, batch)
        optimizer.update(model, jax.tree.map(lambda g: g * scale, grads))
        return loss

    f = mp.jit(step, mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2)
    reference = nnx.jit(step)
    for seed in range(2):
        batch = make_batch(kind, 4, seed=seed)
        loss = f(model, optimizer=opt, batch=batch)  # scale takes its default
        ref_loss = reference(ref_model, ref_opt, 1.0, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert f.num_compiled_steps == 1
    assert f.lower(model, opt, batch=batch).instructions
    expected, got = params_of(ref_model), params_of(model)
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-5, err_msg=path)


def test_keyword_only_and_unknown_arguments():
    model, opt, loss_fn, kind = build("mlp", "sgd", 2)

    def step(model, optimizer, *, batch):
        return train_step_fn(loss_fn)(model, optimizer, batch)

    f = mp.jit(step, mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2)
    with pytest.raises(mp.CompileError, match=r"step takes batch by keyword only.*positionally"):
        f(model, opt, batch=make_batch(kind, 4))
    with pytest.raises(mp.CompileError, match=r"cannot call step.*missing .* argument: 'batch'"):
        f(model, opt, bacth=make_batch(kind, 4))
    with pytest.raises(mp.CompileError, match=r"cannot call step.*unexpected keyword.*'bacth'"):
        f(model, opt, batch=make_batch(kind, 4), bacth=1)
