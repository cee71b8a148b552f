"""Static step arguments: ``mp.jit(..., static_argnums=..., static_argnames=...)``.

A flag such as ``train`` reaches the step as the Python value, each value
compiles its own step once, and the results equal ``nnx.jit`` with the same
static arguments on one device.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from pipeline_models import build, make_batch, make_mesh, params_of

import nnx_mpmd as mp
from nnx_mpmd.aot.stats import count_compilations

SCHEDULES = {"gpipe": mp.GPipe(), "1f1b": mp.OneFOneB(), "zb-h1": mp.ZeroBubbleH1()}


def _step_with_flag(loss_fn, num_microbatches=None):
    def step(model, optimizer, batch, train, scale=1.0):
        def loss(m, b):
            value = loss_fn(m, b)
            return value * scale if train else jnp.abs(value - 1.0)  # a Python branch

        value, grads = mp.value_and_grad(loss, num_microbatches=num_microbatches)(model, batch)
        if train:
            optimizer.update(model, grads)
        return value

    return step


@pytest.mark.parametrize("schedule", SCHEDULES.values(), ids=list(SCHEDULES))
@pytest.mark.parametrize(
    ("by", "donate"), [("argnums", False), ("argnames", False), ("argnames", True)]
)
def test_a_static_flag_equals_nnx_jit_and_compiles_once_per_value(schedule, by, donate):
    model, opt, loss_fn, kind = build("mlp", "adamw", 2)
    ref_model, ref_opt, _, _ = build("mlp", "adamw", 2)
    static = {"static_argnums": 3} if by == "argnums" else {"static_argnames": "train"}
    donated = {"donate_argnums": (0, 1)} if donate else {}
    step = mp.jit(
        _step_with_flag(loss_fn),
        mesh=make_mesh(2, 2),
        schedule=schedule,
        num_microbatches=4,
        **static,
        **donated,
    )
    reference = nnx.jit(_step_with_flag(loss_fn, num_microbatches=4), static_argnums=3, **donated)
    for i, train in enumerate([True, False, True, False, True]):
        batch = make_batch(kind, 16, seed=i)
        with count_compilations() as counter:
            loss = step(model, opt, batch, train=train) if by == "argnames" else None
            loss = step(model, opt, batch, train) if loss is None else loss
        assert i < 2 or counter.count == 0, f"call {i} ({train=}) recompiled {counter.names}"
        np.testing.assert_allclose(
            float(loss), float(reference(ref_model, ref_opt, batch, train)), rtol=1e-6
        )
    assert step.num_compiled_steps == 2
    expected, got = params_of(ref_model), params_of(model)
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-6, err_msg=path)


def test_a_traced_argument_beside_a_static_one_does_not_recompile():
    model, opt, loss_fn, kind = build("mlp", "sgd", 2)
    step = mp.jit(
        _step_with_flag(loss_fn),
        mesh=make_mesh(2, 1),
        schedule=mp.OneFOneB(),
        num_microbatches=2,
        static_argnames=("train",),
    )
    batch = make_batch(kind, 8)
    first = float(step(model, opt, batch, True, 2.0))
    with count_compilations() as counter:
        second = float(step(model, opt, batch, True, 3.0))  # scale is traced
    assert counter.count == 0 and step.num_compiled_steps == 1
    assert first != second


def test_static_arguments_under_cached_partial_and_lower():
    model, opt, loss_fn, kind = build("mlp", "sgd", 2)
    ref_model, ref_opt, _, _ = build("mlp", "sgd", 2)
    step = mp.jit(
        _step_with_flag(loss_fn),
        mesh=make_mesh(2, 1),
        schedule=mp.GPipe(),
        num_microbatches=2,
        static_argnums=(3,),
    )
    batch = make_batch(kind, 8)
    step.lower(model, opt, batch, False)  # cached: the first call below finds it
    assert step.num_compiled_steps == 1
    reference = nnx.jit(_step_with_flag(loss_fn, num_microbatches=2), static_argnums=3)
    partial = nnx.cached_partial(step, model, opt)
    for i, train in enumerate((False, True, False, True)):
        np.testing.assert_allclose(
            float(partial(batch, train)),
            float(reference(ref_model, ref_opt, batch, train)),
            rtol=1e-6,
        )
        assert step.num_compiled_steps == (1 if i == 0 else 2)


def _step(model, optimizer, batch, option):
    return jnp.sum(batch["x"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"static_argnums": -1},
            r"mp.jit\(static_argnums=...\) takes argument positions \(ints >= 0\), got -1; "
            r"pass e.g. static_argnums=\(3,\)",
        ),
        (
            {"static_argnames": "nope"},
            r"mp.jit\(static_argnames=...\) names \['nope'\], which _step has no positional "
            r"parameter of \(it has \['model', 'optimizer', 'batch', 'option'\]\)",
        ),
        (
            {"static_argnums": 1, "donate_argnums": (0, 1)},
            r"argument\(s\) \[1\] are both static and donated",
        ),
    ],
)
def test_bad_static_options_are_refused_at_jit_time(kwargs, message):
    with pytest.raises(mp.CompileError, match=message):
        mp.jit(_step, mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2, **kwargs)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("list", r"argument 3 of _step is static .* but not hashable \(unhashable type: 'list'\)"),
        ("model", r"argument 3 of _step is static .* but holds an NNX object \(MLP\)"),
        ("array", r"argument 3 of _step is static .* but holds an array \(ArrayImpl\)"),
    ],
)
def test_a_static_value_that_cannot_be_static_is_named(option, message):
    model, opt, _, kind = build("mlp", "sgd", 2)
    option = {"list": [1, 2], "model": (model,), "array": {"w": jnp.ones(2)}}[option]
    step = mp.jit(
        _step, mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2, static_argnums=3
    )
    with pytest.raises(mp.CompileError, match=message):
        step(model, opt, make_batch(kind, 8), option)
