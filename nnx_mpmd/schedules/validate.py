"""Checks that per-mesh task lists form a complete, well-placed, deadlock-free schedule.

Dependencies (``S`` stages, data flowing from stage ``s`` to ``s + 1``):

* ``F(s, mb)`` needs ``F(s-1, mb)`` when ``s > 0``;
* ``B(s, mb)`` and ``BI(s, mb)`` need ``F(s, mb)`` and the backward (``B`` or
  ``BI``) of ``(s+1, mb)`` when ``s < S-1``;
* ``BW(s, mb)`` needs ``BI(s, mb)``.

A task runs when its dependencies have finished and the task before it on its
mesh has finished. `run_in_order` plays the lists forward under these rules; it
serves both `validate` (does every task run?) and the simulator (when?).

This module is pure Python: it imports neither JAX nor Flax.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from nnx_mpmd.errors import ScheduleError
from nnx_mpmd.schedules.tasks import Task, TaskLists, normalize_tasks

__all__ = ["dependencies", "format_grid", "run_in_order", "validate"]


def dependencies(task: Task, num_stages: int, split: Callable[[int, int], bool]) -> list[Task]:
    """The tasks that ``task`` waits for.

    Args:
      task: the task.
      num_stages: the number of stages ``S``.
      split: ``(stage, microbatch) -> bool``, True when that pair's backward is
        split into ``BI``/``BW`` rather than one ``B``.

    Returns:
      The dependencies of ``task``.

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
        lines.append(f"{f'mesh {mesh}':<{label_width}} | {' '.join(cells)}".rstrip())
    return "\n".join(lines)


def _fail(message: str, lists: TaskLists, marked: Iterable[Task] = ()) -> ScheduleError:
    return ScheduleError(f"{message}\n{format_grid(lists, marked)}")


def run_in_order(
    lists: TaskLists,
    duration: Callable[[Task], float],
    transfer: float = 0.0,
) -> tuple[dict[Task, tuple[float, float]], list[tuple[int, Task]]]:
    """Plays per-mesh lists forward: every task starts as soon as it can.

    A task starts when the task before it on its mesh has finished and all its
    dependencies have finished (plus ``transfer`` when a dependency ran on
    another mesh). Every dependency must be present somewhere in ``lists``
    (`validate` checks that first).

    Args:
      lists: per-mesh ordered task lists.
      duration: the time a task takes.
      transfer: the extra delay of a dependency that ran on another mesh.

    Returns:
      ``(times, blocked)``: ``times`` maps every task that ran to its
      ``(start, end)``; ``blocked`` lists ``(mesh, task)`` for every mesh that
      stopped early at ``task`` (empty unless the schedule deadlocks).

    Example:
      >>> times, blocked = run_in_order(((Task(0, 0, "F"), Task(0, 0, "B")),), lambda t: 1.0)
      >>> times[Task(0, 0, "B")], blocked
      ((1.0, 2.0), [])
    """
    mesh_of_task = {task: mesh for mesh, row in enumerate(lists) for task in row}
    num_stages = max((t.stage for t in mesh_of_task), default=-1) + 1

    def split(stage: int, microbatch: int) -> bool:
        return Task(stage, microbatch, "BI") in mesh_of_task

    times: dict[Task, tuple[float, float]] = {}
    position = [0] * len(lists)
    # Integer zeros keep exact arithmetic when durations are Fractions.
    free_at: list[float] = [0] * len(lists)
    progress = True
    while progress:
        progress = False
        for mesh, row in enumerate(lists):
            while position[mesh] < len(row):
                task = row[position[mesh]]
                deps = dependencies(task, num_stages, split)
                if any(dep not in times for dep in deps):
                    break
                start = free_at[mesh]
                for dep in deps:
                    ready = times[dep][1]
                    if transfer and mesh_of_task[dep] != mesh:
                        ready = ready + transfer
                    start = max(start, ready)
                end = start + duration(task)
                times[task] = (start, end)
                free_at[mesh] = end
                position[mesh] += 1
                progress = True
    blocked = [
        (mesh, row[position[mesh]]) for mesh, row in enumerate(lists) if position[mesh] < len(row)
    ]
    return times, blocked


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
    times, blocked = run_in_order(lists, lambda task: 1.0)
    if blocked:
        present = {task: mesh for mesh, row in enumerate(lists) for task in row}
        split = lambda s, mb: Task(s, mb, "BI") in present  # noqa: E731
        waits = []
        for mesh, task in blocked:
            missing = [d for d in dependencies(task, num_stages, split) if d not in times]
            waits.append(
                f"mesh {mesh} waits at {task} for "
                + ", ".join(f"{d} (mesh {present[d]})" for d in missing)
            )
        raise _fail(
            "the schedule deadlocks: "
            + "; ".join(waits)
            + ". Reorder the lists so that every task's inputs are produced before it",
            lists,
            [task for _, task in blocked],
        )
