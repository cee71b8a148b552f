"""Time to first step, cold and with JAX's persistent compilation cache warm.

Runs each variant as fresh processes: first with an empty cache directory
(cold), then twice again with the cache the runs before filled (warm, warm2;
the pipelined warm runs load the step the cold run stored in it,
`nnx_mpmd.aot.step_store`, and trace no program):

* ``pipelined``: ``nnx-mpmd train`` (GPT ``tiny`` by default, 4 meshes x 2 data,
  1F1B, 8 microbatches), one step; its first step's time from ``metrics.jsonl``;
* ``reference``: the same model and microbatched step under ``nnx.jit`` on one
  device, timed the same way (the first call, until the loss is ready).

Usage::

    python benchmarks/first_step_cache.py [--preset tiny] [--repeats 2] [--out FILE]
        [--schedule 1f1b] [--layers N]

``--schedule interleaved --layers 8`` (8 stages on the 4 meshes) times a
pipeline whose middle stages are equal; ``--layers`` sets the blocks of both
models (default: the preset's).

It prints a table of seconds and ratios (pipelined / reference, cold and warm)
and writes the raw figures as JSON when ``--out`` is given. Every repeat uses
fresh cache directories; the fastest repeat of each figure counts.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

REFERENCE = """
import os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np, optax
from flax import nnx
from nnx_mpmd.aot.compile_cache import enable_compile_cache
enable_compile_cache(sys.argv[1])
import nnx_mpmd as mp
from nnx_mpmd.models import build_model, lm_loss
preset, batch_size, seq_len, microbatches = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
layers = {"n_layers": int(sys.argv[6])} if sys.argv[6] != "preset" else {}
model = build_model("gpt", preset, num_stages=1, rngs=nnx.Rngs(0), **layers)
optimizer = nnx.Optimizer(
    model, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, b2=0.99)), wrt=nnx.Param
)
@nnx.jit
def step(model, optimizer, batch):
    loss, grads = mp.value_and_grad(lm_loss, num_microbatches=microbatches)(model, batch)
    optimizer.update(model, grads)
    return loss
tokens = np.random.default_rng(0).integers(0, 64, size=(batch_size, seq_len + 1)).astype(np.int32)
batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
start = time.perf_counter()
float(step(model, optimizer, batch))
print("FIRST_STEP_S", time.perf_counter() - start)
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "NNX_MPMD_"))}
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _pipelined(cache: pathlib.Path, run_dir: pathlib.Path, args: argparse.Namespace) -> float:
    command = [
        sys.executable, "-m", "nnx_mpmd", "train", "--preset", args.preset,
        "--steps", "1", "--log-every", "1", "--ckpt-every", "0", "--val-batches", "0",
        "--sample-tokens", "0", "--batch-size", str(args.batch_size),
        "--microbatches", str(args.microbatches), "--seq-len", str(args.seq_len),
        "--corpus-bytes", "200000", "--run-dir", str(run_dir), "--compile-cache", str(cache),
        "--schedule", args.schedule,
    ]  # fmt: skip
    if args.layers is not None:
        command += ["--layers", str(args.layers)]
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    return float(first["step_s"])


def _reference(cache: pathlib.Path, args: argparse.Namespace) -> float:
    command = [
        sys.executable, "-c", REFERENCE, str(cache), args.preset, str(args.batch_size),
        str(args.seq_len), str(args.microbatches),
        "preset" if args.layers is None else str(args.layers),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    line = [x for x in done.stdout.splitlines() if x.startswith("FIRST_STEP_S")][-1]
    return float(line.split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b", help="as nnx-mpmd train --schedule")
    parser.add_argument("--layers", type=int, default=None, help="blocks of both models")
    parser.add_argument("--out", default=None, help="write the raw figures here (JSON)")
    args = parser.parse_args()
    kinds = ("cold", "warm", "warm2")
    samples: dict[str, list[float]] = {f"{w}_{k}": [] for w in ("pipe", "ref") for k in kinds}
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="nnx-mpmd-first-step-") as tmp:
            root = pathlib.Path(tmp)
            for kind in kinds:  # alternated, so that load hits both alike
                samples[f"pipe_{kind}"].append(
                    _pipelined(root / "pipe", root / f"run_{kind}", args)
                )
                samples[f"ref_{kind}"].append(_reference(root / "ref", args))
    best = {k: min(v) for k, v in samples.items()}
    print(f"GPT {args.preset}, batch {args.batch_size} x {args.seq_len}, m={args.microbatches}, "
          f"4 meshes x 2 data, {args.schedule}, layers {args.layers or 'of the preset'}; "
          f"fastest of {args.repeats} (seconds)")  # fmt: skip
    print("| cache | pipelined s | one-device jit s | ratio |")
    print("| --- | --- | --- | --- |")
    for kind in kinds:
        pipe, ref = best[f"pipe_{kind}"], best[f"ref_{kind}"]
        print(f"| {kind} | {pipe:.2f} | {ref:.2f} | {pipe / ref:.2f} |")
    print(f"warm / cold: pipelined {best['pipe_warm'] / best['pipe_cold']:.2f}, "
          f"one-device {best['ref_warm'] / best['ref_cold']:.2f}")  # fmt: skip
    if args.out:
        result = {"settings": vars(args), "samples": samples, "best": best, "time": time.time()}
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
