"""Event-driven simulation of a schedule: `Costs` in, `Timeline` out.

Every task starts as soon as the task before it on its mesh and its
dependencies have finished (plus a transfer delay across meshes), see
`nnx_mpmd.schedules.validate.run_in_order`. Costs may be floats or
`fractions.Fraction`; with fractions every number in the `Timeline` is exact.

Overlapped tasks (a group such as ``F0.5+BI7.2+BW7.2``, see `Task.with_next`)
run as one unit on their mesh: the group starts when the unit before it and
every dependency of its members outside the group have finished, and takes
``max(sum of its members' durations - Costs.overlap, longest member)``. In
the `Timeline` its members are consecutive sub-intervals that fill the
group's interval, in list order, each scaled by the same factor; their
outputs are ready for other tasks only when the group ends.

Meshes that share compute (`Costs.contention`) are played by
`nnx_mpmd.schedules.contention.run_shared`: a task runs slower while other
meshes run theirs.

This module is pure Python: it imports neither JAX nor Flax.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

from nnx_mpmd.errors import ScheduleError
from nnx_mpmd.schedules.contention import run_shared
from nnx_mpmd.schedules.tasks import KINDS, Task, TaskLists, normalize_tasks, overlap_groups
from nnx_mpmd.schedules.validate import run_in_order, validate

__all__ = ["Costs", "Timeline", "simulate"]

_COST_NAMES = (*KINDS, "transfer", "overlap")


def _check_cost(name: str, value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ScheduleError(f"cost {name}{where} must be a number, got {value!r}")
    if value < 0:
        raise ScheduleError(f"cost {name}{where} is {value}; costs must be >= 0")


@dataclasses.dataclass(frozen=True)
class Costs:
    """The time each kind of task takes, and the delay of a cross-mesh transfer.

    Args:
      F: forward time of one stage on one microbatch.
      B: full backward time.
      BI: backward-to-input time (zero-bubble split).
      BW: backward-to-weights time (zero-bubble split).
      transfer: delay added when a task's dependency ran on another mesh.
      overlap: the time hidden when tasks run overlapped in one program (a
        group of `Task.with_next` tasks, e.g. DualPipe's forward of one
        microbatch with the backward of another): a group takes ``max(sum of
        its durations - overlap, longest member)``. In DualPipe's terms,
        ``overlap = F + B - F&B``. It does not apply to lone tasks.
      per_stage: overrides per stage, e.g. ``{3: {"F": 2.0, "B": 4.0}}``.
      contention: how much slower every task runs while 1, 2, ... meshes
        run tasks at once (each at least 1; beyond the last, the last),
        for meshes that share compute, such as simulated CPU devices on a
        few cores. Empty (the default): meshes share nothing.

    Example:
      >>> costs = Costs(per_stage={1: {"F": 3.0}})
      >>> costs.duration(Task(0, 0, "F")), costs.duration(Task(1, 0, "F"))
      (1.0, 3.0)
      >>> simulate([["F0.0", "F0.1+B0.0", "B0.1"]], Costs(overlap=0.5)).makespan
      5.5
      >>> simulate([["F0.0", "B0.0"], ["F1.0", "B1.0"]], Costs(contention=(1.0, 2.0))).makespan
      6.0
    """

    F: float = 1.0
    B: float = 2.0
    BI: float = 1.0
    BW: float = 1.0
    transfer: float = 0.0
    overlap: float = 0.0
    per_stage: Mapping[int, Mapping[str, float]] = dataclasses.field(
        default_factory=dict, hash=False
    )
    contention: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in _COST_NAMES:
            _check_cost(name, getattr(self, name), "")
        object.__setattr__(self, "contention", tuple(self.contention))
        for busy, factor in enumerate(self.contention, start=1):
            _check_cost("contention", factor, f" with {busy} busy meshes")
            if factor < 1:
                raise ScheduleError(
                    f"contention with {busy} busy meshes is {factor}; a task cannot run "
                    f"faster beside others than alone: give factors >= 1 (1: no contention)"
                )
        for stage, overrides in self.per_stage.items():
            for kind, value in overrides.items():
                if kind not in KINDS:
                    raise ScheduleError(
                        f"per_stage cost for stage {stage} names kind {kind!r}; use one of "
                        f"{', '.join(KINDS)}"
                    )
                _check_cost(kind, value, f" of stage {stage}")

    def duration(self, task: Task) -> float:
        """The time ``task`` takes.

        Args:
          task: the task.

        Returns:
          Its per-stage override if there is one, else the cost of its kind.

        Example:
          >>> Costs().duration(Task(0, 0, "B"))
          2.0
        """
        overrides = self.per_stage.get(task.stage)
        if overrides is not None and task.kind in overrides:
            return overrides[task.kind]
        return getattr(self, task.kind)

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Reads ``"F=1,B=2,BI=1,BW=1,transfer=0.1,overlap=0.5"`` (any subset, any order).

        ``contention`` takes one factor per number of busy meshes, joined by
        ``/``: ``contention=1/1.8/2.5``.

        Args:
          text: comma-separated ``name=value`` pairs.

        Returns:
          The costs, defaults for names not given.

        Example:
          >>> Costs.parse("F=1, B=3").B
          3.0
          >>> Costs.parse("F=1, contention=1/1.8/2.5").contention
          (1.0, 1.8, 2.5)
        """
        values: dict[str, Any] = {}
        for item in text.split(","):
            if not item.strip():
                continue
            name, sep, value = item.partition("=")
            name = name.strip()
            if not sep or name not in (*_COST_NAMES, "contention"):
                raise ScheduleError(
                    f"cannot read cost {item.strip()!r} in {text!r}; write name=value with "
                    f"name one of {', '.join(_COST_NAMES)}, contention, e.g. 'F=1,B=2'"
                )
            try:
                if name == "contention":
                    values[name] = tuple(float(factor) for factor in value.split("/"))
                else:
                    values[name] = float(value)
            except ValueError:
                example = "contention=1/1.8/2.5" if name == "contention" else f"{name}=1.5"
                raise ScheduleError(
                    f"cost {name} in {text!r} is {value.strip()!r}, not a number; e.g. '{example}'"
                ) from None
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class Timeline:
    """The result of `simulate`: when every task ran, and summary numbers.

    Attributes:
      entries: ``(mesh, task, start, end)`` for every task, sorted by ``(start, mesh)``.
        The members of a group of overlapped tasks have consecutive
        sub-intervals of the group's interval (their ``task.with_next`` marks
        the group, as in the task lists).
      num_meshes: the number of meshes.
      makespan: the time the last task ends.
      busy: per mesh, the total time its tasks run.
      bubble_fraction: idle time / (``num_meshes`` × ``makespan``).
      peak_activations: per mesh, the most microbatch activations held at once
        (an ``F`` holds one until its ``B``, or its ``BW`` when split; in a
        group, forwards hold theirs from the group's start and backwards
        release at its end).

    Example:
      >>> tl = simulate([["F0.0", "B0.0"], ["F1.0", "B1.0"]])
      >>> tl.makespan, tl.busy, tl.bubble_fraction, tl.peak_activations
      (6.0, (3.0, 3.0), 0.5, (1, 1))
    """

    entries: tuple[tuple[int, Task, float, float], ...]
    num_meshes: int
    makespan: float
    busy: tuple[float, ...]
    bubble_fraction: float
    peak_activations: tuple[int, ...]

    def span(self, task: Task) -> tuple[float, float]:
        """The ``(start, end)`` of ``task``.

        Args:
          task: a task of the simulated schedule.

        Returns:
          Its start and end time.

        Example:
          >>> simulate([["F0.0", "B0.0"]]).span(Task(0, 0, "B"))
          (1.0, 3.0)
        """
        for _, other, start, end in self.entries:
            if other == task:
                return start, end
        raise ScheduleError(f"task {task} is not in this timeline; pick a task of the schedule")


