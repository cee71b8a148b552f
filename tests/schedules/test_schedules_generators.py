"""Schedule generators: closed-form bubbles and memory, constraints, golden task lists."""

import pathlib
from fractions import Fraction

import pytest

from nnx_mpmd.errors import ScheduleError
from nnx_mpmd.schedules import (
    SCHEDULES,
    Costs,
    Custom,
    DualPipeV,
    Eager1F1B,
    GPipe,
    Interleaved1F1B,
    LoopedBFS,
    OneFOneB,
    ZeroBubbleH1,
    ZeroBubbleH2,
    ZeroBubbleV,
    format_tasks,
    get_schedule,
    parse_tasks,
    simulate,
    validate,
)

GOLDEN = pathlib.Path(__file__).parents[1] / "golden" / "schedules"
MESHES = [1, 2, 3, 4, 8]
MICROBATCHES = list(range(1, 17))
UNIT = Costs(F=Fraction(1), B=Fraction(2), BI=Fraction(1), BW=Fraction(1))
# Two stages per mesh at the same work per mesh as one stage per mesh with UNIT costs.
HALF = Costs(F=Fraction(1, 2), B=Fraction(1), BI=Fraction(1, 2), BW=Fraction(1, 2))


def chunk_costs(v):
    return Costs(F=Fraction(1, v), B=Fraction(2, v))


