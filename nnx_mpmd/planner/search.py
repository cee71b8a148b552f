"""Choosing a pipeline configuration with the simulator as the cost model.

For every number of microbatches, every schedule and every stage count the
schedule accepts, the units are split into contiguous stages that balance
their measured time; the schedule's task lists are simulated with the
measured per-stage costs (`nnx_mpmd.schedules.simulate`), and each mesh's
peak memory is predicted by walking its task list: the state and gradient
accumulators of its stages, plus what its forwards keep until their
backwards. Under a memory budget, stages of a mesh over budget recompute their
forward (remat), the one that saves most first, until the mesh fits.

Pure Python on `UnitCosts`: no device is touched here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from nnx_mpmd.annotate.annotate import balanced_partition
from nnx_mpmd.errors import PlanError, ScheduleError
from nnx_mpmd.planner.profile_units import UnitCosts
from nnx_mpmd.schedules import SCHEDULES, Costs, get_schedule, simulate

__all__ = ["Candidate", "predict", "search"]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One pipeline configuration and what the simulator predicts for it.

    Attributes:
      schedule: the schedule's registered name.
      num_stages: the number of stages.
      num_microbatches: the number of microbatches.
      unit_stages: the stage of each unit, in call order.
      remat: per stage, whether it recomputes its forward.
      step_s: predicted seconds per step.
      peak_bytes: predicted peak bytes per device, per mesh.
    """

    schedule: str
    num_stages: int
    num_microbatches: int
    unit_stages: tuple[int, ...]
    remat: tuple[bool, ...]
    step_s: float
    peak_bytes: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Candidate:
        """Reads `to_dict`'s output."""
        fields: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in data.items()
        }
        return cls(**fields)


def _stage_sums(values: Sequence[float], unit_stages: Sequence[int], num_stages: int) -> list[Any]:
    sums: list[Any] = [0] * num_stages
    for value, stage in zip(values, unit_stages, strict=True):
        sums[stage] += value
    return sums


def _stage_costs(
    plain: UnitCosts, rematted: UnitCosts | None, unit_stages: Sequence[int], remat: Sequence[bool]
) -> dict[str, list[Any]]:
    """Per stage: F, BI, BW, B seconds and kept/state/param bytes, remat stages from
    ``rematted``."""
    num_stages = len(remat)
    out: dict[str, list[Any]] = {}
    fields = ("F", "BI", "BW", "kept_bytes", "split_bytes", "state_bytes", "param_bytes")

    def of(costs: UnitCosts, field: str) -> tuple[Any, ...]:
        return costs.full_backward() if field == "B" else getattr(costs, field)

    for field in (*fields, "B", "batch_bytes"):
        values = of(plain, field) or (0,) * len(unit_stages)
        out[field] = _stage_sums(values, unit_stages, num_stages)
        if rematted is not None and any(remat):
            redone = _stage_sums(of(rematted, field) or values, unit_stages, num_stages)
            out[field] = [
                r if remat[s] else p
                for s, (p, r) in enumerate(zip(out[field], redone, strict=True))
            ]
    return out


def _live_peak(row: Sequence[Any], kept: Sequence[int], split: Sequence[int]) -> int:
    """The most bytes a mesh's tasks hold between a forward and its backward, in order.

    A forward keeps its outputs until its backward (``B``, or ``BW`` when split);
    a ``BI`` adds what it hands to its ``BW``. A forward immediately followed by
    its own full backward runs fused (one ``FB`` program) and keeps nothing.
    """
    live = peak = 0
    for i, task in enumerate(row):
        fused_with_next = i + 1 < len(row) and _same(row[i + 1], task) and row[i + 1].kind == "B"
        fused_with_previous = i > 0 and _same(row[i - 1], task) and row[i - 1].kind == "F"
        if task.kind == "F" and not fused_with_next:
            live += kept[task.stage]
        elif task.kind == "BI":
            live += split[task.stage]
        peak = max(peak, live)
        if task.kind == "B" and not fused_with_previous:
            live -= kept[task.stage]
        elif task.kind == "BW":
            live -= split[task.stage] + kept[task.stage]
    return peak


def _same(a: Any, b: Any) -> bool:
    return (a.stage, a.microbatch) == (b.stage, b.microbatch)


