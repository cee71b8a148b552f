"""What `nnx-mpmd bench` measures besides step time: host overhead, memory, bubble.

`Variant` is one timed step; `measure_overhead` replays a step's instruction
list with every program replaced by a cached result (the runtime's own host
work), `measure_memory` compares measured activation peaks with the
simulator's, and `measure_bubble` replays the schedule with measured task
times.

Example:
    >>> from nnx_mpmd.apps.bench_probes import median
    >>> median([3.0, 1.0, 2.0])
    2.0
"""

from __future__ import annotations

import dataclasses
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "Variant",
    "block",
    "measure_bubble",
    "measure_memory",
    "measure_overhead",
    "median",
    "task_durations",
]


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def block(x: Any) -> Any:
    return sys.modules["jax"].block_until_ready(x)


class Variant:
    """One timed step: a name, the callable, its arguments and its batches."""

    # ``step``: an `mp.jit` function (its probes read its attributes) or a jax.jit one.
    def __init__(self, name: str, step: Any, args: tuple, batches: list) -> None:
        self.name, self.step, self.args, self.batches = name, step, args, batches
        self.times: list[float] = []
        self.host_cpu: list[float] = []  # CPU seconds of the calling thread in the call
        self.process_cpu: list[float] = []  # CPU seconds of all threads until ready
        self.first_step_s = float("nan")

    # A step is done when its outputs AND the updated model/optimizer state are: the
    # loss alone can be ready long before the last update (under GPipe it is complete
    # once the forwards ran).
    def first(self) -> None:
        start = time.perf_counter()
        block((self.step(*self.args, self.batches[0]), self.args))
        self.first_step_s = time.perf_counter() - start

    def once(self, n: int) -> None:
        batch = self.batches[n % len(self.batches)]
        cpu_start, start = process_cpu(), time.perf_counter()
        thread_start = time.thread_time()
        out = self.step(*self.args, batch)
        thread_end = time.thread_time()
        block((out, self.args))
        self.times.append(time.perf_counter() - start)
        self.process_cpu.append(process_cpu() - cpu_start)
        self.host_cpu.append(thread_end - thread_start)

    def clear(self) -> None:
        self.times.clear()
        self.host_cpu.clear()
        self.process_cpu.clear()

    def summary(self) -> dict[str, Any]:
        return {
            "median_s": median(self.times),
            "times_s": self.times,
            "host_cpu_ms": median(self.host_cpu) * 1e3,
            "process_cpu_s": median(self.process_cpu),
            "first_step_s": self.first_step_s,
        }


def process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _compiled_and_inputs(variant: Variant) -> tuple[Any, list[Any]]:
    # The step already ran on these arguments: this finds its lowering and programs.
    traced = variant.step.trace(*variant.args, variant.batches[0])
    step = traced.lower().compile().bound_programs.step
    return step, traced.call.inputs(step.consts)


#: Replays run before the timed ones in `measure_overhead`.
_WARM_REPLAYS = 20


