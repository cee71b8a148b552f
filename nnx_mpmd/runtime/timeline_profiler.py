"""The measured timeline of a step: when each task really ran on its mesh.

`TimelineProfiler` watches a run without slowing its dispatch: the host thread
dispatches every program as usual, and one waiter thread per mesh waits for
that mesh's results in program order. A task's end is when its results are
ready; its start is the latest of its dispatch, the end of the previous task
on its mesh, and the arrival of its inputs (a move's end, or a result's ready
time on the same mesh). So meshes overlap as they do without profiling, and
the records show the schedule as it ran.

The times are made consistent after the run, in dispatch order: a task
starts no earlier than the ends of what it reads, a move no earlier than its
source. One approximation: a result that a later program consumed by donation
before its waiter got to it cannot be waited for; its end is then the next
known end of a task on its mesh (an upper bound), and ``Profile.approximate``
counts such records.

`Profile` is the list of records a profiled step leaves in
``step.last_profile``, with the step's task lists and moves, so that it can be
compared with the simulator (`nnx_mpmd.schedules.profile`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from nnx_mpmd.compiler.ir import Call, Instruction, Transfer, TransferBatch
from nnx_mpmd.errors import MpmdError
from nnx_mpmd.runtime.interpreter import Observer
from nnx_mpmd.runtime.observers import TaskRecord
from nnx_mpmd.schedules.profile import ProfileComparison, compare_profile, measured_timeline
from nnx_mpmd.schedules.simulate import Timeline

__all__ = ["Profile", "TimelineProfiler"]


class Profile(list[Sequence[Any]]):
    """The `TaskRecord` list of a profiled step, and what comparing it needs.

    It is a list of ``(mesh, label, task, start_s, end_s)`` records, one per
    program call, sorted by start (seconds from the step's start).

    Attributes:
      tasks: the per-mesh task lists the step ran (None when unknown).
      transfers: ``(src_mesh, dst_mesh, label, start_s, end_s)`` of every
        cross-mesh move the profiler timed (empty for ``profile="isolated"``).
      mode: ``"timeline"`` (meshes overlap as without profiling) or
        ``"isolated"`` (each call waited for before the next is dispatched).
      approximate: records whose end is an upper bound (see the module).

    Example:
      >>> from nnx_mpmd.schedules import Task
      >>> records = [(0, "F0.0", Task(0, 0, "F"), 0.0, 1.0), (0, "B0.0", Task(0, 0, "B"), 1.0, 3.0)]
      >>> p = Profile(records, tasks=[["F0.0", "B0.0"]])
      >>> p.timeline().makespan, p.compare().predicted_over_measured
      (3.0, 1.0)
    """

    def __init__(
        self,
        records: Iterable[Sequence[Any]] = (),
        *,
        tasks: Any = None,
        transfers: Iterable[Sequence[Any]] = (),
        mode: str = "timeline",
        approximate: int = 0,
    ) -> None:
        super().__init__(records)
        self.tasks = tasks
        self.transfers: list[Sequence[Any]] = list(transfers)
        self.mode = mode
        self.approximate = approximate

    def timeline(self) -> Timeline:
        """The measured `Timeline` of the stage tasks (`measured_timeline`)."""
        return measured_timeline(self)

    def compare(self) -> ProfileComparison:
        """`ProfileComparison` of the measured timeline and the simulator's on the measured times.

        Raises:
          MpmdError: the profile does not know the step's task lists.
        """
        if self.tasks is None:
            raise MpmdError(
                "this profile does not know the task lists of its step; call "
                "nnx_mpmd.schedules.compare_profile(records, tasks) with the schedule's tasks"
            )
        return compare_profile(self, self.tasks, self.transfers)

    def plot(self, path: Any = None) -> Any:
        """Draws the measured timeline above the simulated one (saved to ``path`` if given)."""
        return self.compare().plot(path)


class TimelineProfiler(Observer):
    """Records when each `Call` ran on its mesh, without waiting in the host thread.

    Args:
      records: receives a `TaskRecord` per `Call`, sorted by start, when the run ends.
      transfers: receives ``(src_mesh, dst_mesh, label, start_s, end_s)`` per move.
      clock: seconds as a float (``time.perf_counter``).

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from nnx_mpmd.compiler.ir import Call, ProgramKey
      >>> from nnx_mpmd.runtime import interpreter
      >>> from nnx_mpmd.runtime.executor import DeviceOperations, Shardings
      >>> meshes = [jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])]
      >>> call = Call(0, ProgramKey("F", stage=0), jax.jit(jnp.sin), (0,), 1, "F0.0")
      >>> prepared = interpreter.prepare([call], DeviceOperations(Shardings(meshes)))
      >>> records = []
      >>> interpreter.run(prepared, [jnp.zeros(4), None], [TimelineProfiler(records)])
      >>> [record[:2] for record in records]
      [(0, 'F0.0')]
    """

    def __init__(
        self,
        records: list[Any],
        transfers: list[Any] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.records = records
        self.transfers = [] if transfers is None else transfers
        self.clock = clock
        self.approximate = 0
        self._t0 = 0.0
        self._dispatched = 0.0
        self._queues: dict[int, queue.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []
        # (sequence number, instruction, dispatch time, ready time or None) per watched item
        self._seen: list[tuple[int, Any, float, float | None]] = []
        self._count = 0

    def start(self, store: list[Any]) -> None:
        self._t0 = self.clock()

    def before(self, index: int, ins: Instruction, store: list[Any]) -> None:
        self._dispatched = self.clock() - self._t0

    def after(self, index: int, ins: Instruction, result: Any, store: list[Any]) -> None:
        if isinstance(ins, Call):
            self._watch(ins.mesh, ins, result)
        elif isinstance(ins, Transfer):
            self._watch(ins.dst_mesh, ins, store[ins.dst])
        elif isinstance(ins, TransferBatch):
            for move in ins.transfers:
                self._watch(move.dst_mesh, move, store[move.dst])

    def finish(self, store: list[Any]) -> None:
        for pending in self._queues.values():
            pending.put(None)
        for thread in self._threads:
            thread.join()
        self._queues.clear()
        self._threads.clear()
        self._build(sorted(self._seen, key=lambda seen: seen[0]))

    def _watch(self, mesh: int, ins: Call | Transfer, value: Any) -> None:
        pending = self._queues.get(mesh)
        if pending is None:
            pending = self._queues[mesh] = queue.SimpleQueue()
            thread = threading.Thread(
                target=self._wait_in_order, args=(pending,), name=f"nnx-mpmd-profile-{mesh}"
            )
            thread.daemon = True
            thread.start()
            self._threads.append(thread)
        pending.put((self._count, ins, self._dispatched, value))
        self._count += 1

    def _wait_in_order(self, pending: queue.SimpleQueue) -> None:
        while (item := pending.get()) is not None:
            number, ins, dispatched, value = item
            ready = None if _wait_for(value) is None else self.clock() - self._t0
            self._seen.append((number, ins, dispatched, ready))  # list.append is atomic

    def _build(self, seen: list[tuple[int, Any, float, float | None]]) -> None:
        """Turns the observations, in dispatch order, into consistent records.

        A call starts after its dispatch, the previous call on its mesh and its
        inputs; a move after its dispatch and its source. Every end is at least
        its start; an unknown end (results donated away) is the next known end
        of a call on the same mesh.
        """
        ready: dict[int, float] = {}  # slot -> when its value was ready
        last_end: dict[int, float] = {}
        next_known = _next_known_ends(seen)
        for number, ins, dispatched, observed in seen:
            if isinstance(ins, Transfer):
                start = max(dispatched, ready.get(ins.src, 0.0))
                end = max(start, observed if observed is not None else start)
                ready[ins.dst] = end
                self.transfers.append((ins.src_mesh, ins.dst_mesh, ins.label, start, end))
                continue
            inputs = [ready.get(slot, 0.0) for slot in ins.reads()]
            start = max([dispatched, last_end.get(ins.mesh, 0.0), *inputs])
            if observed is None:
                self.approximate += 1
                observed = next_known.get(number, start)
            end = max(start, observed)
            last_end[ins.mesh] = end
            for slot in ins.writes():
                ready[slot] = end
            self.records.append(TaskRecord((ins.mesh, ins.label, ins.task, start, end)))
        self.records.sort(key=lambda record: (record[3], record[0]))


def _next_known_ends(seen: list[tuple[int, Any, float, float | None]]) -> dict[int, float]:
    """For each call whose end is unknown, the next known end of a call on its mesh."""
    found: dict[int, float] = {}
    waiting: dict[int, list[int]] = {}
    for number, ins, _, observed in seen:
        if isinstance(ins, Transfer):
            continue
        if observed is None:
            waiting.setdefault(ins.mesh, []).append(number)
            continue
        for late in waiting.pop(ins.mesh, []):
            found[late] = observed
    return found


def _wait_for(value: Any) -> bool | None:
    """Waits for the leaves of ``value`` still alive; None when every one was donated away."""
    leaves = [x for x in jax.tree.leaves(value) if isinstance(x, jax.Array)]
    alive = [x for x in leaves if not x.is_deleted()]
    if leaves and not alive:
        return None
    try:
        jax.block_until_ready(alive)
    except Exception:  # donated between the check and the wait
        return None
    return True
