"""Lowering and compile time as the work grows, and the stage partitioner at 100,000 layers.

Four parts, each a table (and a PNG with ``--plot-dir``):

* **lowering** against stage tasks: ``step.lower()`` (tracing and every
  lowering pass, no XLA compile of the stage programs) for a toy pipeline of
  ``S`` stages at ``m`` microbatches, with each pass timed on its own (its time
  less the passes it calls) by wrapping the pass functions where the
  compiler's pass managers (`compile_step`, `build_region_program`, `plan_outer_problem`)
  call them. Each pass's growth exponent over the sizes is fitted; an n log n
  pass shows about ``nlogn_exponent`` (printed), a quadratic one 2.
* **layers**: the first step's ``lower().compile()`` seconds against layers on
  2 stages, unrolled (one call per layer) against one `mp.ScanStack` split over
  the stages (one scanned block per stage: flat in layers).
* **stages**: the same against stages (one layer per stage), with the
  distinct programs compiled: equal stages share one program.
* **partitioner**: `balanced_partition` of random weights into 32 and 64 stages.

Run (32 simulated CPU devices)::

    .venv/bin/python benchmarks/scaling_compile_bench.py [--parts lowering,layers,stages,partitioner]
        [--lowering-sizes 4x8,8x16,...] [--layers 4,8,16,32,64] [--stages 2,4,8,16,32]
        [--partition-sizes 1000,10000,100000] [--plot-dir docs/img] [--out results.json]

``--replot FILE`` prints the tables and draws the figures again from an ``--out`` file.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import scaling_common as common

#: Where each pass is called: (module, function names). Modules or names a later
#: version moved are skipped (the pass then counts in its caller's time).
PASS_SITES = {
    "nnx_mpmd.compiler.final.step": [
        "trace_step", "cut_stages", "schedule_tasks", "describe_inputs", "insert_frees",
        "donate_dead_arguments", "donate_step_inputs", "schedule_ticks", "batch_transfers",
        "merge_frees", "dedupe_programs",
    ],
    "nnx_mpmd.compiler.region.region_plan": [
        "compile_stage_programs", "lower_schedule", "overlap_tasks", "fuse_forward_backward",
        "reduce_gradients_once", "insert_transfers", "region_outputs", "assign_slots",
    ],
    "nnx_mpmd.compiler.outer.mesh_inference": [
        "locate_region", "needed_meshes", "assign_meshes", "level_equations",
        "defer_equations", "pack_transfers", "kept_values", "drop_unread_equations",
        "split_common_parts", "emit_outer_program", "report_transfers",
    ],
}  # fmt: skip


class PassTimer:
    """Times each pass's own seconds (less the timed passes it calls) while active.

    Example:
        >>> import types
        >>> mod = types.ModuleType("m"); mod.f = lambda: 1
        >>> sys.modules["m"] = mod
        >>> with PassTimer({"m": ["f"]}) as timer:
        ...     _ = mod.f()
        >>> sorted(timer.seconds)
        ['f']
    """

    def __init__(
        self,
        sites: dict[str, list[str]] = PASS_SITES,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.sites, self.clock = sites, clock
        self.seconds: dict[str, float] = {}
        self._saved: list[tuple[Any, str, Any]] = []
        self._stack: list[float] = []  # seconds spent in timed callees, per open call

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append(0.0)
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = self.clock() - start
                inner = self._stack.pop()
                self.seconds[name] = self.seconds.get(name, 0.0) + elapsed - inner
                if self._stack:
                    self._stack[-1] += elapsed

        return timed

    def __enter__(self) -> PassTimer:
        for module_name, names in self.sites.items():
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            for name in names:
                if callable(getattr(module, name, None)):
                    self._saved.append((module, name, getattr(module, name)))
                    setattr(module, name, self._wrap(name, getattr(module, name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()


def _parse_sizes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",")]  # type: ignore[misc]


def lowering_rows(sizes: list[tuple[int, int]], repeats: int = 3) -> list[dict]:
    """``step.lower()`` seconds and each pass's own seconds, per (stages, microbatches).

    Each size is lowered ``repeats`` times (a fresh step each time); every figure is
    the fastest of them, in CPU seconds of the lowering thread (``time.thread_time``:
    lowering runs in the caller's thread), which a loaded host inflates far less
    than wall seconds.
    """
    rows = []
    step, (model, optimizer), batch = common.pipelined(2, 2)
    step.lower(model, optimizer, batch)  # untimed: JAX's and the compiler's first-use work
    for s, m in sizes:
        samples = []
        for _ in range(repeats):
            step, (model, optimizer), batch = common.pipelined(s, m)
            with PassTimer(clock=time.thread_time) as timer:
                start = time.thread_time()
                lowered = step.lower(model, optimizer, batch)
                total = time.thread_time() - start
            passes = dict(timer.seconds)
            passes["(rest)"] = max(total - sum(passes.values()), 0.0)
            samples.append((total, passes))
            tasks = sum(len(ts) for ts in lowered.compiled.tasks)
            del step, model, optimizer, lowered
        names = {n for _, p in samples for n in p}
        rows.append({"stages": s, "microbatches": m, "tasks": tasks,
                     "lower_s": min(t for t, _ in samples),
                     "passes_s": {n: min(p.get(n, 0.0) for _, p in samples) for n in names}})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _exponent(rows: list[dict], seconds: Callable[[dict], float]) -> float:
    times = [seconds(r) for r in rows]
    if len(rows) < 2 or min(times) <= 0:
        return float("nan")
    return common.growth_exponent([r["tasks"] for r in rows], times)


def pass_growth(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per pass: its seconds at the largest size and its growth exponent in tasks.

    Two fits: over every size, and over the sizes at the most stages (only the
    microbatches grow there, so nothing but the task count changes).
    """
    max_s = max(r["stages"] for r in rows)
    fixed = [r for r in rows if r["stages"] == max_s]
    names = sorted({n for r in rows for n in r["passes_s"]})
    out = {}
    for name in names:
        out[name] = {
            "largest_s": rows[-1]["passes_s"].get(name, 0.0),
            "exponent": _exponent(rows, lambda r, n=name: r["passes_s"].get(n, 0.0)),
            "exponent_fixed_stages": _exponent(fixed, lambda r, n=name: r["passes_s"].get(n, 0.0)),
        }
    out["lower (total)"] = {
        "largest_s": rows[-1]["lower_s"],
        "exponent": _exponent(rows, lambda r: r["lower_s"]),
        "exponent_fixed_stages": _exponent(fixed, lambda r: r["lower_s"]),
    }
    return out


def compile_one(stages: int, per_stage: int, scan: bool) -> dict:
    """The first step's ``lower()`` and ``compile()`` seconds, in this (fresh) process."""
    from nnx_mpmd.aot.stats import count_compilations

    step, (model, optimizer), batch = common.pipelined(stages, 4, per_stage, scan=scan)
    with count_compilations() as counter:
        lower_s, lowered = common.seconds(functools.partial(step.lower, model, optimizer, batch))
        compile_s, _ = common.seconds(lowered.compile)
    return {"stages": stages, "layers": stages * per_stage,
            "variant": "scanned" if scan else "unrolled", "lower_s": lower_s,
            "compile_s": compile_s, "total_s": lower_s + compile_s,
            "programs": len(lowered.compiled.programs), "xla_compilations": counter.count}  # fmt: skip


def compile_rows(counts: list[int], *, vary: str) -> list[dict]:
    """`compile_one` per layer or stage count, each in a fresh process (no cache is warm).

    ``vary="layers"``: 2 stages, unrolled and scanned; ``vary="stages"``: one layer per stage.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "NNX_MPMD_"))}
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    rows = []
    for n in counts:
        for scan in (False, True) if vary == "layers" else (False,):
            stages, per_stage = (2, n // 2) if vary == "layers" else (n, 1)
            command = [sys.executable, os.path.abspath(__file__), "--compile-one",
                       str(stages), str(per_stage), str(int(scan))]  # fmt: skip
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode or not lines:
                raise SystemExit(f"{command} failed:\n{done.stderr[-3000:]}")
            rows.append(json.loads(lines[-1]))
            print(lines[-1], flush=True)
    return rows


def partition_rows(sizes: list[int], stage_counts: tuple[int, ...] = (32, 64)) -> list[dict]:
    """`balanced_partition` seconds for random weights, per (layers, stages)."""
    from nnx_mpmd.annotate.annotate import balanced_partition

    rows = []
    rng = random.Random(0)
    for n in sizes:
        weights = [rng.uniform(0.5, 2.0) for _ in range(n)]
        for s in stage_counts:
            if s <= n:
                cpu = time.thread_time()
                secs, parts = common.seconds(functools.partial(balanced_partition, weights, s))
                cpu = time.thread_time() - cpu  # CPU seconds: what a loaded host does not inflate
                rows.append({"layers": n, "stages": s, "seconds": secs, "cpu_seconds": cpu,
                             "last": parts[-1]})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    return rows


def plots(result: dict, plot_dir: str) -> list[str]:
    """One PNG per part that ran."""
    paths = []
    if "lowering" in result:
        rows = result["lowering"]
        tasks = [r["tasks"] for r in rows]
        top = sorted(rows[-1]["passes_s"], key=lambda n: -rows[-1]["passes_s"][n])[:6]
        lines = {"lower (total)": (tasks, [r["lower_s"] for r in rows])}
        lines.update({n: (tasks, [max(r["passes_s"].get(n, 0), 1e-6) for r in rows]) for n in top})
        paths.append(common.plot_lines(
            os.path.join(plot_dir, "scaling-lowering.png"),
            "Lowering time against stage tasks (its six costliest passes)",
            "stage tasks per step", "CPU seconds (lowering thread)", lines))  # fmt: skip
    if "layers" in result:
        rows = result["layers"]
        lines = {
            v: ([r["layers"] for r in rows if r["variant"] == v],
                [r["total_s"] for r in rows if r["variant"] == v])
            for v in ("unrolled", "scanned")
        }  # fmt: skip
        paths.append(common.plot_lines(
            os.path.join(plot_dir, "scaling-compile-layers.png"),
            "First step's lower + compile against layers (2 stages)",
            "layers", "seconds", lines, logy=False))  # fmt: skip
    if "stages" in result:
        rows = result["stages"]
        lines = {"lower + compile": ([r["stages"] for r in rows], [r["total_s"] for r in rows])}
        paths.append(common.plot_lines(
            os.path.join(plot_dir, "scaling-compile-stages.png"),
            "First step's lower + compile against stages (one layer each)",
            "stages", "seconds", lines, logy=False))  # fmt: skip
    if "partitioner" in result:
        rows = result["partitioner"]
        lines = {
            f"{s} stages": ([r["layers"] for r in rows if r["stages"] == s],
                            [r["seconds"] for r in rows if r["stages"] == s])
            for s in sorted({r["stages"] for r in rows})
        }  # fmt: skip
        paths.append(common.plot_lines(
            os.path.join(plot_dir, "scaling-partitioner.png"),
            "balanced_partition against layers", "layers", "seconds", lines,
            hline=(1.0, "goal: 1 s at 100,000 layers")))  # fmt: skip
    return paths


def report(result: dict) -> str:
    """The Markdown tables of the parts that ran."""
    out = []
    if "lowering" in result:
        rows = result["lowering"]
        out.append(common.markdown_table(
            ["stages", "microbatches", "tasks", "lower CPU s"],
            [[r["stages"], r["microbatches"], r["tasks"], r["lower_s"]] for r in rows]))  # fmt: skip
        growth = result["pass_growth"]
        ranked = sorted(growth, key=lambda n: -growth[n]["largest_s"])
        max_s = max(r["stages"] for r in rows)
        fixed = [r["tasks"] for r in rows if r["stages"] == max_s]
        nlogn_fixed = common.nlogn_exponent(fixed) if len(fixed) > 1 else float("nan")
        out.append(
            f"Growth exponent in tasks (n log n shows "
            f"{common.nlogn_exponent([r['tasks'] for r in rows]):.2f} over every size, "
            f"{nlogn_fixed:.2f} over the sizes at {max_s} stages):\n\n"
            + common.markdown_table(
                [
                    "pass",
                    "CPU seconds at the largest size",
                    "exponent, every size",
                    f"exponent, {max_s} stages",
                ],
                [
                    [
                        n,
                        growth[n]["largest_s"],
                        growth[n]["exponent"],
                        growth[n]["exponent_fixed_stages"],
                    ]
                    for n in ranked
                ],
            )
        )
    for part, key in (("layers", "layers"), ("stages", "stages")):
        if part in result:
            out.append(common.markdown_table(
                [key, "variant", "lower s", "compile s", "total s", "programs in the step",
                 "XLA compilations (distinct programs)"],
                [[r[key], r["variant"], r["lower_s"], r["compile_s"], r["total_s"],
                  r["programs"], r["xla_compilations"]] for r in result[part]]))  # fmt: skip
    if "partitioner" in result:
        out.append(common.markdown_table(
            ["layers", "stages", "seconds", "CPU seconds"],
            [[r["layers"], r["stages"], r["seconds"], r.get("cpu_seconds", float("nan"))]
             for r in result["partitioner"]]))  # fmt: skip
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="lowering,layers,stages,partitioner")
    parser.add_argument("--lowering-sizes", default="4x8,8x16,16x32,32x64,32x128,32x256",
                        help="stages x microbatches, comma-separated")  # fmt: skip
    parser.add_argument("--lowering-repeats", type=int, default=3, help="fastest of these")
    parser.add_argument("--layers", default="4,8,16,32,64")
    parser.add_argument("--stages", default="2,4,8,16,32")
    parser.add_argument("--partition-sizes", default="1000,10000,100000")
    parser.add_argument("--plot-dir", default=None, help="write the PNG figures here")
    parser.add_argument("--out", default=None, help="write the raw figures here (JSON)")
    parser.add_argument("--compile-one", nargs=3, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--replot", default=None, help="tables and figures from this --out file")
    args = parser.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            result = json.load(f)
        print(report(result))
        if args.plot_dir:
            print("wrote", ", ".join(plots(result, args.plot_dir)))
        return result
    if args.compile_one:
        stages, per_stage, scan = args.compile_one
        common.setup_devices(stages)
        print(json.dumps(compile_one(stages, per_stage, bool(scan))), flush=True)
        return {}
    parts = set(args.parts.split(","))
    sizes = _parse_sizes(args.lowering_sizes)
    stage_counts = [int(x) for x in args.stages.split(",")]
    common.setup_devices(max([2, *(s for s, _ in sizes), *stage_counts]))
    result: dict[str, Any] = {"time": time.time()}
    if "lowering" in parts:
        result["lowering"] = lowering_rows(sizes, args.lowering_repeats)
        result["pass_growth"] = pass_growth(result["lowering"])
    if "layers" in parts:
        result["layers"] = compile_rows([int(x) for x in args.layers.split(",")], vary="layers")
    if "stages" in parts:
        result["stages"] = compile_rows(stage_counts, vary="stages")
    if "partitioner" in parts:
        sizes_p = [int(x) for x in args.partition_sizes.split(",")]
        result["partitioner"] = partition_rows(sizes_p)
    print(report(result))
    if args.plot_dir:
        result["plots"] = plots(result, args.plot_dir)
        print("wrote", ", ".join(result["plots"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
