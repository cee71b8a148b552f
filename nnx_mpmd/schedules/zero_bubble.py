"""Zero-bubble schedules: `ZeroBubbleH1`, `ZeroBubbleV` and `DualPipeV`.

They split every backward into ``BI`` (gradient to the stage input, on the
critical path) and ``BW`` (gradient to the weights, which can wait), and use
the ``BW`` passes to fill what would otherwise be bubbles.

This module is pure Python: it imports neither JAX nor Flax.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import ClassVar

from nnx_mpmd.errors import ScheduleError
from nnx_mpmd.schedules.generators import Schedule, one_f_one_b_lists
from nnx_mpmd.schedules.tasks import Task, TaskLists, stages_by_mesh, v_placement
from nnx_mpmd.schedules.validate import dependencies

__all__ = ["DualPipeV", "ZeroBubbleH1", "ZeroBubbleH2", "ZeroBubbleV"]


@dataclasses.dataclass(frozen=True)
class ZeroBubbleH1(Schedule):
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B with deferred ``BW``.

    Mesh ``r`` of ``p`` runs 1F1B with ``BI`` in place of ``B``, and runs each
    ``BW`` ``r`` backwards late, so the last meshes finish with a run of ``BW``
    passes that fills the drain bubble. At most ``p`` microbatches' activations
    are held on any mesh (the peak of 1F1B), and with ``F = BI = BW`` the
    makespan is ``3m + p - 1`` (bubble ``(p - 1)(F + BI - BW)`` per mesh).
    One stage per mesh; any microbatch count.

    Example:
      >>> " ".join(map(str, ZeroBubbleH1().tasks(2, 2, 2)[1]))
      'F1.0 BI1.0 F1.1 BI1.1 BW1.0 BW1.1'
    """

    name: ClassVar[str] = "zb-h1"
    split_backward: ClassVar[bool] = True

    def check(self, num_stages: int, num_meshes: int, num_microbatches: int) -> None:
        super().check(num_stages, num_meshes, num_microbatches)
        _one_split_stage_per_mesh(self.name, num_stages, num_meshes)

    def _generate(self, num_stages: int, num_meshes: int, num_microbatches: int) -> TaskLists:
        return _deferred_weight_lists(num_meshes, num_microbatches, lambda r: num_meshes - r - 1)


def _one_split_stage_per_mesh(name: str, num_stages: int, num_meshes: int) -> None:
    if num_stages != num_meshes:
        raise ScheduleError(
            f"{name} runs one stage per mesh, got {num_stages} stages on {num_meshes} "
            f"meshes; use {num_meshes} stages, or 'zb-v' for two stages per mesh"
        )


def _deferred_weight_lists(
    num_meshes: int, num_microbatches: int, warmup: Callable[[int], int]
) -> TaskLists:
    """1F1B order with ``BI`` for ``B`` and ``warmup(r)`` warm-up forwards; ``BW`` deferred."""
    return tuple(
        _with_deferred_weights(row, r, num_microbatches)
        for r, row in enumerate(one_f_one_b_lists(num_meshes, num_microbatches, warmup, "BI"))
    )


def _with_deferred_weights(
    order: tuple[Task, ...], mesh: int, num_microbatches: int
) -> tuple[Task, ...]:
    """Puts each ``BW`` ``mesh`` backwards after its ``BI``, the rest at the end."""
    with_weights: list[Task] = []
    for task in order:
        with_weights.append(task)
        if task.kind == "BI" and task.microbatch >= mesh:
            with_weights.append(Task(mesh, task.microbatch - mesh, "BW"))
    late = max(0, num_microbatches - mesh)
    with_weights += [Task(mesh, mb, "BW") for mb in range(late, num_microbatches)]
    return tuple(with_weights)