def measure_overhead(variant: Variant, repeats: int) -> dict[str, Any]:
    """Host time of the executor with every program replaced by a cached no-op.

    What remains is the runtime's own work (timed after ``_WARM_REPLAYS`` replays);
    ``dispatch_us_per_task`` is a real step's host time until `execute` returns, per task.
    """
    from nnx_mpmd.compiler.ir import Call
    from nnx_mpmd.runtime.executor import execute
    from nnx_mpmd.runtime.interpreter import PreparedCache

    compiled, inputs = _compiled_and_inputs(variant)
    submeshes = list(variant.step.mesh.submeshes)
    results: dict[int, Any] = {}

    def recording(n: int, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            results[n] = fn(*args)
            return results[n]

        return run

    def replaying(n: int) -> Callable[..., Any]:
        return lambda *args: results[n]

    calls = [(n, ins) for n, ins in enumerate(compiled.instructions) if isinstance(ins, Call)]
    recorder = _with_fns(compiled, {n: recording(n, ins.fn) for n, ins in calls})
    block(execute(recorder, inputs, submeshes))
    replay = _with_fns(compiled, {n: replaying(n) for n, _ in calls})
    replay_steps, compiled_steps = PreparedCache(), PreparedCache()  # prepared once each
    # Untimed: the first replay prepares its instruction list, and on the 2-core CI
    # host the first ~20 replays after other work run ~1.7x slower than the
    # sustained loop (caches, the device threads waking up).
    for _ in range(_WARM_REPLAYS):
        block(execute(replay, inputs, submeshes, prepared=replay_steps))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        block(execute(replay, inputs, submeshes, prepared=replay_steps))
        times.append(time.perf_counter() - start)
    dispatch = []
    for _ in range(max(3, repeats // 4)):
        start = time.perf_counter()
        out = execute(compiled, inputs, submeshes, prepared=compiled_steps)
        dispatch.append(time.perf_counter() - start)
        block(out)
    n_ins = len(compiled.instructions)
    n_tasks = sum(1 for _, ins in calls if ins.task is not None)
    return {
        "instructions": n_ins,
        "stage_tasks": n_tasks,
        "us_per_instruction": median(times) / n_ins * 1e6,
        "us_per_task": median(times) / n_tasks * 1e6,
        "dispatch_us_per_task": median(dispatch) / n_tasks * 1e6,
    }


def _with_fns(compiled: Any, fns: dict[int, Callable[..., Any]]) -> Any:
    instructions = [
        dataclasses.replace(ins, fn=fns[n]) if n in fns else ins
        for n, ins in enumerate(compiled.instructions)
    ]
    return dataclasses.replace(compiled, instructions=instructions)


def measure_memory(variant: Variant) -> dict[str, Any]:
    """Measured peak live bytes per mesh vs the simulator's prediction.

    The prediction is ``simulate(tasks).peak_activations[q]`` times the median
    bytes one lone forward task on mesh ``q`` keeps (its sends and residuals); the
    measured activation peak is the peak during the pipelined region minus the
    bytes held just before the region's first stage task.
    """
    from nnx_mpmd.schedules import simulate

    compiled, _ = _compiled_and_inputs(variant)
    block(variant.step(*variant.args, variant.batches[0], memory=True))
    mem = variant.step.last_memory
    timeline = mem["timeline"]
    labels = {label for _, label, _, _ in mem["task_output_bytes"]}
    task_rows = [i for i, (_, label, _) in enumerate(timeline) if label in labels]
    first, last = task_rows[0], task_rows[-1]
    num_meshes = len(mem["peak_bytes"])
    base = timeline[first - 1][2]
    region_peak = [max(row[2][q] for row in timeline[first : last + 1]) for q in range(num_meshes)]
    per_mesh: list[list[int]] = [[] for _ in range(num_meshes)]
    for q, label, _, nbytes in mem["task_output_bytes"]:
        # Lone forwards only: a fused F+B or an overlapped group also outputs gradients.
        if label.startswith("F") and not label.startswith("FB") and "+" not in label:
            per_mesh[q].append(nbytes)
    peaks = simulate(compiled.tasks).peak_activations
    predicted = [int(p * (median(b) if b else 0)) for p, b in zip(peaks, per_mesh)]
    return {
        "peak_bytes": mem["peak_bytes"],
        "activation_peak_bytes": [r - b for r, b in zip(region_peak, base)],
        "predicted_activation_bytes": predicted,
        "peak_activations": list(peaks),
    }


def task_durations(records: Sequence[Sequence[Any]]) -> dict[tuple[int, str], list[float]]:
    """Measured seconds per ``(stage, kind)`` of a profile's stage tasks, in profile order.

    Fused programs keep kind ``"FB"``; overlapped ones split as `measured_timeline` draws them.

    Example:
      >>> from nnx_mpmd.schedules.tasks import Task
      >>> pair = (Task(1, 3, "F", with_next=True), Task(0, 1, "B"))
      >>> task_durations([(0, "F1.3+B0.1", pair, 0.0, 3.0), (0, "opt", None, 3.0, 4.0)])
      {(1, 'F'): [1.0], (0, 'B'): [2.0]}
    """
    from nnx_mpmd.schedules import Costs
    from nnx_mpmd.schedules.validate import group_intervals

    durations: dict[tuple[int, str], list[float]] = {}
    for _, label, task, start, end in records:
        if task is None:
            continue
        if isinstance(task, tuple):
            weights = [Costs().duration(member) for member in task]
            for member, at, until in group_intervals(task, weights, start, end - start):
                durations.setdefault((member.stage, member.kind), []).append(until - at)
            continue
        kind = "FB" if label.startswith("FB") else task.kind
        durations.setdefault((task.stage, kind), []).append(end - start)
    return durations


def measure_bubble(variant: Variant) -> dict[str, Any]:
    """Bubble of the schedule with measured task times vs nominal costs.

    Profiling waits for every task, so measured medians are fed to the simulator;
    a fused forward+backward is split in the other stages' F:B ratio.
    """
    from nnx_mpmd.schedules import Costs, simulate

    compiled, _ = _compiled_and_inputs(variant)
    block(variant.step(*variant.args, variant.batches[0], profile="isolated"))
    med = {key: median(v) for key, v in task_durations(variant.step.last_profile).items()}
    ratios = [med[(s, "B")] / med[(s, "F")] for s, k in med if k == "F" and (s, "B") in med]
    b_over_f = median(ratios) if ratios else 2.0
    per_stage: dict[int, dict[str, float]] = {}
    for (stage, kind), value in med.items():
        costs = per_stage.setdefault(stage, {})
        if kind == "FB":
            costs.setdefault("F", value / (1 + b_over_f))
            costs.setdefault("B", value * b_over_f / (1 + b_over_f))
        else:
            costs[kind] = value
    measured = simulate(compiled.tasks, Costs(per_stage=per_stage)).bubble_fraction
    return {
        "measured_bubble": float(measured),
        "simulated_bubble": float(simulate(compiled.tasks, Costs()).bubble_fraction),
        "stage_costs_ms": {
            str(s): {k: round(v * 1e3, 3) for k, v in c.items()} for s, c in per_stage.items()
        },
    }
