"""Schedules: task IR, text form, validation, simulation, pictures and the CLI."""

import ast
import pathlib
import re
from fractions import Fraction

import pytest

from nnx_mpmd.apps import schedule_cli
from nnx_mpmd.errors import ScheduleError
from nnx_mpmd.schedules import (
    Costs,
    OneFOneB,
    Task,
    ZeroBubbleH1,
    format_tasks,
    get_schedule,
    looped_placement,
    parse_tasks,
    plot_gantt,
    simulate,
    to_ascii,
    v_placement,
    validate,
)

PACKAGE = pathlib.Path(__file__).parents[2] / "nnx_mpmd" / "schedules"


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_modules_import_no_jax_or_flax(path):
    tree = ast.parse(path.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"jax", "jaxlib", "flax", "optax", "numpy"}
    top_level = {
        alias.name.split(".")[0]
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    } | {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom)}
    assert "matplotlib" not in top_level


@pytest.mark.parametrize(
    ("token", "task"),
    [("F0.3", Task(0, 3, "F")), ("BW12.0", Task(12, 0, "BW")), ("BI1.10", Task(1, 10, "BI"))],
)
def test_task_token_round_trip(token, task):
    assert Task.parse(token) == task
    assert str(task) == token


def test_tasks_are_ordered_and_hashable():
    tasks = [Task(1, 0, "F"), Task(0, 1, "B"), Task(0, 0, "F")]
    assert sorted(tasks)[0] == Task(0, 0, "F")
    assert len({Task(0, 0, "F"), Task(0, 0, "F")}) == 1


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 0, "X"), r"task kind 'X' .* is unknown; use one of F, B, BI, BW"),
        ((-1, 0, "F"), r"task stage must be an int >= 0, got -1"),
        ((0, 1.5, "F"), r"task microbatch must be an int >= 0, got 1.5"),
    ],
)
def test_bad_task_fields(args, match):
    with pytest.raises(ScheduleError, match=match):
        Task(*args)


@pytest.mark.parametrize("token", ["F0", "X0.1", "F-1.0", "f0.0", ""])
def test_bad_token(token):
    with pytest.raises(ScheduleError, match=r"cannot read task token"):
        Task.parse(token)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-v", "dualpipev"])
def test_text_form_round_trips(name):
    schedule = get_schedule(name)
    tasks = schedule.tasks(schedule.default_num_stages(2), 2, 4)
    assert parse_tasks(format_tasks(tasks)) == tasks
    assert parse_tasks(format_tasks(tasks, prefix=False)) == tasks


def test_text_form_comments_blank_lines_and_prefix_order():
    text = """
    # a hand-written schedule
    mesh 1: F1.0 B1.0   # the second mesh first

    mesh 0: F0.0 B0.0
    """
    assert parse_tasks(text) == parse_tasks("F0.0 B0.0\nF1.0 B1.0")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("mesh 0: F0.0\nF1.0", r"prefix every line or none"),
        ("mesh 0: F0.0\nmesh 0: F1.0", r"line 2: mesh 0 is listed twice"),
        ("mesh 0: F0.0\nmesh 2: F1.0", r"numbered \[0, 2\]; number them \[0, 1\]"),
        ("F0.0 G0.1", r"line 1: cannot read task token 'G0.1'"),
    ],
)
def test_bad_text(text, match):
    with pytest.raises(ScheduleError, match=match):
        parse_tasks(text)


@pytest.mark.parametrize(
    ("tasks", "match"),
    [
        ("F0.0 B0.0", r"one string; use parse_tasks"),
        (["F0.0 B0.0"], r"mesh 0 is a string"),
        ([[("F", 0, 0)]], r"mesh 0 lists \('F', 0, 0\), which is not a Task"),
    ],
)
def test_bad_task_list_shapes(tasks, match):
    with pytest.raises(ScheduleError, match=match):
        validate(tasks)


