"""``nnx-mpmd schedule``: print, simulate and draw a pipeline schedule.

Examples::

    nnx-mpmd schedule --schedule 1f1b --meshes 4 --microbatches 8
    nnx-mpmd schedule --schedule interleaved --meshes 4 --virtual 2 --microbatches 8 --png s.png
    nnx-mpmd schedule --schedule zb-h1 --costs F=1,BI=1,BW=1 --svg zb.svg
    nnx-mpmd schedule --text my_schedule.txt      # a hand-written schedule

Bad input prints one clear message and exits with status 2. Imports no JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from fractions import Fraction

from nnx_mpmd.errors import MpmdError, ScheduleError
from nnx_mpmd.schedules.draw import matplotlib_missing, plot_gantt, time_axis_label, to_ascii
from nnx_mpmd.schedules.generators import Custom, Schedule
from nnx_mpmd.schedules.registry import SCHEDULES, get_schedule
from nnx_mpmd.schedules.simulate import Costs, simulate
from nnx_mpmd.schedules.tasks import format_tasks

__all__ = ["build_parser", "main", "positive_float", "positive_int", "stage_costs"]

_PROG = "nnx-mpmd schedule"


def positive_int(text: str) -> int:
    """An argparse ``type``: an int >= 1, so argparse names the flag the user typed.

    Example:
      >>> positive_int("4")
      4
      >>> positive_int("0")
      Traceback (most recent call last):
      ...
      argparse.ArgumentTypeError: must be an int >= 1, got 0
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite float > 0.

    Example:
      >>> positive_float("0.5")
      0.5
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


_KINDS = ("F", "B", "BI", "BW")


def stage_costs(text: str, num_stages: int, num_meshes: int) -> tuple[Costs, Fraction | None]:
    """``(costs, scale)`` to simulate with, in forwards of one mesh's share of the layers.

    With ``k`` stages per mesh default tasks cost ``1/k`` (``scale``), so makespans compare;
    ``scale`` is None when ``text`` sets a cost or one stage runs per mesh.

    Example:
      >>> costs, scale = stage_costs("", 8, 4)
      >>> float(costs.F), float(costs.B), scale
      (0.5, 1.0, Fraction(1, 2))
      >>> stage_costs("F=1,B=3", 8, 4)[1] is None
      True
    """
    costs = Costs.parse(text)
    if _sets_task_costs(text) or num_stages == num_meshes:
        return costs, None
    scale = Fraction(num_meshes, num_stages)
    defaults = Costs()
    scaled = {kind: float(getattr(defaults, kind) * scale) for kind in _KINDS}
    return dataclasses.replace(costs, **scaled), scale


def _sets_task_costs(text: str) -> bool:
    return bool({item.partition("=")[0].strip() for item in text.split(",")} & set(_KINDS))


