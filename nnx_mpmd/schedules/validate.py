"""Checks that per-mesh task lists form a complete, well-placed, deadlock-free schedule.

Dependencies (``S`` stages, data flowing from stage ``s`` to ``s + 1``):

* ``F(s, mb)`` needs ``F(s-1, mb)`` when ``s > 0``;
* ``B(s, mb)`` and ``BI(s, mb)`` need ``F(s, mb)`` and the backward (``B`` or
  ``BI``) of ``(s+1, mb)`` when ``s < S-1``;
* ``BW(s, mb)`` needs ``BI(s, mb)``.

A task runs when its dependencies have finished and the task before it on its
mesh has finished. `run_in_order` plays the lists forward under these rules; it
serves both `validate` (does every task run?) and the simulator (when?).

Overlapped tasks (``F0.5+BI7.2+BW7.2``: each but the last has
`Task.with_next`) run as one program, so they are played as one unit: the
group starts when every dependency of its members has finished, except a
``BW`` whose own ``BI`` is in the group before it, and the outputs of all its
members are ready when the group ends. Hence no member may depend on another
member of its group, directly or through other meshes' tasks; `validate`
reports both.

This module is pure Python: it imports neither JAX nor Flax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence

from nnx_mpmd.errors import ScheduleError
from nnx_mpmd.schedules.tasks import (
    Task,
    TaskLists,
    normalize_tasks,
    overlap_groups,
)

__all__ = [
    "dependencies",
    "external_dependencies",
    "format_grid",
    "Playback",
    "group_intervals",
    "group_work",
    "run_in_order",
    "validate",
]


def dependencies(task: Task, num_stages: int, split: Callable[[int, int], bool]) -> list[Task]:
    """The tasks that ``task`` waits for; ``split(stage, mb)`` says whether its backward is split.

    Example:
      >>> dependencies(Task(1, 0, "B"), 3, lambda s, mb: False)
      [Task(stage=1, microbatch=0, kind='F'), Task(stage=2, microbatch=0, kind='B')]
    """
    s, mb = task.stage, task.microbatch
    if task.kind == "F":
        return [Task(s - 1, mb, "F")] if s > 0 else []
    if task.kind == "BW":
        return [Task(s, mb, "BI")]
    deps = [Task(s, mb, "F")]
    if s < num_stages - 1:
        deps.append(Task(s + 1, mb, "BI" if split(s + 1, mb) else "B"))
    return deps


def format_grid(tasks: Iterable[Iterable[Task]], marked: Iterable[Task] = ()) -> str:
    """Draws per-mesh task lists as a grid, the ``marked`` tasks in brackets.

    Args:
      tasks: per-mesh ordered task lists.
      marked: tasks to point out, e.g. the ones an error is about.

    Returns:
      One line per mesh: ``mesh N | F0.0  F0.1 [B0.0] ...``.

    Example:
      >>> print(format_grid([[Task(0, 0, "F"), Task(0, 0, "B")]], [Task(0, 0, "B")]))
      mesh 0 |  F0.0  [B0.0]

      Overlapped tasks are joined by ``+``:

      >>> from nnx_mpmd.schedules.tasks import parse_tasks
      >>> print(format_grid(parse_tasks("F0.0 F0.1+B0.0 B0.1")))
      mesh 0 |  F0.0   F0.1 + B0.0   B0.1
    """
    lists = normalize_tasks(tasks)
    marked = set(marked)
    width = max((len(str(t)) for row in lists for t in row), default=4)
    label_width = len(f"mesh {max(len(lists) - 1, 0)}")
    lines = []
    for mesh, row in enumerate(lists):
        cells = [
            f"[{t}]".ljust(width + 2) if t in marked else f" {t} ".ljust(width + 2) for t in row
        ]
        body = "".join(
            cell + ("+" if task.with_next else " ") for cell, task in zip(cells, row, strict=True)
        )
        lines.append(f"{f'mesh {mesh}':<{label_width}} | {body}".rstrip())
    return "\n".join(lines)


def _fail(message: str, lists: TaskLists, marked: Iterable[Task] = ()) -> ScheduleError:
    return ScheduleError(f"{message}\n{format_grid(lists, marked)}")


def run_in_order(
    lists: TaskLists,
    duration: Callable[[Task], float],
    transfer: float = 0.0,
    overlap: float = 0,
) -> tuple[dict[Task, tuple[float, float]], list[tuple[int, Task]]]:
    """Plays per-mesh lists forward, every task starting as soon as it can.

    A task waits for its mesh's previous task and its dependencies (+ ``transfer`` across
    meshes); an overlapped group takes ``max(sum - overlap, longest member)``.

    Returns:
      ``(times, blocked)``: ``{task: (start, end)}`` of the tasks that ran, and
      ``(mesh, first task of the unit it waits at)`` per mesh that deadlocked.

    Example:
      >>> times, blocked = run_in_order(((Task(0, 0, "F"), Task(0, 0, "B")),), lambda t: 1.0)
      >>> times[Task(0, 0, "B")], blocked
      ((1.0, 2.0), [])
      >>> from nnx_mpmd.schedules.tasks import parse_tasks
      >>> pair = parse_tasks("F0.0 F0.1+B0.0 B0.1")
      >>> times, _ = run_in_order(pair, lambda t: 1.0, overlap=0.5)
      >>> times[Task(0, 1, "F")], times[Task(0, 0, "B")], times[Task(0, 1, "B")]
      ((1.0, 1.75), (1.75, 2.5), (2.5, 3.5))
    """
    plan = Playback.of(lists)
    times: dict[Task, tuple[float, float]] = {}
    # When each task's outputs are ready: the end of its group.
    done: dict[Task, float] = {}
    position = [0] * len(lists)
    # Integer zeros keep exact arithmetic when durations are Fractions.
    free_at: list[float] = [0] * len(lists)
    progress = True
    while progress:
        progress = False
        for mesh, mesh_groups in enumerate(plan.groups):
            while position[mesh] < len(mesh_groups):
                group = mesh_groups[position[mesh]]
                start = plan.ready_at(mesh, group, done, free_at[mesh], transfer)
                if start is None:
                    break
                end = _place_group(group, start, duration, overlap, times)
                for task in group:
                    done[task] = end
                free_at[mesh] = end
                position[mesh] += 1
                progress = True
    return times, plan.stopped(position)


@dataclasses.dataclass(frozen=True)
class Playback:
    """What playing per-mesh lists forward needs: the units, who runs what, the split.

    Shared by `run_in_order` and `nnx_mpmd.schedules.contention.run_shared`.

    Attributes:
      groups: per mesh, its units in order (a lone task is a group of one).
      mesh_of_task: the mesh each task runs on.
      num_stages: the number of stages.
    """

    groups: tuple[tuple[tuple[Task, ...], ...], ...]
    mesh_of_task: dict[Task, int]
    num_stages: int

    @classmethod
    def of(cls, lists: TaskLists) -> Playback:
        """The playback of ``lists``."""
        mesh_of_task = {task: mesh for mesh, row in enumerate(lists) for task in row}
        return cls(
            groups=tuple(tuple(overlap_groups(row)) for row in lists),
            mesh_of_task=mesh_of_task,
            num_stages=max((t.stage for t in mesh_of_task), default=-1) + 1,
        )

    def split(self, stage: int, microbatch: int) -> bool:
        """Whether the backward of ``(stage, microbatch)`` is split into BI and BW."""
        return Task(stage, microbatch, "BI") in self.mesh_of_task

    def ready_at(
        self,
        mesh: int,
        group: tuple[Task, ...],
        done: Mapping[Task, float],
        free_at: float,
        transfer: float,
    ) -> float | None:
        """When ``group`` can start on ``mesh``, or None while a dependency has not run."""
        deps = external_dependencies(group, self.num_stages, self.split)
        if any(dep not in done for dep in deps):
            return None
        start = free_at
        for dep in deps:
            ready = done[dep]
            if transfer and self.mesh_of_task[dep] != mesh:
                ready = ready + transfer
            start = max(start, ready)
        return start

    def stopped(self, position: Sequence[int]) -> list[tuple[int, Task]]:
        """``(mesh, first task of the unit it waits at)`` for every mesh not at its end."""
        return [
            (mesh, mesh_groups[position[mesh]][0])
            for mesh, mesh_groups in enumerate(self.groups)
            if position[mesh] < len(mesh_groups)
        ]


def group_work(lengths: Sequence[float], overlap: float) -> float:
    """A unit's time: ``max(sum - overlap, longest)`` for a group, the duration of a lone task.

    Example:
      >>> group_work([1.0], 0.5), group_work([1.0, 2.0], 0.5), group_work([1.0, 2.0], 5.0)
      (1.0, 2.5, 2.0)
    """
    if len(lengths) == 1:
        return lengths[0]
    return max(sum(lengths) - overlap, max(lengths))


def _place_group(
    group: tuple[Task, ...],
    start: float,
    duration: Callable[[Task], float],
    overlap: float,
    times: dict[Task, tuple[float, float]],
) -> float:
    """Records the members' sub-intervals from ``start``; returns the group's end."""
    if len(group) == 1:
        end = start + duration(group[0])
        times[group[0]] = (start, end)
        return end
    lengths = [duration(task) for task in group]
    span = group_work(lengths, overlap)
    end = start
    for task, at, end in group_intervals(group, lengths, start, span):
        times[task] = (at, end)
    return end


def group_intervals(
    group: Iterable[Task], lengths: Iterable[float], start: float, span: float
) -> list[tuple[Task, float, float]]:
    """``(task, start, end)`` per group member: consecutive shares of ``span`` from ``start``.

    Each member's share is proportional to its entry of ``lengths``.

    Example:
      >>> from nnx_mpmd.schedules.tasks import parse_tasks
      >>> [(str(t), a, b) for t, a, b in group_intervals(parse_tasks("F0.1+B0.0")[0], [1, 2], 0, 1.5)]
      [('F0.1', 0, 0.5), ('B0.0', 0.5, 1.5)]
    """
    lengths = list(lengths)
    total = sum(lengths)
    at, elapsed = start, 0
    intervals = []
    for task, length in zip(group, lengths, strict=True):
        elapsed = elapsed + length
        # Scale the cumulative time, so that the last member ends exactly at start + span.
        end = at + length if span == total else start + elapsed * span / total
        intervals.append((task, at, end))
        at = end
    return intervals


def external_dependencies(
    group: Iterable[Task], num_stages: int, split: Callable[[int, int], bool]
) -> list[Task]:
    """What a group of overlapped tasks waits for: its members' dependencies outside it, in order.

    A ``BW`` whose ``BI`` is in the group needs nothing; other dependencies on a member stay,
    so a group feeding itself never becomes ready (`validate` reports it).

    Example:
      >>> from nnx_mpmd.schedules.tasks import parse_tasks
      >>> group = parse_tasks("F1.0+BI2.0+BW2.0")[0]
      >>> [str(d) for d in external_dependencies(group, 4, lambda s, mb: True)]
      ['F0.0', 'F2.0', 'BI3.0']
    """
    group = tuple(group)
    deps: list[Task] = []
    for task in group:
        for dep in dependencies(task, num_stages, split):
            if _feeds_allowed(task, dep, group) or dep in deps:
                continue
            deps.append(dep)
    return deps


def _feeds_allowed(task: Task, dep: Task, group: tuple[Task, ...]) -> bool:
    """True when ``dep`` feeding ``task`` inside ``group`` is fine: a BW after its own BI."""
    return task.kind == "BW" and dep in group and group.index(dep) < group.index(task)


def _check_placement(
    lists: TaskLists, mesh_of: Callable[[int], int] | None, num_stages: int
) -> None:
    where: dict[Task, tuple[int, int]] = {}
    stage_mesh: dict[int, tuple[int, Task]] = {}
    for mesh, row in enumerate(lists):
        for index, task in enumerate(row):
            if task in where:
                other_mesh, other_index = where[task]
                raise _fail(
                    f"task {task} appears twice: mesh {other_mesh} position {other_index} and "
                    f"mesh {mesh} position {index}; keep exactly one",
                    lists,
                    [task],
                )
            where[task] = (mesh, index)
            if task.stage >= num_stages:
                raise _fail(
                    f"task {task} on mesh {mesh} names stage {task.stage}, but there are only "
                    f"{num_stages} stages (0..{num_stages - 1}); fix the stage number",
                    lists,
                    [task],
                )
            if mesh_of is not None:
                expected = mesh_of(task.stage)
                if expected != mesh:
                    raise _fail(
                        f"task {task} is on mesh {mesh}, but stage {task.stage} is placed on "
                        f"mesh {expected}; move it to mesh {expected}'s list",
                        lists,
                        [task],
                    )
            first = stage_mesh.setdefault(task.stage, (mesh, task))
            if first[0] != mesh:
                raise _fail(
                    f"stage {task.stage} has tasks on mesh {first[0]} ({first[1]}) and on mesh "
                    f"{mesh} ({task}); run every task of a stage on one mesh",
                    lists,
                    [first[1], task],
                )


def _check_complete(lists: TaskLists, num_stages: int) -> None:
    present = {task for row in lists for task in row}
    num_microbatches = max((t.microbatch for t in present), default=-1) + 1
    stages_seen = {t.stage for t in present}
    for stage in range(num_stages):
        if stage not in stages_seen:
            raise _fail(
                f"stage {stage} has no tasks (there are {num_stages} stages); add its F and B "
                "tasks to the list of its mesh",
                lists,
            )
    for stage in range(num_stages):
        for mb in range(num_microbatches):
            have = {kind for kind in ("F", "B", "BI", "BW") if Task(stage, mb, kind) in present}
            mine = [Task(stage, mb, kind) for kind in sorted(have)]
            if "F" not in have:
                raise _fail(
                    f"task F{stage}.{mb} is missing (stage {stage}, microbatch {mb} of "
                    f"{num_microbatches}); add it to the list of stage {stage}'s mesh",
                    lists,
                    mine,
                )
            if "B" in have and have & {"BI", "BW"}:
                raise _fail(
                    f"stage {stage}, microbatch {mb} has both a full backward B{stage}.{mb} and "
                    "a split one (BI/BW); use either B or the pair BI and BW",
                    lists,
                    mine,
                )
            if "B" not in have and not have & {"BI", "BW"}:
                raise _fail(
                    f"task B{stage}.{mb} is missing (stage {stage}, microbatch {mb}); add "
                    f"B{stage}.{mb}, or the pair BI{stage}.{mb} and BW{stage}.{mb}",
                    lists,
                    mine,
                )
            for kind, partner in (("BI", "BW"), ("BW", "BI")):
                if kind in have and partner not in have:
                    raise _fail(
                        f"task {partner}{stage}.{mb} is missing: {kind}{stage}.{mb} is there "
                        f"and a split backward needs both BI and BW; add {partner}{stage}.{mb}",
                        lists,
                        mine,
                    )


def _check_local_order(lists: TaskLists) -> None:
    for mesh, row in enumerate(lists):
        index = {task: i for i, task in enumerate(row)}
        for task in row:
            before = None
            if task.kind in ("B", "BI"):
                before = Task(task.stage, task.microbatch, "F")
            elif task.kind == "BW":
                before = Task(task.stage, task.microbatch, "BI")
            if before is not None and index[before] > index[task]:
                raise _fail(
                    f"task {task} comes before {before} on mesh {mesh}; move {task} after {before}",
                    lists,
                    [task, before],
                )


def _group_text(group: Iterable[Task]) -> str:
    return "+".join(str(task) for task in group)


def _check_groups(lists: TaskLists, num_stages: int) -> None:
    """``with_next`` on a mesh's last task; a group member fed by another member."""
    present = {task for row in lists for task in row}
    split = lambda s, mb: Task(s, mb, "BI") in present  # noqa: E731
    for mesh, row in enumerate(lists):
        if row and row[-1].with_next:
            raise _fail(
                f"task {row[-1]}, the last task of mesh {mesh}, has with_next=True (runs "
                "overlapped with the next task), but no task follows it on mesh "
                f"{mesh}; set with_next=False on it, or move the task it should overlap "
                "with after it",
                lists,
                [row[-1]],
            )
        for group in overlap_groups(row):
            for task in group:
                for dep in dependencies(task, num_stages, split):
                    if dep in group and not _feeds_allowed(task, dep, group):
                        raise _fail(
                            f"mesh {mesh}: in the overlapped group {_group_text(group)}, "
                            f"{task} needs {dep} of the same group, but a group runs as one "
                            "program and its tasks cannot feed each other (only a BW may "
                            "follow its own BI); run them as separate programs: write "
                            f"'{' '.join(map(str, group))}'",
                            lists,
                            [task, dep],
                        )