def test_placements():
    assert [looped_placement(s, 6, 3) for s in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [v_placement(s, 6, 3) for s in range(6)] == [0, 1, 2, 2, 1, 0]


@pytest.mark.parametrize(
    ("placement", "args", "match"),
    [
        (looped_placement, (0, 6, 4), r"multiple of num_meshes"),
        (looped_placement, (6, 6, 3), r"stage 6 is outside 0..5"),
        (v_placement, (0, 6, 2), r"num_stages == 2 \* num_meshes"),
        (v_placement, (0, 2, 0), r"needs num_meshes >= 1"),
    ],
)
def test_bad_placements(placement, args, match):
    with pytest.raises(ScheduleError, match=match):
        placement(*args)


GOOD = "F0.0 F0.1 B0.0 B0.1\nF1.0 B1.0 F1.1 B1.1"


@pytest.mark.parametrize(
    ("text", "match", "marked"),
    [
        # reordered: a backward before its own forward
        ("F0.0 F0.1 B0.0 B0.1\nB1.0 F1.0 F1.1 B1.1", r"B1.0 comes before F1.0 on mesh 1", "B1.0"),
        # missing
        ("F0.0 F0.1 B0.0 B0.1\nF1.0 B1.0 F1.1", r"task B1.1 is missing", "F1.1"),
        ("F0.0 F0.1 B0.0 B0.1\nF1.0 B1.0 B1.1", r"task F1.1 is missing", "B1.1"),
        # duplicated
        ("F0.0 F0.1 B0.0 B0.1 F0.1\nF1.0 B1.0 F1.1 B1.1", r"F0.1 appears twice", "F0.1"),
        # deadlocking: mesh 0 waits for B1.0, mesh 1 waits for F0.1
        ("F0.0 B0.0 F0.1 B0.1\nF1.0 F1.1 B1.0 B1.1", r"deadlocks: mesh 0 waits at B0.0", "F1.1"),
        # a stage on two meshes
        ("F0.0 F0.1 B0.0 B0.1\nF1.0 B1.0 F1.1 B1.1 F0.2", r"stage 0 has tasks on mesh 0", "F0.2"),
        # split backward half-written
        ("F0.0 F0.1 B0.0 B0.1\nF1.0 BI1.0 BW1.0 F1.1 BI1.1", r"task BW1.1 is missing", "BI1.1"),
        ("F0.0 F0.1 B0.0 B0.1\nF1.0 BI1.0 B1.0 F1.1 B1.1", r"both a full backward B1.0", "B1.0"),
        ("F0.0 F0.1 B0.0 B0.1\nF1.0 F1.1 BW1.0 BI1.0 B1.1", r"BW1.0 comes before BI1.0", "BW1.0"),
    ],
)
def test_invalid_hand_written_schedules_are_rejected_with_marked_grid(text, match, marked):
    with pytest.raises(ScheduleError, match=match) as info:
        validate(parse_tasks(text))
    message = str(info.value)
    assert f"[{marked}]" in message
    assert "mesh 0 |" in message and "mesh 1 |" in message


@pytest.mark.parametrize(
    ("kwargs", "match", "marked"),
    [
        (
            {"mesh_of": lambda s: 1 - s},
            r"F0.0 is on mesh 0, but stage 0 is placed on mesh 1",
            "F0.0",
        ),
        ({"num_stages": 1}, r"names stage 1, but there are only 1 stages", "F1.0"),
        ({"num_stages": 3}, r"stage 2 has no tasks", None),
    ],
)
def test_validate_placement_and_stage_count(kwargs, match, marked):
    with pytest.raises(ScheduleError, match=match) as info:
        validate(parse_tasks(GOOD), **kwargs)
    if marked:
        assert f"[{marked}]" in str(info.value)


@pytest.mark.parametrize(
    ("tasks", "match"),
    [([], r"no meshes"), ([[], []], r"2 mesh lists are all empty")],
)
def test_validate_empty(tasks, match):
    with pytest.raises(ScheduleError, match=match):
        validate(tasks)


def test_rejected_deadlock_names_both_waiting_meshes():
    text = "F0.0 B0.0 F0.1 B0.1\nF1.0 F1.1 B1.0 B1.1"
    expected = r"mesh 0 waits at B0.0 for B1.0 \(mesh 1\); mesh 1 waits at F1.1 for F0.1 \(mesh 0\)"
    with pytest.raises(ScheduleError, match=expected):
        validate(parse_tasks(text))


def test_simulate_with_transfer_and_per_stage_costs():
    tasks = parse_tasks("F0.0 B0.0\nF1.0 B1.0")
    plain = simulate(tasks, Costs(transfer=0.5))
    assert plain.makespan == 1 + 0.5 + 1 + 2 + 0.5 + 2
    slow_head = simulate(tasks, Costs(per_stage={1: {"F": 3.0, "B": 1.0}}))
    assert slow_head.span(Task(1, 0, "F")) == (1.0, 4.0)
    assert slow_head.makespan == 7.0
    assert slow_head.entries[0] == (0, Task(0, 0, "F"), 0, 1.0)


def test_timeline_fields_1f1b():
    timeline = simulate(OneFOneB().tasks(4, 4, 8))
    assert timeline.num_meshes == 4
    assert timeline.busy == (24.0,) * 4
    assert [e[2] for e in timeline.entries] == sorted(e[2] for e in timeline.entries)
    with pytest.raises(ScheduleError, match=r"task F9.9 is not in this timeline"):
        timeline.span(Task(9, 9, "F"))


def test_split_peak_activations_release_at_bw():
    timeline = simulate(parse_tasks("F0.0 F0.1 BI0.0 BI0.1 BW0.0 BW0.1"))
    assert timeline.peak_activations == (2,)
    assert simulate(parse_tasks("F0.0 BI0.0 BW0.0 F0.1 BI0.1 BW0.1")).peak_activations == (1,)


def test_fraction_costs_stay_exact():
    timeline = simulate(OneFOneB().tasks(3, 3, 3), Costs(F=Fraction(1, 3), B=Fraction(2, 3)))
    assert timeline.makespan == Fraction(5)
    assert timeline.bubble_fraction == Fraction(2, 5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"F": -1.0}, r"cost F is -1.0; costs must be >= 0"),
        ({"B": "2"}, r"cost B must be a number, got '2'"),
        ({"per_stage": {0: {"X": 1.0}}}, r"per_stage cost for stage 0 names kind 'X'"),
        ({"per_stage": {0: {"F": -2}}}, r"cost F of stage 0 is -2"),
    ],
)
def test_bad_costs(kwargs, match):
    with pytest.raises(ScheduleError, match=match):
        Costs(**kwargs)


