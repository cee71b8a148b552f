"""The task IR of pipeline schedules: `Task`, stage placements, and the text form.

A schedule is, for every mesh, an ordered list of tasks. A task is one pass of
one stage on one microbatch: ``F`` (forward), ``B`` (full backward), or the
zero-bubble split of the backward into ``BI`` (gradient with respect to the
stage input) and ``BW`` (gradient with respect to the stage weights).

The text form has one line per mesh and one token ``{kind}{stage}.{microbatch}``
per task, so a schedule can be written by hand::

    # 2 meshes, 2 stages, 2 microbatches: GPipe
    mesh 0: F0.0 F0.1 B0.0 B0.1
    mesh 1: F1.0 F1.1 B1.0 B1.1

Tasks joined by ``+`` (``F0.3+BI3.1+BW3.1``) run *overlapped*: as one program,
so that the device can overlap one task's communication with another's compute
(DualPipe's overlapped forward and backward chunks). In the IR each task of
such a group but the last has ``with_next=True``.

This module is pure Python: it imports neither JAX nor Flax.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Sequence

from nnx_mpmd.errors import ScheduleError

__all__ = [
    "BACKWARD_KINDS",
    "KINDS",
    "Task",
    "TaskLists",
    "format_tasks",
    "looped_placement",
    "normalize_tasks",
    "overlap_groups",
    "parse_tasks",
    "stages_by_mesh",
    "v_placement",
]

KINDS: tuple[str, ...] = ("F", "B", "BI", "BW")
BACKWARD_KINDS: frozenset[str] = frozenset({"B", "BI"})

_TOKEN = re.compile(r"^(F|B|BI|BW)(\d+)\.(\d+)$")
_MESH_PREFIX = re.compile(r"^\s*mesh\s+(\d+)\s*:(.*)$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True, order=True)
class Task:
    """One pass of one stage on one microbatch.

    Tasks are frozen, hashable and ordered by ``(stage, microbatch, kind)``.
    ``str(task)`` is the token of the text form.

    Args:
      stage: the pipeline stage, numbered in the direction the data flows.
      microbatch: the microbatch index.
      kind: ``"F"``, ``"B"``, ``"BI"`` or ``"BW"``.
      with_next: the task runs overlapped with the next task of its mesh, in
        one program (text form: the two tokens joined by ``+``). It is not part
        of the task's identity: equality, hashing and ordering ignore it.

    Example:
      >>> t = Task(0, 3, "F")
      >>> str(t), Task.parse("BW2.1")
      ('F0.3', Task(stage=2, microbatch=1, kind='BW'))
      >>> Task(0, 3, "F", with_next=True) == t
      True
    """

    stage: int
    microbatch: int
    kind: str
    with_next: bool = dataclasses.field(default=False, compare=False)

    def __repr__(self) -> str:
        text = f"Task(stage={self.stage}, microbatch={self.microbatch}, kind={self.kind!r}"
        return text + (", with_next=True)" if self.with_next else ")")

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(
                f"task kind {self.kind!r} (stage {self.stage}, microbatch {self.microbatch}) "
                f"is unknown; use one of {', '.join(KINDS)}"
            )
        if not isinstance(self.with_next, bool):
            raise ScheduleError(
                f"task {self.kind}{self.stage}.{self.microbatch}: with_next must be a bool, "
                f"got {self.with_next!r}"
            )
        for field in ("stage", "microbatch"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ScheduleError(
                    f"task {field} must be an int >= 0, got {value!r} in a {self.kind} task; "
                    "number stages and microbatches from 0"
                )

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"

    @classmethod
    def parse(cls, token: str) -> Task:
        """Parses one token of the text form, e.g. ``"BI3.0"``.

        Args:
          token: ``{kind}{stage}.{microbatch}``.

        Returns:
          The task.

        Example:
          >>> Task.parse("F1.2")
          Task(stage=1, microbatch=2, kind='F')
        """
        match = _TOKEN.match(token.strip())
        if match is None:
            raise ScheduleError(
                f"cannot read task token {token!r}; write {{kind}}{{stage}}.{{microbatch}} "
                f"with kind one of {', '.join(KINDS)}, e.g. 'F0.3' or 'BW2.1'"
            )
        kind, stage, microbatch = match.groups()
        return cls(int(stage), int(microbatch), kind)


TaskLists = tuple[tuple[Task, ...], ...]
"""Per-mesh ordered task lists; the index is the mesh id."""


def normalize_tasks(tasks: Iterable[Iterable[Task | str]]) -> TaskLists:
    """Per-mesh lists of tasks or tokens as ``tuple[tuple[Task, ...], ...]``.

    Example:
      >>> normalize_tasks([["F0.0", "B0.0"]])
      ((Task(stage=0, microbatch=0, kind='F'), Task(stage=0, microbatch=0, kind='B')),)
    """
    if isinstance(tasks, str):
        raise ScheduleError(
            "per-mesh task lists were given as one string; use parse_tasks(text) to read "
            "the text form"
        )
    result = []
    for mesh_tasks in tasks:
        if isinstance(mesh_tasks, str):
            raise ScheduleError(
                f"the task list of mesh {len(result)} is a string ({mesh_tasks[:40]!r}); "
                "give a list of tasks per mesh, or use parse_tasks(text)"
            )
        row = []
        for task in mesh_tasks:
            if isinstance(task, str):
                row.extend(_parse_group(task))
                continue
            if not isinstance(task, Task):
                raise ScheduleError(
                    f"mesh {len(result)} lists {task!r}, which is not a Task; use "
                    "Task(stage, microbatch, kind) or a token such as 'F0.3'"
                )
            row.append(task)
        result.append(tuple(row))
    return tuple(result)


def _parse_group(token: str) -> tuple[Task, ...]:
    """``F0.3+BI3.1`` -> the tasks, each but the last ``with_next``."""
    parts = token.split("+")
    if len(parts) > 1 and not all(parts):
        raise ScheduleError(
            f"cannot read the overlapped tasks {token!r}: join whole tokens with '+', "
            "e.g. 'F0.3+BI3.1+BW3.1'"
        )
    tasks = [Task.parse(part) for part in parts]
    return tuple(
        dataclasses.replace(task, with_next=True) if n < len(tasks) - 1 else task
        for n, task in enumerate(tasks)
    )


def overlap_groups(mesh_tasks: Sequence[Task]) -> tuple[tuple[Task, ...], ...]:
    """One mesh's tasks in groups that run as one program (a lone task is a group of one).

    A group is a run of tasks each of which but the last has ``with_next``.

    Args:
      mesh_tasks: one mesh's ordered tasks.

    Returns:
      The groups, in order.

    Example:
      >>> [len(g) for g in overlap_groups(parse_tasks("F0.0 F0.1+BI1.0+BW1.0 B0.0")[0])]
      [1, 3, 1]
    """
    groups: list[tuple[Task, ...]] = []
    current: list[Task] = []
    for task in mesh_tasks:
        current.append(task)
        if not task.with_next:
            groups.append(tuple(current))
            current = []
    if current:
        groups.append(tuple(current))
    return tuple(groups)


def parse_tasks(text: str) -> TaskLists:
    """Reads the text form: one line per mesh, tokens ``{kind}{stage}.{microbatch}``.

    Tokens joined by ``+`` (``F0.3+BI3.1+BW3.1``) are tasks that run
    overlapped, as one program (`Task.with_next`). ``#`` starts a comment; blank lines are skipped. A line may start with
    ``mesh N:``; if one line has such a prefix, all must, and they must number
    the meshes 0, 1, 2, ... in some order without gaps. A mesh with no tasks is
    written ``mesh N:`` with nothing after it.

    Args:
      text: the schedule as text.

    Returns:
      Per-mesh ordered task lists.

    Example:
      >>> parse_tasks('''
      ... # one mesh
      ... mesh 0: F0.0 B0.0   # a comment
      ... ''')
      ((Task(stage=0, microbatch=0, kind='F'), Task(stage=0, microbatch=0, kind='B')),)
    """
    numbered: dict[int, tuple[Task, ...]] = {}
    unnumbered: list[tuple[Task, ...]] = []
    for line_number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0]
        if not line.strip():
            continue
        prefix = _MESH_PREFIX.match(line)
        body = prefix.group(2) if prefix else line
        try:
            row = tuple(task for token in body.split() for task in _parse_group(token))
        except ScheduleError as e:
            raise ScheduleError(f"line {line_number}: {e}") from None
        if prefix is None:
            unnumbered.append(row)
            continue
        mesh = int(prefix.group(1))
        if mesh in numbered:
            raise ScheduleError(
                f"line {line_number}: mesh {mesh} is listed twice; give each mesh one line"
            )
        numbered[mesh] = row
    if numbered and unnumbered:
        raise ScheduleError(
            "some lines start with 'mesh N:' and some do not; prefix every line or none"
        )
    if not numbered:
        return tuple(unnumbered)
    expected = list(range(len(numbered)))
    if sorted(numbered) != expected:
        raise ScheduleError(
            f"mesh lines are numbered {sorted(numbered)}; number them {expected} "
            "(one line per mesh, from 0, no gaps)"
        )
    return tuple(numbered[mesh] for mesh in expected)


def format_tasks(tasks: Iterable[Iterable[Task | str]], *, prefix: bool = True) -> str:
    """Writes per-mesh task lists in the text form that `parse_tasks` reads.

    Args:
      tasks: per-mesh ordered task lists.
      prefix: start every line with ``mesh N:``.

    Returns:
      The text, one line per mesh, ending with a newline.

    Example:
      >>> print(format_tasks([[Task(0, 0, "F"), Task(0, 0, "B")]]), end="")
      mesh 0: F0.0 B0.0
      >>> print(format_tasks([[Task(0, 1, "F", with_next=True), Task(1, 0, "B")]]), end="")
      mesh 0: F0.1+B1.0
    """
    lines = []
    for mesh, mesh_tasks in enumerate(normalize_tasks(tasks)):
        body = "".join(f"{task}{'+' if task.with_next else ' '}" for task in mesh_tasks).rstrip()
        lines.append(f"mesh {mesh}: {body}".rstrip() if prefix else body)
    return "\n".join(lines) + "\n"


def _check_stage(stage: int, num_stages: int, num_meshes: int, placement: str) -> None:
    if num_meshes < 1:
        raise ScheduleError(f"{placement} placement needs num_meshes >= 1, got {num_meshes}")
    if not 0 <= stage < num_stages:
        raise ScheduleError(
            f"stage {stage} is outside 0..{num_stages - 1} ({num_stages} stages, "
            f"{placement} placement); use a stage number below num_stages"
        )


def looped_placement(stage: int, num_stages: int, num_meshes: int) -> int:
    """Looped placement: stage ``s`` runs on mesh ``s % num_meshes``.

    Args:
      stage: the stage.
      num_stages: the number of stages; a multiple of ``num_meshes``.
      num_meshes: the number of meshes.

    Returns:
      The mesh of ``stage``.

    Example:
      >>> [looped_placement(s, 8, 4) for s in range(8)]
      [0, 1, 2, 3, 0, 1, 2, 3]
    """
    _check_stage(stage, num_stages, num_meshes, "looped")
    if num_stages % num_meshes:
        raise ScheduleError(
            f"looped placement needs num_stages ({num_stages}) to be a multiple of "
            f"num_meshes ({num_meshes}); change the number of stages or meshes"
        )
    return stage % num_meshes


def v_placement(stage: int, num_stages: int, num_meshes: int) -> int:
    """V-shaped placement: mesh ``i`` holds stages ``i`` and ``2p-1-i`` (``p`` meshes).

    Data goes down the meshes and back up; the first and last stage share mesh 0.

    Args:
      stage: the stage.
      num_stages: the number of stages; must be ``2 * num_meshes``.
      num_meshes: the number of meshes ``p``.

    Returns:
      The mesh of ``stage``.

    Example:
      >>> [v_placement(s, 8, 4) for s in range(8)]
      [0, 1, 2, 3, 3, 2, 1, 0]
    """
    _check_stage(stage, num_stages, num_meshes, "V-shaped")
    if num_stages != 2 * num_meshes:
        raise ScheduleError(
            f"V-shaped placement needs num_stages == 2 * num_meshes, got {num_stages} stages "
            f"on {num_meshes} meshes; use {2 * num_meshes} stages"
        )
    return stage if stage < num_meshes else num_stages - 1 - stage


def stages_by_mesh(
    mesh_of: Callable[[int, int, int], int], num_stages: int, num_meshes: int
) -> tuple[tuple[int, ...], ...]:
    """The stages each mesh holds, ascending, under ``mesh_of(stage, num_stages, num_meshes)``.

    Example:
      >>> stages_by_mesh(v_placement, 4, 2)
      ((0, 3), (1, 2))
    """
    result: list[list[int]] = [[] for _ in range(num_meshes)]
    for stage in range(num_stages):
        result[mesh_of(stage, num_stages, num_meshes)].append(stage)
    return tuple(tuple(stages) for stages in result)


def count_tasks(tasks: Sequence[Sequence[Task]]) -> int:
    """The total number of tasks over all meshes.

    Example:
      >>> count_tasks(parse_tasks("F0.0 B0.0\\nF1.0 B1.0"))
      4
    """
    return sum(len(mesh_tasks) for mesh_tasks in tasks)
