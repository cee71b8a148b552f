"""Pipelined steps equal the nnx.jit single-device reference, step after step."""

from __future__ import annotations

import numpy as np
import pytest
from pipeline_models import build, make_batch, make_mesh, params_of, reference_run, train_step_fn

import nnx_mpmd as mp
from nnx_mpmd import schedules
from nnx_mpmd.aot.stats import count_compilations

# (schedule, meshes, stages, microbatches, data)
CONFIGS = [
    (schedules.GPipe, 1, 1, 1, 1),
    (schedules.GPipe, 2, 2, 4, 2),
    (schedules.OneFOneB, 4, 4, 8, 2),
    (schedules.OneFOneB, 2, 2, 3, 1),
    (schedules.Interleaved1F1B, 4, 8, 8, 2),
    (schedules.LoopedBFS, 2, 4, 4, 2),
    (schedules.ZeroBubbleH1, 4, 4, 8, 2),
    (schedules.ZeroBubbleH2, 4, 4, 8, 2),
    (schedules.Eager1F1B, 2, 2, 4, 2),
    (schedules.ZeroBubbleV, 2, 4, 4, 2),
    (schedules.DualPipeV, 2, 4, 4, 2),
]
MODEL_NAMES = ["mlp", "lm", "lm_tied", "gated"]
OPT_NAMES = ["sgd", "adamw", "clip_adamw_cosine"]
STEPS = 3


def _config_id(c):
    return f"{c[0].__name__}-M{c[1]}-S{c[2]}-m{c[3]}-d{c[4]}"


def run_equivalence(model_name, opt_name, config, steps=STEPS):
    schedule_cls, meshes, stages, microbatches, data = config
    batch_size = microbatches * 2 * data
    ref_losses, expected = reference_run(
        model_name, opt_name, stages, microbatches, batch_size, steps
    )
    model, opt, loss_fn, kind = build(model_name, opt_name, stages)
    mesh = make_mesh(meshes, data)
    pipelined = mp.jit(
        train_step_fn(loss_fn), mesh=mesh, schedule=schedule_cls(), num_microbatches=microbatches
    )
    for step in range(steps):
        batch = make_batch(kind, batch_size, seed=step)
        with count_compilations() as counter:
            loss = pipelined(model, opt, batch)
            np.testing.assert_allclose(float(loss), ref_losses[step], rtol=1e-5)
        if step > 0:
            assert counter.count == 0, f"step {step} recompiled {counter.count} programs"
        else:
            twice = sorted({n for n in counter.names if counter.names.count(n) > 1})
            assert not twice, f"the first step compiled {twice} more than once"
    atol = 1e-5 if opt_name == "sgd" else 1e-4
    got = params_of(model)
    assert expected.keys() == got.keys()
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=atol, err_msg=path)
    return pipelined


def pairwise_cases():
    """Every (model, layout) pair once, the optimizer rotating so that every
    (layout, optimizer) and (model, optimizer) pair occurs too: 44 cases, not 132.

    The optimizer update runs per stage after the gradients, whatever the schedule,
    so the three-way product re-tested code paths that the pairs already cover.
    """
    return [
        (model_name, OPT_NAMES[(i + j) % len(OPT_NAMES)], config)
        for i, config in enumerate(CONFIGS)
        for j, model_name in enumerate(MODEL_NAMES)
    ]


def test_pairwise_cases_cover_every_pair():
    cases = pairwise_cases()
    models_opts = {(m, o) for m, o, _ in cases}
    configs_opts = {(_config_id(c), o) for _, o, c in cases}
    models_configs = {(m, _config_id(c)) for m, _, c in cases}
    assert len(models_opts) == len(MODEL_NAMES) * len(OPT_NAMES)
    assert len(configs_opts) == len(CONFIGS) * len(OPT_NAMES)
    assert len(models_configs) == len(CONFIGS) * len(MODEL_NAMES) == len(cases)


@pytest.mark.parametrize(
    ("model_name", "opt_name", "config"),
    pairwise_cases(),
    ids=lambda v: _config_id(v) if isinstance(v, tuple) else v,
)
def test_pipelined_step_equals_reference(model_name, opt_name, config):
    pipelined = run_equivalence(model_name, opt_name, config)
    assert pipelined.num_compiled_steps == 1
