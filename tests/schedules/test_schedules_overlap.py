"""Overlapped tasks (Task.with_next, text form 'F0.5+BI7.2+BW7.2'): validation, simulation,
DualPipeV's pairs and their closed form, pictures, profiles, the command line."""

import dataclasses
from fractions import Fraction

import pytest

from nnx_mpmd.apps.schedule_cli import main as schedule_main
from nnx_mpmd.errors import ScheduleError
from nnx_mpmd.schedules import (
    Costs,
    DualPipeV,
    Task,
    format_tasks,
    measured_timeline,
    overlap_groups,
    parse_tasks,
    peak_activations,
    plot_gantt,
    simulate,
    to_ascii,
    validate,
)
from nnx_mpmd.schedules.profile import compare_profile, fit_costs


def equal_costs(c, overlap=0, transfer=0):
    """Every chunk task costs c: F = BI = BW = c, B = 2c (HALF in the generator tests: c = 1/2)."""
    return Costs(F=c, B=2 * c, BI=c, BW=c, overlap=overlap, transfer=transfer)


HALF = Fraction(1, 2)


def dualpipev(p, m, overlap=True):
    return DualPipeV(overlap=overlap).tasks(2 * p, p, m)


# --- text form ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "mesh 0: F0.0 F0.1+B0.0 B0.1\n",
        "mesh 0: F0.0 F0.1 F0.2+BI1.0+BW1.0 B0.0\nmesh 1: F1.0+F1.1\n",
        "F0.0+B1.0 B0.0\n",
    ],
)
def test_text_round_trip_with_groups(text):
    prefix = text.startswith("mesh")
    assert format_tasks(parse_tasks(text), prefix=prefix) == text


@pytest.mark.parametrize("p", [1, 2, 4])
def test_dualpipev_text_round_trip_keeps_the_pairs(p):
    tasks = dualpipev(p, 2 * p + 1)
    text = format_tasks(tasks)
    assert "+" in text
    again = parse_tasks(text)
    assert again == tasks
    assert [[t.with_next for t in row] for row in again] == [
        [t.with_next for t in row] for row in tasks
    ]
    assert format_tasks(again) == text


# --- validate ----------------------------------------------------------------------------


def test_with_next_on_the_last_task_of_a_mesh():
    tasks = [[Task(0, 0, "F"), Task(0, 0, "B", with_next=True)]]
    with pytest.raises(
        ScheduleError,
        match=r"task B0\.0, the last task of mesh 0, has with_next=True .* no task follows it "
        r"on mesh 0; set with_next=False on it",
    ):
        validate(tasks)


def test_group_member_that_needs_another_member():
    # Mesh 1 holds stages 1 and 2 (V placement): F2.0 needs F1.0's output.
    text = "F0.0 F3.0 B3.0 B0.0\nF1.0+F2.0 B2.0 B1.0"
    with pytest.raises(
        ScheduleError,
        match=r"mesh 1: in the overlapped group F1\.0\+F2\.0, F2\.0 needs F1\.0 of the same "
        r"group.*write 'F1\.0 F2\.0'",
    ):
        validate(parse_tasks(text))


def test_group_that_feeds_itself_through_other_meshes_deadlocks():
    # F3.0 needs F2.0 (mesh 1), which needs F1.0, which needs F0.0 of the same group.
    text = "F0.0+F3.0 B3.0 B0.0\nF1.0 F2.0 B2.0 B1.0"
    with pytest.raises(
        ScheduleError,
        match=r"the overlapped group F0\.0\+F3\.0 on mesh 0 deadlocks: .*mesh 0 waits at "
        r"F0\.0\+F3\.0 for F2\.0 \(mesh 1\); mesh 1 waits at F1\.0 for F0\.0 \(mesh 0\).*"
        r"Split the group",
    ):
        validate(parse_tasks(text))
    # The same lists without the group are fine.
    validate(parse_tasks(text.replace("+", " ")))


def test_bw_after_its_own_bi_in_a_group_is_allowed():
    validate(parse_tasks("F0.0 F3.0 BI3.0 BW3.0 BI0.0 BW0.0\nF1.0 F2.0 BI2.0+BW2.0 BI1.0+BW1.0"))
    validate(parse_tasks("F0.0 F0.1+BI0.0+BW0.0 BI0.1 BW0.1"))


def test_bw_before_its_bi_in_a_group_is_an_order_error():
    with pytest.raises(ScheduleError, match=r"task BW0\.0 comes before BI0\.0 on mesh 0"):
        validate(parse_tasks("F0.0 BW0.0+BI0.0"))


