"""Aux values per example: ``aux_reduction="concat"`` returns the full batch's values.

A loss that returns its logits or per-example losses as aux gets them for the
whole batch, in order, as ``nnx.value_and_grad`` on the full batch would give
them; summaries (an accuracy) are averaged as before. The default raises for a
leaf that looks per-example instead of averaging examples into nonsense.
Every case compares with the same step under ``nnx.jit`` on one device and
with a plain forward of the full batch.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from pipeline_models import build, make_batch, make_mesh, params_of
from shared_results import once_per_test_run

import nnx_mpmd as mp
from nnx_mpmd.aot.stats import count_compilations
from nnx_mpmd.compiler.trace.region_aux import aux_modes

MODES = {"outputs": "concat", "per_example": "concat", "worst": "mean"}


def _loss_with_outputs(model, batch):
    if "x" in batch:
        outputs = model(batch["x"])
        per_example = jnp.mean((outputs - batch["y"]) ** 2, axis=-1)
    else:
        outputs = model(batch["inputs"])
        per_token = optax.softmax_cross_entropy_with_integer_labels(outputs, batch["targets"])
        per_example = per_token.mean(axis=-1)
    aux = {"outputs": outputs, "per_example": per_example, "worst": jnp.max(per_example)}
    return per_example.mean(), aux


def _step(num_microbatches=None, aux_reduction=MODES, loss_fn=_loss_with_outputs, **kwargs):
    def step(model, optimizer, batch):
        (loss, aux), grads = mp.value_and_grad(
            loss_fn,
            has_aux=True,
            num_microbatches=num_microbatches,
            aux_reduction=aux_reduction,
            **kwargs,
        )(model, batch)
        optimizer.update(model, grads)
        return loss, aux

    return step


def _inputs(batch):
    return batch["x"] if "x" in batch else batch["inputs"]


# (model, schedule, meshes, stages, axis types)
CASES = [
    ("mlp", mp.OneFOneB(), 4, 4, None),
    ("mlp", mp.ZeroBubbleH1(), 4, 4, None),
    ("mlp", mp.Interleaved1F1B(), 2, 4, None),
    ("mlp", mp.DualPipeV(), 2, 4, None),
    ("lm", mp.GPipe(), 4, 4, jax.sharding.AxisType.Auto),
    ("lm_tied", mp.OneFOneB(), 4, 4, jax.sharding.AxisType.Auto),
]


def _case_id(case):
    model, schedule, meshes, stages, types = case
    return (
        f"{model}-{type(schedule).__name__}-M{meshes}-S{stages}-{'auto' if types else 'explicit'}"
    )


def _reference(model_name, stages):
    """Per step, the reference's full-batch forward, loss and aux; then its parameters.

    It depends on the model and its stage count only, so the cases of one model
    share it (computed once per test run)."""

    def compute(_directory):
        ref_model, ref_opt, _, kind = build(model_name, "adamw", stages)
        reference = nnx.jit(_step(4))
        forward = nnx.jit(lambda m, x: m(x))  # made once: a new function would trace again
        steps = []
        for i in range(2):
            batch = make_batch(kind, 16, seed=i)
            full_batch_outputs = np.asarray(forward(ref_model, _inputs(batch)))
            ref_loss, ref_aux = reference(ref_model, ref_opt, batch)
            ref_aux = {key: np.asarray(value) for key, value in ref_aux.items()}
            steps.append((full_batch_outputs, float(ref_loss), ref_aux))
        return steps, params_of(ref_model)

    return once_per_test_run(f"aux-reduction-reference-{model_name}-S{stages}", compute)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_concatenated_aux_is_the_full_batchs_and_equals_nnx_jit(case):
    model_name, schedule, meshes, stages, axis_types = case
    reference_steps, expected = _reference(model_name, stages)
    model, opt, _, kind = build(model_name, "adamw", stages)
    pipelined = mp.jit(
        _step(), mesh=make_mesh(meshes, 2, axis_types), schedule=schedule, num_microbatches=4
    )
    for i, (full_batch_outputs, ref_loss, ref_aux) in enumerate(reference_steps):
        batch = make_batch(kind, 16, seed=i)
        with count_compilations() as counter:
            loss, aux = pipelined(model, opt, batch)
        assert i == 0 or counter.count == 0, f"step {i} recompiled {counter.names}"
        assert not _compiled_twice(counter), f"compiled twice: {_compiled_twice(counter)}"
        assert aux["outputs"].shape == full_batch_outputs.shape
        assert aux["per_example"].shape == (16,) and aux["worst"].shape == ()
        np.testing.assert_allclose(ref_aux["outputs"], full_batch_outputs, atol=1e-6)
        np.testing.assert_allclose(aux["outputs"], full_batch_outputs, atol=1e-5)
        for key in MODES:
            np.testing.assert_allclose(aux[key], ref_aux[key], atol=1e-5, err_msg=key)
        np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
        np.testing.assert_allclose(float(ref_aux["per_example"].mean()), ref_loss, rtol=1e-5)
    got = params_of(model)
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-4, err_msg=path)
    if axis_types is None:
        _assert_forwards_gather_nothing(pipelined.lower(model, opt, batch).compile())


def _assert_forwards_gather_nothing(compiled):
    """Per-example outputs of an Explicit data axis are sharded over it; each forward
    writes its microbatch's rows into a buffer sharded the same way (no gather).

    Read from the step the test ran: lowering it again compiles nothing.
    """
    forwards = {n: e for n, found in compiled.executables().items() if n[0] == "F" for e in found}
    assert forwards
    for name, executable in forwards.items():
        assert "all-gather" not in executable.as_text(), name


def _masked_sum_and_count(model, batch):
    per_example = jnp.mean((model(batch["x"]) - batch["y"]) ** 2, axis=-1)
    return (jnp.sum(batch["w"] * per_example), jnp.sum(batch["w"])), per_example


def test_token_mean_with_concatenated_aux_equals_the_full_batch():
    batch = make_batch("regression", 16)
    batch["w"] = (np.arange(16) % 3 != 0).astype(np.float32)  # uneven real rows per microbatch
    ref_model, ref_opt, _, _ = build("mlp", "sgd", 2)
    model, opt, _, _ = build("mlp", "sgd", 2)
    kwargs = {
        "aux_reduction": "concat",
        "loss_fn": _masked_sum_and_count,
        "reduction": "token_mean",
    }
    ref_loss, ref_per_example = nnx.jit(_step(4, **kwargs))(ref_model, ref_opt, batch)
    step = mp.jit(_step(**kwargs), mesh=make_mesh(2, 2), schedule=mp.OneFOneB(), num_microbatches=4)
    loss, per_example = step(model, opt, batch)
    assert per_example.shape == (16,)
    np.testing.assert_allclose(per_example, ref_per_example, atol=1e-6)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    weights = batch["w"]
    expected_loss = np.sum(weights * np.asarray(ref_per_example)) / np.sum(weights)
    np.testing.assert_allclose(float(ref_loss), expected_loss, rtol=1e-5)


def test_a_concatenated_scalar_gives_one_value_per_microbatch():
    def loss_fn(model, batch):
        loss = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
        return loss, loss

    model, opt, _, _ = build("mlp", "sgd", 2)
    step = mp.jit(
        _step(aux_reduction="concat", loss_fn=loss_fn), mesh=make_mesh(2, 2),
        schedule=mp.GPipe(), num_microbatches=4,
    )  # fmt: skip
    loss, per_microbatch = step(model, opt, make_batch("regression", 16))
    assert per_microbatch.shape == (4,)
    np.testing.assert_allclose(float(np.mean(per_microbatch)), float(loss), rtol=1e-6)


@pytest.mark.parametrize("pipelined", [True, False], ids=["mp.jit", "unpipelined"])
def test_a_per_example_aux_without_aux_reduction_is_an_error_naming_it(pipelined):
    model, opt, _, _ = build("mlp", "sgd", 2)
    step = _step(None if pipelined else 4, aux_reduction=None)
    if pipelined:
        step = mp.jit(step, mesh=make_mesh(2, 2), schedule=mp.OneFOneB(), num_microbatches=4)
    else:
        step = nnx.jit(step)
    with pytest.raises(mp.CompileError, match=r"aux value \['outputs'\] has shape \(4, 16\).*"
                       r"aux_reduction='concat'"):  # fmt: skip
        step(model, opt, make_batch("regression", 16))


def _compiled_twice(counter):
    return sorted({name for name in counter.names if counter.names.count(name) > 1})


@pytest.mark.parametrize("axis_types", [None, jax.sharding.AxisType.Auto], ids=["explicit", "auto"])
def test_explicit_mean_averages_a_per_example_looking_leaf(axis_types):
    """The accumulator keeps the values' layout: each program compiles once, donates."""
    ref_model, ref_opt, _, _ = build("mlp", "sgd", 2)
    model, opt, _, _ = build("mlp", "sgd", 2)
    step = mp.jit(
        _step(aux_reduction="mean"), mesh=make_mesh(2, 2, axis_types), schedule=mp.OneFOneB(),
        num_microbatches=4,
    )  # fmt: skip
    batch = make_batch("regression", 16)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Some donated buffers were not usable")
        with count_compilations() as counter:
            _, aux = step(model, opt, batch)
    assert aux["outputs"].shape == (4, 16)  # one microbatch's shape: the mean over the four
    assert not _compiled_twice(counter), f"compiled twice: {_compiled_twice(counter)}"
    _, ref_aux = nnx.jit(_step(4, aux_reduction="mean"))(ref_model, ref_opt, batch)
    for key in MODES:
        np.testing.assert_allclose(aux[key], ref_aux[key], atol=1e-6, err_msg=key)


