"""Schedule generators: the `Schedule` base, the classic schedules, and `Custom`.

Every generator is a frozen dataclass whose fields are its parameters. Its
`Schedule.tasks` returns, for every mesh, the ordered task list; the lists are
validated before they are returned. Zero-bubble generators live in
`nnx_mpmd.schedules.zero_bubble`.

This module is pure Python: it imports neither JAX nor Flax.
"""

from __future__ import annotations

import abc
import dataclasses
import heapq
from collections.abc import Callable, Iterable
from typing import ClassVar

from nnx_mpmd.errors import ScheduleError
from nnx_mpmd.schedules.tasks import (
    Task,
    TaskLists,
    looped_placement,
    normalize_tasks,
    parse_tasks,
    stages_by_mesh,
    v_placement,
)
from nnx_mpmd.schedules.validate import validate

__all__ = ["Custom", "GPipe", "Interleaved1F1B", "LoopedBFS", "OneFOneB", "Schedule"]

_PLACEMENTS = {"looped": looped_placement, "v": v_placement}


def _check_positive(name: str, value: int, schedule: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScheduleError(f"{schedule}: {name} must be an int >= 1, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Schedule(abc.ABC):
    """Base class of every schedule: placement, checks, and validated task lists.

    Subclasses set the class attributes and implement ``_generate``; they
    override `Schedule.check` to state their constraints.

    Attributes:
      name: the registry name, e.g. ``"1f1b"``.
      split_backward: True when the tasks use ``BI``/``BW`` instead of ``B``.
      placement: ``"looped"`` (stage ``s`` on mesh ``s % p``) or ``"v"``.

    Example:
      >>> sched = OneFOneB()
      >>> sched.name, sched.split_backward, sched.mesh_of(5, 8, 4)
      ('1f1b', False, 1)
    """

    name: ClassVar[str] = "schedule"
    split_backward: ClassVar[bool] = False
    placement: ClassVar[str] = "looped"

    def mesh_of(self, stage: int, num_stages: int, num_meshes: int) -> int:
        """The mesh that runs ``stage``.

        Args:
          stage: the stage.
          num_stages: the number of stages.
          num_meshes: the number of meshes.

        Returns:
          The mesh id.

        Example:
          >>> OneFOneB().mesh_of(2, 4, 4), LoopedBFS().mesh_of(7, 8, 4)
          (2, 3)
        """
        return _PLACEMENTS[self.placement](stage, num_stages, num_meshes)

    def default_num_stages(self, num_meshes: int) -> int:
        """The number of stages this schedule uses when none is given.

        Args:
          num_meshes: the number of meshes.

        Returns:
          ``num_meshes`` for one stage per mesh, ``2 * num_meshes`` for V shapes.

        Example:
          >>> GPipe().default_num_stages(4), Interleaved1F1B().default_num_stages(4)
          (4, 8)
        """
        return 2 * num_meshes if self.placement == "v" else num_meshes

    def check(self, num_stages: int, num_meshes: int, num_microbatches: int) -> None:
        """Raises `ScheduleError` if the schedule cannot run this combination.

        Args:
          num_stages: the number of stages.
          num_meshes: the number of meshes.
          num_microbatches: the number of microbatches.

        Example:
          >>> OneFOneB().check(4, 4, 8)
          >>> OneFOneB().check(8, 4, 8)  # doctest: +ELLIPSIS
          Traceback (most recent call last):
          ...
          nnx_mpmd.errors.ScheduleError: 1f1b runs one stage per mesh...
        """
        _check_positive("num_stages", num_stages, self.name)
        _check_positive("num_meshes", num_meshes, self.name)
        _check_positive("num_microbatches", num_microbatches, self.name)
        if self.placement == "v" and num_stages != 2 * num_meshes:
            raise ScheduleError(
                f"{self.name} uses V-shaped placement and needs num_stages == 2 * num_meshes, "
                f"got {num_stages} stages on {num_meshes} meshes; use {2 * num_meshes} stages"
            )
        if self.placement == "looped" and num_stages % num_meshes:
            raise ScheduleError(
                f"{self.name} needs num_stages ({num_stages}) to be a multiple of num_meshes "
                f"({num_meshes}); use {num_meshes * max(1, num_stages // num_meshes)} stages"
            )

    def tasks(self, num_stages: int, num_meshes: int, num_microbatches: int) -> TaskLists:
        """Per-mesh ordered task lists; index = mesh id. They pass `validate`.

        Args:
          num_stages: the number of stages.
          num_meshes: the number of meshes.
          num_microbatches: the number of microbatches.

        Returns:
          ``tuple[tuple[Task, ...], ...]``, one tuple per mesh.

        Example:
          >>> [" ".join(map(str, row)) for row in GPipe().tasks(2, 2, 2)]
          ['F0.0 F0.1 B0.0 B0.1', 'F1.0 F1.1 B1.0 B1.1']
        """
        self.check(num_stages, num_meshes, num_microbatches)
        lists = normalize_tasks(self._generate(num_stages, num_meshes, num_microbatches))
        validate(
            lists,
            mesh_of=lambda stage: self.mesh_of(stage, num_stages, num_meshes),
            num_stages=num_stages,
        )
        return lists

    @abc.abstractmethod
    def _generate(self, num_stages: int, num_meshes: int, num_microbatches: int) -> TaskLists:
        """The per-mesh task lists; `tasks` checks and validates them."""


def _one_stage_per_mesh(name: str, num_stages: int, num_meshes: int) -> None:
    if num_stages != num_meshes:
        raise ScheduleError(
            f"{name} runs one stage per mesh, got {num_stages} stages on {num_meshes} meshes; "
            f"use {num_meshes} stages, or 'interleaved'/'looped-bfs' for several stages per mesh"
        )


def one_f_one_b_order(forwards: list[Task], backwards: list[Task], warmup: int) -> tuple[Task, ...]:
    """One mesh's tasks: ``warmup`` forwards, then forward and backward in turn, then the rest.

    Example:
      >>> fs = [Task(0, mb, "F") for mb in range(3)]
      >>> bs = [Task(0, mb, "B") for mb in range(3)]
      >>> " ".join(map(str, one_f_one_b_order(fs, bs, 1)))
      'F0.0 F0.1 B0.0 F0.2 B0.1 B0.2'
    """
    warmup = min(warmup, len(forwards))
    order = forwards[:warmup]
    for k in range(len(forwards) - warmup):
        order += [forwards[warmup + k], backwards[k]]
    order += backwards[len(forwards) - warmup :]
    return tuple(order)


def one_f_one_b_lists(
    num_meshes: int, num_microbatches: int, warmup: Callable[[int], int], backward: str = "B"
) -> TaskLists:
    """One stage per mesh, each mesh in 1F1B order with ``warmup(r)`` warm-up forwards.

    ``backward`` is ``"B"`` or ``"BI"`` (a split backward).

    Example:
      >>> [" ".join(map(str, row)) for row in one_f_one_b_lists(2, 2, lambda r: 1 - r)]
      ['F0.0 F0.1 B0.0 B0.1', 'F1.0 B1.0 F1.1 B1.1']
    """
    mbs = range(num_microbatches)
    return tuple(
        one_f_one_b_order(
            [Task(r, mb, "F") for mb in mbs], [Task(r, mb, backward) for mb in mbs], warmup(r)
        )
        for r in range(num_meshes)
    )


@dataclasses.dataclass(frozen=True)
class GPipe(Schedule):
    """GPipe: every mesh runs all forwards, then all backwards. Any microbatch count.

    One stage per mesh. Peak activations: every microbatch, on every mesh.

    Example:
      >>> [" ".join(map(str, row)) for row in GPipe().tasks(2, 2, 3)][0]
      'F0.0 F0.1 F0.2 B0.0 B0.1 B0.2'
    """

    name: ClassVar[str] = "gpipe"

    def check(self, num_stages: int, num_meshes: int, num_microbatches: int) -> None:
        super().check(num_stages, num_meshes, num_microbatches)
        _one_stage_per_mesh(self.name, num_stages, num_meshes)

    def _generate(self, num_stages: int, num_meshes: int, num_microbatches: int) -> TaskLists:
        mbs = range(num_microbatches)
        return tuple(
            tuple(Task(r, mb, "F") for mb in mbs) + tuple(Task(r, mb, "B") for mb in mbs)
            for r in range(num_meshes)
        )


@dataclasses.dataclass(frozen=True)
class OneFOneB(Schedule):
    """1F1B (Megatron's non-interleaved schedule). Any microbatch count.

    Mesh ``r`` of ``p`` runs ``p - r - 1`` warm-up forwards, then alternates one
    forward and one backward, then drains the backwards. It holds at most
    ``p - r`` microbatches' activations.

    Example:
      >>> [" ".join(map(str, row)) for row in OneFOneB().tasks(2, 2, 3)][0]
      'F0.0 F0.1 B0.0 F0.2 B0.1 B0.2'
    """

    name: ClassVar[str] = "1f1b"

    def check(self, num_stages: int, num_meshes: int, num_microbatches: int) -> None:
        super().check(num_stages, num_meshes, num_microbatches)
        _one_stage_per_mesh(self.name, num_stages, num_meshes)

    def _generate(self, num_stages: int, num_meshes: int, num_microbatches: int) -> TaskLists:
        return one_f_one_b_lists(num_meshes, num_microbatches, lambda r: num_meshes - r - 1)


@dataclasses.dataclass(frozen=True)
class Eager1F1B(Schedule):
    """Eager 1F1B (JaxPP's ``Eager1F1B``): 1F1B with twice the warm-up forwards.

    Mesh ``r`` of ``p`` runs ``2(p - r) - 1`` forwards before its first
    backward (1F1B runs ``p - r``), then alternates. The extra forwards are
    ready before the mesh needs them, so in the steady state a mesh never
    waits for an activation or a gradient in flight: with a transfer delay
    ``t`` the makespan is ``(m + p - 1)(F + B) + 2(p - 1)t`` (only the fill
    and the drain pay the transfers), against more for 1F1B. The price is
    memory: mesh ``r`` holds up to ``min(m, 2(p - r) - 1)`` microbatches'
    activations. One stage per mesh; any microbatch count.

    Example:
      >>> " ".join(map(str, Eager1F1B().tasks(2, 2, 4)[0]))
      'F0.0 F0.1 F0.2 B0.0 F0.3 B0.1 B0.2 B0.3'
    """

    name: ClassVar[str] = "eager-1f1b"

    def check(self, num_stages: int, num_meshes: int, num_microbatches: int) -> None:
        super().check(num_stages, num_meshes, num_microbatches)
        _one_stage_per_mesh(self.name, num_stages, num_meshes)

    def _generate(self, num_stages: int, num_meshes: int, num_microbatches: int) -> TaskLists:
        return one_f_one_b_lists(num_meshes, num_microbatches, lambda r: 2 * (num_meshes - r - 1))


@dataclasses.dataclass(frozen=True)
class Interleaved1F1B(Schedule):
    """Megatron's interleaved 1F1B: ``v`` stages per mesh, looped placement.

    Mesh ``r`` holds stages ``r, r + p, ..., r + (v-1)p``. Microbatches go in
    groups of ``p``: a group runs through the mesh's first stage, then its
    second, and so on (backwards through the stages in reverse). Mesh ``r``
    warms up with ``2(p - r - 1) + (v - 1)p`` forwards (``p - r - 1`` when
    ``v == 1``), then alternates. Constraint: the number of microbatches must
    be a multiple of ``p`` (the grouping needs whole groups).

    Args:
      virtual_stages: stages per mesh ``v``; None takes ``num_stages / num_meshes``.

    Example:
      >>> Interleaved1F1B().tasks(4, 2, 2)[0][:4]  # doctest: +NORMALIZE_WHITESPACE
      (Task(stage=0, microbatch=0, kind='F'), Task(stage=0, microbatch=1, kind='F'),
       Task(stage=2, microbatch=0, kind='F'), Task(stage=2, microbatch=1, kind='F'))
    """

    name: ClassVar[str] = "interleaved"
    virtual_stages: int | None = None

    def default_num_stages(self, num_meshes: int) -> int:
        return num_meshes * (2 if self.virtual_stages is None else self.virtual_stages)

    def check(self, num_stages: int, num_meshes: int, num_microbatches: int) -> None:
        super().check(num_stages, num_meshes, num_microbatches)
        v = self.virtual_stages
        if v is not None and num_stages != v * num_meshes:
            raise ScheduleError(
                f"{self.name} with virtual_stages={v} needs {v * num_meshes} stages on "
                f"{num_meshes} meshes, got {num_stages}; change virtual_stages or num_stages"
            )
        if num_microbatches % num_meshes:
            raise ScheduleError(
                f"{self.name} (Megatron interleaving) needs the number of microbatches "
                f"({num_microbatches}) to be a multiple of the number of meshes ({num_meshes}); "
                f"use {num_meshes * -(-num_microbatches // num_meshes)} microbatches"
            )

    def _generate(self, num_stages: int, num_meshes: int, num_microbatches: int) -> TaskLists:
        p, v = num_meshes, num_stages // num_meshes
        total = num_microbatches * v

        def nth(k: int, r: int, kind: str) -> Task:
            group, within = divmod(k, p * v)
            chunk = within // p if kind == "F" else v - 1 - within // p
            return Task(chunk * p + r, group * p + within % p, kind)

        lists = []
        for r in range(p):
            warmup = p - r - 1 if v == 1 else 2 * (p - r - 1) + (v - 1) * p
            forwards = [nth(k, r, "F") for k in range(total)]
            backwards = [nth(k, r, "B") for k in range(total)]
            lists.append(one_f_one_b_order(forwards, backwards, warmup))
        return tuple(lists)


@dataclasses.dataclass(frozen=True)
class LoopedBFS(Schedule):
    """Breadth-first looping (Shardy's CIRCULAR): ``v`` stages per mesh, looped placement.

    Every mesh runs all microbatches through its first stage, then through its
    next one, and so on; then all backwards, its last stage first. Any
    microbatch count; ``v == 1`` is GPipe.

    Args:
      virtual_stages: stages per mesh ``v``; None takes ``num_stages / num_meshes``.

    Example:
      >>> " ".join(map(str, LoopedBFS().tasks(4, 2, 2)[1]))
      'F1.0 F1.1 F3.0 F3.1 B3.0 B3.1 B1.0 B1.1'
    """

    name: ClassVar[str] = "looped-bfs"
    virtual_stages: int | None = None

    def default_num_stages(self, num_meshes: int) -> int:
        return num_meshes * (2 if self.virtual_stages is None else self.virtual_stages)

    def check(self, num_stages: int, num_meshes: int, num_microbatches: int) -> None:
        super().check(num_stages, num_meshes, num_microbatches)
        v = self.virtual_stages
        if v is not None and num_stages != v * num_meshes:
            raise ScheduleError(
                f"{self.name} with virtual_stages={v} needs {v * num_meshes} stages on "
                f"{num_meshes} meshes, got {num_stages}; change virtual_stages or num_stages"
            )

    def _generate(self, num_stages: int, num_meshes: int, num_microbatches: int) -> TaskLists:
        mbs = range(num_microbatches)
        lists = []
        for stages in stages_by_mesh(looped_placement, num_stages, num_meshes):
            forwards = [Task(s, mb, "F") for s in stages for mb in mbs]
            backwards = [Task(s, mb, "B") for s in reversed(stages) for mb in mbs]
            lists.append(tuple(forwards + backwards))
        return tuple(lists)


def _single_microbatch_key(task: Task) -> tuple[int, int, int, int]:
    # The order one microbatch would run in alone: forwards up, backwards down.
    if task.kind == "F":
        return (task.microbatch, 0, task.stage, 0)
    return (task.microbatch, 1, -task.stage, 1 if task.kind == "BW" else 0)


def order_by_rule(tasks: Iterable[Task], before: Callable[[Task, Task], bool]) -> tuple[Task, ...]:
    """Orders one mesh's tasks by a happens-before rule, with a stable topological sort.

    ``before(a, b)`` True means ``a`` must run before ``b``. A task's ``F``
    always precedes its backward, and ``BI`` its ``BW``. Among the tasks free to
    go next, the one that comes first in the single-microbatch order (by
    microbatch, then forwards up the stages, then backwards down) goes first.

    Args:
      tasks: one mesh's tasks, in any order.
      before: the happens-before rule on two tasks of this mesh.

    Returns:
      The ordered tasks.

    Example:
      >>> fs_first = lambda a, b: a.kind == "F" and b.kind != "F"
      >>> ts = [Task(0, mb, k) for mb in range(2) for k in ("F", "B")]
      >>> " ".join(map(str, order_by_rule(ts, fs_first)))
      'F0.0 F0.1 B0.0 B0.1'
    """
    base = sorted(set(tasks), key=_single_microbatch_key)
    successors: list[list[int]] = [[] for _ in base]
    indegree = [0] * len(base)
    for i, a in enumerate(base):
        for j, b in enumerate(base):
            intrinsic = (a.stage, a.microbatch) == (b.stage, b.microbatch) and (
                (a.kind == "F" and b.kind != "F") or (a.kind == "BI" and b.kind == "BW")
            )
            if i != j and (intrinsic or before(a, b)):
                successors[i].append(j)
                indegree[j] += 1
    ready = [i for i, degree in enumerate(indegree) if degree == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in successors[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                heapq.heappush(ready, j)
    if len(order) < len(base):
        stuck = " ".join(str(base[i]) for i in range(len(base)) if indegree[i] > 0)
        raise ScheduleError(
            f"the happens-before rule has a cycle among these tasks: {stuck}; make the rule "
            "a strict order (never both before(a, b) and before(b, a)), and never put a "
            "backward before its own forward"
        )
    return tuple(base[i] for i in order)


@dataclasses.dataclass(frozen=True)
class Custom(Schedule):
    """A schedule you write: explicit per-mesh lists, their text form, or a rule.

    Give exactly one of ``lists``, ``text`` (see `parse_tasks`) or ``before``.
    With lists or text the schedule is fixed: `tasks` checks that the sizes
    match and returns it. With ``before(a, b) -> bool`` (``a`` must run before
    ``b``, both on one mesh), every mesh's tasks are ordered by `order_by_rule`.

    Args:
      lists: per-mesh ordered tasks (or tokens).
      text: the text form of the lists.
      before: a happens-before rule.
      placement: ``"looped"`` or ``"v"``, the placement a rule schedule uses.
      split_backward: with a rule, generate ``BI``/``BW`` instead of ``B``.

    Example:
      >>> sched = Custom(text="F0.0 F0.1 B0.0 B0.1\\nF1.0 B1.0 F1.1 B1.1")
      >>> sched.tasks(2, 2, 2)[1][1]
      Task(stage=1, microbatch=0, kind='B')
      >>> gpipe = Custom(before=lambda a, b: a.kind == "F" and b.kind != "F")
      >>> gpipe.tasks(2, 2, 2) == GPipe().tasks(2, 2, 2)
      True
    """

    name: ClassVar[str] = "custom"
    lists: TaskLists | None = None
    text: str | None = None
    before: Callable[[Task, Task], bool] | None = None
    placement: str = "looped"  # type: ignore[misc]
    split_backward: bool = False  # type: ignore[misc]

    def __post_init__(self) -> None:
        given = [name for name in ("lists", "text", "before") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ScheduleError(
                f"Custom needs exactly one of lists=, text= or before=, got "
                f"{', '.join(given) or 'none'}; pass one of them"
            )
        if self.placement not in _PLACEMENTS:
            raise ScheduleError(
                f"Custom placement {self.placement!r} is unknown; use 'looped' or 'v'"
            )
        if self.text is not None:
            object.__setattr__(self, "lists", parse_tasks(self.text))
            object.__setattr__(self, "text", None)
        if self.lists is not None:
            lists = normalize_tasks(self.lists)
            object.__setattr__(self, "lists", lists)
            split = any(t.kind in ("BI", "BW") for row in lists for t in row)
            object.__setattr__(self, "split_backward", split)

    def mesh_of(self, stage: int, num_stages: int, num_meshes: int) -> int:
        if self.lists is None:
            return super().mesh_of(stage, num_stages, num_meshes)
        for mesh, row in enumerate(self.lists):
            if any(task.stage == stage for task in row):
                return mesh
        raise ScheduleError(
            f"stage {stage} has no tasks in this Custom schedule ({len(self.lists)} meshes); "
            "add its tasks or use a stage that has some"
        )

    def default_num_stages(self, num_meshes: int) -> int:
        if self.lists is None:
            return super().default_num_stages(num_meshes)
        return 1 + max((t.stage for row in self.lists for t in row), default=-1)

    def check(self, num_stages: int, num_meshes: int, num_microbatches: int) -> None:
        if self.lists is None:
            super().check(num_stages, num_meshes, num_microbatches)
            return
        found = (
            len(self.lists),
            1 + max((t.stage for row in self.lists for t in row), default=-1),
            1 + max((t.microbatch for row in self.lists for t in row), default=-1),
        )
        if found != (num_meshes, num_stages, num_microbatches):
            raise ScheduleError(
                f"this Custom schedule has {found[0]} meshes, {found[1]} stages and {found[2]} "
                f"microbatches, but {num_meshes} meshes, {num_stages} stages and "
                f"{num_microbatches} microbatches were asked for; write lists of that size"
            )

    def _generate(self, num_stages: int, num_meshes: int, num_microbatches: int) -> TaskLists:
        if self.lists is not None:
            return self.lists
        assert self.before is not None
        backward = ("BI", "BW") if self.split_backward else ("B",)
        lists = []
        for stages in stages_by_mesh(_PLACEMENTS[self.placement], num_stages, num_meshes):
            mine = [
                Task(s, mb, kind)
                for s in stages
                for mb in range(num_microbatches)
                for kind in ("F", *backward)
            ]
            lists.append(order_by_rule(mine, self.before))
        return tuple(lists)
