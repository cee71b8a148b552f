"""Mixed precision (`mp.Precision`): bf16 compute, float32 master parameters and optimizer state.

The pipelined step under a policy is compared with ``nnx.jit`` of the same step
under the same policy: both compute the same bf16 operations, so the losses and
parameters agree to bf16 rounding of the last step's update at most.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from pipeline_models import OPTIMIZERS, build, make_batch, make_mesh, params_of

import nnx_mpmd as mp
from nnx_mpmd.apps import train
from nnx_mpmd.errors import MpmdError

BF16 = mp.Precision(compute_dtype=jnp.bfloat16)
# Same operations on both sides; the stage programs may fuse differently from the
# single program, which moves a bf16 result by one unit in the last place (2**-8)
# now and then. The losses agree far closer than bf16 vs float32 differ (> 1e-3).
LOSS_RTOL = 2e-3
PARAM_ATOL = 2e-3
STEPS = 2
# A stateful optimizer whose update is linear in the gradient: Adam would turn the
# bf16 rounding of a near-zero gradient into an lr-sized step (see pipeline_models).
OPTIMIZERS = {**OPTIMIZERS, "momentum": lambda: optax.sgd(0.05, momentum=0.9)}


def _step_fn(policy, loss_fn, num_microbatches=None):
    def step(model, optimizer, batch):
        grad_fn = mp.value_and_grad(policy.wrap(loss_fn), num_microbatches=num_microbatches)
        loss, grads = grad_fn(model, batch)
        optimizer.update(model, grads)
        return loss

    return step


def _floating_dtypes(node) -> set[str]:
    leaves = jax.tree.leaves(nnx.state(node))
    return {str(x.dtype) for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)}


def _build_under(policy, stages, opt_name="momentum"):
    """The test LM (Flax layers with default dtypes) with ``policy`` applied and then
    its optimizer (the optimizer's state follows the parameters' dtype)."""
    model, _, loss_fn, kind = build("lm", "sgd", stages)
    policy.apply_to(model)
    opt = nnx.Optimizer(model, OPTIMIZERS[opt_name](), wrt=nnx.Param)
    return model, opt, loss_fn, kind


def _train_both(schedule, meshes, stages, microbatches, policy, opt_name="momentum"):
    """The pipelined step and the nnx.jit reference on twin models; returns both and the
    per-step losses."""
    ref_model, ref_opt, loss_fn, kind = _build_under(policy, stages, opt_name)
    model, opt, _, _ = _build_under(policy, stages, opt_name)
    reference = nnx.jit(_step_fn(policy, loss_fn, microbatches))
    pipelined = mp.jit(
        _step_fn(policy, loss_fn),
        mesh=make_mesh(meshes, 2),
        schedule=schedule,
        num_microbatches=microbatches,
    )
    losses = []
    for step in range(STEPS):
        batch = make_batch(kind, microbatches * 4, seed=step)
        losses.append(
            (float(pipelined(model, opt, batch)), float(reference(ref_model, ref_opt, batch)))
        )
    return (model, opt), (ref_model, ref_opt), losses


@pytest.mark.parametrize(
    ("schedule", "meshes", "stages", "microbatches"),
    [(mp.GPipe(), 2, 2, 2), (mp.ZeroBubbleH1(), 2, 2, 4)],
    ids=["gpipe", "zb-h1"],
)
def test_pipelined_bf16_step_equals_nnx_jit_under_the_same_policy(
    schedule, meshes, stages, microbatches
):
    (model, opt), (ref_model, ref_opt), losses = _train_both(
        schedule, meshes, stages, microbatches, BF16
    )
    for got, expected in losses:
        np.testing.assert_allclose(got, expected, rtol=LOSS_RTOL)
    expected, got = params_of(ref_model), params_of(mp.gather(model))
    assert expected.keys() == got.keys()
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=PARAM_ATOL, err_msg=path)
    # The master parameters and the optimizer state stay float32 on both sides.
    assert _floating_dtypes(model) == _floating_dtypes(ref_model) == {"float32"}
    assert _floating_dtypes(opt) == _floating_dtypes(ref_opt) == {"float32"}


def _dot_input_dtypes(loss_fn, model, batch) -> set[str]:
    """The dtypes of the inputs of every matmul by a weight matrix (a 2-D operand);
    the test model's attention computes its softmax in float32 by its own choice."""
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda state: loss_fn(nnx.merge(graphdef, state), batch))(state)
    dots = [e.invars for e in _eqns(jaxpr.jaxpr) if "dot" in e.primitive.name]
    return {str(v.aval.dtype) for ins in dots if ins[1].aval.ndim == 2 for v in ins}


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def test_the_policy_makes_every_matmul_bf16_and_the_loss_float32():
    """So the comparison above compares bf16 computations, not two float32 ones."""
    model, _, loss_fn, kind = _build_under(BF16, 2, "sgd")
    twin, _, _, _ = build("lm", "sgd", 2)
    batch = make_batch(kind, 8, seed=0)
    assert _dot_input_dtypes(BF16.wrap(loss_fn), model, batch) == {"bfloat16"}
    assert _dot_input_dtypes(loss_fn, twin, batch) == {"float32"}
    bf16, f32 = float(nnx.jit(BF16.wrap(loss_fn))(model, batch)), float(loss_fn(twin, batch))
    assert bf16 != pytest.approx(f32, rel=1e-4)
    assert bf16 == pytest.approx(f32, rel=5e-2)