def test_aux_modes_broadcasts_a_prefix_and_checks_the_default():
    aux = {"acc": np.float32(0), "logits": np.zeros((4, 10), np.float32), "n": np.zeros(3)}
    leaves, tree = jax.tree.flatten(aux)
    assert aux_modes("concat", tree, leaves, rows=4) == ("concat",) * 3
    assert aux_modes({"acc": "mean", "logits": "concat", "n": None}, tree, leaves, 4) == (
        "mean",
        "concat",
        "mean",
    )
    assert aux_modes(None, tree, leaves, rows=5) == ("mean",) * 3  # no leading axis of 5 rows
    with pytest.raises(mp.CompileError, match=r"aux value \['logits'\] has shape \(4, 10\)"):
        aux_modes(None, tree, leaves, rows=4)


@pytest.mark.parametrize(
    "aux_reduction,match",
    [
        ("stack", r"gives 'stack' for the aux value \['acc'\]; use one of \('mean', 'concat'\)"),
        ({"acc": "mean"}, r"is not a pytree prefix of the aux value"),
    ],
    ids=["unknown-mode", "not-a-prefix"],
)
def test_bad_aux_reduction_is_an_error_saying_what_to_pass(aux_reduction, match):
    aux = {"acc": np.float32(0), "logits": np.zeros((4, 10), np.float32)}
    leaves, tree = jax.tree.flatten(aux)
    with pytest.raises(mp.CompileError, match=match):
        aux_modes(aux_reduction, tree, leaves, rows=4)


