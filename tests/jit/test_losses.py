"""Loss reductions beyond the mean of means: sums and token-weighted means with padding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from pipeline_models import SEQ, VOCAB, build, make_batch, make_mesh, params_of
from shared_results import once_per_test_run

import nnx_mpmd as mp
from nnx_mpmd.compiler.trace.grad_reduction import step_all_reduce_bytes

BATCH = 16


def padded_batch(seed: int) -> dict[str, np.ndarray]:
    """Sequences of random lengths 1..SEQ, padded; the first rows are the longest, so that
    equal microbatches hold very different numbers of real tokens."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
    lengths = np.sort(rng.integers(1, SEQ + 1, size=BATCH))[::-1]
    mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def _token_losses(model, batch):
    logits = model(batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])


def token_sum_and_count(model, batch):
    return jnp.sum(batch["mask"] * _token_losses(model, batch)), jnp.sum(batch["mask"])


def token_sum(model, batch):
    return jnp.sum(batch["mask"] * _token_losses(model, batch))


def full_batch_loss(reduction):
    """The reference: the whole batch at once, no microbatches."""

    def loss(model, batch):
        total, count = token_sum_and_count(model, batch)
        return total / count if reduction == "token_mean" else total

    return loss


def pipelined_step(reduction):
    loss_fn = token_sum_and_count if reduction == "token_mean" else token_sum

    def step(model, optimizer, batch):
        loss, grads = mp.value_and_grad(loss_fn, reduction=reduction)(model, batch)
        optimizer.update(model, grads)
        return loss

    return step


def reference_step(reduction):
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(full_batch_loss(reduction))(model, batch)
        optimizer.update(model, grads)
        return loss

    return step


def _tx(reduction):
    return optax.sgd(0.05 if reduction == "token_mean" else 0.001)


def _full_batch_reference(stages, reduction):
    """The full-batch reference's losses on ``padded_batch(0)`` and ``(1)`` and its final
    parameters: it depends on neither schedule nor microbatches, so the layouts of one
    stage count share it (computed once per test run)."""

    def compute(_directory):
        model, _, _, _ = build("lm_tied", "sgd", stages)
        optimizer = nnx.Optimizer(model, _tx(reduction), wrt=nnx.Param)
        step = nnx.jit(reference_step(reduction))
        losses = [float(step(model, optimizer, padded_batch(seed))) for seed in range(2)]
        return losses, params_of(model)

    return once_per_test_run(f"losses-reference-S{stages}-{reduction}", compute)


# (schedule, stages, meshes, microbatches)
LAYOUTS = [
    (mp.GPipe, 2, 2, 2),
    (mp.OneFOneB, 2, 2, 4),
    (mp.OneFOneB, 4, 4, 4),
    (mp.Interleaved1F1B, 4, 2, 2),
    (mp.ZeroBubbleH1, 2, 2, 4),
    (mp.ZeroBubbleH1, 4, 4, 2),
]


