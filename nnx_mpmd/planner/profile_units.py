"""Measuring each unit on the real devices: time per task kind, and memory.

`profile_units` copies the model, makes every unit its own stage, and runs two
microbatches through all of them on ONE submesh of the user's mesh (the devices
a stage will get): the first with a split backward, so that the
backward-to-input (``BI``) and backward-to-weights (``BW``) times are measured
apart, the second with the full backward (``B``) that schedules without a
split run. ``B`` is not ``BI + BW``: one program shares work the two repeat
(on GPT tiny, CPU, ``B`` took 0.65-0.87 of ``BI + BW`` per layer). Each
program is timed alone (``profile="isolated"``), medians over a few runs; the
memory recorder gives the bytes each forward keeps for its backward (per
device) and the bytes of parameters and optimizer state. One run per
microbatch size and remat setting asked for.

Alone, a task can run faster than it will in the pipeline, where every
submesh works at once and the meshes may share compute (CPU cores, host
threads, memory bandwidth). `contention` measures that once: the same
profiling step on 1, 2, ... submeshes at once against one submesh alone.
Where the submeshes share nothing (separate accelerators), it is about 1.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from nnx_mpmd.annotate.stage import variable_stage
from nnx_mpmd.compiler.ir import Call, Transfer, TransferBatch
from nnx_mpmd.errors import PartitionError
from nnx_mpmd.jit.jit import jit
from nnx_mpmd.jit.losses import value_and_grad
from nnx_mpmd.placement.mesh import MpmdMesh
from nnx_mpmd.planner.units import restage, stage_units
from nnx_mpmd.schedules import Custom, Task

__all__ = ["UnitCosts", "contention", "profile_units"]


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
      B: the median time of the full (fused) backward; empty in profiles made
        before it was measured, which then count ``BI + BW`` (`full_backward`).
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
      contention: how much slower the tasks run with 1, 2, ... submeshes
        busy at once than alone (`contention`); the planner's simulation
        slows every task by it while that many meshes run
        (`nnx_mpmd.schedules.Costs.contention`).
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
    contention: tuple[float, ...] = (1.0,)
    B: tuple[float, ...] = ()

    def full_backward(self) -> tuple[float, ...]:
        """Per unit, the time of its full backward: ``B``, or ``BI + BW`` without it.

        Example:
          >>> costs = UnitCosts(("a",), 1, False, (1.0,), (2.0,), (3.0,), (), (), (), ())
          >>> costs.full_backward(), dataclasses.replace(costs, B=(4.0,)).full_backward()
          ((5.0,), (4.0,))
        """
        if self.B:
            return self.B
        return tuple(bi + bw for bi, bw in zip(self.BI, self.BW, strict=True))

    def slowdown(self, busy_meshes: float) -> float:
        """The contention factor with ``busy_meshes`` submeshes busy on average
        (linear between the measured counts, the last one beyond them).

        Example:
          >>> costs = UnitCosts((), 1, False, (), (), (), (), (), (), (), contention=(1.0, 3.0))
          >>> costs.slowdown(1.5), costs.slowdown(4)
          (2.0, 3.0)
        """
        factors = self.contention or (1.0,)
        at = min(max(busy_meshes, 1.0), float(len(factors))) - 1.0
        low = int(at)
        high = min(low + 1, len(factors) - 1)
        return factors[low] + (at - low) * (factors[high] - factors[low])

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (`from_dict` reads it back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UnitCosts:
        """Reads `to_dict`'s output."""
        fields: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in data.items()
        }
        return cls(**fields)


def train_step_of(loss_fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any, Any], Any]:
    """The plain train step of ``loss_fn``: value and grad, then the optimizer update."""

    def train_step(model: Any, optimizer: Any, batch: Any) -> Any:
        loss, grads = value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    return train_step


def one_submesh(mesh: MpmdMesh, index: int = 0) -> MpmdMesh:
    """An `MpmdMesh` of one submesh: the devices of ``mesh``'s submesh ``index``."""
    sub = mesh.submeshes[index]
    devices = np.asarray(sub.devices)[None]
    names = (mesh.mpmd_axis, *sub.axis_names)
    types = (sub.axis_types[0], *sub.axis_types) if sub.axis_types else None
    return MpmdMesh(jax.sharding.Mesh(devices, names, axis_types=types), mesh.mpmd_axis)


def _profile_schedule(num_units: int, num_microbatches: int) -> Custom:
    """One mesh: every unit's F and split backward of microbatch 0, then microbatch 1's (if 2).

    Microbatch 0's last ``BW`` sits between microbatch 1's forwards and backwards, so no
    forward is followed by its own backward (which the step would fuse and time as one).
    """

    def forwards(mb: int) -> list[Task]:
        return [Task(u, mb, "F") for u in range(num_units)]

    split = [Task(u, 0, k) for u in reversed(range(num_units)) for k in ("BI", "BW")]
    if num_microbatches == 1:
        return Custom(lists=(tuple(forwards(0) + split),))
    last = split.pop()
    full = [Task(u, 1, "B") for u in reversed(range(num_units))]
    return Custom(lists=(tuple(forwards(0) + split + forwards(1) + [last] + full),))


def _rows(batch: Any, size: int) -> Any:
    return jax.tree.map(lambda x: x[:size], batch)


def _twice(rows: Any) -> Any:
    """Two microbatches of ``rows`` (the same rows twice)."""
    return jax.tree.map(lambda x: np.concatenate([np.asarray(x)] * 2), rows)


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


