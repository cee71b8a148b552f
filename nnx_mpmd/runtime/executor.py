"""The single-controller runtime: one process drives every submesh.

Instructions are dispatched in order; JAX's asynchronous dispatch lets each
submesh run as soon as its inputs are ready, so meshes overlap as the schedule
intends. Transfers are ``jax.device_put`` onto the destination submesh with the
source's PartitionSpec. An optional profiler records each task's start and end.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_mpmd.compiler.instructions import Call, Free, Transfer
from nnx_mpmd.compiler.mesh_inference import HOST
from nnx_mpmd.compiler.step import CompiledStep
from nnx_mpmd.partition import MpmdArray

__all__ = ["TaskRecord", "execute"]


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


def _transfer(ins: Transfer, value: Any, shardings: _Shardings) -> Any:
    if ins.reshape_microbatches:
        m = ins.reshape_microbatches
        value = value.reshape((m, value.shape[0] // m, *value.shape[1:]))
    spec = ins.spec
    if spec is None:
        sharding = getattr(value, "sharding", None)
        spec = sharding.spec if isinstance(sharding, NamedSharding) else P()
    if not isinstance(value, jax.Array):
        value = np.asarray(value)
    return jax.device_put(value, shardings(ins.dst_mesh, spec))


def execute(
    step: CompiledStep,
    inputs: Sequence[Any],
    submeshes: Sequence[Any],
    shardings: _Shardings | None = None,
    profile: list[Any] | None = None,
) -> list[Any]:
    """Runs ``step`` on ``inputs`` (consts, state leaves, other leaves).

    Args:
      step: the compiled step.
      inputs: one value per input of the step.
      submeshes: the jax Mesh of each mesh id.
      shardings: a sharding cache to reuse across calls.
      profile: if a list is given, a `TaskRecord` per instruction is appended
        (each instruction is waited for, so meshes do not overlap).

    Returns:
      One value per output (user outputs, then new state leaves): a jax.Array
      when it lives on one mesh, an `MpmdArray` when on several.
    """
    shardings = shardings or _Shardings(submeshes)
    store: list[Any] = [None] * step.num_slots
    for slot, value in step.constants.items():
        store[slot] = value
    for value, slots_of in zip(inputs, step.input_slots):
        for q, slot in slots_of.items():
            store[slot] = _value_on(value, q)
    clock = time.perf_counter
    t0 = clock()
    for ins in step.instructions:
        if isinstance(ins, Call):
            start = clock() if profile is not None else 0.0
            result = ins.fn(*_build(store, ins.args))
            _assign(store, ins.outs, result)
            if profile is not None:
                jax.block_until_ready(result)
                profile.append(
                    TaskRecord((ins.mesh, ins.label, ins.task, start - t0, clock() - t0))
                )
        elif isinstance(ins, Transfer):
            store[ins.dst] = _transfer(ins, store[ins.src], shardings)
        elif isinstance(ins, Free):
            for slot in ins.slots:
                store[slot] = None
    outputs = []
    for locations in step.output_slots:
        if len(locations) == 1:
            outputs.append(store[locations[0][1]])
        else:
            outputs.append(MpmdArray({q: store[slot] for q, slot in locations}))
    return outputs