def _deadlock(
    lists: TaskLists,
    num_stages: int,
    times: dict[Task, tuple[float, float]],
    blocked: list[tuple[int, Task]],
) -> str:
    """``mesh M waits at X for Y (mesh N); ...`` for the units that could not run."""
    present = {task: mesh for mesh, row in enumerate(lists) for task in row}
    split = lambda s, mb: Task(s, mb, "BI") in present  # noqa: E731
    group_of = {group[0]: group for row in lists for group in overlap_groups(row)}
    waits = []
    for mesh, task in blocked:
        group = group_of[task]
        missing = [d for d in external_dependencies(group, num_stages, split) if d not in times]
        waits.append(
            f"mesh {mesh} waits at {_group_text(group)} for "
            + ", ".join(f"{d} (mesh {present[d]})" for d in missing)
        )
    return "; ".join(waits)


def validate(
    tasks: Iterable[Iterable[Task | str]],
    *,
    mesh_of: Callable[[int], int] | None = None,
    num_stages: int | None = None,
) -> None:
    """Checks per-mesh task lists; raises `ScheduleError` with a marked grid if wrong.

    Checks that every task appears once; every stage runs on one mesh (the one
    ``mesh_of`` gives, if given); every (stage, microbatch) has exactly one
    ``F`` and either one ``B`` or one ``BI`` and one ``BW``; ``F`` comes before
    its backward and ``BI`` before ``BW``; and that a dry run of the lists
    finishes, i.e. no two meshes wait for each other.

    Overlapped tasks (``with_next``, text form ``F0.5+BI7.2+BW7.2``) must be
    followed by a task on their mesh, and no task of a group may depend on
    another task of the same group, directly or through other meshes (a
    second dry run plays each group as one unit), except a ``BW`` after its
    own ``BI``.

    Args:
      tasks: per-mesh ordered task lists (`Task` objects or tokens).
      mesh_of: ``stage -> mesh``, the placement the lists must follow.
      num_stages: the number of stages (default: the highest stage + 1).

    Returns:
      None.

    Example:
      >>> from nnx_mpmd.schedules.tasks import parse_tasks
      >>> validate(parse_tasks("F0.0 B0.0\\nF1.0 B1.0"))
      >>> validate(parse_tasks("F0.0 B0.0\\nB1.0 F1.0"))  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      nnx_mpmd.errors.ScheduleError: task B1.0 comes before F1.0 on mesh 1; ...
      >>> validate(parse_tasks("F0.0 F0.1+B0.0 B0.1"))
      >>> validate(parse_tasks("F0.0+B0.0"))  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      nnx_mpmd.errors.ScheduleError: mesh 0: in the overlapped group F0.0+B0.0, B0.0 needs F0.0 ...
    """
    lists = normalize_tasks(tasks)
    if not lists:
        raise ScheduleError("the schedule has no meshes; give one task list per mesh")
    highest = max((t.stage for row in lists for t in row), default=-1) + 1
    if highest == 0:
        raise ScheduleError(
            f"the schedule's {len(lists)} mesh lists are all empty; give every stage its tasks"
        )
    if num_stages is None:
        num_stages = highest
    _check_placement(lists, mesh_of, num_stages)
    _check_complete(lists, num_stages)
    _check_local_order(lists)
    _check_groups(lists, num_stages)
    plain = tuple(tuple(dataclasses.replace(t, with_next=False) for t in row) for row in lists)
    times, blocked = run_in_order(plain, lambda task: 1.0)
    if blocked:
        raise _fail(
            "the schedule deadlocks: "
            + _deadlock(plain, num_stages, times, blocked)
            + ". Reorder the lists so that every task's inputs are produced before it",
            lists,
            [task for _, task in blocked],
        )
    if not any(t.with_next for row in lists for t in row):
        return
    times, blocked = run_in_order(lists, lambda task: 1.0)
    if blocked:
        group_of = {group[0]: group for row in lists for group in overlap_groups(row)}
        stuck = [
            f"{_group_text(group_of[task])} on mesh {mesh}"
            for mesh, task in blocked
            if len(group_of[task]) > 1
        ] or [f"{_group_text(group_of[task])} on mesh {mesh}" for mesh, task in blocked]
        many = len(stuck) > 1
        raise _fail(
            f"the overlapped group{'s' if many else ''} {', '.join(stuck)} "
            f"deadlock{'' if many else 's'}: a group runs as one program and starts only "
            "when the inputs of all its tasks are ready, so none of its tasks may wait, through other meshes, for "
            "another task of the same group ("
            + _deadlock(lists, num_stages, times, blocked)
            + "). Split the group into separate programs (a space instead of '+'), or "
            "overlap tasks that do not depend on each other",
            lists,
            [task for _, task in blocked],
        )
