"""The single-controller runtime: one process drives every submesh.

Instructions are dispatched in order; JAX's asynchronous dispatch lets each
submesh run as soon as its inputs are ready, so meshes overlap as the schedule
intends. Transfers are ``jax.device_put`` onto the destination submesh with the
source's PartitionSpec. An optional profiler records each task's start and end,
and an optional memory recorder the bytes of live arrays per mesh after every
instruction.

The host work per instruction is kept small: on first use a compiled step is
turned into a list of *operations* whose argument builders and result
assignments are generated Python code over the slot list (no recursive walk of
nested slot tuples per call), and transfer shardings are built once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_mpmd.compiler.instructions import Call, Free, Transfer
from nnx_mpmd.compiler.mesh_inference import HOST
from nnx_mpmd.compiler.stage_programs import check_mesh_context
from nnx_mpmd.compiler.step import CompiledStep
from nnx_mpmd.placement.partition import MpmdArray

__all__ = ["MemoryRecorder", "TaskRecord", "execute"]


class TaskRecord(tuple):
    """``(mesh, label, task, start_s, end_s)`` of one profiled instruction."""

    __slots__ = ()


def _build(store: list[Any], tree: Any) -> Any:
    if isinstance(tree, int):
        return store[tree]
    return tuple(_build(store, t) for t in tree)


def _assign(store: list[Any], tree: Any, value: Any) -> None:
    if isinstance(tree, int):
        store[tree] = value
        return
    for t, v in zip(tree, value, strict=True):
        _assign(store, t, v)


def _build_expr(tree: Any) -> str:
    if isinstance(tree, int):
        return f"s[{tree}]"
    inner = "".join(f"{_build_expr(t)}, " for t in tree)
    return f"({inner})"


def _assign_lines(tree: Any, value: str, lines: list[str]) -> None:
    if isinstance(tree, int):
        lines.append(f"    s[{tree}] = {value}")
        return
    lines.append(f"    if len({value}) != {len(tree)}: raise ValueError({value!r})")
    for j, t in enumerate(tree):
        _assign_lines(t, f"{value}[{j}]", lines)


def _compile_call(fn: Callable[..., Any], args: Any, outs: Any) -> Callable[[list[Any]], Any]:
    """``run(s)``: calls ``fn`` on the arguments built from slot list ``s``, stores results.

    The builder is generated source, so a call costs one Python frame plus the
    tuple displays, instead of a recursive walk over the slot tree.
    """
    lines = ["def run(s):", f"    r = fn({''.join(f'{_build_expr(a)}, ' for a in args)})"]
    _assign_lines(outs, "r", lines)
    lines.append("    return r")
    namespace: dict[str, Any] = {"fn": fn}
    exec("\n".join(lines), namespace)  # the source holds slot numbers only
    return namespace["run"]


class _Shardings:
    def __init__(self, submeshes: Sequence[Any]) -> None:
        self.submeshes = submeshes
        self.cache: dict[tuple[int, Any], NamedSharding] = {}

    def __call__(self, mesh: int, spec: Any) -> NamedSharding:
        key = (mesh, spec)
        sharding = self.cache.get(key)
        if sharding is None:
            sharding = self.cache[key] = NamedSharding(self.submeshes[mesh], spec)
        return sharding


def _value_on(x: Any, q: int) -> Any:
    if q == HOST:
        return x
    if isinstance(x, MpmdArray):
        return x.array(q)
    return x


def _transferred_shape(ins: Transfer, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape ``ins`` delivers for a source of ``shape`` (microbatch reshape)."""
    m = ins.reshape_microbatches
    return (m, shape[0] // m, *shape[1:]) if m else tuple(shape)


def _kept_spec(sharding: Any) -> Any:
    """The PartitionSpec a transfer without its own ``spec`` keeps from its source."""
    return sharding.spec if isinstance(sharding, NamedSharding) else P()


def _transfer(ins: Transfer, value: Any, shardings: _Shardings) -> Any:
    if ins.reshape_microbatches:
        value = value.reshape(_transferred_shape(ins, value.shape))
    spec = ins.spec
    if spec is None:
        spec = _kept_spec(getattr(value, "sharding", None))
    if not isinstance(value, jax.Array):
        value = np.asarray(value)
    return jax.device_put(value, shardings(ins.dst_mesh, spec))


# Operation codes of the precomputed plan.
_CALL, _MOVE, _TRANSFER, _FREE = range(4)


class _Plan:
    """A compiled step as a flat list of ``(code, ...)`` operations."""

    def __init__(self, step: CompiledStep, shardings: _Shardings) -> None:
        self.ops: list[tuple[Any, ...]] = []
        for ins in step.instructions:
            if isinstance(ins, Call):
                self.ops.append((_CALL, _compile_call(ins.fn, ins.args, ins.outs), ins))
            elif isinstance(ins, Transfer):
                if ins.spec is not None and not ins.reshape_microbatches:
                    # The destination sharding is known now: one device_put per step.
                    sharding = shardings(ins.dst_mesh, ins.spec)
                    self.ops.append((_MOVE, ins.src, ins.dst, sharding, ins))
                else:
                    self.ops.append((_TRANSFER, ins.src, ins.dst, None, ins))
            elif isinstance(ins, Free):
                self.ops.append((_FREE, ins.slots, None, None, ins))


def _plan_for(step: CompiledStep, shardings: _Shardings | None) -> tuple[_Shardings, _Plan]:
    """The step's cached plan (rebuilt when another sharding cache is passed)."""
    cached = getattr(step, "_executor_plan", None)
    if cached is not None and shardings in (None, cached[0]):
        return cached
    shardings = shardings or _Shardings(cached[0].submeshes if cached else [])
    cached = (shardings, _Plan(step, shardings))
    step._executor_plan = cached  # type: ignore[attr-defined]
    return cached


class MemoryRecorder:
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
        """Appends the live bytes of ``store`` to the timeline.

        Args:
          index: the instruction index (-1 before the first).
          label: what just ran.
          store: the slot values.
        """
        self.timeline.append((index, label, self._bytes(store)))

    def record_outputs(self, ins: Call, result: Any) -> None:
        """Remembers the bytes a stage task produced (its sends and residuals)."""
        if ins.task is not None:
            self.output_bytes.append((ins.mesh, ins.label, ins.task, sum(self._bytes([result]))))

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


def execute(
    step: CompiledStep,
    inputs: Sequence[Any],
    submeshes: Sequence[Any],
    shardings: _Shardings | None = None,
    profile: list[Any] | None = None,
    memory: MemoryRecorder | None = None,
) -> list[Any]:
    """Runs ``step`` on ``inputs`` (consts, state leaves, other leaves).

    Args:
      step: the compiled step.
      inputs: one value per input of the step.
      submeshes: the jax Mesh of each mesh id.
      shardings: a sharding cache to reuse across calls.
      profile: if a list is given, a `TaskRecord` per instruction is appended
        (each instruction is waited for, so meshes do not overlap).
      memory: if given, live bytes per mesh are recorded after every
        instruction (each instruction is waited for).

    Returns:
      One value per output (user outputs, then new state leaves): a jax.Array
      when it lives on one mesh, an `MpmdArray` when on several.

    Raises:
      MeshError: the call is under a ``jax.set_mesh`` context (each program runs
        on its own submesh; see `check_mesh_context`).

    Example:
      >>> # Called by `nnx_mpmd.jit` steps: ``step(*args, memory=True)`` fills
      >>> # ``step.last_memory`` through a `MemoryRecorder` passed here.
      >>> callable(execute)
      True
    """
    if submeshes:
        check_mesh_context(submeshes)
    if shardings is None and getattr(step, "_executor_plan", None) is None:
        shardings = _Shardings(submeshes)
    shardings, plan = _plan_for(step, shardings)
    store: list[Any] = [None] * step.num_slots
    for slot, value in step.constants.items():
        store[slot] = value
    for value, slots_of in zip(inputs, step.input_slots):
        for q, slot in slots_of.items():
            store[slot] = _value_on(value, q)
    if profile is None and memory is None:
        _run_fast(plan.ops, store, shardings)
    else:
        _run_instrumented(plan.ops, store, shardings, profile, memory)
    outputs = []
    for locations in step.output_slots:
        if len(locations) == 1:
            outputs.append(store[locations[0][1]])
        else:
            outputs.append(MpmdArray({q: store[slot] for q, slot in locations}))
    return outputs


def _run_fast(ops: list[tuple[Any, ...]], store: list[Any], shardings: _Shardings) -> None:
    device_put = jax.device_put
    for op in ops:
        code = op[0]
        if code == _CALL:
            op[1](store)
        elif code == _MOVE:
            store[op[2]] = device_put(store[op[1]], op[3])
        elif code == _TRANSFER:
            store[op[2]] = _transfer(op[4], store[op[1]], shardings)
        else:
            for slot in op[1]:
                store[slot] = None


def _run_instrumented(
    ops: list[tuple[Any, ...]],
    store: list[Any],
    shardings: _Shardings,
    profile: list[Any] | None,
    memory: MemoryRecorder | None,
) -> None:
    clock = time.perf_counter
    t0 = clock()
    if memory is not None:
        memory.record(-1, "start", store)
    for index, op in enumerate(ops):
        code, ins = op[0], op[-1]
        if code == _CALL:
            start = clock()
            result = op[1](store)
            jax.block_until_ready(result)
            if profile is not None:
                profile.append(
                    TaskRecord((ins.mesh, ins.label, ins.task, start - t0, clock() - t0))
                )
            if memory is not None:
                memory.record_outputs(ins, result)
        elif code in (_MOVE, _TRANSFER):
            store[ins.dst] = _transfer(ins, store[ins.src], shardings)
            if memory is not None:
                jax.block_until_ready(store[ins.dst])
        else:
            for slot in ins.slots:
                store[slot] = None
        if memory is not None:
            memory.record(index, "free" if code == _FREE else ins.label, store)
