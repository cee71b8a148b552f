"""A profiled step's measured timeline against the simulator run with its task times.

GPT ``tiny`` (or ``--preset``), 4 meshes x 2 data devices (CPU, 8 simulated
devices), every schedule given: a warm-up step, then ``--repeats`` steps with
``profile=True`` (meshes overlap as unprofiled); for each, the simulator runs the
step's own task lists with the per-stage medians this profile measured
(`Profile.compare`). Prints measured and simulated makespans and bubbles, and
their ratio (median over repeats). ``--picture FILE`` draws the last one.

Usage::

    python benchmarks/profile_compare.py [--preset tiny] [--schedules 1f1b,zb-h1] [--repeats 3]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import statistics

import jax
import numpy as np
import optax
from flax import nnx

import nnx_mpmd as mp
from nnx_mpmd.models import build_model, lm_loss
from nnx_mpmd.schedules import get_schedule


def _step(model, optimizer, batch):
    loss, grads = mp.value_and_grad(lm_loss)(model, batch)
    optimizer.update(model, grads)
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--schedules", default="gpipe,1f1b,zb-h1")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--picture", default=None)
    args = parser.parse_args()
    mesh = mp.MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
    tokens = np.random.default_rng(0).integers(0, 64, size=(32, 65)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    print(f"GPT {args.preset}, batch 32 x 64, 4 meshes x 2 data, m={args.microbatches}; "
          f"median of {args.repeats} profiled steps")  # fmt: skip
    print("| schedule | measured ms | bubble | simulated ms | bubble | simulated / measured |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.schedules.split(","):
        schedule = get_schedule(name)
        stages = schedule.default_num_stages(4)
        model = build_model("gpt", args.preset, num_stages=stages, rngs=nnx.Rngs(0), vocab_size=64)
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        step = mp.jit(_step, mesh=mesh, schedule=schedule, num_microbatches=args.microbatches)
        jax.block_until_ready(step(model, optimizer, batch))
        rows = []
        for _ in range(args.repeats):
            jax.block_until_ready(step(model, optimizer, batch, profile=True))
            rows.append(step.last_profile.compare())
        measured = statistics.median(c.measured.makespan for c in rows)
        simulated = statistics.median(c.simulated.makespan for c in rows)
        print(f"| {name} | {1e3 * measured:.1f} | "
              f"{statistics.median(c.measured.bubble_fraction for c in rows):.1%} | "
              f"{1e3 * simulated:.1f} | "
              f"{statistics.median(c.simulated.bubble_fraction for c in rows):.1%} | "
              f"{statistics.median(c.predicted_over_measured for c in rows):.2f} |")  # fmt: skip
        if args.picture:
            step.last_profile.plot(args.picture)


if __name__ == "__main__":
    main()
