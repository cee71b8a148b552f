"""Profiled steps: the measured timeline, fitted costs, and the simulator beside them."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from pipeline_models import build, make_batch, make_mesh, params_of, train_step_fn

import nnx_mpmd as mp
from nnx_mpmd.compiler.ir import Call, ProgramKey, Transfer
from nnx_mpmd.runtime.timeline_profiler import Profile, TimelineProfiler
from nnx_mpmd.schedules import (
    Costs,
    Task,
    compare_profile,
    fit_costs,
    measured_timeline,
    plot_timelines,
    simulate,
)
from nnx_mpmd.schedules.validate import dependencies

# (schedule, stages, meshes)
SCHEDULES = [
    (mp.GPipe(), 2, 2),
    (mp.OneFOneB(), 4, 4),
    (mp.ZeroBubbleH1(), 2, 2),
    (mp.Interleaved1F1B(), 4, 2),
]


def _profiled_step(schedule, num_stages, profile, num_meshes=None, num_microbatches=4):
    model, opt, loss_fn, kind = build("mlp", "sgd", num_stages)
    num_meshes = num_meshes or num_stages
    step = mp.jit(
        train_step_fn(loss_fn),
        mesh=make_mesh(num_meshes, 8 // num_meshes),
        schedule=schedule,
        num_microbatches=num_microbatches,
    )
    batch = make_batch(kind, 8)
    loss = step(model, opt, batch, profile=profile)
    return step, model, float(np.asarray(jax.device_get(loss)))


@pytest.mark.parametrize(
    "schedule,num_stages,num_meshes", SCHEDULES, ids=lambda x: getattr(x, "name", x)
)
def test_timeline_has_every_task_once_after_its_dependencies(schedule, num_stages, num_meshes):
    step, _, _ = _profiled_step(schedule, num_stages, True, num_meshes)
    profile = step.last_profile
    assert isinstance(profile, Profile) and profile.mode == "timeline"
    timeline = profile.timeline()
    ran = [task for _, task, _, _ in timeline.entries]
    planned = [task for row in profile.tasks for task in row]
    assert sorted(ran, key=str) == sorted(planned, key=str)
    spans = {task: (start, end) for _, task, start, end in timeline.entries}
    split = lambda s, mb: Task(s, mb, "BI") in spans  # noqa: E731
    for task, (start, _) in spans.items():
        for dep in dependencies(task, num_stages, split):
            assert spans[dep][1] <= start + 1e-9, (dep, task)
    for mesh in range(timeline.num_meshes):
        rows = [(s, e) for m, _, s, e in timeline.entries if m == mesh]
        assert all(e1 <= s2 + 1e-9 for (_, e1), (s2, _) in itertools.pairwise(rows))
    assert all(0 <= start <= end for *_, start, end in profile.transfers)


def test_profiling_changes_no_number():
    _, plain_model, plain_loss = _profiled_step(mp.OneFOneB(), 4, False)
    for mode in (True, "isolated"):
        _, model, loss = _profiled_step(mp.OneFOneB(), 4, mode)
        assert loss == plain_loss
        for path, value in params_of(model).items():
            np.testing.assert_array_equal(value, params_of(plain_model)[path], err_msg=path)


def test_isolated_profile_waits_for_each_call():
    step, _, _ = _profiled_step(mp.OneFOneB(), 4, "isolated")
    profile = step.last_profile
    assert profile.mode == "isolated" and profile.transfers == []
    # The records of calls in dispatch order; each call is waited for before the next starts.
    ends = [end for *_, end in profile]
    starts = [start for *_, start, _ in profile]
    assert all(e <= s + 1e-9 for e, s in zip(ends, starts[1:], strict=False))


def test_compare_and_plot(tmp_path):
    step, _, _ = _profiled_step(mp.OneFOneB(), 4, True)
    comparison = step.last_profile.compare()
    assert comparison.measured.makespan > 0 and comparison.simulated.makespan > 0
    assert comparison.predicted_over_measured == pytest.approx(
        comparison.simulated.makespan / comparison.measured.makespan
    )
    assert comparison.summary().splitlines()[0].startswith("measured : makespan")
    figure = step.last_profile.plot(tmp_path / "profile.png")
    assert (tmp_path / "profile.png").stat().st_size > 0
    assert len(figure.axes) == 2
    assert figure.axes[0].get_xlim() == figure.axes[1].get_xlim()


def test_unknown_profile_mode_is_an_error():
    with pytest.raises(mp.CompileError, match=r"profile='fast' is not a profiling mode.*isolated"):
        _profiled_step(mp.GPipe(), 2, "fast")


def test_profile_without_tasks_cannot_be_compared():
    profile = Profile([(0, "F0.0", Task(0, 0, "F"), 0.0, 1.0)])
    with pytest.raises(mp.MpmdError, match=r"does not know the task lists.*compare_profile"):
        profile.compare()


def _call(mesh, label, reads, writes, task=None):
    return Call(mesh, ProgramKey("F", stage=mesh), None, tuple(reads), tuple(writes), label, task)


def test_times_are_made_consistent_in_dispatch_order():
    profiler = TimelineProfiler([])
    f0 = _call(0, "F0.0", [0], [1], Task(0, 0, "F"))
    move = Transfer(1, 2, 1, "act", src_mesh=0)
    f1 = _call(1, "F1.0", [2], [3], Task(1, 0, "F"))
    g0 = _call(0, "F0.1", [0], [4], Task(0, 1, "F"))
    h0 = _call(0, "F0.2", [0], [5], Task(0, 2, "F"))
    # F1.0 was seen ready before its input arrived (two waiter threads' clocks);
    # F0.1's results were donated away before its waiter got to them.
    profiler._build(
        [(0, f0, 0.0, 2.0), (1, move, 0.1, 1.0), (2, f1, 0.2, 2.5), (3, g0, 0.3, None),
         (4, h0, 0.4, 6.0)]
    )  # fmt: skip
    spans = {record[1]: record[3:] for record in profiler.records}
    assert profiler.transfers == [(0, 1, "act", 2.0, 2.0)]
    assert spans["F1.0"] == (2.0, 2.5)  # starts when its input arrived
    assert spans["F0.1"] == (2.0, 6.0)  # unknown end: the next known end on mesh 0
    assert spans["F0.2"] == (6.0, 6.0)
    assert profiler.approximate == 1


def test_fit_costs_takes_medians_per_stage_and_kind():
    records = [
        (0, "F0.0", Task(0, 0, "F"), 0.0, 1.0),
        (0, "F0.1", Task(0, 1, "F"), 1.0, 4.0),
        (0, "F0.2", Task(0, 2, "F"), 4.0, 6.0),
        (1, "FB1.0", Task(1, 0, "B"), 1.0, 4.0),  # a fused F+B, split 1:2
        (0, "post.L0.mesh0", None, 6.0, 9.0),
    ]
    costs = fit_costs(records, [(0, 1, "act", 1.0, 1.5), (0, 1, "act", 2.0, 2.1)])
    # Kinds a stage did not run are derived from those it did (all in seconds).
    assert costs.per_stage[0] == {"F": 2.0, "B": 4.0, "BI": 2.0, "BW": 2.0}
    assert costs.per_stage[1] == pytest.approx({"F": 1.0, "B": 2.0, "BI": 1.0, "BW": 1.0})
    assert pytest.approx((1.5, 2.0, 1.0, 1.0)) == (costs.F, costs.B, costs.BI, costs.BW)
    assert costs.transfer == pytest.approx(0.3)


@pytest.mark.parametrize(
    "profiled,derived",
    [
        ({"F": 0.001}, {"B": 0.002, "BI": 0.001, "BW": 0.001}),
        ({"F": 0.001, "B": 0.004}, {"BI": 0.002, "BW": 0.002}),
        ({"F": 0.001, "BI": 0.003, "BW": 0.001}, {"B": 0.004}),
    ],
)
def test_fit_costs_derives_kinds_the_profile_did_not_run(profiled, derived):
    """A 1F1B profile must not leave BI/BW at the unitless defaults (1.0) beside
    seconds: simulating a zero-bubble schedule from it would be nonsense."""
    records = [(0, kind, Task(0, 0, kind), 0.0, t) for kind, t in profiled.items()]
    costs = fit_costs(records)
    for kind, value in derived.items():
        assert getattr(costs, kind) == pytest.approx(value), kind
        assert costs.per_stage[0][kind] == pytest.approx(value), kind


def test_costs_fitted_to_1f1b_simulate_zb_h1_in_seconds():
    tasks = mp.OneFOneB().tasks(2, 2, 4)
    truth = simulate(tasks, Costs(F=0.001, B=0.002))
    records = [(m, str(t), t, s, e) for m, t, s, e in truth.entries]
    zb = simulate(mp.ZeroBubbleH1().tasks(2, 2, 4), fit_costs(records))
    assert 0 < zb.makespan <= truth.makespan  # same work, smaller bubble, same unit


def test_compare_profile_simulates_the_given_tasks():
    tasks = mp.OneFOneB().tasks(2, 2, 2)
    truth = simulate(tasks, Costs(F=0.5, B=1.0))
    records = [(m, str(t), t, s, e) for m, t, s, e in truth.entries]
    comparison = compare_profile(records, tasks)
    assert comparison.simulated.makespan == pytest.approx(truth.makespan)
    assert comparison.measured.makespan == pytest.approx(truth.makespan)
    with pytest.raises(mp.ScheduleError, match=r"ran tasks the task lists do not have.*F1\.1"):
        compare_profile(records, [["F0.0", "F0.1", "B0.0", "B0.1"], ["F1.0", "B1.0"]])


def test_forward_only_profile_is_not_compared():
    records = [(0, "F0.0", Task(0, 0, "F"), 0.0, 1.0)]
    with pytest.raises(mp.ScheduleError, match=r"forward tasks only.*plot_gantt"):
        compare_profile(records, [["F0.0", "B0.0"]])


def test_measured_timeline_needs_a_task():
    with pytest.raises(mp.MpmdError, match=r"no schedule tasks.*profile=True"):
        measured_timeline([(0, "post.L0.mesh0", None, 0.0, 1.0)])


def test_plot_timelines_errors(tmp_path):
    timeline = simulate([["F0.0", "B0.0"]])
    with pytest.raises(mp.ScheduleError, match=r"no panels given"):
        plot_timelines([])
    with pytest.raises(mp.ScheduleError, match=r"cannot save a Gantt chart as .*\.png"):
        plot_timelines([("a", timeline)], tmp_path / "picture.txt")