def _peak_bytes(
    tasks: Any,
    mesh_of: list[int],
    stage: Mapping[str, list[Any]],
    num_microbatches: int,
    donate: bool,
) -> tuple[int, ...]:
    """Per mesh: parameters, optimizer state and gradient accumulators of its stages, the
    step's batch leaves they read (all microbatches), and the larger of the bytes its
    forwards hold for their backwards and the optimizer update's new state (none when
    the step donates its state: the update writes it into the old buffers)."""
    peaks = []
    for mesh, row in enumerate(tasks):
        mine = [s for s, q in enumerate(mesh_of) if q == mesh]
        state = sum(stage["state_bytes"][s] for s in mine)
        grads = sum(stage["param_bytes"][s] for s in mine)
        batch = num_microbatches * sum(stage["batch_bytes"][s] for s in mine)
        live = _live_peak(row, stage["kept_bytes"], stage["split_bytes"])
        peaks.append(int(state + grads + batch + max(live, 0 if donate else state)))
    return tuple(peaks)


def predict(
    schedule: str,
    num_meshes: int,
    num_microbatches: int,
    unit_stages: Sequence[int],
    remat: Sequence[bool],
    plain: UnitCosts,
    rematted: UnitCosts | None = None,
    *,
    donate: bool = False,
) -> Candidate:
    """The simulator's step time and peak memory for one configuration.

    Args:
      schedule: a registered schedule name.
      num_meshes: the meshes of the pipeline.
      num_microbatches: microbatches per step.
      unit_stages: the stage of each unit.
      remat: per stage, whether it recomputes its forward.
      plain: unit costs without remat, at this microbatch size.
      rematted: unit costs with remat at this size (needed if any stage remats).
      donate: whether the step donates the model's and optimizer's state
        (``mp.jit(donate_argnums=...)``): the update then needs no second copy.

    Returns:
      The `Candidate`.

    Example:
      >>> unit = UnitCosts(("a", "b"), 4, False, F=(1.0, 1.0), BI=(1.0, 1.0), BW=(1.0, 1.0),
      ...     kept_bytes=(10, 10), split_bytes=(0, 0), state_bytes=(100, 100), param_bytes=(50, 50))
      >>> c = predict("gpipe", 2, 2, [0, 1], [False, False], unit)
      >>> c.step_s, c.peak_bytes
      (9.0, (250, 250))
    """
    num_stages = len(remat)
    sched = get_schedule(schedule)
    tasks = sched.tasks(num_stages, num_meshes, num_microbatches)
    stage = _stage_costs(plain, rematted, unit_stages, remat)
    per_stage = {
        s: {"F": stage["F"][s], "BI": stage["BI"][s], "BW": stage["BW"][s], "B": stage["B"][s]}
        for s in range(num_stages)
    }  # fmt: skip
    # Tasks slow down while other meshes run theirs (shared compute): the simulator
    # plays the schedule with the measured contention, so a task in a bubble runs at
    # full speed and one in the steady state at the shared speed. The update (profiled
    # for every unit on one submesh) runs on all meshes at once, each on its share.
    timeline = simulate(tasks, Costs(per_stage=per_stage, contention=plain.contention))
    makespan = timeline.makespan
    update = plain.other_s * plain.slowdown(num_meshes) / num_meshes
    mesh_of = [sched.mesh_of(s, num_stages, num_meshes) for s in range(num_stages)]
    return Candidate(
        schedule=sched.name,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        unit_stages=tuple(int(s) for s in unit_stages),
        remat=tuple(bool(r) for r in remat),
        step_s=float(makespan + update),
        peak_bytes=_peak_bytes(tasks, mesh_of, stage, num_microbatches, donate),
    )


def _stage_counts(schedule: Any, num_meshes: int, num_units: int, m: int) -> list[int]:
    counts = []
    for per_mesh in (1, 2, 3, 4):
        stages = per_mesh * num_meshes
        if stages > num_units:
            break
        try:
            schedule.check(stages, num_meshes, m)
        except ScheduleError:
            continue
        counts.append(stages)
    return counts


def _fit_budget(
    candidate: Candidate,
    num_meshes: int,
    plain: UnitCosts,
    rematted: UnitCosts | None,
    budget: int,
    donate: bool,
) -> Candidate | None:
    """``candidate`` with stages rematted until every mesh fits ``budget``, or None."""
    while max(candidate.peak_bytes) > budget:
        if rematted is None:
            return None
        sched = get_schedule(candidate.schedule)
        over = max(range(num_meshes), key=lambda q: candidate.peak_bytes[q])
        kept = _stage_sums(plain.kept_bytes, candidate.unit_stages, candidate.num_stages)
        redone = _stage_sums(rematted.kept_bytes, candidate.unit_stages, candidate.num_stages)
        choices = [
            s for s in range(candidate.num_stages)
            if not candidate.remat[s] and sched.mesh_of(s, candidate.num_stages, num_meshes) == over
        ]  # fmt: skip
        if not choices:
            return None
        best = max(choices, key=lambda s: kept[s] - redone[s])
        remat = tuple(r or s == best for s, r in enumerate(candidate.remat))
        candidate = predict(
            candidate.schedule, num_meshes, candidate.num_microbatches,
            candidate.unit_stages, remat, plain, rematted, donate=donate,
        )  # fmt: skip
    return candidate