def peak_activations(tasks: Iterable[Iterable[Task]]) -> tuple[int, ...]:
    """Per mesh, the most microbatch activations held at once.

    An ``F`` adds an activation, ``B``/``BW`` releases it; a group adds before it releases.

    Args:
      tasks: per-mesh ordered task lists.

    Returns:
      The peak count per mesh.

    Example:
      >>> peak_activations([[Task(0, 0, "F"), Task(0, 1, "F"), Task(0, 0, "B"), Task(0, 1, "B")]])
      (2,)
      >>> peak_activations([["F0.0", "B0.0+F0.1", "B0.1"]])  # B0.0 frees at the group's end
      (2,)
    """
    peaks = []
    for row in normalize_tasks(tasks):
        held = peak = 0
        for group in overlap_groups(row):
            held += sum(task.kind == "F" for task in group)
            peak = max(peak, held)
            held -= sum(task.kind in ("B", "BW") for task in group)
        peaks.append(peak)
    return tuple(peaks)


def simulate(tasks: Iterable[Iterable[Task | str]], costs: Costs | None = None) -> Timeline:
    """Simulates a schedule: every task starts as soon as it can.

    The lists are validated first (see `validate`). A group of overlapped
    tasks runs as one unit and takes ``max(sum of its durations -
    costs.overlap, longest member)`` (see the module docstring).

    Args:
      tasks: per-mesh ordered task lists.
      costs: task durations, the transfer delay and the overlap (default
        ``Costs()``: ``F=1, B=2, BI=1, BW=1, transfer=0, overlap=0``).

    Returns:
      The `Timeline`.

    Example:
      >>> from nnx_mpmd.schedules import GPipe
      >>> tl = simulate(GPipe().tasks(4, 4, 8))
      >>> tl.makespan, round(tl.bubble_fraction, 4)
      (33.0, 0.2727)
    """
    costs = Costs() if costs is None else costs
    lists: TaskLists = normalize_tasks(tasks)
    validate(lists)
    if any(factor != 1 for factor in costs.contention):
        times, _ = run_shared(
            lists, costs.duration, costs.transfer, costs.overlap, costs.contention
        )
    else:
        times, _ = run_in_order(lists, costs.duration, costs.transfer, costs.overlap)
    entries = sorted(
        ((mesh, task, *times[task]) for mesh, row in enumerate(lists) for task in row),
        key=lambda entry: (entry[2], entry[0], entry[3]),
    )
    makespan = max((end for *_, end in entries), default=0)
    busy: list[float] = [0] * len(lists)
    for mesh, _, start, end in entries:
        busy[mesh] += end - start
    total = len(lists) * makespan
    bubble = (total - sum(busy)) / total if total else 0.0
    return Timeline(
        entries=tuple(entries),
        num_meshes=len(lists),
        makespan=makespan,
        busy=tuple(busy),
        bubble_fraction=bubble,
        peak_activations=peak_activations(lists),
    )