def test_costs_parse():
    assert Costs.parse("F=1,B=3,transfer=0.25") == Costs(B=3.0, transfer=0.25)
    assert Costs.parse("") == Costs()
    with pytest.raises(ScheduleError, match=r"cannot read cost 'Q=1'"):
        Costs.parse("Q=1")
    with pytest.raises(ScheduleError, match=r"cost B in 'B=two' is 'two', not a number"):
        Costs.parse("B=two")


def test_ascii_grid_rows_and_slots():
    grid = to_ascii(ZeroBubbleH1().tasks(2, 2, 2))
    lines = grid.splitlines()
    assert lines[0].startswith("time   | 0")
    assert lines[1].startswith("mesh 0 | F0.0  F0.1  .     BI0.0 BW0.0")
    assert len(lines) == 3
    assert "B0.0 ----" in to_ascii(OneFOneB().tasks(2, 2, 2))
    doubled = to_ascii(OneFOneB().tasks(2, 2, 2), slot=2.0).splitlines()[1]
    assert doubled.split("|")[1].split()[0] == "F0.0"
    with pytest.raises(ScheduleError, match=r"slot must be > 0"):
        to_ascii(OneFOneB().tasks(2, 2, 2), slot=0)
    with pytest.raises(ScheduleError, match=r"costs were given with a Timeline"):
        to_ascii(simulate(OneFOneB().tasks(2, 2, 2)), Costs())


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_gantt_chart_is_written(tmp_path, suffix):
    path = tmp_path / f"chart{suffix}"
    fig = plot_gantt(ZeroBubbleH1().tasks(2, 2, 4), path)
    assert path.stat().st_size > 1000
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert sorted(set(texts)) == ["0", "1", "2", "3"]
    assert len(fig.axes[0].patches) == 2 * 4 * 3