def _logits_loss(model, batch):
    logits = model(batch["inputs"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    return loss, logits


def _metrics_step(num_microbatches=None):
    def step(model, optimizer, metrics, batch):
        (loss, logits), grads = mp.value_and_grad(
            _logits_loss, has_aux=True, num_microbatches=num_microbatches, aux_reduction="concat"
        )(model, batch)
        optimizer.update(model, grads)
        flat_logits = logits.reshape(-1, logits.shape[-1])
        metrics.update(loss=loss, logits=flat_logits, labels=batch["targets"].reshape(-1))
        return loss

    return step


@pytest.mark.parametrize("donate", [(), (0, 1, 2)], ids=["kept", "donating"])
def test_nnx_metrics_updated_with_the_logits_equal_nnx_jit(donate):
    """The Flax tutorials' step: an ``nnx.MultiMetric`` updated with the batch's logits."""

    def build_all():
        model, opt, _, _ = build("lm", "adamw", 4)
        metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"), accuracy=nnx.metrics.Accuracy())
        return model, opt, metrics

    ref, got = build_all(), build_all()
    reference = nnx.jit(_metrics_step(4))
    step = mp.jit(
        _metrics_step(), mesh=make_mesh(4, 2, jax.sharding.AxisType.Auto), schedule=mp.OneFOneB(),
        num_microbatches=4, donate_argnums=donate,
    )  # fmt: skip
    for i in range(3):
        batch = make_batch("tokens", 16, seed=i)
        np.testing.assert_allclose(
            float(step(*got, batch)), float(reference(*ref, batch)), rtol=1e-5
        )
    want, have = ref[2].compute(), got[2].compute()
    assert 0 < float(want["accuracy"]) < 1
    for key in want:
        np.testing.assert_allclose(float(have[key]), float(want[key]), rtol=1e-5, err_msg=key)
    assert step.num_compiled_steps == 1