def test_gradients_come_back_in_the_master_dtype_and_the_casts_are_undone():
    model, _, loss_fn, kind = _build_under(BF16, 2, "sgd")
    loss, grads = mp.value_and_grad(BF16.wrap(loss_fn), num_microbatches=2)(
        model, make_batch(kind, 4)
    )
    assert loss.dtype == jnp.float32
    assert {str(g.dtype) for g in jax.tree.leaves(grads)} == {"float32"}
    assert _floating_dtypes(model) == {"float32"}


def test_apply_to_sets_the_dtypes_of_layers_but_not_through_a_stage():
    model, _, _, _ = build("lm", "sgd", 2)
    mp.Precision(compute_dtype="bfloat16", param_dtype="bfloat16").apply_to(model)
    embed = model.embed.module
    assert (embed.dtype, embed.param_dtype) == (jnp.bfloat16, jnp.bfloat16)
    assert model.blocks[0].module.norm.dtype == jnp.bfloat16
    assert "dtype" not in vars(model.embed)  # a Stage only forwards its module's attributes


def test_param_dtype_bfloat16_stores_parameters_and_optimizer_state_in_bf16():
    policy = mp.Precision(compute_dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    model, _, loss_fn, kind = build("lm", "adamw", 2)
    policy.apply_to(model)
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    loss = nnx.jit(_step_fn(policy, loss_fn, 2))(model, opt, make_batch(kind, 4))
    assert loss.dtype == jnp.float32 and np.isfinite(float(loss))
    assert _floating_dtypes(model) == {"bfloat16"}
    assert _floating_dtypes(opt) == {"bfloat16"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"compute_dtype": jnp.int32}, r"compute_dtype=.*int32.*not a floating-point dtype"),
        ({"param_dtype": "float12"}, r"param_dtype='float12'.*not a floating-point dtype"),
        ({"output_dtype": object()}, r"output_dtype=.*jnp.float32, jnp.bfloat16"),
    ],
)
def test_a_dtype_that_is_not_floating_point_is_an_error(kwargs, message):
    with pytest.raises(MpmdError, match=message):
        mp.Precision(**kwargs)


def test_wrap_of_something_not_callable_is_an_error():
    with pytest.raises(MpmdError, match=r"Precision.wrap\(3\): expected the loss function"):
        BF16.wrap(3)


# -- nnx-mpmd train --dtype / --param-dtype ------------------------------------------

TINY = [
    "--meshes", "1", "--data", "1", "--layers", "1", "--batch-size", "4",
    "--microbatches", "2", "--seq-len", "16", "--corpus-bytes", "20000",
    "--log-every", "1", "--ckpt-every", "2", "--warmup", "1", "--steps", "2",
    "--sample-tokens", "0", "--val-batches", "0", "--no-compile-cache",
]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dtype", "float64"], r"--dtype 'float64' is not a supported dtype; choose one of"),
        (["--param-dtype", "fp16"], r"--param-dtype 'fp16' is not a supported dtype"),
    ],
)
def test_train_rejects_an_unknown_dtype(argv, message, tmp_path, capsys):
    with pytest.raises(MpmdError, match=message):
        train.config_from_args(argv)
    assert train.main([*argv, "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and __import__("re").search(message, err), err


def test_train_dtype_bfloat16_runs_with_float32_state_and_refuses_a_float32_resume(
    tmp_path, capsys
):
    from nnx_mpmd.apps.train_loop import Trainer

    run_dir = tmp_path / "run"
    cfg = train.config_from_args([*TINY, "--dtype", "bfloat16", "--run-dir", str(run_dir)])
    trainer = Trainer(cfg, run_dir)
    summary = trainer.train()
    assert "precision: compute bfloat16, parameters and optimizer state float32" in (
        capsys.readouterr().out
    )
    assert summary["steps_run"] == 2 and np.isfinite(summary["last_loss"])
    assert trainer.model.config.dtype == jnp.bfloat16  # the zoo's layers compute in bf16
    assert _floating_dtypes(trainer.model) == {"float32"}
    assert _floating_dtypes(trainer.optimizer) == {"float32"}
    # A bare --resume continues with the saved configuration (RUN/config.toml): ask
    # for float32 compute explicitly.
    argv = [*TINY, "--run-dir", str(run_dir), "--resume", "--steps", "3", "--dtype", "float32"]
    assert train.main(argv) == 2  # float32 compute: a numeric setting, refused ...
    err = capsys.readouterr().err
    assert "dtype: saved 'bfloat16', now 'float32'" in err, err
    assert "pass --allow-changed-settings" in err
    assert train.main([*argv, "--dtype", "bfloat16", "--param-dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err  # ... and other stored arrays never fit
    assert "param_dtype: saved 'float32', now 'bfloat16'" in err, err
    assert "resume with the saved --model, --preset, --layers, --param-dtype" in err
    assert train.main([*argv, "--allow-changed-settings"]) == 0  # ... unless allowed
    out = capsys.readouterr().out
    assert "(accepted): steps: saved 2, now 3; dtype: saved 'bfloat16', now 'float32'" in out
