"""Host work per task and per step, two versions of the code side by side.

For GPT ``tiny`` and ``small`` (the `nnx-mpmd bench` settings: 4 meshes x 2
data CPU devices, m = 8, batch 64, seq 32) and the schedules given, a worker
process per version and preset reports, per schedule:

* the no-op replay's µs per stage task, median and minimum over 60 replays
  (every program replaced by its recorded result, as `nnx-mpmd bench`'s
  **µs/task (no-op)**: what remains is the runtime's own work), taken between
  real steps (so devices may still be busy), and again over 200 replays after
  the real steps have finished (**quiet**);
* the host CPU ms of a real step (the calling thread's CPU time until the step
  returns, not blocked), median and minimum over 16 steps;
* the wall time of those steps until their results are ready (median), and
  the program calls per step.

Replays and steps of the schedules alternate inside a worker; workers of the
two versions alternate, ``--rounds`` times. ``--before`` is a checkout of the
code before a change (``git worktree add /tmp/before <rev>``); ``--after``
defaults to this checkout. Prints one JSON line per row and a Markdown table,
and writes ``benchmarks/results/<date>-host-overhead.json``.

Run: ``.venv/bin/python benchmarks/host_overhead_bench.py --before /tmp/before``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _replay(variant):
    """The step's instruction list with every program replaced by its recorded result."""
    import dataclasses

    from nnx_mpmd.apps.bench_probes import _compiled_and_inputs, block
    from nnx_mpmd.compiler.ir import Call
    from nnx_mpmd.runtime import executor
    from nnx_mpmd.runtime.interpreter import PreparedCache

    compiled, inputs = _compiled_and_inputs(variant)
    submeshes = list(variant.step.mesh.submeshes)
    calls = [(n, ins) for n, ins in enumerate(compiled.instructions) if isinstance(ins, Call)]
    results = {}

    def recording(n, fn):
        def run(*args):
            results[n] = fn(*args)
            return results[n]

        return run

    def with_fns(fns):
        instructions = [
            dataclasses.replace(ins, fn=fns[n]) if n in fns else ins
            for n, ins in enumerate(compiled.instructions)
        ]
        return dataclasses.replace(compiled, instructions=instructions)

    block(executor.execute(with_fns({n: recording(n, i.fn) for n, i in calls}), inputs, submeshes))

    def replaying(n):
        return lambda *args: results[n]

    replay, prepared = with_fns({n: replaying(n) for n, _ in calls}), PreparedCache()
    tasks = sum(1 for _, ins in calls if ins.task is not None)
    return (
        lambda: block(executor.execute(replay, inputs, submeshes, prepared=prepared)),
        tasks,
        len(calls),
    )


def _quiet_replays(replay, count: int = 200) -> list[float]:
    """Seconds per replay with no real step in flight (the runtime's own work alone)."""
    for _ in range(20):
        replay()
    times = []
    for _ in range(count):
        start = time.perf_counter()
        replay()
        times.append(time.perf_counter() - start)
    return times


def worker(preset: str, schedules: list[str]) -> list[dict]:
    """One version's rows (runs inside a worker process, importing that version)."""
    from nnx_mpmd.apps import bench
    from nnx_mpmd.models.presets import GPT_PRESETS

    settings = bench.BenchSettings(presets=(preset,), schedules=tuple(schedules))
    bench._setup_devices(settings.num_meshes * settings.data)
    batches = bench._batches(settings, settings.batch, 3, GPT_PRESETS[preset]["vocab_size"])
    variants = {name: bench._pipelined(settings, preset, name, batches)[0] for name in schedules}
    for variant in variants.values():
        for r in range(3):
            variant.once(r)
        variant.clear()
    replays = {name: _replay(v) for name, v in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in schedules}
    for _ in range(4):
        for name, variant in variants.items():
            for r in range(4):
                variant.once(r)
            replay = replays[name][0]
            for _ in range(15):
                start = time.perf_counter()
                replay()
                times[name].append(time.perf_counter() - start)
    quiet = {name: _quiet_replays(replay) for name, (replay, _, _) in replays.items()}
    rows = []
    for name, variant in variants.items():
        _, tasks, num_calls = replays[name]
        rows.append(
            {
                "preset": preset,
                "schedule": name,
                "tasks": tasks,
                "calls": num_calls,
                "us_per_task_median": statistics.median(times[name]) / tasks * 1e6,
                "us_per_task_min": min(times[name]) / tasks * 1e6,
                "us_per_task_quiet_median": statistics.median(quiet[name]) / tasks * 1e6,
                "us_per_task_quiet_min": min(quiet[name]) / tasks * 1e6,
                "host_cpu_ms_median": statistics.median(variant.host_cpu) * 1e3,
                "host_cpu_ms_min": min(variant.host_cpu) * 1e3,
                "step_ms_median": statistics.median(variant.times) * 1e3,
                "load": os.getloadavg()[0],
            }
        )
    return rows


def run_worker(root: str, preset: str, schedules: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, os.path.abspath(__file__), "--worker", preset, schedules]
    out = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise SystemExit(f"worker for {root} failed:\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in lines]


def _table(rows: list[dict]) -> str:
    lines = [
        "| preset / schedule | version | µs/task median (per round) | µs/task min "
        "| quiet µs/task median (per round) | quiet µs/task min "
        "| host CPU ms median (per round) | host CPU ms min | step ms median (per round) "
        "| calls |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    keys = sorted({(r["preset"], r["schedule"], r["version"]) for r in rows})
    for preset, schedule, version in keys:
        rs = [
            r
            for r in rows
            if (r["preset"], r["schedule"], r["version"]) == (preset, schedule, version)
        ]
        medians = ", ".join(f"{r['us_per_task_median']:.1f}" for r in rs)
        cpus = ", ".join(f"{r['host_cpu_ms_median']:.1f}" for r in rs)
        quiet = ", ".join(f"{r.get('us_per_task_quiet_median', float('nan')):.1f}" for r in rs)
        quiet_min = min(r.get("us_per_task_quiet_min", float("nan")) for r in rs)
        steps = ", ".join(f"{r.get('step_ms_median', float('nan')):.1f}" for r in rs)
        lines.append(
            f"| {preset} {schedule} | {version} | {medians} | "
            f"{min(r['us_per_task_min'] for r in rs):.1f} | {quiet} | {quiet_min:.1f} | {cpus} | "
            f"{min(r['host_cpu_ms_min'] for r in rs):.1f} | {steps} | {rs[0].get('calls', '')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=2, metavar=("PRESET", "SCHEDULES"))
    parser.add_argument("--before", required="--worker" not in sys.argv)
    parser.add_argument("--after", default=os.path.dirname(HERE))
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--schedules", default="1f1b,zb-h1")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.worker:
        for row in worker(args.worker[0], args.worker[1].split(",")):
            print(json.dumps(row), flush=True)
        return
    rows = []
    for rnd in range(args.rounds):
        for preset in args.presets.split(","):
            for version, root in (("before", args.before), ("after", args.after)):
                for row in run_worker(root, preset, args.schedules):
                    rows.append({"version": version, "round": rnd, **row})
                    print(json.dumps(rows[-1]), flush=True)
    print(_table(rows))
    path = os.path.join(HERE, "results", f"{datetime.date.today()}-host-overhead.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