def _medians(
    profiles: Sequence[Any], num_units: int, latency: float = 0.0
) -> dict[str, tuple[float, ...]]:
    """Per task kind and unit, the median time less ``latency`` (kept at least half)."""
    times: dict[tuple[int, str], list[float]] = {}
    for records in profiles:
        for _, _, task, start, end in records:
            if isinstance(task, Task):
                times.setdefault((task.stage, task.kind), []).append(end - start)

    def net(samples: list[float]) -> float:
        median = statistics.median(samples)
        return max(median - latency, median / 2)

    return {
        kind: tuple(net(times.get((u, kind), [0.0])) for u in range(num_units))
        for kind in ("F", "BI", "BW", "B")
    }


def _sync_latency(mesh: MpmdMesh, repeats: int) -> float:
    """The median time to dispatch a trivial program on ``mesh``'s submesh and wait for it.

    Timing a task alone adds this to its compute; in a running pipeline,
    dispatch overlaps the device's work, so the profile subtracts it.
    """
    sharding = jax.sharding.NamedSharding(mesh.submeshes[0], jax.sharding.PartitionSpec())
    x = jax.device_put(np.zeros((8,), np.float32), sharding)
    bump = jax.jit(lambda v: v + 1)
    jax.block_until_ready(bump(x))
    samples = []
    for _ in range(max(5, 4 * repeats)):
        start = time.perf_counter()
        jax.block_until_ready(bump(x))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


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
    moved: dict[int | None, list[int]] = {}  # a host input's slot -> the slots it is copied to
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

    A copy of the model is profiled; ``model`` is not changed or placed.

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
    factor = contention(model, loss_fn, _rows(batch, max(microbatch_sizes)), mesh, tx, repeats)
    return [dataclasses.replace(r, contention=factor) for r in results]


def _profiling_step(
    model: Any,
    loss_fn: Callable[[Any, Any], Any],
    rows: Any,
    mesh: MpmdMesh,
    tx: optax.GradientTransformation,
    remat: bool,
    num_microbatches: int = 1,
) -> tuple[Any, Any, Any, list[tuple[str, Any]]]:
    """A copy of ``model`` with every unit its own stage, its optimizer, and its step on
    ``mesh`` (one submesh) over ``num_microbatches`` microbatches of ``rows``' size
    (`_profile_schedule`)."""
    copy = nnx.clone(model)
    units = stage_units(copy, loss_fn, rows)
    if not units:  # stage_units raises first; kept for type checkers
        raise PartitionError("the model has no Stage to profile")
    restage(units, list(range(len(units))), remat=[remat] * len(units))
    optimizer = nnx.Optimizer(copy, tx, wrt=nnx.Param)
    step = jit(
        train_step_of(loss_fn), mesh=mesh,
        schedule=_profile_schedule(len(units), num_microbatches),
        num_microbatches=num_microbatches,
    )  # fmt: skip
    return step, copy, optimizer, units


def contention(
    model: Any,
    loss_fn: Callable[[Any, Any], Any],
    rows: Any,
    mesh: MpmdMesh,
    tx: optax.GradientTransformation,
    repeats: int = 3,
) -> tuple[float, ...]:
    """How much slower the profiling step runs on k submeshes at once than on one (each >= 1).

    The counts are timed in turn, round after round, so slow spells hit all alike.
    """
    if mesh.num_meshes == 1:
        return (1.0,)
    runs = [
        _profiling_step(model, loss_fn, rows, one_submesh(mesh, i), tx, remat=False)[:3]
        for i in range(mesh.num_meshes)
    ]
    for step, copy, optimizer in runs:
        jax.block_until_ready(step(copy, optimizer, rows))  # compiles

    def wall(chosen: Sequence[Any]) -> float:
        start = time.perf_counter()
        jax.block_until_ready([step(copy, opt, rows) for step, copy, opt in chosen])
        return time.perf_counter() - start

    # Rounds of k = 1, 2, ... in turn, so that a slow spell of the machine (another
    # process, a frequency change) weighs on every k alike instead of on one.
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(max(5, 2 * repeats)):
        for k in range(1, len(runs) + 1):
            samples[k - 1].append(wall(runs[:k]))
    medians = [statistics.median(times) for times in samples]
    return tuple(max(1.0, t / medians[0]) for t in medians)


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
    both = _twice(rows)  # microbatch 0: split backwards; 1: full backwards
    step, copy, optimizer, units = _profiling_step(
        model, loss_fn, rows, one_submesh(mesh), tx, remat, num_microbatches=2
    )
    jax.block_until_ready(step(copy, optimizer, both))  # compiles
    # The first isolated run of a process's programs is slower (loading, threads
    # waking up): up to 10x on CPU, enough to move a split. It is not kept.
    jax.block_until_ready(step(copy, optimizer, both, profile="isolated"))
    profiles = []
    for _ in range(repeats):
        jax.block_until_ready(step(copy, optimizer, both, profile="isolated"))
        profiles.append(list(step.last_profile))
    jax.block_until_ready(step(copy, optimizer, both, memory=True))
    memory = step.last_memory
    medians = _medians(profiles, len(units), _sync_latency(one_submesh(mesh), repeats))
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
        B=medians["B"],
        kept_bytes=_output_bytes(memory, len(units), "F"),
        split_bytes=_output_bytes(memory, len(units), "BI"),
        state_bytes=tuple(round(static * p / total_params) for p in params),
        param_bytes=tuple(params),
        other_s=_other_seconds(profiles),
        batch_bytes=_batch_bytes(
            step.lower(copy, optimizer, both).compiled, rows, len(units), _batch_split(step)
        ),
    )