def test_a_deadlock_elsewhere_is_reported_as_for_plain_lists():
    # Mesh 1 runs F2.0 before F1.0; the harmless group on mesh 0 plays no part.
    plain = "F0.0 F3.0 B3.0 B0.0\nF2.0 F1.0 B2.0 B1.0"
    messages = []
    for text in (plain, plain.replace("B3.0 B0.0", "B3.0+B0.0")):
        with pytest.raises(ScheduleError) as info:
            validate(parse_tasks(text))
        messages.append(str(info.value).splitlines()[0])
    assert (
        messages[0]
        == messages[1]
        == (
            "the schedule deadlocks: mesh 0 waits at F3.0 for F2.0 (mesh 1); mesh 1 waits at F2.0 "
            "for F1.0 (mesh 1). Reorder the lists so that every task's inputs are produced before it"
        )
    )


# --- Costs.overlap and simulate ----------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"overlap": -1.0}, r"cost overlap is -1\.0; costs must be >= 0"),
        ({"overlap": "x"}, r"cost overlap must be a number, got 'x'"),
        ({"overlap": True}, r"cost overlap must be a number, got True"),
    ],
)
def test_bad_overlap_cost(kwargs, match):
    with pytest.raises(ScheduleError, match=match):
        Costs(**kwargs)


def test_overlap_cost_parses():
    assert Costs.parse("F=1,overlap=0.5") == Costs(overlap=0.5)
    assert Costs().overlap == 0


def test_group_runs_as_one_unit_with_overlap():
    tasks = parse_tasks("F0.0 F0.1+BI0.0+BW0.0 BI0.1 BW0.1")
    costs = Costs(F=Fraction(1), BI=Fraction(2), BW=Fraction(1), overlap=Fraction(2))
    tl = simulate(tasks, costs)
    # The group takes 1 + 2 + 1 - 2 = 2, split 1:2:1 into consecutive sub-intervals.
    assert [tl.span(t) for t in tasks[0]] == [
        (0, 1),
        (1, Fraction(3, 2)),
        (Fraction(3, 2), Fraction(5, 2)),
        (Fraction(5, 2), 3),
        (3, 5),
        (5, 6),
    ]
    assert tl.makespan == 6 and tl.busy == (6,)
    assert [t.with_next for _, t, _, _ in tl.entries] == [False, True, True, False, False, False]


def test_group_takes_at_least_its_longest_member():
    tasks = parse_tasks("F0.0 F0.1+B0.0 B0.1")
    tl = simulate(tasks, Costs(F=Fraction(1), B=Fraction(3), overlap=Fraction(10)))
    assert tl.span(Task(0, 0, "B"))[1] - tl.span(Task(0, 1, "F"))[0] == 3
    # Overlap never shortens a lone task.
    assert simulate(parse_tasks("F0.0 B0.0"), Costs(overlap=5.0)).makespan == 3.0


def test_group_waits_for_every_member_and_sends_at_its_end():
    # Alone, F0.1 runs while mesh 0 waits for B1.0; in a group with B0.0 it waits too,
    # and F1.1 (mesh 1) gets F0.1's output only when the group ends.
    plain = parse_tasks("F0.0 F0.1 B0.0 B0.1\nF1.0 B1.0 F1.1 B1.1")
    paired = parse_tasks("F0.0 F0.1+B0.0 B0.1\nF1.0 B1.0 F1.1 B1.1")
    a, b = simulate(plain), simulate(paired)
    assert a.span(Task(0, 1, "F")) == (1.0, 2.0)
    assert b.span(Task(0, 1, "F")) == (4.0, 5.0)
    assert b.span(Task(1, 1, "F"))[0] == b.span(Task(0, 0, "B"))[1] == 7.0


def test_transfer_delay_applies_to_a_groups_inputs():
    tasks = parse_tasks("F0.0 F0.1+B0.0 B0.1\nF1.0 B1.0 F1.1 B1.1")
    tl = simulate(tasks, Costs(transfer=0.5))
    # F1.0 ends at 2.5, B1.0 at 4.5; the group starts after the transfer back.
    assert tl.span(Task(0, 1, "F"))[0] == 5.0