@dataclasses.dataclass(frozen=True)
class ZeroBubbleH2(Schedule):
    """ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism"): ZB-H1 with eager warm-up.

    Mesh ``r`` of ``p`` runs ``2(p - r) - 1`` forwards before its first
    ``BI`` (ZB-H1 runs ``p - r``), then ``F``/``BI`` in turn, each ``BW``
    ``r`` backwards late and the rest at the end, as ZB-H1 does. The extra
    forwards fill the warm-up bubble and keep every transfer off the steady
    state: with ``F = BI = BW`` and ``m >= p`` the makespan is
    ``3m + p - 1 + 2(p - 1)t`` for a transfer delay ``t`` (ZB-H1 pays the
    delay on every microbatch). Within one step the first stage still waits
    ``p - 1`` for the last, so at ``t = 0`` the makespan equals ZB-H1's; the
    paper's zero bubble also overlaps consecutive steps, which a step here
    does not. Memory: mesh ``r`` holds up to ``min(m, 2p - r - 1)``
    microbatches' activations. One stage per mesh; any microbatch count.

    Example:
      >>> " ".join(map(str, ZeroBubbleH2().tasks(2, 2, 3)[0]))
      'F0.0 F0.1 F0.2 BI0.0 BW0.0 BI0.1 BW0.1 BI0.2 BW0.2'
    """

    name: ClassVar[str] = "zb-h2"
    split_backward: ClassVar[bool] = True

    def check(self, num_stages: int, num_meshes: int, num_microbatches: int) -> None:
        super().check(num_stages, num_meshes, num_microbatches)
        _one_split_stage_per_mesh(self.name, num_stages, num_meshes)

    def _generate(self, num_stages: int, num_meshes: int, num_microbatches: int) -> TaskLists:
        return _deferred_weight_lists(
            num_meshes, num_microbatches, lambda r: 2 * (num_meshes - r - 1)
        )


def _greedy_v_schedule(num_meshes: int, num_microbatches: int, limit: int) -> TaskLists:
    """List-schedules V-placed tasks with unit costs; see `ZeroBubbleV`."""
    num_stages = 2 * num_meshes
    meshes = stages_by_mesh(v_placement, num_stages, num_meshes)
    pending = [
        {
            Task(s, mb, k)
            for s in stages
            for mb in range(num_microbatches)
            for k in ("F", "BI", "BW")
        }
        for stages in meshes
    ]
    end: dict[Task, int] = {}
    held = [0] * num_meshes
    free_at = [0] * num_meshes
    lists: list[list[Task]] = [[] for _ in range(num_meshes)]

    def split(stage: int, microbatch: int) -> bool:
        return True

    # A lower-stage F leaves one activation slot free, so that an upper-stage F
    # (which brings a microbatch closer to the loss and to its backward) can
    # always run: without that reserve a small limit deadlocks.
    def priority(task: Task, mesh: int) -> tuple[int, ...]:
        # Backward-to-input first (critical path), then forwards while memory
        # allows (the later stage first, to reach the loss sooner), then the
        # weight gradients, which only fill gaps or free memory.
        upper = 0 if task.stage == meshes[mesh][1] else 1
        if task.kind == "BI":
            return (0, task.microbatch, upper)
        if task.kind == "F":
            return (1, upper, task.microbatch)
        return (2, task.microbatch, upper)

    while any(pending):
        now = min(free_at[m] for m in range(num_meshes) if pending[m])
        waiting = [m for m in range(num_meshes) if pending[m] and free_at[m] == now]
        for mesh in waiting:
            ready = [
                task
                for task in pending[mesh]
                if not (task.kind == "F" and held[mesh] >= limit - (task.stage < num_meshes))
                and all(end.get(d, now + 1) <= now for d in dependencies(task, num_stages, split))
            ]
            if ready:
                task = min(ready, key=lambda t: priority(t, mesh))
                pending[mesh].remove(task)
                lists[mesh].append(task)
                held[mesh] += {"F": 1, "BW": -1}.get(task.kind, 0)
                free_at[mesh] = end[task] = now + 1
                break
        else:
            later = [t for t in end.values() if t > now]
            if not later:
                raise ScheduleError(
                    f"zb-v: no task can run on meshes {waiting} at time {now} with at most "
                    f"{limit} activations per mesh ({num_meshes} meshes, {num_microbatches} "
                    "microbatches); raise max_activations"
                )
            for mesh in waiting:
                free_at[mesh] = min(later)
    return tuple(tuple(row) for row in lists)


