"""Playing a schedule on meshes that share compute: tasks slow down while others run.

`run_in_order` assumes that every mesh has compute of its own, so a task
takes its duration whatever the other meshes do. Where meshes share compute
(simulated CPU devices on a few cores, accelerators behind one host), a task
runs slower while other meshes work: with ``k`` meshes busy, each of their
tasks advances at ``1 / contention[k - 1]`` of its speed alone (processor
sharing). `run_shared` plays the lists forward event by event under that
rule; with no contention (every factor 1) its times are `run_in_order`'s.

The factors are measured, not assumed: `nnx_mpmd.planner.profile_units`
times one step on 1, 2, ... submeshes at once. A factor of ``k`` for ``k``
busy meshes means that they share one device's worth of compute; a factor
of 1 means that they share nothing.

This module is pure Python: it imports neither JAX nor Flax.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from nnx_mpmd.schedules.tasks import Task, TaskLists
from nnx_mpmd.schedules.validate import Playback, group_intervals, group_work

__all__ = ["contention_factor", "run_shared"]


def contention_factor(contention: Sequence[float], busy: int) -> float:
    """How much slower a task runs while ``busy`` (>= 1) meshes run tasks at once.

    ``contention`` holds the factors for 1, 2, ... busy meshes (its last beyond; empty: 1).

    Example:
      >>> contention_factor((1.0, 1.8, 2.5), 2), contention_factor((1.0, 1.8, 2.5), 6)
      (1.8, 2.5)
    """
    if not contention:
        return 1
    return contention[min(busy, len(contention)) - 1]


def run_shared(
    lists: TaskLists,
    duration: Callable[[Task], float],
    transfer: float = 0,
    overlap: float = 0,
    contention: Sequence[float] = (),
) -> tuple[dict[Task, tuple[float, float]], list[tuple[int, Task]]]:
    """`run_in_order` with shared compute: while ``k`` units run, each goes ``1/factor(k)`` as fast.

    ``contention`` holds the factors for 1, 2, ... busy meshes (`contention_factor`).

    Example:
      >>> from nnx_mpmd.schedules.tasks import parse_tasks
      >>> lists = parse_tasks("F0.0 F0.1\\nF1.0 F1.1")
      >>> times, _ = run_shared(lists, lambda t: 1.0, contention=(1.0, 2.0))
      >>> times[Task(0, 0, "F")], times[Task(0, 1, "F")], times[Task(1, 0, "F")]
      ((0, 1.0), (1.0, 3.0), (1.0, 3.0))
      >>> times[Task(1, 1, "F")]  # alone again: full speed
      (3.0, 4.0)
    """
    plan = Playback.of(lists)
    position = [0] * len(lists)
    free_at: list[float] = [0] * len(lists)
    done: dict[Task, float] = {}
    times: dict[Task, tuple[float, float]] = {}
    # mesh -> [start, remaining work, member lengths]
    running: dict[int, list] = {}
    now: float = 0
    while True:
        next_ready = _start_ready(plan, position, running, free_at, done, now, transfer,
                                  duration, overlap)  # fmt: skip
        if not running:
            if next_ready is None:
                break
            now = next_ready
            continue
        factor = contention_factor(contention, len(running))
        step = min(state[1] for state in running.values()) * factor
        if next_ready is not None and next_ready - now < step:
            step = next_ready - now
            finished = []
        else:
            finished = [m for m, state in running.items() if state[1] * factor <= step]
        now = now + step
        for mesh, state in running.items():
            state[1] = 0 if mesh in finished else state[1] - step / factor
        for mesh in finished:
            start, _, lengths = running.pop(mesh)
            group = plan.groups[mesh][position[mesh]]
            for task, at, end in group_intervals(group, lengths, start, now - start):
                times[task] = (at, end)
                done[task] = now
            free_at[mesh] = now
            position[mesh] += 1
    return times, plan.stopped(position)


def _start_ready(
    plan: Playback,
    position: list[int],
    running: dict[int, list],
    free_at: list[float],
    done: dict[Task, float],
    now: float,
    transfer: float,
    duration: Callable[[Task], float],
    overlap: float,
) -> float | None:
    """Starts every idle mesh's next unit that is ready at ``now``.

    Returns the earliest later time at which a waiting unit becomes ready (a
    transfer still in flight), or None.
    """
    later = None
    for mesh, mesh_groups in enumerate(plan.groups):
        if mesh in running or position[mesh] >= len(mesh_groups):
            continue
        group = mesh_groups[position[mesh]]
        ready = plan.ready_at(mesh, group, done, free_at[mesh], transfer)
        if ready is None:
            continue
        if ready <= now:
            lengths = [duration(task) for task in group]
            running[mesh] = [now, group_work(lengths, overlap), lengths]
        elif later is None or ready < later:
            later = ready
    return later
