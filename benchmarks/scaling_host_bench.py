"""Host time per step as the work grows: microbatches (8...256) and stages (2...32).

For each (stages, microbatches) the step of a toy pipeline (one Linear+tanh per
stage, one CPU device per stage, 1F1B) is compiled and run once; then its
instruction list is replayed with every program replaced by its recorded
result (the no-op replay of `nnx-mpmd bench`, as ``host_overhead_bench.py``
builds it), so what is timed is the runtime's own host work: arguments,
results, transfers, frees. Reported per row: stage tasks, instructions, ms of
host time per step (median and fastest), µs per task, the host thread's CPU
time per task (what the host work costs without the waits for a core on a
loaded machine), the CPU time of the process's other threads per task (XLA's
CPU client runs every copy on its worker pool, whose threads spin while they
look for work and take cores from the host thread), how often the host thread
was preempted, and how much of the wall time is spent inside JAX's batched
copy (the transfers between meshes) and outside it.

The sweep is a cross by default: microbatches at the largest stage count and
stages at the largest microbatch count (``--grid full`` runs every pair). A
straight line through (tasks, host time) per sweep gives the marginal µs per
task; the growth exponent says whether the time is linear in tasks (1.0).
``--profile`` adds a cProfile of the largest replay (the top functions by own
time), which says where the time goes; the copy floor line times JAX's batched
copy alone, without nnx_mpmd. ``--replot FILE`` prints the tables and draws
the figures again from an ``--out`` file.

Run (32 simulated CPU devices)::

    .venv/bin/python benchmarks/scaling_host_bench.py [--stages 2,4,8,16,32]
        [--microbatches 8,16,32,64,128,256] [--grid cross|full] [--repeats 10]
        [--plot-dir docs/img] [--out results.json] [--profile] [--replot results.json]
        [--nice-other-threads 10]

``--nice-other-threads N`` gives every other thread of the process (XLA's worker
and compute pools) the nice value ``N`` (a lower priority) before timing, on Linux:
an experiment that shows how much of the host time is the host thread waiting
for a core those threads hold (see docs/guides/performance.md).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import scaling_common as common

#: The host time per task the issue asks for at 32 stages x 256 microbatches.
GOAL_US_PER_TASK = 15.0
#: Untimed replays before the timed ones (the first prepare the instruction list).
WARM_REPLAYS = 10


def _pairs(stages: list[int], microbatches: list[int], grid: str) -> list[tuple[int, int]]:
    """The (stages, microbatches) rows: a cross through the largest sizes, or every pair."""
    if grid == "full":
        return [(s, m) for s in stages for m in microbatches]
    cross = [(max(stages), m) for m in microbatches] + [(s, max(microbatches)) for s in stages]
    return sorted(set(cross))


class CopyTimer:
    """Seconds and arrays in JAX's batched copies (the transfers' device-to-device moves).

    Wraps the batched copies the runtime's `BatchedCopier` calls (a batch's
    first run, and every run on its plan), so the host time of a replay
    splits into JAX's copy calls and everything else.
    """

    #: The names in nnx_mpmd.runtime.batched_copy that call JAX's batched copy.
    NAMES = ("batched_copy", "batched_copy_prepared")

    def __init__(self) -> None:
        self.seconds, self.arrays = 0.0, 0

    def __enter__(self) -> CopyTimer:
        from nnx_mpmd.runtime import batched_copy as module

        self._module = module
        self._originals = {
            name: getattr(module, name) for name in self.NAMES if hasattr(module, name)
        }
        for name, original in self._originals.items():
            setattr(module, name, self._timed(original))
        return self

    def _timed(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def timed(values: Any, *rest: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(values, *rest)
            finally:
                self.seconds += time.perf_counter() - start
                self.arrays += len(values)

        return timed

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(self._module, name, original)


def measure(
    num_stages: int, num_microbatches: int, repeats: int, niceness: int = 0
) -> tuple[dict, object]:
    """One row: the no-op replay's host time for this pipeline size, and the replay.

    ``niceness`` > 0: the other threads get that nice value before the timed replays.
    """
    from host_overhead_bench import _replay

    from nnx_mpmd.apps.bench_probes import Variant

    step, (model, optimizer), batch = common.pipelined(num_stages, num_microbatches)
    variant = Variant(f"{num_stages}x{num_microbatches}", step, (model, optimizer), [batch])
    first_s, _ = common.seconds(variant.first)
    replay, tasks, calls = _replay(variant)
    for _ in range(WARM_REPLAYS):  # untimed: the first replays prepare the instruction list
        replay()
    nice_other_threads(niceness)  # after the warm replays, which may start threads
    times, cpu_times, process_times, copy_times, arrays = [], [], [], [], 0
    preemptions_start = _host_thread_preemptions()
    for _ in range(repeats):
        with CopyTimer() as copies:
            # The process's interval holds the thread's, so the other threads' share is >= 0.
            process_start = time.process_time()
            cpu_start = time.thread_time()
            times.append(common.seconds(replay)[0])
            cpu_times.append(time.thread_time() - cpu_start)
            process_times.append(time.process_time() - process_start)
        copy_times.append(copies.seconds)
        arrays = copies.arrays
    preemptions = _host_thread_preemptions() - preemptions_start
    other_threads_s = statistics.median(p - c for p, c in zip(process_times, cpu_times))
    step_s, copy_s = statistics.median(times), statistics.median(copy_times)
    outside_s = statistics.median(t - c for t, c in zip(times, copy_times))
    return {
        "stages": num_stages,
        "microbatches": num_microbatches,
        "tasks": tasks,
        "calls": calls,
        "instructions": len(step.lower(model, optimizer, batch).compiled.instructions),
        "host_ms_per_step": step_s * 1e3,
        "host_ms_per_step_min": min(times) * 1e3,
        "us_per_task": step_s / tasks * 1e6,
        "us_per_task_min": min(times) / tasks * 1e6,
        "cpu_us_per_task": statistics.median(cpu_times) / tasks * 1e6,
        "other_threads_cpu_us_per_task": other_threads_s / tasks * 1e6,
        "preemptions_per_task": preemptions / (repeats * tasks),
        "copy_us_per_task": copy_s / tasks * 1e6,
        "outside_copies_us_per_task": outside_s / tasks * 1e6,
        "arrays_copied_per_step": arrays,
        "first_step_s": first_s,
        "other_threads_niceness": niceness,
        "load": os.getloadavg()[0],
    }, replay


def _host_thread_preemptions() -> int:
    """How often the calling thread was preempted (involuntary context switches) so far.

    Per thread on Linux only; elsewhere the whole process's count.
    """
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    return resource.getrusage(who).ru_nivcsw


def nice_other_threads(niceness: int) -> int:
    """Gives every other thread the nice value ``niceness`` (Linux); returns how many it set.

    Only the benchmark does this, to measure the effect; ``nnx_mpmd`` never does.
    """
    import threading

    if niceness <= 0 or not os.path.isdir("/proc/self/task"):
        return 0
    me = threading.get_native_id()
    others = [int(t) for t in os.listdir("/proc/self/task") if int(t) != me]
    done = 0
    for tid in others:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
            done += 1
        except ProcessLookupError:  # the thread ended since the listing
            pass
    return done


def copy_floor(batch_sizes: tuple[int, ...] = (1, 16), repeats: int = 200) -> dict[str, float]:
    """µs per array of JAX's batched copy alone (16 floats, CPU device 0 -> 1), no nnx_mpmd.

    The floor under a transfer's host cost: what one array moved between two
    devices costs in JAX itself, per batch size (arrays moved in one call).
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from nnx_mpmd._jax_compat import batched_copy, sharding_device_list

    source, target = jax.devices()[:2]
    out = {}
    for k in batch_sizes:
        values = [jax.device_put(jnp.full((common.WIDTH,), float(i)), source) for i in range(k)]
        targets = [SingleDeviceSharding(target)] * k
        device_lists = [sharding_device_list(t) for t in targets]
        times = []
        for _ in range(repeats):
            t, moved = common.seconds(lambda: batched_copy(values, device_lists, targets))  # noqa: B023
            jax.block_until_ready(moved)
            times.append(t)
        out[f"{k} per call"] = statistics.median(times) / k * 1e6
    return out