@dataclasses.dataclass(frozen=True)
class ZeroBubbleV(Schedule):
    """ZB-V: V-shaped placement (mesh ``i`` holds stages ``i`` and ``2p-1-i``), split backward.

    The order comes from a list scheduler with equal unit costs for ``F``,
    ``BI`` and ``BW`` (the setting of the ZB-V construction): whenever a mesh is
    free it runs a ready ``BI`` (oldest microbatch first), else a ready ``F``
    (the later stage first) if it holds fewer than ``max_activations`` stage
    activations (a lower-stage F leaves one of them free for upper-stage Fs),
    else a ``BW``. The default limit, ``2p`` stage activations, is
    the memory of 1F1B's first mesh (``p`` microbatches of ``2p`` half-size stages).
    Needs ``num_stages == 2 * num_meshes``; any microbatch count.

    Args:
      max_activations: most stage activations a mesh may hold; None means ``2p``.

    Example:
      >>> " ".join(map(str, ZeroBubbleV().tasks(2, 1, 2)[0]))
      'F0.0 F1.0 BI1.0 BI0.0 BW1.0 BW0.0 F0.1 F1.1 BI1.1 BI0.1 BW1.1 BW0.1'
    """

    name: ClassVar[str] = "zb-v"
    split_backward: ClassVar[bool] = True
    placement: ClassVar[str] = "v"
    max_activations: int | None = None

    def check(self, num_stages: int, num_meshes: int, num_microbatches: int) -> None:
        super().check(num_stages, num_meshes, num_microbatches)
        limit = self.max_activations
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 2
        ):
            raise ScheduleError(
                f"{self.name}: max_activations must be an int >= 2 (one per stage of a mesh), "
                f"got {limit!r}"
            )

    def _generate(self, num_stages: int, num_meshes: int, num_microbatches: int) -> TaskLists:
        limit = 2 * num_meshes if self.max_activations is None else self.max_activations
        return _greedy_v_schedule(num_meshes, num_microbatches, limit)


class _DualPipeVRank:
    """Builds the task list of one rank of DualPipeV, step by step."""

    def __init__(self, rank: int, num_meshes: int) -> None:
        self.lower, self.upper = rank, 2 * num_meshes - 1 - rank
        self.next = {(stage, kind): 0 for stage in (self.lower, self.upper) for kind in "FB"}
        self.deferred: collections.deque[Task] = collections.deque()
        self.order: list[Task] = []
        self.overlapping = False

    def forward(self, stage: int, with_next: bool = False) -> None:
        self.order.append(Task(stage, self.next[stage, "F"], "F", with_next=with_next))
        self.next[stage, "F"] += 1

    def backward(self, stage: int, defer_weights: bool = False) -> None:
        mb = self.next[stage, "B"]
        self.next[stage, "B"] += 1
        # A full backward (weights not deferred) is BI then BW, one program.
        self.order.append(Task(stage, mb, "BI", with_next=self.overlapping and not defer_weights))
        if defer_weights:
            self.deferred.append(Task(stage, mb, "BW"))
        else:
            self.order.append(Task(stage, mb, "BW"))
        self.overlapping = False

    def forward_backward(self, forward: int, backward: int, overlap: bool) -> None:
        """The forward of one chunk and the full backward of the other, overlapped if asked."""
        self.forward(forward, with_next=overlap)
        self.overlapping = overlap
        self.backward(backward)

    def weights(self) -> None:
        self.order.append(self.deferred.popleft())


