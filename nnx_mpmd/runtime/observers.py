"""Observers of the interpreter: profiling and memory measurement.

Each is an `nnx_mpmd.runtime.interpreter.Observer`: it wraps the prepared
steps with hooks instead of copying the loop. Both wait for what they measure
(so meshes no longer overlap while they watch).

* `Profiler` appends a `TaskRecord` ``(mesh, label, task, start_s, end_s)``
  per `Call` that this process runs.
* `MemoryRecorder` records the bytes of live arrays per mesh after every
  instruction, and the bytes each stage task produced.

Example:
  >>> import jax
  >>> import jax.numpy as jnp
  >>> from nnx_mpmd.compiler.ir import Call, ProgramKey
  >>> from nnx_mpmd.runtime import interpreter
  >>> from nnx_mpmd.runtime.executor import DeviceOperations, Shardings
  >>> meshes = [jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])]
  >>> call = Call(0, ProgramKey("F", stage=0), jax.jit(jnp.sin), (0,), 1, "F0.0")
  >>> prepared = interpreter.prepare([call], DeviceOperations(Shardings(meshes)))
  >>> records, memory = [], MemoryRecorder(meshes)
  >>> interpreter.run(prepared, [jnp.zeros(4), None], [Profiler(records), memory])
  >>> [record[:2] for record in records], memory.peak_bytes
  ([(0, 'F0.0')], [32])
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from nnx_mpmd.compiler.ir import Call, Free, Instruction, Transfer, TransferBatch
from nnx_mpmd.runtime.interpreter import Observer

__all__ = ["MemoryRecorder", "Profiler", "TaskRecord"]


class TaskRecord(tuple):
    """``(mesh, label, task, start_s, end_s)`` of one profiled instruction."""

    __slots__ = ()


class Profiler(Observer):
    """Appends a `TaskRecord` per `Call` to ``records``, times from the run's start.

    Each call is waited for, so its end time is when its results were ready.

    Args:
      records: the list to append to.
      clock: seconds as a float (``time.perf_counter``).

    Example:
      >>> Profiler([]).records
      []
    """

    def __init__(self, records: list[Any], clock: Callable[[], float] = time.perf_counter) -> None:
        self.records = records
        self.clock = clock
        self.t0 = 0.0
        self._started = 0.0

    def start(self, store: list[Any]) -> None:
        self.t0 = self.clock()

    def before(self, index: int, ins: Instruction, store: list[Any]) -> None:
        if isinstance(ins, Call):
            self._started = self.clock()

    def after(self, index: int, ins: Instruction, result: Any, store: list[Any]) -> None:
        if isinstance(ins, Call):
            jax.block_until_ready(result)
            self.records.append(
                TaskRecord(
                    (ins.mesh, ins.label, ins.task, self._started - self.t0, self.clock() - self.t0)
                )
            )


class MemoryRecorder(Observer):
    """Per-mesh bytes of the live arrays held in a step's slots, after every instruction.

    Bytes are per device: for each array on a mesh, the size of one shard
    (what ``addressable_shards[0].data.nbytes`` gives, computed from the
    sharding without touching the shards; residual pytrees counted leaf by
    leaf). An array held in several slots counts once.

    Args:
      submeshes: the jax Mesh of each mesh id.

    Attributes:
      timeline: ``(instruction index, label, bytes per mesh)`` per instruction;
        index -1 is the state before the first instruction.
      output_bytes: ``(mesh, label, task, bytes)`` of every stage task's results.

    Example:
      >>> import jax
      >>> mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
      >>> recorder = MemoryRecorder([mesh])
      >>> recorder.record(-1, "start", [jax.numpy.zeros((4,), "float32")])
      >>> recorder.peak_bytes
      [16]
    """

    def __init__(self, submeshes: Sequence[Any]) -> None:
        self.num_meshes = len(submeshes)
        self.mesh_of_device = {
            d.id: q for q, sub in enumerate(submeshes) for d in np.asarray(sub.devices).flat
        }
        self.timeline: list[tuple[int, str, list[int]]] = []
        self.output_bytes: list[tuple[int, str, Any, int]] = []
        self._cache: dict[tuple[Any, ...], tuple[int | None, int]] = {}

    def _leaf(self, leaf: jax.Array) -> tuple[int | None, int]:
        """``(mesh, bytes per device)`` of an array, cached per shape/dtype/sharding."""
        key = (leaf.shape, leaf.dtype, leaf.sharding)
        info = self._cache.get(key)
        if info is None:
            device = next(iter(leaf.sharding.device_set))
            shard = leaf.sharding.shard_shape(leaf.shape)
            nbytes = int(np.prod(shard, dtype=np.int64)) * leaf.dtype.itemsize
            info = self._cache[key] = (self.mesh_of_device.get(device.id), nbytes)
        return info

    def _bytes(self, values: Sequence[Any]) -> list[int]:
        totals = [0] * self.num_meshes
        seen: set[int] = set()
        for leaf in jax.tree.leaves(list(values)):
            if not isinstance(leaf, jax.Array) or id(leaf) in seen or leaf.is_deleted():
                continue
            seen.add(id(leaf))
            q, nbytes = self._leaf(leaf)
            if q is not None:
                totals[q] += nbytes
        return totals

    def record(self, index: int, label: str, store: Sequence[Any]) -> None:
        """Appends the live bytes of ``store`` after instruction ``index`` (-1: before any)."""
        self.timeline.append((index, label, self._bytes(store)))

    def record_outputs(self, ins: Call, result: Any) -> None:
        """Remembers the bytes a stage task produced (its sends and residuals)."""
        if ins.task is not None:
            self.output_bytes.append((ins.mesh, ins.label, ins.task, sum(self._bytes([result]))))

    # The Observer hooks: the state before the run, then after every instruction.

    def start(self, store: list[Any]) -> None:
        self.record(-1, "start", store)

    def after(self, index: int, ins: Instruction, result: Any, store: list[Any]) -> None:
        if isinstance(ins, Call | Transfer | TransferBatch):
            jax.block_until_ready(result)
        if isinstance(ins, Call):
            self.record_outputs(ins, result)
        self.record(index, "free" if isinstance(ins, Free) else ins.label, store)

    @property
    def peak_bytes(self) -> list[int]:
        """The largest live bytes seen on each mesh."""
        return [max((t[2][q] for t in self.timeline), default=0) for q in range(self.num_meshes)]

    def summary(self) -> dict[str, Any]:
        """``{"peak_bytes", "initial_bytes", "timeline", "task_output_bytes"}``."""
        initial = self.timeline[0][2] if self.timeline else [0] * self.num_meshes
        return {
            "peak_bytes": self.peak_bytes,
            "initial_bytes": list(initial),
            "timeline": [(i, label, list(b)) for i, label, b in self.timeline],
            "task_output_bytes": [(q, label, str(t), b) for q, label, t, b in self.output_bytes],
        }