@pytest.mark.parametrize("reduction", ["token_mean", "sum"])
@pytest.mark.parametrize(
    "layout", LAYOUTS, ids=lambda c: f"{c[0].__name__}-S{c[1]}-M{c[2]}-m{c[3]}"
)
def test_reductions_equal_the_full_batch_reference(layout, reduction):
    schedule, stages, meshes, m = layout
    ref_losses, want = _full_batch_reference(stages, reduction)
    model, _, _, _ = build("lm_tied", "sgd", stages)
    optimizer = nnx.Optimizer(model, _tx(reduction), wrt=nnx.Param)
    step = mp.jit(
        pipelined_step(reduction),
        mesh=make_mesh(meshes, 8 // meshes),
        schedule=schedule(),
        num_microbatches=m,
    )
    for seed in range(2):
        batch = padded_batch(seed)
        counts = batch["mask"].reshape(m, -1).sum(axis=1)  # real tokens per microbatch
        assert len(set(counts.tolist())) > 1, counts
        loss = float(jax.device_get(step(model, optimizer, batch)))
        np.testing.assert_allclose(loss, ref_losses[seed], rtol=1e-5)
    got = params_of(mp.gather(model))
    for path, value in want.items():
        np.testing.assert_allclose(got[path], value, rtol=1e-4, atol=1e-5, err_msg=path)


def test_the_token_mean_is_not_the_mean_of_means():
    """The same padded batch: the mean of microbatch means differs from the token mean."""
    model, _, _, _ = build("lm", "sgd", 2)
    batch = padded_batch(0)

    def microbatch_mean(model, batch):
        total, count = token_sum_and_count(model, batch)
        return total / count

    token_mean, _ = mp.value_and_grad(
        token_sum_and_count, num_microbatches=4, reduction="token_mean"
    )(model, batch)
    mean_of_means, _ = mp.value_and_grad(microbatch_mean, num_microbatches=4)(model, batch)
    full = full_batch_loss("token_mean")(model, batch)
    np.testing.assert_allclose(token_mean, full, rtol=1e-6)
    assert abs(float(mean_of_means) - float(full)) > 1e-3


def test_aux_is_averaged_with_token_mean():
    model, _, _, _ = build("lm", "sgd", 2)
    batch = padded_batch(1)

    def with_aux(model, batch):
        total, count = token_sum_and_count(model, batch)
        return (total, count), {"tokens": count}

    (loss, aux), _ = mp.value_and_grad(
        with_aux, has_aux=True, num_microbatches=4, reduction="token_mean"
    )(model, batch)
    np.testing.assert_allclose(aux["tokens"], batch["mask"].sum() / 4, rtol=1e-6)
    np.testing.assert_allclose(loss, full_batch_loss("token_mean")(model, batch), rtol=1e-6)


def weighted_squares(model, batch):
    """A regression loss with per-example weights (0 marks a padding row)."""
    errors = jnp.sum((model(batch["x"]) - batch["y"]) ** 2, axis=-1)
    return jnp.sum(batch["w"] * errors), jnp.sum(batch["w"])


def test_gradients_are_reduced_once_per_step_with_token_mean():
    # The MLP's batch is sharded over the data axis (the LM's embedding lookup replicates it).
    model, opt, _, kind = build("mlp", "sgd", 2)
    batch = make_batch(kind, BATCH)
    batch["w"] = (np.arange(BATCH) % 3 != 0).astype(np.float32)

    def step_fn(model, optimizer, batch):
        loss, grads = mp.value_and_grad(weighted_squares, reduction="token_mean")(model, batch)
        optimizer.update(model, grads)
        return loss

    step = mp.jit(step_fn, mesh=make_mesh(2, 2), schedule=mp.OneFOneB(), num_microbatches=4)
    lowered = step.lower(model, opt, batch)
    executables = lowered.compile().executables()
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    ratio = step_all_reduce_bytes(lowered.compiled.instructions, executables) / param_bytes
    assert ratio <= 1.25, ratio
    reference, ref_opt, _, _ = build("mlp", "sgd", 2)

    def ref_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m, b: jnp.divide(*weighted_squares(m, b)))(
            model, batch
        )
        optimizer.update(model, grads)
        return loss

    loss = float(jax.device_get(step(model, opt, batch)))
    np.testing.assert_allclose(loss, float(nnx.jit(ref_step)(reference, ref_opt, batch)), 1e-5)
    for path, value in params_of(reference).items():
        np.testing.assert_allclose(params_of(mp.gather(model))[path], value, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,loss_fn,match",
    [
        (
            {"reduction": "median"},
            token_sum,
            r"reduction='median'\) is not a reduction.*'token_mean'",
        ),
        ({"reduction": "token_mean"}, token_sum, r"needs the loss to return \(sum, count\)"),
        (
            {"reduction": "token_mean"},
            lambda m, b: (jnp.sum(b["mask"], axis=1), jnp.sum(b["mask"])),
            r"the loss's sum has shape \(4,\); return a scalar sum",
        ),
    ],
    ids=["unknown", "scalar-loss", "vector-sum"],
)
def test_bad_reductions_are_errors(kwargs, loss_fn, match):
    model, _, _, _ = build("lm", "sgd", 2)
    with pytest.raises(mp.CompileError, match=match):
        mp.value_and_grad(loss_fn, num_microbatches=4, **kwargs)(model, padded_batch(0))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"argnums": 1}, r"argnums=1\): the pipelined region differentiates the model"),
        ({"argnums": (0, 1)}, r"argnums=\(0, 1\)\).*make it a Variable of the model"),
        ({"argnums": nnx.DiffState(1, nnx.Param)}, r"argnum=1.*argument 0\) only"),
        (
            {"argnums": nnx.DiffState(0, nnx.LoRAParam), "wrt": nnx.BatchStat},
            r"got both wrt=.*BatchStat.*and argnums=.*give the filter once",
        ),
        ({"has_aux": nnx.DiffState(0, nnx.Param)}, r"has_aux is True or False; pass argnums"),
    ],
    ids=["batch", "both-args", "diffstate-batch", "wrt-and-diffstate", "positional-diffstate"],
)
def test_argnums_other_than_the_model_are_errors(kwargs, match):
    """NNX's ``argnums`` is accepted for the model only; the batch is not differentiated."""
    with pytest.raises(mp.CompileError, match=match):
        mp.value_and_grad(token_sum, **kwargs)


def test_a_loss_that_closes_over_its_batch_is_an_error():
    """``value_and_grad(loss)(model)`` has nothing to split into microbatches: the error
    says to pass the arrays as arguments (closed-over ones would be whole in every one)."""
    model, _, _, _ = build("mlp", "sgd", 2)

    def closes_over_batch(model):
        return jnp.mean(model(jnp.ones((4, 16))) ** 2)

    with pytest.raises(
        mp.CompileError,
        match=r"closes_over_batch\)\(model\) got no batch.*"
        r"closes_over_batch\(model, x, y\)",
    ):
        mp.value_and_grad(closes_over_batch, num_microbatches=2)(model)
