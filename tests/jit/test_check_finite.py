"""``mp.jit(..., check_finite=True)``: the first NaN/inf of a step, by stage, task and path.

Off (the default) a step passes NaN and inf through as ``nnx.jit`` does, and its
programs are the same as with the check on: the check only watches the run.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from flax import nnx
from pipeline_models import build, make_batch, make_mesh, params_of, train_step_fn

import nnx_mpmd as mp
from nnx_mpmd.runtime.finite_check import FiniteCheck


def _step(check_finite, num_microbatches=2):
    model, opt, loss_fn, _ = build("mlp", "sgd", 3)
    step = mp.jit(
        train_step_fn(loss_fn),
        mesh=make_mesh(3, 1),
        schedule=mp.OneFOneB(),
        num_microbatches=num_microbatches,
        check_finite=check_finite,
    )
    return step, model, opt, loss_fn


def _batch_with(value, field, row):
    batch = make_batch("dense", 8)
    batch[field][row, 3] = value
    return batch


def test_an_inf_in_the_input_names_stage_0s_gradient_by_path():
    # tanh(inf) is 1: the activation stays finite, the kernel's gradient is inf * 0 = NaN.
    step, model, opt, _ = _step(True)
    with pytest.raises(
        mp.NonFiniteError,
        match=r"^stage 0's task B0\.1 made a non-finite value \(NaN or inf\) first: the "
        r"gradient of layers\.0\.module\.kernel\. The step ran to its end .*restore the last",
    ):
        step(model, opt, _batch_with(np.inf, "x", 5))  # row 5: the second microbatch of 4 rows


def test_a_nan_in_the_input_names_stage_0s_forward_output():
    step, model, opt, _ = _step(True)
    with pytest.raises(mp.NonFiniteError, match=r"^stage 0's task F0\.1 .* first: output 0\."):
        step(model, opt, _batch_with(np.nan, "x", 5))


def test_an_inf_in_the_targets_names_the_last_stages_gradient_by_path():
    step, model, opt, _ = _step(True)
    with pytest.raises(
        mp.NonFiniteError,
        match=r"^stage 2's task FB2\.0 made a non-finite value \(NaN or inf\) first: "
        r"input cotangent 0\.",
    ):
        step(model, opt, _batch_with(np.inf, "y", 0))


def test_gradients_are_named_by_parameter_path():
    step, model, opt, _ = _step(True)
    check = FiniteCheck(step.lower(model, opt, make_batch("dense", 8)).compiled)
    assert [check._name(k, "gradient", i) for k in range(3) for i in range(2)] == [
        f"the gradient of layers.{k}.module.{name}" for k in range(3) for name in ("kernel", "bias")
    ]


def test_without_the_check_an_inf_passes_through_as_under_nnx_jit():
    step, model, opt, loss_fn = _step(False)
    batch = _batch_with(np.inf, "x", 5)
    ref_model, ref_opt, _, _ = build("mlp", "sgd", 3)

    @nnx.jit
    def ref_step(model, opt, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss

    loss = step(model, opt, batch)  # no error: JAX's behaviour
    ref_loss = ref_step(ref_model, ref_opt, batch)
    assert np.isnan(float(loss)) == np.isnan(float(ref_loss))
    ours, ref = params_of(model), params_of(ref_model)
    for path, value in ref.items():
        np.testing.assert_array_equal(np.isfinite(ours[path]), np.isfinite(value), err_msg=path)


def test_a_checked_step_trains_like_nnx_jit():
    step, model, opt, loss_fn = _step(True)
    ref_model, ref_opt, _, _ = build("mlp", "sgd", 3)

    @nnx.jit
    def ref_step(model, opt, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss

    for seed in range(2):
        batch = make_batch("dense", 8, seed=seed)
        loss, ref_loss = step(model, opt, batch), ref_step(ref_model, ref_opt, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    ours = params_of(model)
    for path, value in params_of(ref_model).items():
        np.testing.assert_allclose(ours[path], value, rtol=1e-5, atol=1e-6, err_msg=path)


def test_the_check_compiles_the_same_programs():
    batch = make_batch("dense", 8)
    texts = []
    for check in (False, True):
        step, model, opt, _ = _step(check)
        compiled = step.lower(model, opt, batch).compile()
        executables = compiled.executables()
        texts.append(
            (
                compiled.as_text(),
                {n: [e.as_text() for e in found] for n, found in executables.items()},
            )
        )
    assert texts[0] == texts[1]


def test_check_finite_must_be_a_bool():
    with pytest.raises(mp.CompileError, match=r"check_finite must be True or False, got 'yes'"):
        _step("yes")


def test_train_check_finite_names_the_first_nan_stage(tmp_path, monkeypatch, capsys):
    from nnx_mpmd.apps import train, train_loop

    build_model = train_loop.build_model

    def poisoned(*args, **kwargs):  # one inf in the token embedding (stage 0)
        model = build_model(*args, **kwargs)
        table = model.embed.module.token.table
        table.set_value(table.get_value().at[:, 0].set(np.inf))
        return model

    monkeypatch.setattr(train_loop, "build_model", poisoned)
    argv = ["--meshes", "2", "--data", "1", "--layers", "2", "--batch-size", "4"]
    argv += ["--microbatches", "2", "--seq-len", "8", "--corpus-bytes", "20000", "--steps", "2"]
    argv += ["--ckpt-every", "0", "--no-compile-cache", "--run-dir", str(tmp_path / "run")]
    assert train.main([*argv, "--check-finite"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(
        r"^nnx-mpmd train: error: NonFiniteError: step 1: stage 0's task F0\.0 made a "
        r"non-finite value \(NaN or inf\) first: output 0\.",
        err,
    ), err
    assert train.main([*argv, "--run-dir", str(tmp_path / "unchecked")]) == 2
    err = capsys.readouterr().err
    assert "the loss became nan at step 1" in err and "rerun with --check-finite" in err


@pytest.mark.multiprocess
@pytest.mark.slow  # one 2-process launch
def test_launched_check_finite_names_the_same_first_value_on_every_process(tmp_path):
    from mp_launch import launch_once

    argv = ["--meshes", "2", "--data", "1", "--layers", "2", "--batch-size", "4"]
    argv += ["--microbatches", "2", "--seq-len", "8", "--corpus-bytes", "20000", "--steps", "2"]
    argv += ["--ckpt-every", "0", "--sample-tokens", "0", "--val-batches", "0"]
    argv += ["--compile-cache", str(tmp_path / "cache"), "--run-dir", str(tmp_path / "run")]
    done, _ = launch_once(
        "nonfinite_train.py", *argv, "--check-finite", devices_per_process=1, timeout=300
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-6000:]
    for process in (0, 1):  # process 1 holds stage 1 only, and names stage 0's value too
        assert re.search(
            rf"\[p{process}\] nnx-mpmd train: error: NonFiniteError: step 1: stage 0's task "
            r"F0\.0 made a non-finite value \(NaN or inf\) first: output 0\.",
            output,
        ), output[-6000:]
    assert "Traceback" not in output, output[-6000:]