def sweeps(rows: list[dict]) -> dict[str, list[dict]]:
    """The rows of each sweep: microbatches at the most stages, stages at the most microbatches."""
    max_s = max(r["stages"] for r in rows)
    max_m = max(r["microbatches"] for r in rows)
    return {
        f"{max_s} stages, microbatches vary": sorted(
            (r for r in rows if r["stages"] == max_s), key=lambda r: r["tasks"]
        ),
        f"{max_m} microbatches, stages vary": sorted(
            (r for r in rows if r["microbatches"] == max_m), key=lambda r: r["tasks"]
        ),
    }


def linear_fit(rows: list[dict]) -> dict:
    """Host µs per step (fastest replay) = a + b * tasks, least squares: b is the marginal µs per task.

    The fastest replay, not the median: on a loaded host the median carries the
    waits for a core, which do not grow with the work.
    """
    xs = [r["tasks"] for r in rows]
    ys = [r["host_ms_per_step_min"] * 1e3 for r in rows]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else float("nan")
    intercept = my - slope * mx
    total = sum((y - my) ** 2 for y in ys)
    residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
    return {
        "us_per_task_marginal": slope,
        "intercept_us": intercept,
        "r2": 1 - residual / total if total else float("nan"),
        "growth_exponent": common.growth_exponent(xs, ys) if len(set(xs)) > 1 else float("nan"),
    }