def search(
    costs: Sequence[UnitCosts],
    num_meshes: int,
    batch_size: int,
    *,
    schedules: Sequence[str] | None = None,
    num_microbatches: Sequence[int],
    memory_budget: int | None = None,
    donate: bool = False,
) -> list[Candidate]:
    """Every configuration that fits, fastest predicted first.

    Args:
      costs: `UnitCosts` at ``batch_size // m`` for every ``m`` (with remat too
        when a budget may need it).
      num_meshes: the meshes of the pipeline.
      batch_size: rows per step.
      schedules: registered schedule names (default: all).
      num_microbatches: the microbatch counts to consider.
      memory_budget: bytes per device; None: no limit.
      donate: whether the step donates its state (see `predict`).

    Returns:
      The candidates, sorted by predicted step time.

    Raises:
      PlanError: nothing fits the budget (the message names the smallest
        budget that something fits), or no schedule accepts any configuration.

    Example:
      >>> unit = UnitCosts(("a", "b"), 4, False, F=(1.0, 2.0), BI=(1.0, 2.0), BW=(1.0, 2.0),
      ...     kept_bytes=(10, 10), split_bytes=(0, 0), state_bytes=(100, 100), param_bytes=(50, 50))
      >>> best = search([unit], 2, 8, schedules=["gpipe", "1f1b"], num_microbatches=[2])[0]
      >>> best.schedule, best.unit_stages, best.step_s
      ('gpipe', (0, 1), 15.0)
    """
    by_key = {(c.microbatch_size, c.remat): c for c in costs}
    names = list(schedules) if schedules is not None else list(SCHEDULES)
    found: list[Candidate] = []
    seen: set[Any] = set()  # (task lists, split): looped-bfs with one stage per mesh is gpipe
    smallest: int | None = None
    for m in num_microbatches:
        plain, rematted = by_key[(batch_size // m, False)], by_key.get((batch_size // m, True))
        for name in names:
            for stages in _stage_counts(get_schedule(name), num_meshes, len(plain.paths), m):
                tasks = get_schedule(name).tasks(stages, num_meshes, m)
                split = balanced_partition(_unit_weights(plain, tasks), stages)
                same = (tasks, tuple(split))
                if same in seen:
                    continue
                seen.add(same)
                candidate = predict(
                    name, num_meshes, m, split, [False] * stages, plain, rematted, donate=donate
                )
                if memory_budget is not None:
                    least = _least_peak(candidate, num_meshes, plain, rematted, donate)
                    smallest = least if smallest is None else min(smallest, least)
                    candidate = _fit_budget(
                        candidate, num_meshes, plain, rematted, memory_budget, donate
                    )
                if candidate is not None:
                    found.append(candidate)
    if not found:
        raise PlanError(_nothing_fits(memory_budget, smallest, names, num_microbatches))
    return sorted(found, key=lambda c: (c.step_s, max(c.peak_bytes)))


def _unit_weights(costs: UnitCosts, tasks: Any) -> list[float]:
    """Each unit's time per microbatch under the schedule ``tasks``: its forward and
    its split backward where the schedule splits, its full backward otherwise."""
    if any(task.kind in ("BI", "BW") for row in tasks for task in row):
        backward = [bi + bw for bi, bw in zip(costs.BI, costs.BW, strict=True)]
    else:
        backward = list(costs.full_backward())
    return [f + b for f, b in zip(costs.F, backward, strict=True)]


def _least_peak(
    candidate: Candidate,
    num_meshes: int,
    plain: UnitCosts,
    rematted: UnitCosts | None,
    donate: bool,
) -> int:
    """The lower of the candidate's peak and its peak with every stage rematted."""
    least = max(candidate.peak_bytes)
    if rematted is not None:
        everything = predict(
            candidate.schedule, num_meshes, candidate.num_microbatches, candidate.unit_stages,
            [True] * candidate.num_stages, plain, rematted, donate=donate,
        )  # fmt: skip
        least = min(least, max(everything.peak_bytes))
    return least


def _nothing_fits(
    budget: int | None, smallest: int | None, names: Sequence[str], counts: Sequence[int]
) -> str:
    if budget is not None and smallest is not None:
        return (
            f"no configuration fits the memory budget of {budget:,} bytes per device; the "
            f"smallest predicted peak is {smallest:,} bytes (every stage rematted). Raise the "
            "budget to at least that, use more meshes, or smaller microbatches."
        )
    return (
        f"no schedule of {list(names)} accepts any stage count with {list(counts)} "
        "microbatches on this mesh; add schedules or microbatch counts."
    )
