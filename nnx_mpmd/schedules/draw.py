"""Pictures of schedules: an ASCII grid and a matplotlib Gantt chart.

matplotlib is imported only inside `plot_gantt`, so importing this module (and
the rest of `nnx_mpmd.schedules`) stays light. matplotlib is an optional
dependency (the ``plots`` extra): without it `plot_gantt` raises an `MpmdError`
that says how to install it, and `matplotlib_missing` tells callers that would
rather skip a picture.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

from nnx_mpmd.errors import MpmdError, ScheduleError
from nnx_mpmd.schedules.simulate import Costs, Timeline, simulate
from nnx_mpmd.schedules.tasks import Task

__all__ = [
    "KIND_COLORS",
    "PLOTS_INSTALL",
    "matplotlib_missing",
    "plot_gantt",
    "plot_timelines",
    "time_axis_label",
    "to_ascii",
]

PLOTS_INSTALL = "pip install 'nnx-mpmd[plots]'"
"""The command that installs matplotlib, the optional dependency of the pictures."""

KIND_COLORS: dict[str, str] = {
    "F": "#4C78A8",
    "B": "#54A24B",
    "BI": "#F58518",
    "BW": "#B279A2",
}
"""Gantt-chart colour of each task kind."""

_IMAGE_FORMATS = (".png", ".svg", ".pdf")


def matplotlib_missing() -> str | None:
    """Why pictures cannot be drawn here (naming `PLOTS_INSTALL`), or None when matplotlib imports.

    Example:
      >>> matplotlib_missing() is None  # matplotlib comes with the dev extra
      True
    """
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        return f"matplotlib is not installed; {PLOTS_INSTALL} to draw pictures"
    return None


def time_axis_label(costs: Costs | None) -> str:
    """The x-axis label of a schedule simulated with ``costs`` (None: ``Costs()``): its time unit.

    Example:
      >>> time_axis_label(None)
      'time (units of one forward, F=1)'
      >>> time_axis_label(Costs(F=2.0, B=4.0))
      'time (cost units: F=2, B=4, BI=1, BW=1, transfer=0)'
    """
    costs = Costs() if costs is None else costs
    if costs == Costs():
        return "time (units of one forward, F=1)"
    # float(): Fractions have no 'g' format before Python 3.12.
    values = (
        f"F={float(costs.F):g}, B={float(costs.B):g}, BI={float(costs.BI):g}, "
        f"BW={float(costs.BW):g}, transfer={float(costs.transfer):g}"
    )
    if costs.overlap:
        values += f", overlap={float(costs.overlap):g}"
    if costs.per_stage:
        values += ", per-stage overrides"
    if costs.F == 1:
        return f"time (units of one forward; costs {values})"
    return f"time (cost units: {values})"


def _as_timeline(
    schedule: Timeline | Iterable[Iterable[Task | str]], costs: Costs | None
) -> Timeline:
    if isinstance(schedule, Timeline):
        if costs is not None:
            raise ScheduleError(
                "costs were given with a Timeline, which is already simulated; pass the task "
                "lists with costs, or the Timeline alone"
            )
        return schedule
    return simulate(schedule, costs)


def to_ascii(
    schedule: Timeline | Iterable[Iterable[Task | str]],
    costs: Costs | None = None,
    *,
    slot: float | None = None,
) -> str:
    """Draws a schedule as text: meshes as rows, time slots as columns.

    A task shows its token in its first slot and ``-`` in the slots it goes on
    for; ``.`` is an idle slot. Tasks that run overlapped, as one program
    (`Task.with_next`), are joined by ``+`` instead of a space.

    Args:
      schedule: a `Timeline`, or per-mesh task lists to simulate with ``costs``.
      costs: the costs to simulate with (default ``Costs()``).
      slot: the time one column stands for (default: the shortest task). With a
        longer slot, a column shows the first task that starts in it.

    Returns:
      The grid, one line per mesh, with a time ruler on top.

    Example:
      >>> print(to_ascii([["F0.0", "F0.1", "B0.0", "B0.1"], ["F1.0", "F1.1", "B1.0", "B1.1"]]))
      time   | 0    1    2    3    4    5    6    7    8
      mesh 0 | F0.0 F0.1 .    .    .    B0.0 ---- B0.1 ----
      mesh 1 | .    F1.0 F1.1 B1.0 ---- B1.1 ---- .    .
      >>> print(to_ascii([["F0.0", "F0.1+B0.0", "B0.1"]]))
      time   | 0    1    2    3    4    5
      mesh 0 | F0.0 F0.1+B0.0 ---- B0.1 ----
    """
    timeline = _as_timeline(schedule, costs)
    durations = [end - start for _, _, start, end in timeline.entries if end > start]
    if slot is None:
        slot = min(durations, default=1)
    if not slot > 0:
        raise ScheduleError(f"to_ascii: slot must be > 0, got {slot!r}; e.g. slot=1")
    columns = math.ceil(round(timeline.makespan / slot, 9))
    width = max([len(str(task)) for _, task, _, _ in timeline.entries] + [4])
    grid = [["."] * columns for _ in range(timeline.num_meshes)]
    taken = [[False] * columns for _ in range(timeline.num_meshes)]
    # joined[mesh][column]: the cell starts a task that overlaps the one before it.
    joined = [[False] * columns for _ in range(timeline.num_meshes)]
    previous: dict[int, Task] = {}
    for mesh, task, start, end in timeline.entries:
        first = math.floor(round(start / slot, 9))
        last = max(first + 1, math.ceil(round(end / slot, 9)))
        for column in range(first, min(last, columns)):
            # A slot longer than some tasks shows the first task that starts in it.
            if column == first and not taken[mesh][column]:
                grid[mesh][column] = str(task)
                taken[mesh][column] = True
                joined[mesh][column] = mesh in previous and previous[mesh].with_next
            elif not taken[mesh][column]:
                grid[mesh][column] = "-" * width
        previous[mesh] = task
    label = max(len(f"mesh {timeline.num_meshes - 1}"), len("time"))
    ruler = " ".join(f"{column:<{width}}" for column in range(columns))
    lines = [f"{'time':<{label}} | {ruler}".rstrip()]
    for mesh, row in enumerate(grid):
        cells = "".join(
            ("+" if joined[mesh][column] else " ") * (column > 0) + f"{cell:<{width}}"
            for column, cell in enumerate(row)
        )
        lines.append(f"{f'mesh {mesh}':<{label}} | {cells}".rstrip())
    return "\n".join(lines)


def plot_gantt(
    schedule: Timeline | Iterable[Iterable[Task | str]],
    path: str | os.PathLike[str] | None = None,
    *,
    costs: Costs | None = None,
    title: str | None = None,
    xlabel: str | None = None,
) -> Any:
    """Draws a schedule as a Gantt chart: one row per mesh, boxes coloured by kind.

    Overlapped tasks (`Task.with_next`) share one outline; no pyplot window opens.

    Args:
      schedule: a `Timeline`, or per-mesh task lists to simulate with ``costs``.
      path: if given, save the chart there; ``.png``, ``.svg`` or ``.pdf``.
      costs: the costs to simulate with (default ``Costs()``).
      title: the chart title (default: makespan and bubble fraction).
      xlabel: the x-axis label (default: `time_axis_label` of ``costs`` for task
        lists; for a `Timeline`, the units of the costs it was simulated with).

    Returns:
      The ``matplotlib.figure.Figure``.

    Raises:
      ScheduleError: ``path`` has no image suffix.
      MpmdError: matplotlib is not installed (``pip install 'nnx-mpmd[plots]'``).

    Example:
      >>> fig = plot_gantt([["F0.0", "B0.0"], ["F1.0", "B1.0"]])
      >>> [t.get_text() for t in fig.axes[0].get_yticklabels()]
      ['mesh 0', 'mesh 1']
      >>> fig.axes[0].get_xlabel()
      'time (units of one forward, F=1)'
    """
    _check_image_path(path)
    if xlabel is None:
        given_timeline = isinstance(schedule, Timeline)
        xlabel = "time (units of the simulated task costs)" if given_timeline else None
        xlabel = xlabel or time_axis_label(costs)
    timeline = _as_timeline(schedule, costs)
    figure = _new_figure(float(timeline.makespan), [timeline.num_meshes])
    if title is None:
        title = (
            f"makespan {float(timeline.makespan):g}, bubble {float(timeline.bubble_fraction):.1%}"
        )
    _draw_axes(figure.add_subplot(), timeline, title, xlabel, float(timeline.makespan) or 1.0)
    return _finish(figure, path)


def plot_timelines(
    panels: Sequence[tuple[str, Timeline]],
    path: str | os.PathLike[str] | None = None,
    *,
    xlabel: str = "time",
) -> Any:
    """Draws several timelines one above the other, on one time axis.

    Args:
      panels: ``(title, timeline)`` per panel, top first.
      path: if given, save the picture there; ``.png``, ``.svg`` or ``.pdf``.
      xlabel: the label of every panel's time axis.

    Returns:
      The ``matplotlib.figure.Figure``.

    Raises:
      ScheduleError: ``path`` has no image suffix, or ``panels`` is empty.
      MpmdError: matplotlib is not installed.

    Example:
      >>> tasks = [["F0.0", "B0.0"], ["F1.0", "B1.0"]]
      >>> a, b = simulate(tasks), simulate(tasks, Costs(F=2))
      >>> fig = plot_timelines([("nominal", a), ("slower forwards", b)])
      >>> [ax.get_title() for ax in fig.axes], [float(x) for x in fig.axes[0].get_xlim()]
      (['nominal', 'slower forwards'], [0.0, 8.0])
    """
    _check_image_path(path)
    if not panels:
        raise ScheduleError("plot_timelines: no panels given; pass [(title, timeline), ...]")
    makespan = max(float(timeline.makespan) for _, timeline in panels) or 1.0
    figure = _new_figure(makespan, [timeline.num_meshes for _, timeline in panels])
    for row, (title, timeline) in enumerate(panels):
        axes = figure.add_subplot(len(panels), 1, row + 1)
        _draw_axes(axes, timeline, title, xlabel, makespan)
    return _finish(figure, path)


def _check_image_path(path: str | os.PathLike[str] | None) -> None:
    if path is not None and os.path.splitext(os.fspath(path))[1].lower() not in _IMAGE_FORMATS:
        raise ScheduleError(
            f"cannot save a Gantt chart as {os.fspath(path)!r}; use a file name ending in "
            f"{', '.join(_IMAGE_FORMATS)}"
        )


def _new_figure(makespan: float, meshes_per_panel: Sequence[int]) -> Any:
    missing = matplotlib_missing()
    if missing is not None:
        raise MpmdError(f"cannot draw the Gantt chart: {missing}.")
    from matplotlib.figure import Figure

    width = max(6.0, min(24.0, 0.35 * (makespan or 1.0) + 2))
    return Figure(figsize=(width, sum(0.6 * n + 1.4 for n in meshes_per_panel)))


def _finish(figure: Any, path: str | os.PathLike[str] | None) -> Any:
    figure.tight_layout()
    if path is not None:
        figure.savefig(os.fspath(path))
    return figure


def _overlap_spans(timeline: Timeline) -> list[tuple[int, float, float]]:
    """``(mesh, start, end)`` of every group of overlapped tasks in ``timeline``."""
    spans: list[tuple[int, float, float]] = []
    open_group: dict[int, tuple[float, float]] = {}
    for mesh, task, start, end in timeline.entries:
        if mesh in open_group:
            start = open_group.pop(mesh)[0]
            if not task.with_next:
                spans.append((mesh, start, end))
        if task.with_next:
            open_group[mesh] = (start, end)
    return spans


def _draw_axes(ax: Any, timeline: Timeline, title: str, xlabel: str, xmax: float) -> None:
    """One Gantt chart on ``ax``: a row per mesh, boxes coloured by kind."""
    from matplotlib.patches import Patch, Rectangle

    font = max(5.0, min(9.0, 160.0 / max(float(timeline.makespan), 1.0)))
    for mesh, task, start, end in timeline.entries:
        ax.barh(
            mesh,
            float(end - start),
            left=float(start),
            height=0.8,
            color=KIND_COLORS[task.kind],
            edgecolor="white",
            linewidth=0.8,
        )
        ax.text(
            float(start + end) / 2,
            mesh,
            str(task.microbatch),
            ha="center",
            va="center",
            fontsize=font,
            color="white",
        )
    groups = _overlap_spans(timeline)
    for mesh, start, end in groups:
        ax.add_patch(
            Rectangle(
                (float(start), mesh - 0.4),
                float(end - start),
                0.8,
                fill=False,
                edgecolor="black",
                linewidth=1.6,
                zorder=3,
            )
        )
    ax.set_yticks(range(timeline.num_meshes), [f"mesh {m}" for m in range(timeline.num_meshes)])
    ax.set_ylim(timeline.num_meshes - 0.5, -0.5)
    ax.set_xlim(0, xmax)
    ax.set_xlabel(xlabel)
    kinds = [kind for kind in KIND_COLORS if any(t.kind == kind for _, t, _, _ in timeline.entries)]
    handles = [Patch(color=KIND_COLORS[k], label=k) for k in kinds]
    if groups:
        handles.append(
            Patch(fill=False, edgecolor="black", linewidth=1.6, label="overlapped (one program)")
        )
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.25 if timeline.num_meshes > 2 else -0.4),
        ncol=len(handles),
        frameon=False,
    )
    ax.set_title(title)
