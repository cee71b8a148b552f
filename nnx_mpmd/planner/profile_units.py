"""Measuring each unit on the real devices: time per task kind, and memory.

`profile_units` copies the model, makes every unit its own stage, and runs one
microbatch through all of them on ONE submesh of the user's mesh (the devices
a stage will get), with a split backward so that the backward-to-input
(``BI``) and backward-to-weights (``BW``) times are measured apart. Each
program is timed alone (``profile="isolated"``), medians over a few runs; the
memory recorder gives the bytes each forward keeps for its backward (per
device) and the bytes of parameters and optimizer state. One run per
microbatch size and remat setting asked for.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from nnx_mpmd.compiler.instructions import Call, Transfer, TransferBatch
from nnx_mpmd.errors import PartitionError
from nnx_mpmd.frontend.jit import jit, value_and_grad
from nnx_mpmd.frontend.stage import variable_stage
from nnx_mpmd.placement.mesh import MpmdMesh
from nnx_mpmd.planner.units import restage, stage_units
from nnx_mpmd.schedules import Custom, Task

__all__ = ["UnitCosts", "profile_units"]


@dataclasses.dataclass(frozen=True)
class UnitCosts:
    """What each unit costs at one microbatch size, with or without remat.

    All lists have one entry per unit, in call order. Times are seconds,
    bytes are per device of one submesh.

    Attributes:
      paths: the units' paths.
      microbatch_size: the rows of the microbatch measured.
      remat: whether the units recomputed their forward.
      F, BI, BW: the median time of each task kind.
      kept_bytes: the bytes a forward keeps for its backward (its outputs:
        the activation sent on and the residuals).
      split_bytes: the bytes a split backward's ``BI`` hands to its ``BW``
        (its outputs).
      state_bytes: parameter and optimizer-state bytes the unit owns.
      param_bytes: parameter bytes the unit owns (its gradient accumulator
        is as large).
      other_s: the time of the step's other programs (optimizer update,
        gradient reduction), all units together.
      batch_bytes: per unit, the bytes per device of the microbatch leaves it
        is the first to read (the inputs go to the first unit, the targets
        to the loss's).
    """

    paths: tuple[str, ...]
    microbatch_size: int
    remat: bool
    F: tuple[float, ...]
    BI: tuple[float, ...]
    BW: tuple[float, ...]
    kept_bytes: tuple[int, ...]
    split_bytes: tuple[int, ...]
    state_bytes: tuple[int, ...]
    param_bytes: tuple[int, ...]
    other_s: float = 0.0
    batch_bytes: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (`from_dict` reads it back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UnitCosts:
        """Reads `to_dict`'s output."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def train_step_of(loss_fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any, Any], Any]:
    """The plain train step of ``loss_fn``: value and grad, then the optimizer update."""

    def train_step(model: Any, optimizer: Any, batch: Any) -> Any:
        loss, grads = value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    return train_step


def one_submesh(mesh: MpmdMesh) -> MpmdMesh:
    """An `MpmdMesh` of one submesh: the devices of ``mesh``'s first one."""
    sub = mesh.submeshes[0]
    devices = np.asarray(sub.devices)[None]
    names = (mesh.mpmd_axis, *sub.axis_names)
    types = (sub.axis_types[0] if sub.axis_types else None, *sub.axis_types)
    return MpmdMesh(jax.sharding.Mesh(devices, names, axis_types=types), mesh.mpmd_axis)


def _profile_schedule(num_units: int) -> Custom:
    """Every unit's forward, then every split backward in reverse, one microbatch, one mesh."""
    forwards = [Task(u, 0, "F") for u in range(num_units)]
    backwards = [Task(u, 0, k) for u in reversed(range(num_units)) for k in ("BI", "BW")]
    return Custom(lists=[forwards + backwards])


def _rows(batch: Any, size: int) -> Any:
    return jax.tree.map(lambda x: x[:size], batch)


def _owned_param_bytes(units: Sequence[tuple[str, Any]]) -> list[int]:
    """Per unit, the per-device bytes of the Params it owns (a tied one counts once)."""
    owned = [0] * len(units)
    for u, (_, unit) in enumerate(units):
        for _, node in nnx.iter_graph(unit):
            if isinstance(node, nnx.Param) and variable_stage(node) == u:
                value = node.get_value()
                shards = getattr(value, "addressable_shards", None)
                owned[u] += int(shards[0].data.nbytes if shards else np.asarray(value).nbytes)
    return owned


def _medians(profiles: Sequence[Any], num_units: int) -> dict[str, tuple[float, ...]]:
    times: dict[tuple[int, str], list[float]] = {}
    for records in profiles:
        for _, _, task, start, end in records:
            if isinstance(task, Task):
                times.setdefault((task.stage, task.kind), []).append(end - start)
    return {
        kind: tuple(statistics.median(times.get((u, kind), [0.0])) for u in range(num_units))
        for kind in ("F", "BI", "BW")
    }


def _batch_split(step: Any) -> int:
    """Over how many devices of its submesh a step shards the batch's rows."""
    if step.batch_axis is None:
        return 1
    return int(step.mesh.submeshes[0].shape[step.batch_axis])


def _batch_bytes(compiled: Any, rows: Any, num_units: int, split: int) -> tuple[int, ...]:
    """Per unit, the per-device bytes of the batch leaves whose first reader it is.

    ``compiled`` is the profiling step (every unit its own stage, one mesh):
    its inputs are its constants, the model's and optimizer's state leaves,
    then the batch leaves, so the batch's are the last ``input_slots`` (one
    ``{mesh: slot}`` per input). A leaf no stage task reads counts for no unit.
    """
    leaves = jax.tree.leaves(rows)
    slots = [
        next(iter(where.values()), None) for where in compiled.input_slots[-len(leaves) :]
    ] if leaves else []  # fmt: skip
    first: dict[int, int] = {}
    moved: dict[int, list[int]] = {}  # a host input's slot -> the slots it is copied to
    for ins in compiled.instructions:
        members = ins.transfers if isinstance(ins, TransferBatch) else (ins,)
        for move in members:
            if isinstance(move, Transfer):
                moved.setdefault(move.src, []).append(move.dst)
        if isinstance(ins, Call) and isinstance(ins.task, Task):
            for slot in ins.reads():
                first[slot] = min(first.get(slot, ins.task.stage), ins.task.stage)
    per_unit = [0] * num_units
    for leaf, slot in zip(leaves, slots, strict=True):
        readers = [first[s] for s in (slot, *moved.get(slot, ())) if s in first]
        if readers:
            per_unit[min(readers)] += int(np.asarray(leaf).nbytes) // split
    return tuple(per_unit)


def _other_seconds(profiles: Sequence[Any]) -> float:
    """The median over runs of the summed time of the calls that are not stage tasks."""
    sums = [sum(end - start for _, _, task, start, end in r if task is None) for r in profiles]
    return statistics.median(sums) if sums else 0.0


def _output_bytes(memory: dict[str, Any], num_units: int, kind: str) -> tuple[int, ...]:
    """Per unit, the bytes per device of its ``kind`` task's outputs (memory recorder)."""
    found = [0] * num_units
    for _, _, task, nbytes in memory["task_output_bytes"]:
        parsed = Task.parse(task) if isinstance(task, str) else task
        if parsed.kind == kind:
            found[parsed.stage] = int(nbytes)
    return tuple(found)


def profile_units(
    model: Any,
    loss_fn: Callable[[Any, Any], Any],
    batch: Any,
    mesh: MpmdMesh,
    tx: optax.GradientTransformation,
    *,
    microbatch_sizes: Sequence[int],
    remat: Sequence[bool] = (False, True),
    repeats: int = 3,
) -> list[UnitCosts]:
    """Measures every unit of ``model``, once per microbatch size and remat setting.

    The model itself is not changed or placed: a copy is profiled.

    Args:
      model: the model (its `Stage` wrappers are the units).
      loss_fn: ``loss_fn(model, microbatch) -> loss``.
      batch: a batch with at least ``max(microbatch_sizes)`` rows.
      mesh: the mesh the plan is for; its first submesh is used.
      tx: the optimizer's transformation (its state counts as memory).
      microbatch_sizes: the microbatch sizes to measure at.
      remat: the remat settings to measure.
      repeats: timed runs per setting (medians are kept).

    Returns:
      One `UnitCosts` per (microbatch size, remat), in that order.
    """
    results = []
    for size in microbatch_sizes:
        for flag in remat:
            results.append(_profile_one(model, loss_fn, batch, mesh, tx, size, flag, repeats))
    return results


def _profile_one(
    model: Any,
    loss_fn: Callable[[Any, Any], Any],
    batch: Any,
    mesh: MpmdMesh,
    tx: optax.GradientTransformation,
    size: int,
    remat: bool,
    repeats: int,
) -> UnitCosts:
    rows = _rows(batch, size)
    copy = nnx.clone(model)
    units = stage_units(copy, loss_fn, rows)
    if not units:  # stage_units raises first; kept for type checkers
        raise PartitionError("the model has no Stage to profile")
    restage(units, list(range(len(units))), remat=[remat] * len(units))
    optimizer = nnx.Optimizer(copy, tx, wrt=nnx.Param)
    step = jit(
        train_step_of(loss_fn),
        mesh=one_submesh(mesh),
        schedule=_profile_schedule(len(units)),
        num_microbatches=1,
    )
    jax.block_until_ready(step(copy, optimizer, rows))  # compiles
    profiles = []
    for _ in range(repeats):
        jax.block_until_ready(step(copy, optimizer, rows, profile="isolated"))
        profiles.append(list(step.last_profile))
    jax.block_until_ready(step(copy, optimizer, rows, memory=True))
    memory = step.last_memory
    medians = _medians(profiles, len(units))
    params = _owned_param_bytes(units)
    total_params = sum(params) or 1
    static = int(memory["initial_bytes"][0])
    return UnitCosts(
        paths=tuple(path for path, _ in units),
        microbatch_size=size,
        remat=remat,
        F=medians["F"],
        BI=medians["BI"],
        BW=medians["BW"],
        kept_bytes=_output_bytes(memory, len(units), "F"),
        split_bytes=_output_bytes(memory, len(units), "BI"),
        state_bytes=tuple(round(static * p / total_params) for p in params),
        param_bytes=tuple(params),
        other_s=_other_seconds(profiles),
        batch_bytes=_batch_bytes(
            step.lower(copy, optimizer, rows).compiled, rows, len(units), _batch_split(step)
        ),
    )
