"""Validation of what the user hands mp.jit: mesh axis names, grad transforms, hidden stages.

Each error is raised as early as the library can know it (``mp.jit(...)`` for a
bad ``batch_axis``, the first trace for a grad transform around the stages) and
its message names the culprit and the fix.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from pipeline_models import (
    MLP,
    WIDTH,
    build,
    make_batch,
    make_mesh,
    mlp_loss,
    params_of,
    train_step_fn,
)

import nnx_mpmd as mp
from nnx_mpmd.placement.mesh import MpmdMesh


def _mesh_1d(num_meshes: int = 2) -> MpmdMesh:
    devices = jax.devices()[:num_meshes]
    return MpmdMesh(jax.make_mesh((num_meshes,), ("stage",), devices=devices), "stage")


def _jit(step, mesh, **kwargs):
    return mp.jit(step, mesh=mesh, schedule=mp.GPipe(), num_microbatches=2, **kwargs)


# --------------------------------------------------------------- batch_axis


def test_batch_axis_typo_is_rejected_at_jit_time():
    with pytest.raises(
        mp.MeshError,
        match=r"batch_axis='dp' is not an axis of the submeshes of MpmdMesh\('stage': 2, "
        r"submesh=\('data': 2\).*pass one of the submesh axes \('data',\), or "
        r"batch_axis=None to replicate",
    ):
        _jit(train_step_fn(mlp_loss), make_mesh(2, 2), batch_axis="dp")


def test_batch_axis_typo_is_rejected_by_the_decorator_form():
    with pytest.raises(mp.MeshError, match=r"batch_axis='dp' is not an axis of the submeshes"):

        @functools.partial(
            mp.jit, mesh=make_mesh(2, 2), schedule=mp.GPipe(), num_microbatches=2, batch_axis="dp"
        )
        def step(model, opt, batch):
            return train_step_fn(mlp_loss)(model, opt, batch)


def test_batch_axis_naming_the_stage_axis_is_rejected():
    with pytest.raises(
        mp.MeshError,
        match=r"batch_axis='stage' names the mpmd axis .*does not exist inside a stage.*"
        r"\('data',\).*batch_axis=None",
    ):
        _jit(train_step_fn(mlp_loss), make_mesh(2, 2), batch_axis="stage")


def test_explicit_data_axis_on_a_mesh_without_one_is_rejected():
    with pytest.raises(
        mp.MeshError,
        match=r"batch_axis='data' is not an axis of the submeshes.*the submeshes have no axes "
        r"\(the mesh has no axis besides the mpmd axis\).*batch_axis=None",
    ):
        _jit(train_step_fn(mlp_loss), _mesh_1d(), batch_axis="data")


@pytest.mark.parametrize("bad", [("data",), ["data"], 0])
def test_batch_axis_must_be_one_axis_name(bad):
    with pytest.raises(mp.MeshError, match=r"batch_axis=.* must be one mesh axis name \(a str\)"):
        _jit(train_step_fn(mlp_loss), make_mesh(2, 2), batch_axis=bad)


def test_default_batch_axis_is_data_when_present_else_replicated():
    step = train_step_fn(mlp_loss)
    assert _jit(step, make_mesh(2, 2)).batch_axis == "data"
    assert _jit(step, _mesh_1d()).batch_axis is None
    assert _jit(step, make_mesh(2, 2), batch_axis=None).batch_axis is None
    assert _jit(step, make_mesh(2, 2), batch_axis="data").batch_axis == "data"


def test_other_submesh_axis_is_accepted():
    devices = jax.devices()[:4]
    mesh = MpmdMesh(jax.make_mesh((2, 2), ("pipe", "dp"), devices=devices), "pipe")
    assert _jit(train_step_fn(mlp_loss), mesh, batch_axis="dp").batch_axis == "dp"
    assert _jit(train_step_fn(mlp_loss), mesh).batch_axis is None  # no "data" axis


# ----------------------------------------------------- out_sharding axis names


class _TwoStages(mp.PipelinedModel):
    """Stage 0's kernel is sharded along ``axis`` by its out_sharding metadata."""

    def __init__(self, axis: str, *, rngs: nnx.Rngs) -> None:
        first = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        value = first.kernel.get_value()
        first.kernel = nnx.Param(value, out_sharding=(None, axis), eager_sharding=False)
        self.a = mp.Stage(first, stage=0)
        self.b = mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=1)

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


