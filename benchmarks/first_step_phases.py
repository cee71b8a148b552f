"""Where a cold first step goes: nnx_mpmd against the one-device jit, phase by phase.

For one row of `peers_models.ROWS` (default: the compute-bound MLP) it runs
the one-device jit and nnx_mpmd in fresh processes, alternating, each cold
(no persistent compilation cache), and reports per peer the fastest first step
in wall seconds and in the process's CPU seconds (which a loaded host inflates
far less), how the CPU split between the caller's thread (tracing and our
lowering passes) and the others (XLA's compilations, the compile pool, the
run), how many XLA compilations ran and of which programs, and JAX's own
trace / lower / compile seconds summed over threads. The ratios to the
one-device jit are those of `make bench-peers`' "first / 1-dev" column.

Run: ``.venv/bin/python benchmarks/first_step_phases.py [--row compute] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = ("one-device", "nnx_mpmd")
_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "to_mlir_s",
    "/jax/core/compile/backend_compile_duration": "xla_compile_s",
}


def measure(row_name: str, peer: str) -> dict:
    """One cold first step of ``peer`` on ``row_name``, in this process."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["NNX_MPMD_COMPILE_CACHE"] = "off"
    sys.path.insert(0, str(HERE))
    import jax
    import peers_models as pm
    import peers_worker as pw

    pm.setup_cpu_devices(8)
    sums: dict[str, float] = collections.defaultdict(float)
    compiled: list[str] = []
    compile_s: dict[str, float] = collections.defaultdict(float)

    def listener(event: str, duration: float, **kwargs: object) -> None:
        if event in _EVENTS:
            sums[_EVENTS[event]] += duration
        if event.endswith("backend_compile_duration"):
            compiled.append(str(kwargs.get("fun_name", "?")))
            compile_s[compiled[-1]] += duration

    jax.monitoring.register_event_duration_secs_listener(listener)
    run_step, block = pw.step_runner(pm.ROWS[row_name], peer)
    sums.clear()
    compiled.clear()
    compile_s.clear()
    wall, cpu, caller = time.perf_counter(), time.process_time(), time.thread_time()
    block(run_step())
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    caller = time.thread_time() - caller
    names = collections.Counter(compiled)
    return {
        "peer": peer,
        "first_s": wall,
        "first_cpu_s": cpu,
        "caller_cpu_s": caller,
        "other_threads_cpu_s": cpu - caller,
        "xla_compilations": len(compiled),
        "programs": dict(sorted(names.items())),
        "program_compile_s": {k: round(v, 3) for k, v in sorted(compile_s.items())},
        **{k: round(v, 4) for k, v in sums.items()},
    }


def run_fresh(row: str, peer: str, timeout_s: float) -> dict:
    """`measure` in a fresh process."""
    command = [sys.executable, __file__, "--worker", peer, "--row", row]
    env = dict(os.environ, JAX_PLATFORMS="cpu", NNX_MPMD_COMPILE_CACHE="off")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=HERE
        )
    except subprocess.TimeoutExpired:
        return {"peer": peer, "error": f"timed out after {timeout_s:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith("PHASES "):
            return json.loads(line[len("PHASES ") :])
    tail = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["no output"]
    return {"peer": peer, "error": f"exit {done.returncode}: {tail[0][:300]}"}


def summary(samples: dict[str, list[dict]]) -> str:
    """A Markdown table: each peer's fastest first step and its split, ratios to one-device."""
    best = {}
    for peer, runs in samples.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            return f"{peer} failed: {runs[-1]['error']}"
        best[peer] = {
            "first_s": min(r["first_s"] for r in ok),
            "first_cpu_s": min(r["first_cpu_s"] for r in ok),
            **{k: v for k, v in min(ok, key=lambda r: r["first_cpu_s"]).items() if k != "first_s"},
        }
    base = best["one-device"]
    lines = [
        "| peer | first s | / 1-dev | first CPU s | / 1-dev | caller CPU s | other CPU s "
        "| XLA compilations | trace s | to MLIR s | XLA compile s (summed) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for peer, b in best.items():
        lines.append(
            f"| {peer} | {b['first_s']:.2f} | {b['first_s'] / base['first_s']:.2f} "
            f"| {b['first_cpu_s']:.2f} | {b['first_cpu_s'] / base['first_cpu_s']:.2f} "
            f"| {b['caller_cpu_s']:.2f} | {b['other_threads_cpu_s']:.2f} "
            f"| {b['xla_compilations']} | {b.get('trace_s', 0):.2f} | {b.get('to_mlir_s', 0):.2f} "
            f"| {b.get('xla_compile_s', 0):.2f} |"
        )
    programs = ", ".join(
        f"{n}×{c}" if c > 1 else n for n, c in best["nnx_mpmd"]["programs"].items()
    )
    lines += ["", f"nnx_mpmd's XLA compilations: {programs}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", default="compute")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per peer")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per process")
    parser.add_argument("--worker", choices=PEERS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help="write the samples here (JSON)")
    args = parser.parse_args(argv)
    if args.worker:
        print("PHASES " + json.dumps(measure(args.row, args.worker)), flush=True)
        return {}
    samples: dict[str, list[dict]] = {peer: [] for peer in PEERS}
    for round_index in range(args.rounds):
        order = PEERS if round_index % 2 == 0 else PEERS[::-1]
        for peer in order:
            result = run_fresh(args.row, peer, args.timeout)
            samples[peer].append(result)
            shown = result.get("error") or (
                f"first {result['first_s']:.2f} s, CPU {result['first_cpu_s']:.2f} s"
            )
            print(f"round {round_index + 1} {peer:10s} {shown}", flush=True)
    print(summary(samples))
    if args.out:
        args.out.write_text(json.dumps({"row": args.row, "samples": samples}, indent=1))
    return samples


if __name__ == "__main__":
    main()
