"""Measured timelines: a profiled step next to the simulator's prediction.

A profiled step (``step(..., profile=True)``) yields one record per program
call, ``(mesh, label, task, start_s, end_s)``, and the measured durations of
its cross-mesh moves. This module turns them into a `Timeline` (the same type
the simulator returns), fits `Costs` to them (medians per stage and kind),
simulates the step's own task lists with those costs, and draws both
timelines one above the other on one time axis, so that what the simulator
predicts and what the step did can be compared box by box.

Everything here is pure Python: the records are plain tuples.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from nnx_mpmd.errors import MpmdError, ScheduleError
from nnx_mpmd.schedules.simulate import Costs, Timeline, peak_activations, simulate
from nnx_mpmd.schedules.tasks import Task, TaskLists, normalize_tasks
from nnx_mpmd.schedules.validate import group_intervals

__all__ = ["ProfileComparison", "compare_profile", "fit_costs", "measured_timeline"]

# A fused forward+backward program (label ``FB...``) is split in this F:B ratio,
# the ratio of the default `Costs` (F=1, B=2).
_FUSED_F_SHARE = 1.0 / 3.0


def _group_spans(
    mesh: int, group: tuple[Task, ...], start: float, end: float
) -> list[tuple[int, Task, float, float]]:
    """Splits one program of overlapped tasks among them, in the ratio of the default `Costs`."""
    # Mark the group as in the task lists, whatever flags the record carries.
    group = tuple(
        dataclasses.replace(task, with_next=n < len(group) - 1) for n, task in enumerate(group)
    )
    weights = [Costs().duration(task) for task in group]
    start, end = float(start), float(end)
    spans = [
        (mesh, task, float(at), float(until))
        for task, at, until in group_intervals(group, weights, start, end - start)
    ]
    spans[-1] = (*spans[-1][:3], end)  # the program's measured end, exactly
    return spans


def _task_spans(records: Iterable[Sequence[Any]]) -> list[tuple[int, Task, float, float]]:
    """``(mesh, task, start, end)`` of every schedule task in ``records``."""
    spans = []
    for mesh, label, task, start, end in records:
        if isinstance(task, tuple) and task and all(isinstance(t, Task) for t in task):
            spans.extend(_group_spans(int(mesh), task, start, end))
            continue
        if not isinstance(task, Task):
            continue
        if str(label).startswith("FB"):
            middle = start + (end - start) * _FUSED_F_SHARE
            spans.append((int(mesh), Task(task.stage, task.microbatch, "F"), start, middle))
            task, start = Task(task.stage, task.microbatch, "B"), middle
        spans.append((int(mesh), task, float(start), float(end)))
    return spans


def _peaks(entries: Sequence[tuple[int, Task, float, float]], num_meshes: int) -> tuple[int, ...]:
    rows: list[list[Task]] = [[] for _ in range(num_meshes)]
    for mesh, task, _, _ in entries:
        rows[mesh].append(task)
    # Order on each mesh, overlapped groups (Task.with_next) as one program.
    return peak_activations(rows)


def measured_timeline(records: Iterable[Sequence[Any]]) -> Timeline:
    """A `Timeline` of the stage tasks in a profile (``step.last_profile``), in seconds.

    Non-task programs are left out; an overlapped program's time is split by the default `Costs`.

    Args:
      records: ``(mesh, label, task, start_s, end_s)`` tuples; ``task`` is a
        `Task`, a tuple of the `Task` objects of one overlapped program, or
        anything else for a program that is not a schedule task.

    Returns:
      The timeline, ready for `nnx_mpmd.schedules.plot_gantt`.

    Raises:
      MpmdError: no record is a schedule task.

    Example:
      >>> tl = measured_timeline([(0, "F0", Task(0, 0, "F"), 0.5, 1.0), (1, "opt", None, 1, 2)])
      >>> tl.makespan, tl.num_meshes
      (0.5, 1)
      >>> pair = (Task(0, 1, "F", with_next=True), Task(0, 0, "B"))
      >>> [e[2:] for e in measured_timeline([(0, "F0.1+B0.0", pair, 0.0, 3.0)]).entries]
      [(0.0, 1.0), (1.0, 3.0)]
    """
    spans = _task_spans(records)
    if not spans:
        raise MpmdError(
            "measured_timeline: the profile has no schedule tasks to draw; profile a step "
            "that runs stage tasks (`step(..., profile=True)`) and pass `step.last_profile`."
        )
    origin = min(start for _, _, start, _ in spans)
    entries = sorted(((m, t, s - origin, e - origin) for m, t, s, e in spans), key=lambda x: x[2:])
    num_meshes = 1 + max(m for m, *_ in entries)
    makespan = max(e for *_, e in entries)
    busy = tuple(sum(e - s for m, _, s, e in entries if m == q) for q in range(num_meshes))
    idle = 1.0 - sum(busy) / (num_meshes * makespan) if makespan > 0 else 0.0
    return Timeline(
        entries=tuple(entries),
        num_meshes=num_meshes,
        makespan=makespan,
        busy=busy,
        bubble_fraction=idle,
        peak_activations=_peaks(entries, num_meshes),
    )


def _complete(times: dict[str, float]) -> dict[str, float]:
    """Fills the kinds a profile did not run from those it did (see `fit_costs`)."""
    if "B" not in times and "BI" in times and "BW" in times:
        times["B"] = times["BI"] + times["BW"]
    if "B" in times:
        times.setdefault("BI", times["B"] / 2)
        times.setdefault("BW", times["B"] / 2)
    if "F" in times:
        times.setdefault("B", 2 * times["F"])
        times.setdefault("BI", times["F"])
        times.setdefault("BW", times["F"])
    return times


def fit_costs(records: Iterable[Sequence[Any]], transfers: Iterable[Sequence[Any]] = ()) -> Costs:
    """`Costs` fitted to a profile: the median time of each kind on each stage.

    An overlapped program is split among its members as in `measured_timeline`.

    Args:
      records: ``(mesh, label, task, start_s, end_s)`` tuples (``step.last_profile``).
      transfers: ``(src_mesh, dst_mesh, label, start_s, end_s)`` of the measured
        cross-mesh moves (``step.last_profile.transfers``); their median
        duration becomes ``Costs.transfer`` (0 without any).

    Returns:
      Costs whose kind-wide values are the medians over all stages and whose
      ``per_stage`` holds each stage's own medians. Kinds the profile did not
      run are derived from those it did, so that every cost is in seconds and
      the costs can simulate another schedule: ``B = BI + BW`` from a split
      backward, ``BI = BW = B / 2`` from a whole one, and from forwards alone
      the default ratios (``B = 2F``, ``BI = BW = F``).

    Example:
      >>> records = [(0, "F0", Task(0, 0, "F"), 0.0, 0.2), (0, "F0", Task(0, 1, "F"), 0.2, 0.6),
      ...            (1, "F1", Task(1, 0, "F"), 0.2, 0.3)]
      >>> costs = fit_costs(records, [(0, 1, "act", 0.2, 0.25)])
      >>> round(costs.F, 3), round(costs.per_stage[0]["F"], 3), round(costs.transfer, 3)
      (0.2, 0.3, 0.05)
      >>> round(costs.B, 3), round(costs.BW, 3)  # not profiled: derived from F
      (0.4, 0.2)
    """
    by_kind: dict[str, list[float]] = {}
    by_stage: dict[int, dict[str, list[float]]] = {}
    for _, task, start, end in _task_spans(records):
        by_kind.setdefault(task.kind, []).append(end - start)
        by_stage.setdefault(task.stage, {}).setdefault(task.kind, []).append(end - start)
    moves = [float(end) - float(start) for *_, start, end in transfers]
    kinds = _complete({kind: statistics.median(values) for kind, values in by_kind.items()})
    per_stage = {
        stage: _complete({kind: statistics.median(values) for kind, values in kinds_.items()})
        for stage, kinds_ in by_stage.items()
    }
    transfer = statistics.median(moves) if moves else 0.0
    times: dict[str, Any] = kinds  # the kinds' medians: F, B, BI, BW
    return Costs(**times, transfer=max(0.0, transfer), per_stage=per_stage)


@dataclasses.dataclass(frozen=True)
class ProfileComparison:
    """A profiled step's measured timeline and the simulator's prediction for it.

    Attributes:
      measured: the tasks as they ran (seconds from the first task's start).
      simulated: the step's task lists simulated with ``costs``.
      costs: the costs fitted to the profile (`fit_costs`).

    Example:
      >>> records = [(0, "F0.0", Task(0, 0, "F"), 0.0, 1.0), (0, "B0.0", Task(0, 0, "B"), 1.0, 3.0)]
      >>> cmp = compare_profile(records, [["F0.0", "B0.0"]])
      >>> cmp.measured.makespan, cmp.simulated.makespan, cmp.predicted_over_measured
      (3.0, 3.0, 1.0)
    """

    measured: Timeline
    simulated: Timeline
    costs: Costs

    @property
    def predicted_over_measured(self) -> float:
        """The simulated makespan divided by the measured one."""
        if self.measured.makespan <= 0:
            return float("nan")
        return self.simulated.makespan / self.measured.makespan

    def summary(self) -> str:
        """Makespans and bubbles side by side, and the fitted costs, as text.

        Returns:
          A few lines, e.g. for a log.
        """
        m, s = self.measured, self.simulated
        kinds = sorted({t.kind for _, t, _, _ in m.entries})
        fitted = ", ".join(f"{k}={1e3 * getattr(self.costs, k):.3f}" for k in kinds)
        return "\n".join(
            [
                f"measured : makespan {1e3 * m.makespan:.3f} ms, bubble {m.bubble_fraction:.1%}",
                f"simulated: makespan {1e3 * s.makespan:.3f} ms, bubble {s.bubble_fraction:.1%} "
                f"({self.predicted_over_measured:.2f}x the measured makespan)",
                f"fitted costs (median ms): {fitted}, transfer={1e3 * self.costs.transfer:.3f}",
            ]
        )

    def plot(self, path: str | os.PathLike[str] | None = None) -> Any:
        """Draws the measured timeline above the simulated one, on one time axis.

        Args:
          path: if given, save the picture there (``.png``, ``.svg`` or ``.pdf``).

        Returns:
          The ``matplotlib.figure.Figure``.

        Raises:
          ScheduleError: ``path`` has no image suffix.
          MpmdError: matplotlib is not installed.
        """
        from nnx_mpmd.schedules.draw import plot_timelines

        m, s = self.measured, self.simulated
        measured = f"measured: {1e3 * m.makespan:.1f} ms, bubble {m.bubble_fraction:.1%}"
        simulated = (
            f"simulated (measured task times): {1e3 * s.makespan:.1f} ms, "
            f"bubble {s.bubble_fraction:.1%}"
        )
        return plot_timelines(
            [(measured, m), (simulated, s)], path, xlabel="time (seconds from the first task)"
        )


def _check_tasks_match(measured: Timeline, tasks: TaskLists) -> None:
    ran = {task for _, task, _, _ in measured.entries}
    planned = {task for row in tasks for task in row}
    if all(task.kind == "F" for task in ran):
        raise ScheduleError(
            "compare_profile: the profiled step ran forward tasks only (an inference step); "
            "the simulator models training schedules, so there is nothing to compare with. "
            "Draw the measured timeline alone: plot_gantt(profile.timeline())"
        )
    if not ran <= planned:
        extra = sorted(ran - planned, key=str)[:3]
        raise ScheduleError(
            f"compare_profile: the profile ran tasks the task lists do not have "
            f"({', '.join(map(str, extra))}); pass the task lists of the profiled step "
            f"(`step.last_profile.tasks`)"
        )


def compare_profile(
    records: Iterable[Sequence[Any]],
    tasks: Iterable[Iterable[Task | str]],
    transfers: Iterable[Sequence[Any]] = (),
) -> ProfileComparison:
    """Compares a profiled step with the simulator run on the step's own task times.

    Args:
      records: ``(mesh, label, task, start_s, end_s)`` tuples (``step.last_profile``).
      tasks: the per-mesh task lists the step ran (``step.last_profile.tasks``).
      transfers: the measured moves (``step.last_profile.transfers``).

    Returns:
      The `ProfileComparison`.

    Raises:
      MpmdError: the profile has no schedule task.
      ScheduleError: the profile ran tasks that ``tasks`` does not have, or
        forward tasks only (an inference step: the simulator models training).

    Example:
      >>> tasks = [["F0.0", "B0.0"], ["F1.0", "B1.0"]]
      >>> records = [(0, "F", Task(0, 0, "F"), 0, 1), (1, "F", Task(1, 0, "F"), 1.5, 2.5),
      ...            (1, "B", Task(1, 0, "B"), 2.5, 4.5), (0, "B", Task(0, 0, "B"), 5, 7)]
      >>> moves = [(0, 1, "act", 1.0, 1.5), (1, 0, "grad", 4.5, 5.0)]
      >>> compare_profile(records, tasks, moves).simulated.makespan
      7.0
    """
    measured = measured_timeline(records)
    lists = normalize_tasks(tasks)
    _check_tasks_match(measured, lists)
    costs = fit_costs(records, transfers)
    return ProfileComparison(measured, simulate(lists, costs), costs)
