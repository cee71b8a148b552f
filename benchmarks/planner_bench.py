"""The planner against the registered schedules run with the default split and m.

For a GPT preset on 4 meshes x 2 data devices (CPU, 8 simulated devices):

1. ``mp.plan`` (every registered schedule; 1, 2 and 4 microbatches per mesh),
   then ``mp.planner.verify`` of the top K: predicted against measured step
   time and peak memory (``memory=True``), and the plan re-ranked by
   measurement (``Plan.with_measurements``);
2. every registered schedule with the model zoo's default split (its
   ``num_stages`` from the schedule) and the default 8 microbatches, timed the
   same way (one compiling step, then the median of ``--steps`` steps).

Prints both tables and the ratio planned / best default, all measured in this
one run. Usage::

    python benchmarks/planner_bench.py [--preset tiny] [--verify 3] [--steps 5] [--repeats 3]
        [--donate] [--out FILE]

``--donate`` plans and verifies a step that donates its state
(``mp.plan(donate=True)``; the defaults are then run donating too).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import statistics
import time

import jax
import numpy as np
import optax
from flax import nnx

import nnx_mpmd as mp
from nnx_mpmd.models import build_model, lm_loss
from nnx_mpmd.schedules import SCHEDULES, get_schedule


def _batch(batch_size: int, seq_len: int) -> dict[str, np.ndarray]:
    tokens = np.random.default_rng(0).integers(0, 64, size=(batch_size, seq_len + 1))
    tokens = tokens.astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _train_step(model, optimizer, batch):
    loss, grads = mp.value_and_grad(lm_loss)(model, batch)
    optimizer.update(model, grads)
    return loss


def _time_default(
    name: str, preset: str, mesh, batch, tx, steps: int, donate: bool
) -> float | None:
    schedule = get_schedule(name)
    stages = schedule.default_num_stages(mesh.num_meshes)
    try:
        schedule.check(stages, mesh.num_meshes, 8)
        model = build_model("gpt", preset, num_stages=stages, rngs=nnx.Rngs(0), vocab_size=64)
    except mp.MpmdError:
        return None
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = mp.jit(
        _train_step, mesh=mesh, schedule=schedule, num_microbatches=8,
        donate_argnums=(0, 1) if donate else (),
    )  # fmt: skip
    jax.block_until_ready(step(model, optimizer, batch))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(step(model, optimizer, batch))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--verify", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="mp.plan's timed runs per profile")
    parser.add_argument("--donate", action="store_true", help="plan a donating step")
    parser.add_argument("--out", default=None, help="write the raw figures here (JSON)")
    args = parser.parse_args()
    mesh = mp.MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
    batch = _batch(args.batch_size, args.seq_len)
    tx = optax.adamw(1e-3)
    model = build_model("gpt", args.preset, num_stages=4, rngs=nnx.Rngs(0), vocab_size=64)

    start = time.perf_counter()
    plan = mp.plan(
        model, lm_loss, batch, mesh, tx, repeats=args.repeats, donate=args.donate, spmd=False
    )
    plan_s = time.perf_counter() - start
    checked = mp.planner.verify(plan, model, lm_loss, batch, mesh, tx, top=args.verify,
                                steps=args.steps)  # fmt: skip
    plan = plan.with_measurements(checked)
    print(f"GPT {args.preset}, batch {args.batch_size} x {args.seq_len}, 4 meshes x 2 data; "
          f"planning took {plan_s:.1f} s")  # fmt: skip
    print("| planned | predicted ms | measured ms | time error | peak MiB predicted | measured "
          "| memory error | worst mesh's memory error |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for v in checked:
        c = v.candidate
        per_mesh = [p / m - 1 for p, m in zip(c.peak_bytes, v.measured_peak_bytes)]
        print(f"| {c.schedule} x{c.num_stages}, m={c.num_microbatches}, remat "
              f"{sum(c.remat)} | {1e3 * c.step_s:.1f} | {1e3 * v.measured_step_s:.1f} | "
              f"{v.time_error:+.0%} | {max(c.peak_bytes) / 2**20:.2f} | "
              f"{max(v.measured_peak_bytes) / 2**20:.2f} | {v.memory_error:+.1%} | "
              f"{max(per_mesh, key=abs):+.1%} |")  # fmt: skip
    defaults = {name: _time_default(name, args.preset, mesh, batch, tx, args.steps, args.donate)
                for name in SCHEDULES}  # fmt: skip
    print("| default split, m=8 | measured ms |")
    print("| --- | --- |")
    for name, seconds in defaults.items():
        why = "- (more stages than the preset has blocks)"
        print(f"| {name} | {why if seconds is None else f'{1e3 * seconds:.1f}'} |")
    best_default = min(s for s in defaults.values() if s is not None)
    planned = min(v.measured_step_s for v in checked)
    print(f"planned (fastest measured of the top {args.verify}) / best default: "
          f"{planned / best_default:.2f}; calibration (measured / predicted) "
          f"{plan.calibration:.2f}")  # fmt: skip
    if args.out:
        result = {
            "settings": vars(args),
            "plan_s": plan_s,
            "verified": [
                {**v.candidate.to_dict(), "measured_step_s": v.measured_step_s,
                 "measured_peak_bytes": list(v.measured_peak_bytes)}
                for v in checked
            ],
            "defaults": defaults,
            "calibration": plan.calibration,
        }  # fmt: skip
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
