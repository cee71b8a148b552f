"""Let the planner choose: GPT ``tiny`` on 4 meshes x 2 data devices.

`mp.plan` times and measures every layer on one submesh, simulates every
registered schedule with those numbers, and returns the fastest configuration
(layer split, schedule, microbatches, remat) with its predicted step time and
peak memory. The top two are then run and measured (`mp.planner.verify`); their
times are printed beside the calibrated prediction (the simulator's times
scaled by the median measured / predicted ratio, `Plan.calibration`), the
fastest measured one is applied to the model, and the planned run's losses are
checked against the same model run unpipelined.

Run:  python examples/09_plan.py --steps 5
      (``--schedules 1f1b,zb-h1 --no-remat --candidate-microbatches 8`` plans among
      fewer configurations, faster: each microbatch count is profiled on its own)
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse

import jax
import numpy as np
import optax
from flax import nnx

import nnx_mpmd as mp
from nnx_mpmd.apps.data import BatchIterator, CharTokenizer, stdlib_corpus
from nnx_mpmd.models import build_model, lm_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--budget-mib", type=float, default=None, help="memory per device")
    parser.add_argument(
        "--schedules", default=None, help="comma-separated names to consider (default: all)"
    )
    parser.add_argument(
        "--no-remat", action="store_true", help="consider no remat (profiles half as much)"
    )
    parser.add_argument(
        "--candidate-microbatches",
        default=None,
        help="comma-separated counts to consider (default: 4, 8 and 16; each one is profiled)",
    )
    args = parser.parse_args()
    mp.enable_compile_cache()

    text = stdlib_corpus(200_000)
    tokenizer = CharTokenizer.from_text(text)
    batches = BatchIterator(tokenizer.encode(text), batch_size=32, seq_len=32, seed=0)
    mesh = mp.MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")

    def fresh_model():
        return build_model(
            "gpt", "tiny", num_stages=4, rngs=nnx.Rngs(0), vocab_size=tokenizer.vocab_size
        )

    tx = optax.adamw(3e-3, b2=0.99)
    model = fresh_model()
    first = batches.batch_at(0)
    budget = None if args.budget_mib is None else int(args.budget_mib * 2**20)
    schedules = args.schedules.split(",") if args.schedules else None
    counts = args.candidate_microbatches
    counts = [int(m) for m in counts.split(",")] if counts else None
    plan = mp.plan(
        model, lm_loss, first, mesh, tx, schedules=schedules, num_microbatches=counts,
        memory_budget=budget, remat=not args.no_remat, repeats=2,
    )  # fmt: skip
    checked = mp.planner.verify(plan, model, lm_loss, first, mesh, tx, top=2, steps=2)
    # The simulator's step times assume free transfers and an idle host; `calibration`
    # (the median measured / predicted of the runs) scales them to this machine.
    plan = plan.with_measurements(checked)
    for v in checked:
        c = v.candidate
        print(
            f"{c.schedule} x{c.num_stages} stages, m={c.num_microbatches}: measured "
            f"{1e3 * v.measured_step_s:.1f} ms, calibrated prediction "
            f"{1e3 * c.step_s * plan.calibration:.1f} ms; peak "
            f"{max(v.measured_peak_bytes) / 2**20:.2f} MiB measured, "
            f"{max(c.peak_bytes) / 2**20:.2f} MiB predicted ({v.memory_error:+.0%})"
        )
    print(
        f"calibration {plan.calibration:.2f}: the uncalibrated simulator predicted "
        + ", ".join(f"{1e3 * v.candidate.step_s:.1f} ms" for v in checked)
    )
    print(plan.summary())

    plan.apply(model)
    print(model.stage_summary())
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    reference = fresh_model()
    ref_optimizer = nnx.Optimizer(reference, tx, wrt=nnx.Param)
    m = plan.num_microbatches

    def train_step(model, optimizer, batch):
        loss, grads = mp.value_and_grad(lm_loss, num_microbatches=m)(model, batch)
        optimizer.update(model, grads)
        return loss

    step = mp.jit(train_step, mesh=mesh, schedule=plan.schedule(), num_microbatches=m)
    ref_step = nnx.jit(train_step)
    for i in range(args.steps):
        batch = batches.batch_at(i)
        loss, expected = (
            float(step(model, optimizer, batch)),
            float(ref_step(reference, ref_optimizer, batch)),
        )
        np.testing.assert_allclose(loss, expected, rtol=2e-4)
    print(f"the planned run's {args.steps} losses equal the unpipelined run (last {loss:.4f})")


if __name__ == "__main__":
    main()
