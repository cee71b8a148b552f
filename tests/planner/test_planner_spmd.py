"""The planner's SPMD alternatives: data parallel and FSDP over all devices, ranked with
the pipelines, verified, and the one-line verdict on whether pipelining pays."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from pipeline_models import build, make_batch, make_mesh, params_of, train_step_fn

import nnx_mpmd as mp
from nnx_mpmd.apps import plan as plan_app
from nnx_mpmd.planner import (
    Candidate,
    LinkCosts,
    Plan,
    SpmdCandidate,
    UnitCosts,
    Verification,
    plan,
    spmd_step,
    verify,
)
from nnx_mpmd.planner.spmd import predict_spmd, spmd_microbatches


@pytest.mark.parametrize(
    "kind,model_name,opt_name",
    [("dp", "mlp", "sgd"), ("fsdp", "lm_tied", "adamw")],
)
def test_spmd_steps_compute_what_nnx_jit_computes(kind, model_name, opt_name):
    """Two steps over all 8 devices with 2 accumulated microbatches: the losses and the
    parameters are those of ``nnx.jit`` of the same microbatched step, to float rounding."""
    mesh = make_mesh(4, 2)
    model, _, loss_fn, batch_kind = build(model_name, opt_name, 2)
    tx = optax.sgd(0.1) if opt_name == "sgd" else optax.adamw(1e-2)
    step, state = spmd_step(kind, model, loss_fn, tx, mesh, 2)
    reference, _, _, _ = build(model_name, opt_name, 2)
    ref_opt = nnx.Optimizer(reference, tx, wrt=nnx.Param)
    ref_step = nnx.jit(train_step_fn(loss_fn, num_microbatches=2))
    for seed in range(2):
        batch = make_batch(batch_kind, 16, seed=seed)
        loss, state = step(state, batch)
        expected = float(ref_step(reference, ref_opt, batch))
        assert float(loss) == pytest.approx(expected, rel=1e-5)
    specs = {leaf.sharding.spec for leaf in jax.tree.leaves(state)}
    assert (jax.sharding.PartitionSpec("spmd") in specs) == (kind == "fsdp"), specs
    trained = nnx.merge(nnx.graphdef((model, nnx.Optimizer(model, tx, wrt=nnx.Param))), state)[0]
    got, want = params_of(trained), params_of(reference)
    for path, value in want.items():
        np.testing.assert_allclose(got[path], value, rtol=2e-5, atol=2e-6, err_msg=path)


def test_spmd_step_rejects_an_unknown_kind():
    model, _, loss_fn, _ = build("mlp", "sgd", 2)
    with pytest.raises(mp.PlanError, match=r"unknown SPMD alternative 'tp'; use one of"):
        spmd_step("tp", model, loss_fn, optax.sgd(0.1), make_mesh(2, 1), 1)


def _costs(**changes):
    fields = dict(
        paths=("a", "b"), microbatch_size=4, remat=False, F=(1.0, 1.0), BI=(1.0, 1.0),
        BW=(1.0, 1.0), B=(2.0, 2.0), kept_bytes=(10, 10), split_bytes=(0, 0),
        state_bytes=(300, 300), param_bytes=(100, 100), other_s=0.5, batch_bytes=(8, 0),
    )  # fmt: skip
    return UnitCosts(**{**fields, **changes})


def test_the_spmd_cost_model_is_compute_plus_collectives_over_the_link():
    link = LinkCosts(latency_s=0.1, bytes_per_s=100.0)
    costs = _costs(contention=(1.0, 2.0))
    dp = predict_spmd("dp", costs, 2, 4, 2, link)
    # Compute: 2 microbatches x (F + B) of both units, x2 with both submeshes busy;
    # all-reduce per microbatch: 2 (n-1)/n x 200 bytes = 300 bytes at 100 B/s + 0.1 s;
    # the update of the whole state on every device, x2 contention.
    assert dp.step_s == pytest.approx(2 * 6.0 * 2 + 2 * (0.1 + 3.0) + 0.5 * 2)
    # State and gradients, 2 microbatches' batch bytes, then the larger of the kept
    # activations (20) and the update's second copy of the state (600).
    assert dp.peak_bytes == (600 + 200 + 16 + 600,)
    fsdp = predict_spmd("fsdp", costs, 2, 4, 2, link)
    # Per microbatch: two all-gathers and a reduce-scatter of (n-1)/n x 200 = 150 bytes.
    assert fsdp.step_s == pytest.approx(2 * 6.0 * 2 + 2 * 3 * (0.1 + 1.5) + 0.5 * 2 / 4)
    # A quarter of the state and gradients, one unit's parameters gathered, the batch,
    # then the kept activations against a quarter of the state.
    assert fsdp.peak_bytes == (200 + 100 + 16 + 150,)
    assert predict_spmd("fsdp", costs, 2, 4, 2, link, donate=True).peak_bytes == (
        200 + 100 + 16 + 20,
    )
    assert dp.label == "data parallel over 4 devices, m=2"
    with pytest.raises(mp.PlanError, match=r"unknown SPMD alternative 'zero3'"):
        predict_spmd("zero3", costs, 2, 4, 2, link)
    # Rows per device of an SPMD microbatch equal the pipeline profile's at m / meshes.
    assert spmd_microbatches(16, 2, 4, [2, 4, 8]) == [1, 2, 4]
    assert spmd_microbatches(16, 2, 8, [2, 4, 8]) == [1, 2]  # 16 rows: not 4 x 8 devices
    assert spmd_microbatches(16, 2, 4, [3]) == []


def _plan_with_alternatives(mesh):
    model, _, loss_fn, kind = build("mlp", "sgd", 4)
    batch = make_batch(kind, 16)
    planned = plan(
        model, loss_fn, batch, mesh, optax.sgd(0.1), schedules=["1f1b"], num_microbatches=[2, 4],
        remat=False, repeats=1,
    )  # fmt: skip
    return model, loss_fn, batch, planned


def test_the_spmd_alternatives_are_ranked_verified_and_saved(tmp_path):
    mesh = make_mesh(2, 2)
    model, loss_fn, batch, planned = _plan_with_alternatives(mesh)
    assert {(c.kind, c.num_devices) for c in planned.spmd} == {("dp", 4), ("fsdp", 4)}
    assert {c.num_microbatches for c in planned.spmd} == {1, 2}  # m = 2, 4 on 2 meshes
    assert planned.link is not None and planned.link.bytes_per_s > 0
    ranked = [c for c, _, _ in planned.ranking()]
    assert set(ranked) == {planned.best, *planned.runners_up, *planned.spmd}
    assert "| FSDP over 4 devices | - |" in planned.summary()
    assert "| data parallel over 4 devices | - |" in planned.summary()
    # Whatever this machine's timings, put one SPMD alternative first and the others
    # last: --verify 2 runs it and the first pipeline of the ranking.
    first = dataclasses.replace(planned.spmd[0], step_s=1e-9)
    last = tuple(dataclasses.replace(c, step_s=1e9) for c in planned.spmd[1:])
    rigged = dataclasses.replace(planned, spmd=(first, *last))
    checked = verify(rigged, model, loss_fn, batch, mesh, optax.sgd(0.1), top=2, steps=1)
    assert [type(v.candidate) for v in checked] == [SpmdCandidate, Candidate]
    # Code that prints a pipeline's fields over verify's results reads both kinds.
    assert checked[0].candidate.schedule in ("data parallel", "FSDP")
    assert (checked[0].candidate.num_stages, checked[0].candidate.remat) == (1, ())
    assert all(v.measured_step_s > 0 for v in checked)
    assert "| FSDP over 4 devices |" in plan_app._verification_table(checked) or (
        "| data parallel over 4 devices |" in plan_app._verification_table(checked)
    )
    closed = rigged.with_measurements(checked)
    assert dict(closed.spmd_measured) == {first: checked[0].measured_step_s}
    assert closed.spmd_calibration == pytest.approx(checked[0].measured_step_s / 1e-9)
    assert closed.calibration == pytest.approx(
        checked[1].measured_step_s / checked[1].candidate.step_s
    )
    assert closed.verdict().endswith("(both measured)")
    closed.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == closed
    closed.apply(model)  # the plan file still applies its best pipeline
    assert mp.annotate.num_stages(model) == closed.best.num_stages


def _pipeline(step_s):
    return Candidate("1f1b", 4, 8, (0, 1, 2, 3), (False,) * 4, step_s, (10,) * 4)


def _measured(pipe_s, spmd_s):
    """A plan of one pipeline and two SPMD alternatives, closed over made-up timings."""
    pipe = _pipeline(0.01)
    dp, fsdp = SpmdCandidate("dp", 8, 1, 0.01, (10,)), SpmdCandidate("fsdp", 8, 2, 0.02, (10,))
    planned = Plan(pipe, (), ("a", "b", "c", "d"), 4, 32, spmd=(dp, fsdp))
    checked = [
        Verification(pipe, pipe_s, (10,) * 4),
        Verification(dp, spmd_s, (10,)),
        Verification(fsdp, 2 * spmd_s, (10,)),
    ]
    return planned.with_measurements(checked)


def test_the_verdict_says_when_pipelining_pays_and_when_not():
    pays = _measured(pipe_s=0.01, spmd_s=0.018)
    assert pays.verdict() == (
        "pipelining pays: 1f1b with 4 stages, m=8 is 1.80x faster than the best SPMD "
        "(data parallel over 8 devices, m=1) (both measured)"
    )
    does_not = _measured(pipe_s=0.013, spmd_s=0.01)
    assert does_not.verdict() == (
        "do not pipeline: data parallel over 8 devices, m=1 is 1.30x faster than the best "
        "pipeline (1f1b with 4 stages, m=8) (both measured)"
    )
    assert [type(c) for c, _, _ in does_not.ranking()] == [SpmdCandidate, Candidate, SpmdCandidate]
    # Unmeasured alternatives are compared by their calibrated predictions.
    predicted = Plan(
        _pipeline(0.02), (), ("a",) * 4, 4, 32, spmd=(SpmdCandidate("fsdp", 8, 2, 0.01, (1,)),)
    )
    assert predicted.verdict().startswith("do not pipeline: FSDP over 8 devices, m=2 is 2.00x")
    assert predicted.verdict().endswith("(both predicted)")
    assert (
        "no SPMD alternative was profiled" in Plan(_pipeline(0.02), (), ("a",) * 4, 4, 32).verdict()
    )


def test_plans_without_spmd_alternatives_still_load_and_bad_ones_are_refused():
    planned = _measured(pipe_s=0.01, spmd_s=0.02)
    data = json.loads(planned.to_json())
    assert Plan.from_json(planned.to_json()) == planned
    for key in ("spmd", "spmd_measured", "link", "spmd_calibration"):
        del data[key]  # a plan written before the SPMD alternatives were profiled
    older = Plan.from_json(json.dumps(data))
    assert older.spmd == () and older.spmd_calibration is None and older.link is None
    bad = json.loads(planned.to_json())
    bad["spmd"][0]["kind"] = "tensor"
    with pytest.raises(mp.PlanError, match=r"cannot read a plan .*spmd: kind must be one of"):
        Plan.from_json(json.dumps(bad))


def test_plan_command_has_a_no_spmd_option():
    assert plan_app.build_parser().parse_args(["--no-spmd"]).no_spmd
    assert not plan_app.build_parser().parse_args([]).no_spmd
