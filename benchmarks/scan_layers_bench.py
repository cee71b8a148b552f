"""Unrolled vs scanned blocks (``nnx-mpmd train --scan-layers``): first step and step time.

For each number of blocks, runs ``nnx-mpmd train`` as fresh processes without
a compilation cache, alternating the unrolled model (one call per block) and
the scanned one (one `ScanStack` chunk per stage), and reads from
``metrics.jsonl`` the first step's seconds (tracing and compiling included) and
the median of the later steps. Both variants run side by side in one run, so
the ratios (scanned / unrolled) compare like with like.

Usage::

    python benchmarks/scan_layers_bench.py [--layers 8,16,32] [--repeats 2]
        [--preset tiny] [--schedule 1f1b] [--steps 6] [--out FILE]

It prints a Markdown table (the fastest repeat of each figure) and writes the
raw figures as JSON when ``--out`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "NNX_MPMD_"))}
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _run(layers: int, scan: bool, run_dir: pathlib.Path, args: argparse.Namespace) -> dict:
    """One training run; its first step's seconds and the median of the later steps'."""
    command = [
        sys.executable, "-m", "nnx_mpmd", "train", "--preset", args.preset,
        "--layers", str(layers), "--schedule", args.schedule, "--steps", str(args.steps),
        "--log-every", "1", "--ckpt-every", "0", "--val-batches", "0", "--sample-tokens", "0",
        "--corpus-bytes", "200000", "--no-compile-cache", "--run-dir", str(run_dir),
    ]  # fmt: skip
    if scan:
        command.append("--scan-layers")
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "first_s": float(rows[0]["step_s"]),
        "step_s": statistics.median(float(r["step_s"]) for r in rows[1:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="8,16,32", help="comma-separated block counts")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--schedule", default="1f1b", help="as nnx-mpmd train --schedule")
    parser.add_argument(
        "--steps", type=int, default=6, help="steps per run (the first counts alone)"
    )
    parser.add_argument("--out", default=None, help="write the raw figures here (JSON)")
    args = parser.parse_args()
    counts = [int(x) for x in args.layers.split(",")]
    samples: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="nnx-mpmd-scan-bench-") as tmp:
        for repeat in range(args.repeats):
            for layers in counts:
                for scan in (False, True):  # alternated, so that load hits both alike
                    key = f"{layers}:{'scanned' if scan else 'unrolled'}"
                    run_dir = pathlib.Path(tmp) / f"{key.replace(':', '_')}_{repeat}"
                    samples.setdefault(key, []).append(_run(layers, scan, run_dir, args))
    best = {k: {f: min(s[f] for s in v) for f in ("first_s", "step_s")} for k, v in samples.items()}
    print(f"GPT {args.preset}, nnx-mpmd train defaults (4 meshes x 2 data, m=8), "
          f"{args.schedule}, no compile cache; fastest of {args.repeats} (seconds)")  # fmt: skip
    print("| blocks | first step unrolled | scanned | ratio | step unrolled | scanned | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for layers in counts:
        u, s = best[f"{layers}:unrolled"], best[f"{layers}:scanned"]
        print(
            f"| {layers} | {u['first_s']:.2f} | {s['first_s']:.2f} | "
            f"{s['first_s'] / u['first_s']:.2f} | {u['step_s']:.3f} | {s['step_s']:.3f} | "
            f"{s['step_s'] / u['step_s']:.2f} |"
        )
    if args.out:
        result = {"settings": vars(args), "samples": samples, "best": best, "time": time.time()}
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