def test_peak_activations_count_a_group_as_one_program():
    # B0.0 frees only at the group's end, after F0.1 took its activation.
    assert peak_activations(parse_tasks("F0.0 B0.0+F0.1 B0.1")) == (2,)
    assert peak_activations(parse_tasks("F0.0 B0.0 F0.1 B0.1")) == (1,)
    assert simulate(parse_tasks("F0.0 B0.0+F0.1 B0.1")).peak_activations == (2,)


# --- DualPipeV pairs ---------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_dualpipev_pairs_only_change_flags(p, extra):
    m = 2 * p + extra
    paired, plain = dualpipev(p, m), dualpipev(p, m, overlap=False)
    assert paired == plain
    assert not any(t.with_next for row in plain for t in row)
    for r, row in enumerate(paired):
        groups = [g for g in overlap_groups(row) if len(g) > 1]
        assert groups
        lower, upper = r, 2 * p - 1 - r
        for f, bi, bw in groups:
            # A forward of one chunk with the full backward (BI then BW) of the other.
            assert (f.kind, bi.kind, bw.kind) == ("F", "BI", "BW")
            assert (bi.stage, bi.microbatch) == (bw.stage, bw.microbatch)
            assert {f.stage, bi.stage} == {lower, upper}


def test_dualpipev_pairs_at_p4_m8():
    rows = format_tasks(dualpipev(4, 8)).splitlines()
    # The turn of the V: the first steady round's lower forward runs alone.
    assert " F3.4 BI4.0 BW4.0 F4.4+BI3.0+BW3.0 " in rows[3]
    # Meshes 1..3 run the upper forwards after their last lower forward alone.
    assert " F4.7 BI3.3 BW3.3 " in rows[3]
    assert " F6.5 BI1.1 BW1.1 " in rows[1] and " F6.7 BI1.3 BW1.3 " in rows[1]
    # Mesh 0 pairs them: its upper stage is the last one.
    assert " F7.7+BI0.3+BW0.3 " in rows[0]
    assert sum(row.count("+") for row in rows) // 2 == 19


def test_dualpipev_overlap_must_be_a_bool():
    with pytest.raises(ScheduleError, match=r"dualpipev: overlap must be a bool, got 'yes'"):
        DualPipeV(overlap="yes").tasks(4, 2, 4)


# The closed form. With every chunk task costing c (F = BI = BW = c, B = 2c; HALF is
# c = 1/2) and 0 <= overlap <= c, DualPipeV with its pairs on p meshes and m >= 2p
# microbatches takes
#
#     makespan = (6m + p - 1) c - (2m - 3p) overlap.
#
# 6mc is one mesh's work (2m forwards and 2m full backwards of its two chunks), (p - 1)c
# the idle time of the V's fill and drain, and each of the 2m - 3p pairs on the critical
# path hides `overlap` (mesh 0 runs 2m - 3p + 1 pairs, all but one on that path). Past
# overlap = c (a pair of three c-long members takes max(3c - overlap, c)) other paths
# become critical on pipelines of p >= 4 meshes and the formula stops holding.
#
# DeepSeek publish a bubble of (PP/2 - 1)(F&B + B - 3W) for DualPipe and for DualPipeV on
# PP/2 = p devices, with F&B = F + B - overlap the time of an overlapped pair, B = BI + BW
# and W = BW; at equal costs that is (p - 1)(2c - overlap). It does not map term by term
# onto the simulated figures: the simulator idles (p - 1)c per mesh at overlap 0 (half the
# published 2(p - 1)c, as ZB-V does at equal costs), and mesh 0's idle time
# (makespan - busy) is (p - 1)c + overlap, because overlap shortens mesh 0's own work by
# one pair more than it shortens the makespan. Both agree that the fill-and-drain term
# scales with p - 1 and that overlap shortens the step; the published number reads as
# the accounting of DeepSeek's own figure, not as this simulator's exact value.
CLOSED_FORM_MESHES = [1, 2, 3, 4, 5, 8]


def closed_form_makespan(p, m, c, overlap):
    return (6 * m + p - 1) * c - (2 * m - 3 * p) * overlap