@pytest.mark.parametrize("p", MESHES)
@pytest.mark.parametrize("m", MICROBATCHES)
@pytest.mark.parametrize("schedule", [GPipe(), OneFOneB()], ids=["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_exact(schedule, p, m):
    timeline = simulate(schedule.tasks(p, p, m), UNIT)
    assert timeline.bubble_fraction == Fraction(p - 1, m + p - 1)
    assert timeline.makespan == 3 * (m + p - 1)
    assert timeline.busy == (3 * m,) * p


@pytest.mark.parametrize("p", MESHES)
@pytest.mark.parametrize("m", MICROBATCHES)
def test_peak_activations_gpipe_holds_all_1f1b_holds_p_minus_r(p, m):
    assert simulate(GPipe().tasks(p, p, m)).peak_activations == (m,) * p
    peaks = simulate(OneFOneB().tasks(p, p, m)).peak_activations
    assert peaks == tuple(min(p - r, m) for r in range(p))


@pytest.mark.parametrize("p", MESHES)
@pytest.mark.parametrize("m", MICROBATCHES)
@pytest.mark.parametrize("v", [1, 2, 3])
def test_interleaved_bubble_is_exact(p, m, v):
    schedule = Interleaved1F1B()
    if m % p:
        with pytest.raises(ScheduleError, match=r"multiple of the number of meshes"):
            schedule.tasks(v * p, p, m)
        return
    timeline = simulate(schedule.tasks(v * p, p, m), chunk_costs(v))
    assert timeline.bubble_fraction == Fraction(p - 1, v * m + p - 1)


@pytest.mark.parametrize("p", MESHES)
@pytest.mark.parametrize("m", MICROBATCHES)
def test_zb_h1_makespan_and_memory(p, m):
    timeline = simulate(ZeroBubbleH1().tasks(p, p, m), UNIT)
    assert max(timeline.peak_activations) <= p
    if m >= p:
        assert timeline.makespan <= 3 * m + (p - 1)
        assert timeline.bubble_fraction == Fraction(p - 1, 3 * m + p - 1)
    else:  # too few microbatches to fill the pipe: the critical path decides
        assert timeline.makespan == 2 * (m + p) - 1


TRANSFERS = [Fraction(0), Fraction(1, 2), Fraction(1)]


@pytest.mark.parametrize("t", TRANSFERS)
@pytest.mark.parametrize("p", MESHES)
@pytest.mark.parametrize("m", MICROBATCHES)
def test_eager_1f1b_hides_transfers_in_the_steady_state(p, m, t):
    # Every mesh has its next forward's input before it needs it, so a transfer delay t is
    # paid only on the fill (p - 1 forward hops) and the drain (p - 1 backward hops).
    costs = Costs(F=Fraction(1), B=Fraction(2), transfer=t)
    eager = simulate(Eager1F1B().tasks(p, p, m), costs)
    assert eager.makespan == (m + p - 1) * 3 + 2 * (p - 1) * t
    assert eager.peak_activations == tuple(min(m, 2 * (p - r) - 1) for r in range(p))
    assert eager.makespan <= simulate(OneFOneB().tasks(p, p, m), costs).makespan


@pytest.mark.parametrize("t", TRANSFERS)
@pytest.mark.parametrize("p", MESHES)
@pytest.mark.parametrize("m", MICROBATCHES)
def test_zb_h2_makespan_and_memory(p, m, t):
    costs = Costs(F=Fraction(1), B=Fraction(2), BI=Fraction(1), BW=Fraction(1), transfer=t)
    h2 = simulate(ZeroBubbleH2().tasks(p, p, m), costs)
    h1 = simulate(ZeroBubbleH1().tasks(p, p, m), costs)
    assert h2.peak_activations == tuple(min(m, 2 * p - r - 1) for r in range(p))
    assert h2.makespan <= h1.makespan
    if m >= p:
        assert h2.makespan == 3 * m + p - 1 + 2 * (p - 1) * t
        if t == 0:  # within one step the first mesh still waits p - 1 for the last
            assert h2.makespan == h1.makespan
        elif m > p > 1:  # the eager warm-up needs more microbatches than meshes to matter
            assert h2.makespan < h1.makespan


@pytest.mark.parametrize("p", MESHES)
@pytest.mark.parametrize("m", MICROBATCHES)
def test_v_schedules_beat_zb_h1_at_equal_work(p, m):
    h1 = simulate(ZeroBubbleH1().tasks(p, p, m), UNIT)
    zbv = simulate(ZeroBubbleV().tasks(2 * p, p, m), HALF)
    assert sum(zbv.busy) == sum(h1.busy)
    assert max(zbv.peak_activations) <= 2 * p  # 2p half-size stages = 1F1B's first mesh
    if p == 1:
        assert zbv.bubble_fraction == h1.bubble_fraction == 0
    else:
        assert zbv.bubble_fraction < h1.bubble_fraction
    if m >= 2 * p:
        dual = simulate(DualPipeV().tasks(2 * p, p, m), HALF)
        assert max(dual.peak_activations) <= 2 * p + 1
        if p > 1:
            assert dual.bubble_fraction < h1.bubble_fraction


def test_reported_bubbles_at_p4_m8():
    h1 = simulate(ZeroBubbleH1().tasks(4, 4, 8), UNIT).bubble_fraction
    zbv = simulate(ZeroBubbleV().tasks(8, 4, 8), HALF).bubble_fraction
    dual = simulate(DualPipeV().tasks(8, 4, 8), HALF).bubble_fraction
    assert (h1, zbv, dual) == (Fraction(1, 9), Fraction(1, 17), Fraction(1, 17))


@pytest.mark.parametrize("p", MESHES)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("v", [1, 2, 3])
def test_looped_bfs_is_valid_and_gpipe_at_v1(p, m, v):
    tasks = LoopedBFS().tasks(v * p, p, m)
    assert max(simulate(tasks).peak_activations) == v * m
    if v == 1:
        assert tasks == GPipe().tasks(p, p, m)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_golden_task_lists_at_p4_m8(name):
    schedule = get_schedule(name)
    text = (GOLDEN / f"{name}.txt").read_text()
    assert text.startswith("# "), "each golden file starts with a comment on what was checked"
    expected = parse_tasks(text)
    tasks = schedule.tasks(schedule.default_num_stages(4), 4, 8)
    assert tasks == expected
    # == ignores Task.with_next; the text form shows the overlapped groups too.
    assert format_tasks(tasks) == format_tasks(expected)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("p", [1, 2, 4])
def test_generated_lists_follow_placement(name, p):
    schedule = get_schedule(name)
    stages = schedule.default_num_stages(p)
    m = 2 * p
    tasks = schedule.tasks(stages, p, m)
    validate(tasks, mesh_of=lambda s: schedule.mesh_of(s, stages, p), num_stages=stages)
    kinds = {t.kind for row in tasks for t in row}
    assert kinds == ({"F", "BI", "BW"} if schedule.split_backward else {"F", "B"})


@pytest.mark.parametrize(
    ("schedule", "args", "match"),
    [
        (GPipe(), (8, 4, 8), r"gpipe runs one stage per mesh"),
        (OneFOneB(), (12, 4, 8), r"1f1b runs one stage per mesh"),
        (ZeroBubbleH1(), (8, 4, 8), r"zb-h1 runs one stage per mesh"),
        (ZeroBubbleV(), (4, 4, 8), r"needs num_stages == 2 \* num_meshes"),
        (DualPipeV(), (8, 4, 7), r"at least 2 \* num_meshes = 8 microbatches"),
        (Interleaved1F1B(), (6, 4, 8), r"multiple of num_meshes"),
        (Interleaved1F1B(virtual_stages=3), (8, 4, 8), r"virtual_stages=3 needs 12 stages"),
        (LoopedBFS(virtual_stages=2), (12, 4, 8), r"virtual_stages=2 needs 8 stages"),
        (OneFOneB(), (4, 4, 0), r"num_microbatches must be an int >= 1"),
        (OneFOneB(), (4, 0, 4), r"num_meshes must be an int >= 1"),
        (ZeroBubbleV(max_activations=1), (4, 2, 4), r"max_activations must be an int >= 2"),
    ],
)
def test_unsupported_combinations_raise(schedule, args, match):
    with pytest.raises(ScheduleError, match=match):
        schedule.tasks(*args)


def test_zb_v_list_scheduler_reports_when_stuck():
    from nnx_mpmd.schedules.zero_bubble import _greedy_v_schedule

    # The public class refuses limits below 2; the scheduler itself still guards.
    with pytest.raises(ScheduleError, match=r"zb-v: no task can run .* raise max_activations"):
        _greedy_v_schedule(2, 4, limit=1)


@pytest.mark.parametrize("limit", [2, 3, 4, 6])
def test_zb_v_respects_its_memory_limit(limit):
    timeline = simulate(ZeroBubbleV(max_activations=limit).tasks(6, 3, 6), HALF)
    assert max(timeline.peak_activations) <= limit


def test_custom_rule_reproduces_gpipe_and_split_backward():
    f_before_backward = Custom(before=lambda a, b: a.kind == "F" and b.kind != "F")
    assert f_before_backward.tasks(3, 3, 4) == GPipe().tasks(3, 3, 4)
    split = Custom(before=lambda a, b: a.kind == "F" and b.kind != "F", split_backward=True)
    tasks = split.tasks(2, 2, 2)
    assert [str(t) for t in tasks[0]] == ["F0.0", "F0.1", "BI0.0", "BW0.0", "BI0.1", "BW0.1"]


def test_custom_rule_with_v_placement():
    sched = Custom(before=lambda a, b: a.kind == "F" and b.kind != "F", placement="v")
    tasks = sched.tasks(4, 2, 2)
    assert {t.stage for t in tasks[0]} == {0, 3}
    assert sched.mesh_of(3, 4, 2) == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, r"exactly one of lists=, text= or before=, got none"),
        ({"text": "F0.0 B0.0", "before": lambda a, b: False}, r"got text, before"),
        ({"before": lambda a, b: False, "placement": "zigzag"}, r"placement 'zigzag'"),
    ],
)
def test_custom_bad_arguments(kwargs, match):
    with pytest.raises(ScheduleError, match=match):
        Custom(**kwargs)