def _unit_line(text: str, scale: Fraction | None, stages: int) -> str:
    """Says what one unit of time is, so that makespans compare across commands."""
    if _sets_task_costs(text):
        return "time unit: the task costs given by --costs (per task, not scaled by the stages)"
    unit = "time unit: one forward through one mesh's layers (F=1, B=2), as in docs/concepts.md"
    if scale is None:
        return unit
    return (
        f"{unit}; each of the {stages} stages holds {scale} of them, so its tasks cost {scale} "
        "as much and makespans compare across stage counts"
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``nnx-mpmd schedule``.

    Example:
      >>> build_parser().parse_args(["--schedule", "gpipe"]).schedule
      'gpipe'
    """
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Print the task grid of a pipeline schedule, its bubble fraction and "
        "peak activations per mesh; optionally draw a Gantt chart.",
    )
    parser.add_argument(
        "--schedule",
        default="1f1b",
        help=f"one of {', '.join(SCHEDULES)} (default: 1f1b)",
    )
    parser.add_argument("--meshes", type=positive_int, help="number of meshes p (default: 4)")
    parser.add_argument(
        "--stages",
        type=positive_int,
        help="number of stages (default: p; 2p for interleaved, looped-bfs and V shapes)",
    )
    parser.add_argument(
        "--virtual",
        type=positive_int,
        help="stages per mesh for interleaved/looped-bfs (stages = v * p)",
    )
    parser.add_argument(
        "--microbatches", type=positive_int, help="number of microbatches m (default: 8)"
    )
    parser.add_argument(
        "--costs",
        default="",
        help="task costs, e.g. F=1,B=2,BI=1,BW=1,transfer=0,overlap=0 (the defaults, for one "
        "stage per mesh; with k stages per mesh each task costs 1/k of them unless given); overlap "
        "is the time hidden when tasks run overlapped in one program (dualpipev's pairs); "
        "contention=1/1.8/2.5 slows tasks while 1, 2, 3 meshes run at once (shared compute)",
    )
    parser.add_argument(
        "--text", metavar="FILE", help="read a hand-written schedule (one line per mesh)"
    )
    parser.add_argument("--png", metavar="PATH", help="save a Gantt chart as PNG")
    parser.add_argument("--svg", metavar="PATH", help="save a Gantt chart as SVG")
    parser.add_argument(
        "--tasks", action="store_true", help="also print the task lists in the text form"
    )
    parser.add_argument(
        "--slot", type=positive_float, help="time per grid column (default: shortest task)"
    )
    return parser


def _resolve(args: argparse.Namespace) -> tuple[Schedule, int, int, int]:
    if args.text is not None:
        try:
            with open(args.text, encoding="utf-8") as f:
                schedule: Schedule = Custom(text=f.read())
        except OSError as e:
            raise ScheduleError(
                f"cannot read schedule file {args.text!r}: {e.strerror}; check the path"
            ) from None
        assert isinstance(schedule, Custom) and schedule.lists is not None
        found_m = 1 + max((t.microbatch for row in schedule.lists for t in row), default=-1)
        meshes = len(schedule.lists) if args.meshes is None else args.meshes
        microbatches = found_m if args.microbatches is None else args.microbatches
    else:
        params = {}
        if args.virtual is not None and args.schedule.lower() in ("interleaved", "looped-bfs"):
            params["virtual_stages"] = args.virtual
        schedule = get_schedule(args.schedule, **params)
        meshes = 4 if args.meshes is None else args.meshes
        microbatches = 8 if args.microbatches is None else args.microbatches
    if args.virtual is not None:
        if args.stages is not None and args.stages != args.virtual * meshes:
            raise ScheduleError(
                f"--stages {args.stages} disagrees with --virtual {args.virtual} on {meshes} "
                f"meshes ({args.virtual * meshes} stages); give one of them"
            )
        stages = args.virtual * meshes
    elif args.stages is not None:
        stages = args.stages
    else:
        stages = schedule.default_num_stages(meshes)
    return schedule, stages, meshes, microbatches


def _run(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed the message or the help
        return 0 if e.code in (0, None) else 2
    pictures = [path for path in (args.png, args.svg) if path is not None]
    missing = matplotlib_missing() if pictures else None
    if missing is not None:
        raise MpmdError(f"--png/--svg need matplotlib: {missing}.")
    schedule, stages, meshes, microbatches = _resolve(args)
    costs, scale = stage_costs(args.costs, stages, meshes)
    tasks = schedule.tasks(stages, meshes, microbatches)
    timeline = simulate(tasks, costs)
    print(
        f"schedule {schedule.name}: {meshes} meshes, {stages} stages, {microbatches} "
        f"microbatches; costs F={costs.F:g} B={costs.B:g} BI={costs.BI:g} BW={costs.BW:g} "
        f"transfer={costs.transfer:g}" + (f" overlap={costs.overlap:g}" if costs.overlap else "")
        + (f" contention={'/'.join(f'{c:g}' for c in costs.contention)}" if costs.contention else "")
    )  # fmt: skip
    print(to_ascii(timeline, slot=args.slot))
    print(
        f"makespan {float(timeline.makespan):g}, bubble fraction "
        f"{float(timeline.bubble_fraction):.4f} ({float(timeline.bubble_fraction):.1%})"
    )
    print(_unit_line(args.costs, scale, stages))
    print("peak activations per mesh: " + " ".join(map(str, timeline.peak_activations)))
    if args.tasks:
        print(format_tasks(tasks), end="")
    for path in pictures:
        _make_parent(path)
        try:
            plot_gantt(
                timeline,
                path,
                title=f"{schedule.name}, p={meshes}, m={microbatches}: makespan "
                f"{float(timeline.makespan):g}, bubble {float(timeline.bubble_fraction):.1%}",
                xlabel=time_axis_label(costs if scale is None else Costs()),
            )
        except OSError as e:
            raise MpmdError(
                f"cannot write {path!r}: {e.strerror or e}; choose a writable path"
            ) from None
        print(f"wrote {path}")
    return 0


def _make_parent(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(parent):
        return
    try:
        os.makedirs(parent)
    except OSError as e:
        raise MpmdError(
            f"cannot create the directory {parent!r} for {path!r}: {e.strerror}; choose "
            "another path"
        ) from None
    print(f"created directory {parent}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``nnx-mpmd schedule``: 0 on success, 2 on bad input (reason on stderr).

    Example:
      >>> main(["--schedule", "gpipe", "--meshes", "2", "--microbatches", "2"])
      schedule gpipe: 2 meshes, 2 stages, 2 microbatches; costs F=1 B=2 BI=1 BW=1 transfer=0
      time   | 0    1    2    3    4    5    6    7    8
      mesh 0 | F0.0 F0.1 .    .    .    B0.0 ---- B0.1 ----
      mesh 1 | .    F1.0 F1.1 B1.0 ---- B1.1 ---- .    .
      makespan 9, bubble fraction 0.3333 (33.3%)
      time unit: one forward through one mesh's layers (F=1, B=2), as in docs/concepts.md
      peak activations per mesh: 2 2
      0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _run(argv)
    except MpmdError as e:
        print(f"{_PROG}: error: {e}", file=sys.stderr)
        return 2