def profile_replay(replay: Callable[[], object], top: int = 15) -> str:
    """cProfile of 5 no-op replays: the functions with the most own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        replay()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def plots(rows: list[dict], plot_dir: str) -> list[str]:
    """Host ms per step against tasks, and µs per task against tasks (one PNG each)."""
    groups = {k: rs for k, rs in sweeps(rows).items() if len(rs) > 1}
    xs = {k: [r["tasks"] for r in rs] for k, rs in groups.items()}
    per_step = {k: (xs[k], [r["host_ms_per_step"] for r in rs]) for k, rs in groups.items()}
    per_step.update(
        {f"{k} (fastest)": (xs[k], [r["host_ms_per_step_min"] for r in rs])
         for k, rs in groups.items()}
    )  # fmt: skip
    per_task = {k: (xs[k], [r["us_per_task"] for r in rs]) for k, rs in groups.items()}
    per_task.update(
        {f"{k}: outside JAX's copies": (xs[k], [r["outside_copies_us_per_task"] for r in rs])
         for k, rs in groups.items()}
    )  # fmt: skip
    return [
        common.plot_lines(
            os.path.join(plot_dir, "scaling-host-per-step.png"),
            "Host time per step, programs replaced by no-ops (1F1B, CPU)",
            "stage tasks per step",
            "host ms per step",
            per_step,
        ),
        common.plot_lines(
            os.path.join(plot_dir, "scaling-host-per-task.png"),
            "Host time per stage task, programs replaced by no-ops (1F1B, CPU)",
            "stage tasks per step",
            "µs per task",
            per_task,
            logy=False,
            hline=(GOAL_US_PER_TASK, f"goal {GOAL_US_PER_TASK:g} µs/task"),
        ),
    ]


def report(rows: list[dict], fits: dict[str, dict]) -> str:
    """The Markdown table of the rows and the fit's line."""
    header = ["stages", "microbatches", "tasks", "instructions", "host ms/step", "fastest", "µs/task",
              "host thread CPU µs/task", "other threads CPU µs/task", "host thread preempted/task",
              "of which JAX's copies µs/task", "outside the copies µs/task",
              "arrays copied/step", "first step s"]  # fmt: skip
    table = common.markdown_table(
        header,
        [
            [
                r["stages"],
                r["microbatches"],
                r["tasks"],
                r["instructions"],
                r["host_ms_per_step"],
                r["host_ms_per_step_min"],
                r["us_per_task"],
                r.get("cpu_us_per_task", float("nan")),
                r.get("other_threads_cpu_us_per_task", float("nan")),
                r.get("preemptions_per_task", float("nan")),
                r["copy_us_per_task"],
                r["outside_copies_us_per_task"],
                r["arrays_copied_per_step"],
                r["first_step_s"],
            ]
            for r in rows
        ],
    )
    lines = [
        f"* {name}: host µs/step = {fit['intercept_us']:.0f} + "
        f"{fit['us_per_task_marginal']:.2f} × tasks (R² = {fit['r2']:.4f}); "
        f"growth exponent {fit['growth_exponent']:.2f} (1.00 = linear)."
        for name, fit in fits.items()
    ]
    return table + "\n\nFits, per sweep:\n\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="2,4,8,16,32")
    parser.add_argument("--microbatches", default="8,16,32,64,128,256")
    parser.add_argument("--grid", choices=("cross", "full"), default="cross")
    parser.add_argument("--repeats", type=int, default=10, help="timed replays per row")
    parser.add_argument("--plot-dir", default=None, help="write the PNG figures here")
    parser.add_argument("--out", default=None, help="write the rows and the fit here (JSON)")
    parser.add_argument("--profile", action="store_true", help="cProfile the largest replay")
    parser.add_argument("--replot", default=None, help="tables and figures from this --out file")
    parser.add_argument(
        "--nice-other-threads", type=int, default=0, help="the other threads' nice value"
    )
    args = parser.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            result = json.load(f)
        print(report(result["rows"], result["fits"]))
        if args.plot_dir:
            print("wrote", ", ".join(plots(result["rows"], args.plot_dir)))
        return result
    stages = [int(x) for x in args.stages.split(",")]
    microbatches = [int(x) for x in args.microbatches.split(",")]
    common.setup_devices(max(stages))
    rows, largest = [], None
    for s, m in _pairs(stages, microbatches, args.grid):
        row, replay = measure(s, m, args.repeats, args.nice_other_threads)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if largest is None or row["tasks"] >= largest[0]:
            largest = (row["tasks"], replay)
    floor = copy_floor()
    print("JAX's batched copy alone, µs per array:", json.dumps(floor))
    fits = {name: linear_fit(rs) for name, rs in sweeps(rows).items() if len(rs) > 1}
    print(report(rows, fits))
    result = {
        "rows": rows,
        "fits": fits,
        "copy_floor_us_per_array": floor,
        "goal_us_per_task": GOAL_US_PER_TASK,
        "time": time.time(),
    }
    if args.profile and largest is not None:
        result["profile"] = profile_replay(largest[1])
        print(result["profile"])
    if args.plot_dir:
        result["plots"] = plots(rows, args.plot_dir)
        print("wrote", ", ".join(result["plots"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
