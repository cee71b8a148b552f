"""Simulating meshes that share compute (Costs.contention): processor sharing, checked
against run_in_order, closed forms and hand-played timelines."""

from fractions import Fraction

import pytest

from nnx_mpmd.errors import ScheduleError
from nnx_mpmd.schedules import SCHEDULES, Costs, Task, get_schedule, parse_tasks, simulate
from nnx_mpmd.schedules.contention import contention_factor, run_shared
from nnx_mpmd.schedules.validate import run_in_order

MESHES = (2, 4)
MICROBATCHES = (4, 8)


def _every_schedule():
    for name in SCHEDULES:
        for p in MESHES:
            for m in MICROBATCHES:
                schedule = get_schedule(name)
                stages = schedule.default_num_stages(p)
                try:
                    schedule.check(stages, p, m)
                except ScheduleError:
                    continue
                yield pytest.param(schedule.tasks(stages, p, m), id=f"{name}-p{p}-m{m}")


EVERY_SCHEDULE = list(_every_schedule())


COSTS = Costs(F=Fraction(1), B=Fraction(5, 2), BI=Fraction(3, 2), BW=Fraction(1))


@pytest.mark.parametrize("tasks", EVERY_SCHEDULE)
def test_without_contention_the_times_are_run_in_orders(tasks):
    for transfer, overlap in ((0, 0), (Fraction(1, 4), Fraction(1, 2))):
        plain, _ = run_in_order(tasks, COSTS.duration, transfer, overlap)
        for factors in ((), (1,), (1, 1, 1, 1)):
            shared, blocked = run_shared(tasks, COSTS.duration, transfer, overlap, factors)
            assert shared == plain and blocked == []


@pytest.mark.parametrize("tasks", EVERY_SCHEDULE)
def test_linear_contention_makes_the_step_the_total_work(tasks):
    """With factor k for k busy meshes the meshes share one mesh's compute: while
    anything runs, work gets done at rate 1, so (no transfers) the makespan is the
    sum of every task's duration, whatever the schedule's bubbles."""
    p = len(tasks)
    costs = Costs(F=COSTS.F, B=COSTS.B, BI=COSTS.BI, BW=COSTS.BW, contention=range(1, p + 1))
    total = sum(simulate(tasks, COSTS).busy)
    assert simulate(tasks, costs).makespan == total


@pytest.mark.parametrize("tasks", EVERY_SCHEDULE)
def test_a_uniform_factor_stretches_every_task_alike(tasks):
    c = Fraction(3, 2)
    plain = simulate(tasks, COSTS)
    costs = Costs(F=COSTS.F, B=COSTS.B, BI=COSTS.BI, BW=COSTS.BW, contention=(c,) * 4)
    shared = simulate(tasks, costs)
    assert shared.makespan == c * plain.makespan
    assert [(m, t, c * a, c * b) for m, t, a, b in plain.entries] == list(shared.entries)


def test_tasks_beside_others_slow_down_and_alone_run_at_full_speed():
    # GPipe on 2 meshes, m = 2, F = 1, B = 2; a task runs at half speed beside another.
    lists = parse_tasks("F0.0 F0.1 B0.1 B0.0\nF1.0 F1.1 B1.1 B1.0")
    timeline = simulate(lists, Costs(contention=(1, 2)))
    spans = {str(task): (start, end) for _, task, start, end in timeline.entries}
    assert spans["F0.0"] == (0, 1)  # alone
    assert spans["F0.1"] == spans["F1.0"] == (1, 3)  # side by side: 1 unit of work each in 2
    assert spans["F1.1"] == (3, 4) and spans["B1.1"] == (4, 6)  # alone again
    assert spans["B0.1"] == spans["B1.0"] == (6, 10)
    assert spans["B0.0"] == (10, 12)
    assert timeline.makespan == 12 and timeline.busy == (9, 9)  # stretched durations


