"""DualPipeV with its forward/backward pairs overlapped in one program, and without.

For each GPT preset (the `nnx-mpmd bench` settings: 4 meshes x 2 data CPU
devices, 8 stages in a V, m = 8, batch 64, seq 32), builds
``DualPipeV(overlap=True)`` and ``DualPipeV(overlap=False)`` in one process,
checks that their first losses are equal, then times steps alternating
A B A B ... and reports, per variant: the median step, the host CPU time of the
calling thread per step, the calls dispatched per step and the distinct
programs compiled; and the ratio overlapped / separate of the median steps.

Run: ``.venv/bin/python benchmarks/overlap_bench.py [--presets tiny small] [--rounds 15]``
Writes ``benchmarks/results/<date>-overlap.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _variant(settings, preset, overlap, batches):
    import nnx_mpmd as mp
    from nnx_mpmd.apps.bench import _model, _mpmd_mesh, _pipelined_fn
    from nnx_mpmd.apps.bench_probes import Variant
    from nnx_mpmd.models.presets import GPT_PRESETS

    num_stages = 2 * settings.num_meshes
    n_layers = max(GPT_PRESETS[preset]["n_layers"], num_stages)
    model, opt = _model(preset, num_stages, n_layers)
    step = mp.jit(
        _pipelined_fn(),
        mesh=_mpmd_mesh(settings),
        schedule=mp.DualPipeV(overlap=overlap),
        num_microbatches=settings.microbatches,
    )
    name = "overlapped" if overlap else "separate"
    return Variant(name, step, (model, opt), batches)


def _counts(variant):
    from nnx_mpmd.apps.bench_probes import _compiled_and_inputs
    from nnx_mpmd.compiler.ir import Call

    compiled, _ = _compiled_and_inputs(variant)
    calls = [ins for ins in compiled.instructions if isinstance(ins, Call)]
    return {
        "calls_per_step": len(calls),
        "stage_calls_per_step": sum(1 for c in calls if c.task is not None),
        "overlapped_calls_per_step": sum(1 for c in calls if c.program.members),
        "programs": len({str(c.program) for c in calls}),
    }


def run(presets, rounds):
    from nnx_mpmd.apps.bench import BenchSettings, _batches, _setup_devices
    from nnx_mpmd.models.presets import GPT_PRESETS

    settings = BenchSettings(presets=tuple(presets))
    _setup_devices(settings.num_meshes * settings.data)
    import numpy as np

    rows = []
    for preset in presets:
        batches = _batches(settings, settings.batch, 4, GPT_PRESETS[preset]["vocab_size"])
        variants = [_variant(settings, preset, o, batches) for o in (True, False)]
        losses = []
        for v in variants:
            v.first()
            losses.append(float(v.step(*v.args, batches[0])))
        # Both start from the same model: after one update each, the second step's
        # losses must agree (the schedules differ only in program boundaries).
        np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
        for n in range(2):  # warm-up
            for v in variants:
                v.once(n)
        for v in variants:
            v.clear()
        for n in range(rounds):
            for v in variants:
                v.once(n)
        result = {"preset": preset, "rounds": rounds}
        for v in variants:
            result[v.name] = {**v.summary(), **_counts(v)}
            result[v.name].pop("times_s")
        ratios = [a / b for a, b in zip(variants[0].times, variants[1].times)]
        result["ratio_median"] = float(np.median(ratios))
        result["ratio_min_max"] = [float(min(ratios)), float(max(ratios))]
        print(json.dumps(result), flush=True)
        rows.append(result)
    return rows


def markdown(rows):
    lines = [
        "| preset | variant | step ms | host CPU ms | stage calls | overlapped calls | programs |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        for name in ("overlapped", "separate"):
            r = row[name]
            lines.append(
                f"| {row['preset']} | {name} | {r['median_s'] * 1e3:.1f} | "
                f"{r['host_cpu_ms']:.1f} | {r['stage_calls_per_step']} | "
                f"{r['overlapped_calls_per_step']} | {r['programs']} |"
            )
    lines.append("")
    for row in rows:
        lo, hi = row["ratio_min_max"]
        lines.append(
            f"{row['preset']}: overlapped / separate = {row['ratio_median']:.3f} "
            f"(pairwise min {lo:.3f}, max {hi:.3f}, {row['rounds']} rounds)"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=None, help="result JSON (default: dated name)")
    args = parser.parse_args(argv)
    rows = run(args.presets, args.rounds)
    print(markdown(rows))
    out = args.out or os.path.join(
        HERE, "results", f"{datetime.date.today().isoformat()}-overlap.json"
    )
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
