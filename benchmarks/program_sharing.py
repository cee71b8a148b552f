"""XLA compilations and time to first step with and without compiling equal programs once.

Each variant runs in a fresh process without a persistent compilation cache:

* ``shared``: ``mp.jit`` as it is (a stage program equal to one on an
  equal-shaped submesh loads that executable instead of compiling);
* ``separate``: the same with sharing turned off (every program compiles);
* ``one-device``: the same microbatched step under ``nnx.jit`` on one device.

Usage::

    python benchmarks/program_sharing.py [--preset small] [--repeats 2]

GPT with ``n_layers = max(preset, 4)`` on 4 meshes x 2 data (Auto axes), 1F1B,
batch 64 x 32 tokens, 8 microbatches, as ``nnx-mpmd bench``. Prints, per
variant, the fastest first step of the repeats, the XLA compilations and their
summed time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = """
import json, os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np, optax
from flax import nnx
import nnx_mpmd as mp
from nnx_mpmd.models import build_model, lm_loss
from nnx_mpmd.models.presets import preset_fields
variant, preset = sys.argv[1], sys.argv[2]
if variant == "separate":
    from nnx_mpmd.aot import program_sharing
    program_sharing.share_key = lambda *args, **kwargs: None
compile_s = []
def listen(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        compile_s.append(duration)
jax.monitoring.register_event_duration_secs_listener(listen)
layers = max(preset_fields("gpt", preset)["n_layers"], 4)
stages = 1 if variant == "one-device" else 4
model = build_model("gpt", preset, num_stages=stages, rngs=nnx.Rngs(0), n_layers=layers)
optimizer = nnx.Optimizer(model, optax.adamw(3e-4), wrt=nnx.Param)
m = 8
def step(model, optimizer, batch):
    loss, grads = mp.value_and_grad(lm_loss, num_microbatches=None if stages > 1 else m)(model, batch)
    optimizer.update(model, grads)
    return loss
if variant == "one-device":
    fn = nnx.jit(step)
else:
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = mp.MpmdMesh(jax.make_mesh((4, 2), ("stage", "data"), axis_types=auto), "stage")
    fn = mp.jit(step, mesh=mesh, schedule=mp.OneFOneB(), num_microbatches=m)
tokens = np.random.default_rng(0).integers(0, 64, size=(64, 33)).astype(np.int32)
batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
start = time.perf_counter()
float(fn(model, optimizer, batch))
first = time.perf_counter() - start
print("RESULT", json.dumps({"first_s": first, "compiles": len(compile_s), "xla_s": sum(compile_s)}))
"""


def _run(variant: str, preset: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "NNX_MPMD_"))}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, variant, preset], env=env, capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    variants = ("separate", "shared", "one-device")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.repeats):  # alternated, so that load hits every variant alike
        for variant in variants:
            results[variant].append(_run(variant, args.preset))
    one = min(r["first_s"] for r in results["one-device"])
    print(f"GPT {args.preset}, 4 meshes x 2 data, 1F1B, m=8; fastest of {args.repeats}")
    print("| variant | first step s | / one-device | XLA compilations | XLA compile s |")
    print("| --- | --- | --- | --- | --- |")
    for variant in variants:
        best = min(results[variant], key=lambda r: r["first_s"])
        print(
            f"| {variant} | {best['first_s']:.2f} | {best['first_s'] / one:.2f} | "
            f"{best['compiles']} | {best['xla_s']:.2f} |"
        )


if __name__ == "__main__":
    main()