def test_a_task_that_starts_mid_way_shares_only_the_rest():
    # Every task takes 2 alone; F1.0 waits for F0.0 and a transfer of 1/2, while mesh 0
    # has gone on to F0.9.
    lists = ((Task(0, 0, "F"), Task(0, 9, "F")), (Task(1, 0, "F"),))
    times, _ = run_shared(lists, lambda t: 2, transfer=Fraction(1, 2), contention=(1, 2))
    # F0.9 runs alone from 2 to 2.5 (1/2 done), then beside F1.0: the remaining 3/2 of F0.9
    # take 3 (ends 5.5); F1.0 did 3/2 of its 2 by then and finishes its last 1/2 alone.
    assert times[Task(0, 9, "F")] == (2, Fraction(11, 2))
    assert times[Task(1, 0, "F")] == (Fraction(5, 2), 6)


def test_groups_run_as_one_unit_under_contention():
    lists = parse_tasks("F0.0 F0.1+B0.0 B0.1\nF1.0 B1.0 F1.1 B1.1")
    plain = simulate(lists, Costs(overlap=Fraction(1, 2)))
    shared = simulate(lists, Costs(overlap=Fraction(1, 2), contention=(1, 1)))
    assert plain.entries == shared.entries
    stretched = simulate(lists, Costs(overlap=Fraction(1, 2), contention=(2, 2)))
    assert stretched.makespan == 2 * plain.makespan
    group = [(s, e) for _, t, s, e in stretched.entries if t in (Task(0, 1, "F"), Task(0, 0, "B"))]
    assert group[0][1] == group[1][0]  # the members still fill the group's interval


def test_run_shared_reports_where_a_deadlocked_schedule_stops():
    lists = parse_tasks("F0.0 B0.0\nB1.0 F1.0")
    times, blocked = run_shared(lists, lambda t: 1, contention=(1, 2))
    assert set(times) == {Task(0, 0, "F")}
    assert blocked == [(0, Task(0, 0, "B")), (1, Task(1, 0, "B"))]


def test_contention_factor_uses_the_last_value_beyond_the_measured_counts():
    assert contention_factor((), 3) == 1
    assert contention_factor((1.0, 1.5), 1) == 1.0
    assert contention_factor((1.0, 1.5), 5) == 1.5


@pytest.mark.parametrize(
    ("factors", "match"),
    [
        ((1.0, 0.5), r"contention with 2 busy meshes is 0.5; a task cannot run faster.*>= 1"),
        ((1.0, "2"), r"cost contention with 2 busy meshes must be a number, got '2'"),
        ((1.0, -1.0), r"cost contention with 2 busy meshes is -1.0; costs must be >= 0"),
    ],
)
def test_bad_contention_is_a_schedule_error_naming_the_count(factors, match):
    with pytest.raises(ScheduleError, match=match):
        Costs(contention=factors)


def test_costs_parse_reads_contention_factors_joined_by_slashes():
    costs = Costs.parse("F=1, contention=1/2/3")
    assert costs.contention == (1.0, 2.0, 3.0)
    assert simulate(parse_tasks("F0.0 F0.1 B0.1 B0.0\nF1.0 F1.1 B1.1 B1.0"), costs).makespan == 12


def test_costs_parse_names_the_form_of_a_bad_contention():
    with pytest.raises(ScheduleError, match=r"cost contention .* is '1/x'.*'contention=1/1.8/2.5'"):
        Costs.parse("contention=1/x")


def test_schedule_command_simulates_with_contention(capsys):
    from nnx_mpmd.apps.schedule_cli import main

    assert main(["--schedule", "gpipe", "--meshes", "2", "--microbatches", "2"]) == 0
    plain = capsys.readouterr().out
    costs = "F=1,B=2,contention=1/2"
    assert (
        main(["--schedule", "gpipe", "--meshes", "2", "--microbatches", "2", "--costs", costs]) == 0
    )
    shared = capsys.readouterr().out
    assert "makespan 9," in plain and "makespan 12," in shared
    assert "contention=1/2\n" in shared and "contention" not in plain