@pytest.mark.parametrize(
    ("axis", "message"),
    [
        ("stage", r"a\.module\.kernel: out_sharding .* names the mpmd axis 'stage'"),
    ],
    ids=["mpmd-axis"],
)
def test_out_sharding_axis_the_submesh_lacks_is_rejected_by_jit(axis, message):
    model = _TwoStages(axis, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    f = _jit(train_step_fn(mlp_loss), make_mesh(2, 2))
    with pytest.raises(mp.PlacementError, match=message):
        f.lower(model, opt, make_batch("regression", 8))


# ----------------------------------------------------- grad transforms in mp.jit


def _nnx_value_and_grad(model, batch):
    return nnx.value_and_grad(mlp_loss)(model, batch)


def _nnx_grad(model, batch):
    return 0.0, nnx.grad(mlp_loss)(model, batch)


def _pure_loss(model):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, batch):
        return mlp_loss(nnx.merge(graphdef, params, rest), batch)

    return loss, params


def _jax_grad(model, batch):
    loss, params = _pure_loss(model)
    return 0.0, jax.grad(loss)(params, batch)


def _jax_value_and_grad(model, batch):
    loss, params = _pure_loss(model)
    return jax.value_and_grad(loss)(params, batch)


GRAD_FORMS = {
    "nnx.value_and_grad": _nnx_value_and_grad,
    "nnx.grad": _nnx_grad,
    "jax.grad": _jax_grad,
    "jax.value_and_grad": _jax_value_and_grad,
}


@pytest.mark.parametrize("transform", list(GRAD_FORMS))
def test_grad_transform_around_stages_names_itself_and_the_fix(transform):
    model, opt, _, kind = build("mlp", "sgd", 2)
    grad_form = GRAD_FORMS[transform]

    def step(model, opt, batch):
        loss, grads = grad_form(model, batch)
        opt.update(model, grads)
        return loss

    f = _jit(step, make_mesh(2, 1))
    pattern = (
        "^" + re.escape(transform) + r" at .*test_validation\.py:\d+ differentiates "
        r"through Stage 0 while mp\.jit traces the step.*"
        r"mp\.value_and_grad\(loss_fn\)\(model, batch\).*differentiates per stage.*"
        r"fine outside mp\.jit"
    )
    with pytest.raises(mp.CompileError, match=pattern):
        f.lower(model, opt, make_batch(kind, 4))


def test_grad_transform_next_to_a_pipelined_region_is_rejected():
    model, opt, _, kind = build("mlp", "sgd", 2)

    def step(model, opt, batch):
        loss, grads = mp.value_and_grad(mlp_loss)(model, batch)
        opt.update(model, grads)
        extra = nnx.grad(mlp_loss)(model, batch)  # a second, unpipelined gradient
        return loss, jax.tree.leaves(extra)[0]

    f = _jit(step, make_mesh(2, 1))
    with pytest.raises(mp.CompileError, match=r"^nnx\.grad at .*differentiates through Stage 0"):
        f.lower(model, opt, make_batch(kind, 4))


def test_grad_transform_inside_the_region_is_rejected():
    model, opt, _, kind = build("mlp", "sgd", 2)

    def loss_with_input_gradient(model, batch):
        def out_sum(x):
            return jnp.sum(model(x))

        penalty = jnp.mean(jax.grad(out_sum)(batch["x"]) ** 2)
        return mlp_loss(model, batch) + penalty

    f = _jit(train_step_fn(loss_with_input_gradient), make_mesh(2, 1))
    with pytest.raises(mp.CompileError, match=r"^jax\.grad at .*differentiates through Stage"):
        f.lower(model, opt, make_batch(kind, 4))


