"""assign_stages on layers held in containers, trained with mp.jit.

The model below is written without any nnx_mpmd import and keeps its layers in
an ``nnx.List``, an ``nnx.Dict``, a list or a tuple (Flax 0.12 wants plain lists
and tuples of modules marked with ``nnx.data``). After `assign_stages` with a
whole-container path, element paths (``layers.3``) or a wildcard (``layers.*``),
its own code (iteration, indexing, ``len``, ``.items()``) runs unchanged, and two
pipelined steps give the losses and parameters of the same model under
``nnx.jit`` on one device (with the same microbatch averaging).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from pipeline_models import make_mesh, params_of

import nnx_mpmd as mp

WIDTH = 8
DEPTH = 4
MICROBATCHES = 4
STEPS = 3
KINDS = ["nnx.List", "nnx.Dict", "list", "tuple"]


class Block(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.linear(x))


class Tower(nnx.Module):
    """A plain NNX model: an input layer, DEPTH blocks in a container, a head."""

    def __init__(self, kind: str, *, rngs: nnx.Rngs) -> None:
        self.kind = kind
        self.embed = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        blocks = [Block(rngs=rngs) for _ in range(DEPTH)]
        if kind == "nnx.List":
            self.layers = nnx.List(blocks)
        elif kind == "nnx.Dict":
            self.layers = nnx.Dict({f"block{i}": block for i, block in enumerate(blocks)})
        elif kind == "list":
            self.layers = nnx.data(blocks)
        else:
            self.layers = nnx.data(tuple(blocks))
        self.head = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        x = self.embed(x)
        assert len(self.layers) == DEPTH
        if self.kind == "nnx.Dict":
            for name, layer in self.layers.items():
                assert self.layers[name] is layer
                x = layer(x)
        else:
            for i, layer in enumerate(self.layers):
                assert self.layers[i] is layer
                x = layer(x)
        return self.head(x)


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def train_step(model, optimizer, batch):
    loss, grads = mp.value_and_grad(loss_fn, num_microbatches=MICROBATCHES)(model, batch)
    optimizer.update(model, grads)
    return loss


def element(kind: str, i: int) -> str:
    return f"layers.block{i}" if kind == "nnx.Dict" else f"layers.{i}"


def stage_mapping(kind: str, path_form: str) -> dict[str, int]:
    if path_form == "whole":  # the container itself
        return {"embed": 0, "layers": 1, "head": 1}
    if path_form == "wildcard":
        return {"embed": 0, "layers.*": 0, "head": 1}
    # one path per element: blocks 0-1 on stage 0, blocks 2-3 on stage 1
    return {"embed": 0, **{element(kind, i): i // 2 for i in range(DEPTH)}, "head": 1}


def make_batch(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    x = rng.normal(size=(2 * MICROBATCHES, WIDTH)).astype(np.float32)
    y = rng.normal(size=(2 * MICROBATCHES, WIDTH)).astype(np.float32)
    return {"x": x, "y": y}


def new_model_and_optimizer(kind: str):
    model = Tower(kind, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


@pytest.mark.parametrize("schedule", [mp.OneFOneB, mp.GPipe], ids=["1F1B", "GPipe"])
@pytest.mark.parametrize("path_form", ["whole", "element", "wildcard"])
@pytest.mark.parametrize("kind", KINDS)
def test_container_annotated_model_trains_like_nnx_jit(kind, path_form, schedule):
    ref_model, ref_opt = new_model_and_optimizer(kind)
    reference = nnx.jit(train_step)
    model, opt = new_model_and_optimizer(kind)
    mp.assign_stages(model, stage_mapping(kind, path_form))

    container_type = type(ref_model.layers)
    assert type(model.layers) is container_type and len(model.layers) == DEPTH
    stages = [
        layer.stage for layer in (model.layers.values() if kind == "nnx.Dict" else model.layers)
    ]
    assert stages == {"whole": [1] * 4, "wildcard": [0] * 4, "element": [0, 0, 1, 1]}[path_form]
    assert mp.annotate.validate_stages(model) == 2

    pipelined = mp.jit(
        train_step, mesh=make_mesh(2, 1), schedule=schedule(), num_microbatches=MICROBATCHES
    )
    for step in range(STEPS):
        batch = make_batch(step)
        ref_loss = reference(ref_model, ref_opt, batch)
        loss = pipelined(model, opt, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    expected, got = params_of(ref_model), params_of(model)
    assert expected.keys() == got.keys()
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-5, atol=1e-6, err_msg=path)


@pytest.mark.parametrize("kind", KINDS)
def test_container_annotated_model_on_a_2x2_mesh(kind):
    """Data parallelism inside each stage: same numbers on a 2x2 MpmdMesh."""
    ref_model, ref_opt = new_model_and_optimizer(kind)
    reference = nnx.jit(train_step)
    model, opt = new_model_and_optimizer(kind)
    mp.assign_stages(model, stage_mapping(kind, "element"))
    pipelined = mp.jit(
        train_step, mesh=make_mesh(2, 2), schedule=mp.OneFOneB(), num_microbatches=MICROBATCHES
    )
    for step in range(2):
        batch = make_batch(step)
        np.testing.assert_allclose(
            float(pipelined(model, opt, batch)),
            float(reference(ref_model, ref_opt, batch)),
            rtol=1e-5,
        )
    expected, got = params_of(ref_model), params_of(model)
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-5, atol=1e-6, err_msg=path)


@pytest.mark.parametrize("kind", KINDS)
def test_container_annotation_keeps_the_forward(kind):
    model = Tower(kind, rngs=nnx.Rngs(0))
    x = jnp.ones((2, WIDTH))
    expected = model(x)
    mp.assign_stages(model, {"embed": 0, "layers": 0, "head": 1})
    np.testing.assert_allclose(model(x), expected, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(lambda m, x: m(x))(model, x), expected, rtol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pattern", ["layers.9", "layers.block9"])
def test_path_into_a_container_that_matches_nothing(kind, pattern):
    model = Tower(kind, rngs=nnx.Rngs(0))
    valid = re.escape(", ".join(element(kind, i) for i in range(DEPTH)))
    with pytest.raises(
        mp.PartitionError,
        match=rf"{re.escape(repr(pattern))} matches no path of Tower\. Paths under "
        rf"'layers': {valid}[.;]",
    ):
        mp.assign_stages(model, {pattern: 0})
    assert not any(isinstance(layer, mp.Stage) for layer in model.layers)  # unchanged


def test_nested_containers_get_every_module():
    class Nested(nnx.Module):
        def __init__(self, rngs):
            self.groups = nnx.data(
                [(Block(rngs=rngs), Block(rngs=rngs)), {"extra": Block(rngs=rngs)}]
            )
            self.scale = nnx.Param(jnp.ones(WIDTH))

        def __call__(self, x):
            for group in self.groups:
                for layer in group.values() if isinstance(group, dict) else group:
                    x = layer(x)
            return x * self.scale

    model = Nested(nnx.Rngs(0))
    x = jnp.ones((2, WIDTH))
    expected = model(x)
    mp.assign_stages(model, {"groups": 1, "scale": 0})
    assert isinstance(model.groups[0], tuple)
    assert [layer.stage for layer in model.groups[0]] == [1, 1]
    assert model.groups[1]["extra"].stage == 1
    assert mp.annotate.variable_stage(model.scale) == 0
    np.testing.assert_allclose(model(x), expected, rtol=1e-6)