@pytest.mark.parametrize("p", CLOSED_FORM_MESHES)
@pytest.mark.parametrize("k", [0, 1, 2, 4])  # m = 2p + k
@pytest.mark.parametrize("overlap", [Fraction(0), Fraction(1, 8), Fraction(1, 4), HALF])
def test_dualpipev_makespan_closed_form(p, k, overlap):
    m = 2 * p + k
    tl = simulate(dualpipev(p, m), equal_costs(HALF, overlap))
    assert tl.makespan == closed_form_makespan(p, m, HALF, overlap)
    # Mesh 0 runs 2m - 3p + 1 pairs (one fewer when p = 1: it is also the turn of the V).
    pairs = 2 * m - 3 * p + (p > 1)
    assert sum(len(g) > 1 for g in overlap_groups(dualpipev(p, m)[0])) == pairs
    busy0 = 6 * m * HALF - pairs * overlap
    assert tl.busy[0] == busy0
    assert tl.makespan - busy0 == (p - 1) * HALF + (p > 1) * overlap


@pytest.mark.parametrize("p", [2, 4, 6])
@pytest.mark.parametrize("c", [Fraction(1), Fraction(3, 7)])
def test_dualpipev_closed_form_scales_with_c_up_to_overlap_c(p, c):
    m = 2 * p + 3
    for overlap in (c / 3, c):
        tl = simulate(dualpipev(p, m), equal_costs(c, overlap))
        assert tl.makespan == closed_form_makespan(p, m, c, overlap)
    # Past overlap = c other paths (lone tasks) become critical on longer pipelines.
    beyond = simulate(dualpipev(p, m), equal_costs(c, 2 * c)).makespan
    assert (beyond == closed_form_makespan(p, m, c, 2 * c)) == (p < 4)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("k", [0, 1, 3, 2 * 6])
@pytest.mark.parametrize(
    ("F", "BI", "BW"),
    [(HALF, HALF, HALF), (1, 2, 1), (1, 1, 2), (2, 3, 1)],
    ids=["equal", "BI=2F", "BW=2F", "BI=3F/2"],
)
def test_dualpipev_pairs_keep_the_makespan_at_zero_overlap_and_shrink_it_above(p, k, F, BI, BW):
    m = 2 * p + k
    F, BI, BW = Fraction(F), Fraction(BI), Fraction(BW)
    costs = Costs(F=F, B=BI + BW, BI=BI, BW=BW)
    paired, plain = dualpipev(p, m), dualpipev(p, m, overlap=False)
    baseline = simulate(plain, costs)
    at_zero = simulate(paired, costs)
    assert at_zero.makespan == baseline.makespan
    assert at_zero.peak_activations == baseline.peak_activations
    shorter = simulate(paired, dataclasses.replace(costs, overlap=F / 4)).makespan
    assert shorter < baseline.makespan
    # Without pairs the overlap cost changes nothing.
    assert simulate(plain, dataclasses.replace(costs, overlap=F / 4)) == baseline


def test_dualpipev_the_turn_of_the_v_runs_apart_under_a_transfer_delay():
    # DualPipe's reason for not overlapping the first steady round on its middle ranks:
    # pairing it there makes the step longer once transfers take time.
    p, m, costs = 4, 8, equal_costs(HALF, transfer=Fraction(1, 4))
    tasks = [list(row) for row in dualpipev(p, m)]
    at = next(i for i, t in enumerate(tasks[p - 1]) if t == Task(p - 1, p, "F"))
    tasks[p - 1][at] = dataclasses.replace(tasks[p - 1][at], with_next=True)
    tasks[p - 1][at + 1] = dataclasses.replace(tasks[p - 1][at + 1], with_next=True)
    assert str(tasks[p - 1][at + 1]) == f"BI{p}.0"
    assert simulate(dualpipev(p, m), costs).makespan < simulate(tasks, costs).makespan


# --- pictures ----------------------------------------------------------------------------


def test_ascii_joins_a_group_with_plus():
    text = to_ascii(parse_tasks("F0.0 F0.1+BI0.0+BW0.0 BI0.1 BW0.1"))
    assert text.splitlines()[1] == "mesh 0 | F0.0  F0.1 +BI0.0+BW0.0 BI0.1 BW0.1"
    assert "+" not in to_ascii(parse_tasks("F0.0 F0.1 BI0.0 BW0.0 BI0.1 BW0.1"))


def test_ascii_of_dualpipev_shows_its_pairs():
    lines = to_ascii(dualpipev(2, 4), equal_costs(HALF)).splitlines()
    assert "F0.3 +BI3.1+BW3.1" in lines[1]
    assert "F2.2 +BI1.0+BW1.0" in lines[2]


def _outlines(figure):
    from matplotlib.patches import Rectangle

    return [
        patch
        for patch in figure.axes[0].patches
        if isinstance(patch, Rectangle) and not patch.get_fill()
    ]