@dataclasses.dataclass(frozen=True)
class DualPipeV(Schedule):
    """DualPipeV (DeepSeek's DualPipe, V-shaped "cut-in-half" variant), split backward.

    Mesh ``r`` of ``p`` holds stages ``r`` (its lower chunk) and ``2p-1-r``
    (its upper chunk). With ``m`` microbatches it runs eight phases:
    ``2(p-r-1)`` lower forwards; ``r+1`` pairs (lower F, upper F); ``p-r-1``
    triples (upper backward, its weights, upper F); ``m-2p+r+1`` steady
    rounds (lower F, upper backward, upper F, lower backward); ``p-r-1``
    rounds (upper backward, upper F, lower backward); ``r+1`` pairs of
    backwards (upper, lower), deferring weights from the middle on; ``p-r-1``
    rounds (a deferred ``BW``, lower backward with deferred weights); and
    ``r+1`` deferred ``BW``.

    As DualPipe does, the forward of one chunk and the full backward of the
    other run *overlapped*, as one program, so that one's communication
    hides behind the other's compute: in the steady rounds (lower ``F`` +
    upper backward) and (upper ``F`` + lower backward), and in the rounds
    after them (upper ``F`` + lower backward). A full backward is ``BI`` then
    ``BW``, so a pair is three tasks, ``F0.5+BI7.2+BW7.2`` in the text form
    (`Task.with_next`); ``Costs.overlap`` is the time the simulator takes off
    each pair. Two kinds of pairs run apart instead. At the turn of the V (the
    last mesh, which holds stages ``p-1`` and ``p``) the first steady round's
    lower forward runs alone, as on DualPipe's middle ranks: the upper
    backward there waits for the first gradient to come back down the V (with
    a transfer delay, pairing it lengthens the step). And on meshes ``r > 0``
    the upper forwards after the last lower forward run alone: they carry the
    last microbatches to the loss, and a program's outputs are ready only when
    it ends, so a paired backward would delay the whole drain (DualPipe pairs
    them; here that lengthens the step unless ``Costs.overlap`` is large).
    With these rules, at ``overlap = 0`` the step is as long as with no pairs,
    and with ``F = BI = BW = c`` and ``0 <= overlap <= c`` its makespan is
    ``(6m + p - 1)c - (2m - 3p) overlap`` (tests/schedules/test_schedules_overlap.py).
    With ``overlap=False`` the same tasks run one after the other, forward
    first. The task lists are equal (``==``) either way; only
    `Task.with_next` differs. Needs ``num_stages == 2 * num_meshes`` and
    ``m >= 2p``.

    Args:
      overlap: mark the (forward, full backward) pairs as overlapped.

    Example:
      >>> from nnx_mpmd.schedules import format_tasks
      >>> print(format_tasks(DualPipeV().tasks(2, 1, 2)), end="")
      mesh 0: F0.0 F1.0 F0.1 BI1.0 BW1.0 F1.1+BI0.0+BW0.0 BI1.1 BW1.1 BI0.1 BW0.1
      >>> DualPipeV(overlap=False).tasks(2, 1, 2) == DualPipeV().tasks(2, 1, 2)
      True
    """

    name: ClassVar[str] = "dualpipev"
    split_backward: ClassVar[bool] = True
    placement: ClassVar[str] = "v"
    overlap: bool = True

    def check(self, num_stages: int, num_meshes: int, num_microbatches: int) -> None:
        super().check(num_stages, num_meshes, num_microbatches)
        if not isinstance(self.overlap, bool):
            raise ScheduleError(f"{self.name}: overlap must be a bool, got {self.overlap!r}")
        if num_microbatches < 2 * num_meshes:
            raise ScheduleError(
                f"{self.name} needs at least 2 * num_meshes = {2 * num_meshes} microbatches "
                f"on {num_meshes} meshes, got {num_microbatches}; use more microbatches"
            )

    def _generate(self, num_stages: int, num_meshes: int, num_microbatches: int) -> TaskLists:
        p, m = num_meshes, num_microbatches
        lists = []
        for r in range(p):
            rank = _DualPipeVRank(r, p)
            lo, up = rank.lower, rank.upper
            for _ in range(2 * (p - r - 1)):
                rank.forward(lo)
            for _ in range(r + 1):
                rank.forward(lo)
                rank.forward(up)
            for _ in range(p - r - 1):
                rank.backward(up)
                rank.forward(up)
            rounds = m - 2 * p + r + 1
            for i in range(rounds):
                # At the turn of the V (the last mesh) the first round's lower
                # forward runs alone, as on DualPipe's middle ranks: the upper
                # backward waits for the first gradient to come back down the V.
                turn = r == p - 1 and i == 0
                rank.forward_backward(lo, up, self.overlap and not turn)
                # Once the lower forwards are done, the upper forwards carry the
                # last microbatches to the loss: on meshes r > 0 they run alone.
                rank.forward_backward(up, lo, self.overlap and (r == 0 or i < rounds - 1))
            for _ in range(p - r - 1):
                rank.backward(up)
                rank.forward_backward(up, lo, self.overlap and r == 0)
            half = (r + 1) // 2
            for i in range(r + 1):
                rank.backward(up, defer_weights=i > half or (i == half and r % 2 == 1))
                rank.backward(lo, defer_weights=i >= half)
            for _ in range(p - r - 1):
                rank.weights()
                rank.backward(lo, defer_weights=True)
            for _ in range(r + 1):
                rank.weights()
            lists.append(tuple(rank.order))
        return tuple(lists)