def test_grad_transform_is_fine_inside_one_stage_body():
    class InputGradient(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

        def __call__(self, x):
            return x + jax.grad(lambda x: jnp.sum(jnp.tanh(self.linear(x))))(x)

    class Model(mp.PipelinedModel):
        def __init__(self, rngs):
            self.a = mp.Stage(InputGradient(rngs), stage=0)
            self.b = mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=1)

        def __call__(self, x):
            return self.b(self.a(x))

    model = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    lowered = _jit(train_step_fn(mlp_loss), make_mesh(2, 1)).lower(
        model, opt, make_batch("regression", 4)
    )
    assert {"F0", "F1"} <= {label.split(".")[0] for label in lowered.programs}


def test_mp_value_and_grad_form_equals_the_nnx_jit_reference():
    ref_model, ref_opt, loss_fn, kind = build("mlp", "adamw", 2)
    model, opt, _, _ = build("mlp", "adamw", 2)
    reference = nnx.jit(train_step_fn(loss_fn, 2))
    pipelined = _jit(train_step_fn(loss_fn), make_mesh(2, 2))
    for seed in range(2):
        batch = make_batch(kind, 8, seed=seed)
        ref_loss = reference(ref_model, ref_opt, batch)
        np.testing.assert_allclose(float(pipelined(model, opt, batch)), float(ref_loss), rtol=1e-5)
    expected, got = params_of(ref_model), params_of(model)
    assert expected.keys() == got.keys()
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-4, err_msg=path)


# -------------------------------------- transforms that hide Stage calls from the cut


def _remat_model(model, x):
    return nnx.remat(lambda m, x: m(x))(model, x)


def _jit_model(model, x):
    return nnx.jit(lambda m, x: m(x))(model, x)


@pytest.mark.parametrize(
    ("wrap", "message"),
    [
        (_remat_model, r"Stage call\(s\) \[0, 1\] run inside jax\.checkpoint / nnx\.remat"),
        (_jit_model, r"Stage call\(s\) \[0, 1\] run inside jax\.jit / nnx\.jit"),
    ],
    ids=["remat", "jit"],
)
def test_transform_around_the_whole_model_in_the_loss_is_rejected(wrap, message):
    model, opt, _, kind = build("mlp", "sgd", 2)

    def loss_fn(model, batch):
        return jnp.mean((wrap(model, batch["x"]) - batch["y"]) ** 2)

    f = _jit(train_step_fn(loss_fn), make_mesh(2, 1))
    with pytest.raises(
        mp.PartitionError, match=message + r".*mp\.Stage\(module, stage=k, remat=True\)"
    ):
        f.lower(model, opt, make_batch(kind, 4))


def test_remat_around_the_whole_model_in_a_forward_only_step_is_rejected():
    model = MLP(2, rngs=nnx.Rngs(0))
    f = _jit(_remat_model, make_mesh(2, 1))
    with pytest.raises(mp.PartitionError, match=r"run inside jax\.checkpoint / nnx\.remat"):
        f.lower(model, make_batch("regression", 4)["x"])


def test_vmap_over_the_model_in_the_loss_equals_the_reference():
    def loss_fn(model, batch):
        xs = batch["x"].reshape(2, -1, WIDTH)  # two groups, one vmapped model call
        ys = jax.vmap(model)(xs).reshape(batch["y"].shape)
        return jnp.mean((ys - batch["y"]) ** 2)

    ref_model, ref_opt, _, kind = build("mlp", "sgd", 2)
    model, opt, _, _ = build("mlp", "sgd", 2)
    batch = make_batch(kind, 8)
    ref_loss = nnx.jit(train_step_fn(loss_fn, 2))(ref_model, ref_opt, batch)
    loss = _jit(train_step_fn(loss_fn), make_mesh(2, 1))(model, opt, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    expected, got = params_of(ref_model), params_of(model)
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-5, err_msg=path)