def test_gantt_outlines_each_group_once():
    pytest.importorskip("matplotlib")
    tasks = dualpipev(2, 4)
    figure = plot_gantt(tasks, costs=equal_costs(HALF))
    groups = [
        (mesh, g) for mesh, row in enumerate(tasks) for g in overlap_groups(row) if len(g) > 1
    ]
    outlines = _outlines(figure)
    assert len(outlines) == len(groups) == 5
    tl = simulate(tasks, equal_costs(HALF))
    spans = sorted((o.get_y() + 0.4, o.get_x(), o.get_x() + o.get_width()) for o in outlines)
    expected = sorted(
        (mesh, float(tl.span(g[0])[0]), float(tl.span(g[-1])[1])) for mesh, g in groups
    )
    assert [x for span in spans for x in span] == pytest.approx(
        [x for span in expected for x in span]
    )
    legend = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert legend[-1] == "overlapped (one program)"
    plain = plot_gantt(dualpipev(2, 4, overlap=False), costs=equal_costs(HALF))
    assert not _outlines(plain)
    assert "overlapped (one program)" not in [
        t.get_text() for t in plain.axes[0].get_legend().get_texts()
    ]


# --- profiles ----------------------------------------------------------------------------


def _records_of(timeline, lists):
    """One record per program: a group of overlapped tasks is one record with a tuple."""
    records = []
    for mesh, row in enumerate(lists):
        for group in overlap_groups(row):
            start, end = timeline.span(group[0])[0], timeline.span(group[-1])[1]
            if len(group) == 1:
                records.append((mesh, str(group[0]), group[0], float(start), float(end)))
            else:
                label = "+".join(map(str, group))
                records.append((mesh, label, tuple(group), float(start), float(end)))
    return records


def test_measured_group_records_split_among_their_members():
    tasks = dualpipev(2, 4)
    simulated = simulate(tasks, Costs(overlap=0.5))  # default ratio F:BI:BW = 1:1:1
    records = _records_of(simulated, tasks)
    assert any(isinstance(r[2], tuple) for r in records)
    measured = measured_timeline(records)
    assert [(m, str(t), t.with_next) for m, t, _, _ in measured.entries] == [
        (m, str(t), t.with_next) for m, t, _, _ in simulated.entries
    ]
    for (_, _, s1, e1), (_, _, s2, e2) in zip(measured.entries, simulated.entries, strict=True):
        assert (s1, e1) == pytest.approx((s2, e2))
    assert measured.makespan == pytest.approx(simulated.makespan)
    assert measured.peak_activations == simulated.peak_activations
    costs = fit_costs(records)
    # Paired members are measured shorter (the overlap is split among them).
    assert all(5 / 6 - 1e-9 <= v <= 1.0 for v in (costs.F, costs.BI, costs.BW))
    comparison = compare_profile(records, tasks)
    assert comparison.measured.makespan == pytest.approx(simulated.makespan)


def test_measured_group_record_without_flags_is_still_a_group():
    members = (Task(0, 1, "F"), Task(1, 0, "BI"), Task(1, 0, "BW"))
    tl = measured_timeline([(0, "F0.1+BI1.0+BW1.0", members, 1.0, 4.0)])
    assert [(str(t), t.with_next, s, e) for _, t, s, e in tl.entries] == [
        ("F0.1", True, 0.0, 1.0),
        ("BI1.0", True, 1.0, 2.0),
        ("BW1.0", False, 2.0, 3.0),
    ]


# --- command line ------------------------------------------------------------------------


def test_schedule_command_prints_dualpipev_pairs(capsys):
    args = ["--schedule", "dualpipev", "--meshes", "2", "--microbatches", "4", "--tasks"]
    assert schedule_main([*args, "--costs", "F=0.5,B=1,BI=0.5,BW=0.5"]) == 0
    out = capsys.readouterr().out
    assert "transfer=0\n" in out  # no overlap cost: the header is as before
    assert "F0.3 +BI3.1+BW3.1" in out
    assert "mesh 0: F0.0 F0.1 F0.2 F3.0 BI3.0 BW3.0 F3.1 F0.3+BI3.1+BW3.1 " in out
    assert "makespan 12.5," in out
    assert schedule_main([*args, "--costs", "F=0.5,B=1,BI=0.5,BW=0.5,overlap=0.25"]) == 0
    out = capsys.readouterr().out
    assert "transfer=0 overlap=0.25\n" in out
    assert "makespan 12," in out  # 12.5 - (2m - 3p) * 0.25