def test_gantt_rejects_unknown_format(tmp_path):
    with pytest.raises(ScheduleError, match=r"cannot save a Gantt chart as .*chart.gif"):
        plot_gantt(OneFOneB().tasks(2, 2, 2), tmp_path / "chart.gif")


def test_cli_prints_grid_bubble_and_peaks(capsys):
    rc = schedule_cli.main(["--schedule", "1f1b", "--meshes", "4", "--microbatches", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "bubble fraction 0.2727" in out
    assert "peak activations per mesh: 4 3 2 1" in out
    assert out.count("mesh ") >= 4


def test_cli_top_level_dispatch(capsys):
    from nnx_mpmd.apps import cli

    assert cli.main(["schedule", "--schedule", "gpipe", "--meshes", "2"]) == 0
    assert "peak activations per mesh: 8 8" in capsys.readouterr().out


def test_cli_images_virtual_costs_and_tasks(tmp_path, capsys):
    png, svg = tmp_path / "s.png", tmp_path / "s.svg"
    argv = ["--schedule", "interleaved", "--meshes", "2", "--virtual", "2", "--microbatches", "4"]
    argv += ["--costs", "F=0.5,B=1", "--png", str(png), "--svg", str(svg), "--tasks"]
    assert schedule_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert png.stat().st_size > 0 and svg.stat().st_size > 0
    assert "4 stages" in out and "mesh 1: F1.0" in out
    assert "bubble fraction 0.1111" in out  # (p-1)/(vm+p-1) = 1/9


def test_cli_reads_hand_written_schedule(tmp_path, capsys):
    path = tmp_path / "mine.txt"
    path.write_text("# mine\nmesh 0: F0.0 F0.1 B0.0 B0.1\nmesh 1: F1.0 B1.0 F1.1 B1.1\n")
    assert schedule_cli.main(["--text", str(path)]) == 0
    assert "schedule custom: 2 meshes, 2 stages, 2 microbatches" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--schedule", "pipedream"], r"unknown schedule 'pipedream'"),
        (["--schedule", "interleaved", "--microbatches", "5"], r"multiple of the number"),
        (["--schedule", "gpipe", "--stages", "8"], r"gpipe runs one stage per mesh"),
        (["--virtual", "2", "--stages", "6"], r"--stages 6 disagrees with --virtual 2"),
        (["--costs", "F=x"], r"cost F in 'F=x' is 'x'"),
        (["--text", "/nonexistent/schedule.txt"], r"cannot read schedule file"),
        (["--png", "out.gif"], r"cannot save a Gantt chart"),
        (["--meshes", "many"], r"invalid int value: 'many'"),
    ],
)
def test_cli_bad_input_returns_2_without_traceback(argv, match, capsys):
    assert schedule_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(match, err), err


def test_cli_bad_hand_written_schedule(tmp_path, capsys):
    path = tmp_path / "bad.txt"
    path.write_text("F0.0 B0.0 B0.1 F0.1\nF1.0 B1.0 F1.1 B1.1\n")
    assert schedule_cli.main(["--text", str(path)]) == 2
    assert "[B0.1]" in capsys.readouterr().err


def test_cli_help_returns_0(capsys):
    assert schedule_cli.main(["--help"]) == 0
    assert "--microbatches" in capsys.readouterr().out