def test_custom_rule_cycle_is_reported():
    backwards_first = Custom(before=lambda a, b: a.kind == "B" and b.kind == "F")
    with pytest.raises(ScheduleError, match=r"rule has a cycle among these tasks: .*F0.0"):
        backwards_first.tasks(1, 1, 1)


def test_custom_lists_size_must_match_request():
    sched = Custom(text="F0.0 B0.0\nF1.0 B1.0")
    assert sched.tasks(2, 2, 1)[1][0].stage == 1
    assert sched.default_num_stages(2) == 2
    with pytest.raises(ScheduleError, match=r"has 2 meshes, 2 stages and 1 microbatches"):
        sched.tasks(2, 2, 4)
    with pytest.raises(ScheduleError, match=r"stage 5 has no tasks in this Custom schedule"):
        sched.mesh_of(5, 2, 2)


def test_get_schedule_names_and_errors():
    assert get_schedule("ZB_H1") == ZeroBubbleH1()
    sched = OneFOneB()
    assert get_schedule(sched) is sched
    with pytest.raises(ScheduleError, match=r"unknown schedule 'pipedream'; use one of gpipe"):
        get_schedule("pipedream")
    with pytest.raises(ScheduleError, match=r"'gpipe' has no parameter virtual_stages"):
        get_schedule("gpipe", virtual_stages=2)
    with pytest.raises(ScheduleError, match=r"instance and parameters"):
        get_schedule(sched, virtual_stages=2)
    with pytest.raises(ScheduleError, match=r"schedule name must be a string"):
        get_schedule(3)
