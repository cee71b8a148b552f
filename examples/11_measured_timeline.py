"""Profile a pipelined step and see its measured timeline beside the simulated one.

``step(..., profile=True)`` records when every task really ran on its mesh (the
host dispatches as usual; one waiter thread per mesh watches the results), in
``step.last_profile``. ``last_profile.compare()`` simulates the step's own task
lists with the task times this profile measured, and gives both timelines:
their makespans and bubbles say how far the schedule ran from what the
simulator predicts. ``last_profile.plot(path)`` draws the measured timeline
above the simulated one on one time axis (it needs matplotlib; without it this
example prints the numbers and skips the picture).

A 4-stage MLP on 4 meshes x 2 data devices trains a few steps under 1F1B and
ZB-H1; the last step of each is profiled. Profiling changes no number: every
step's loss is checked against the same model under ``nnx.jit``. On CPU the 8
simulated devices share the machine's cores, so the measured tasks take longer
while others run than the simulator assumes; on accelerators each mesh has its
own.

Run:  python examples/11_measured_timeline.py --steps 3 --out runs/timeline.png
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import nnx_mpmd as mp
from nnx_mpmd.schedules.draw import matplotlib_missing

WIDTH, NUM_STAGES, MICROBATCHES = 128, 4, 8


class MLP(mp.PipelinedModel):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List(
            [
                mp.Stage(nnx.Linear(8 if s == 0 else WIDTH, WIDTH, rngs=rngs), stage=s)
                for s in range(NUM_STAGES)
            ]
        )
        self.head = mp.Stage(nnx.Linear(WIDTH, 1, rngs=rngs), stage=NUM_STAGES - 1)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return self.head(x)[:, 0]


def loss_fn(model: MLP, batch: dict) -> jax.Array:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def train_step(model, optimizer, batch):
    loss, grads = mp.value_and_grad(loss_fn, num_microbatches=MICROBATCHES)(model, batch)
    optimizer.update(model, grads)
    return loss


def batch_at(step: int) -> dict:
    x = np.random.default_rng(step).normal(size=(256, 8)).astype(np.float32)
    return {"x": x, "y": np.sin(x[:, 0] + x[:, 1])}


def picture_path(out: pathlib.Path, name: str) -> pathlib.Path:
    """``runs/timeline.png`` -> ``runs/timeline-1f1b.png``: one picture per schedule."""
    return out.with_name(f"{out.stem}-{name}{out.suffix or '.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="steps per schedule (>= 2)")
    parser.add_argument(
        "--out",
        default="runs/measured_timeline.png",
        help="where to draw the pictures (one per schedule, named after it)",
    )
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step compiles, a later one is profiled")
    mp.enable_compile_cache()
    missing = matplotlib_missing()  # None when matplotlib imports

    mesh = mp.MpmdMesh(jax.make_mesh((NUM_STAGES, 2), ("stage", "data")), "stage")
    for schedule in (mp.OneFOneB(), mp.ZeroBubbleH1()):
        model = MLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        step = mp.jit(train_step, mesh=mesh, schedule=schedule, num_microbatches=MICROBATCHES)
        reference = MLP(nnx.Rngs(0))
        ref_optimizer = nnx.Optimizer(reference, optax.adam(1e-3), wrt=nnx.Param)
        reference_step = nnx.jit(train_step)

        # Compile and warm up first; profile the last step only.
        for i in range(args.steps):
            loss = step(model, optimizer, batch_at(i), profile=i == args.steps - 1)
            ref_loss = reference_step(reference, ref_optimizer, batch_at(i))
            np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)

        profile = step.last_profile
        comparison = profile.compare()
        measured, simulated = comparison.measured, comparison.simulated
        print(f"== {schedule.name}: {NUM_STAGES} stages, {MICROBATCHES} microbatches ==")
        # A Profile is a list of (mesh, label, task, start_s, end_s), sorted by start;
        # task is None for programs that are not schedule tasks (init, optimizer update).
        print(f"{len(profile)} programs ran; the first schedule task on each mesh:")
        for q in range(mesh.num_meshes):
            _, label, _, start, end = next(r for r in profile if r[0] == q and r[2])
            print(f"  mesh {q}: {label:<6} {1e3 * start:7.3f} .. {1e3 * end:7.3f} ms")
        print(
            f"measured : makespan {1e3 * measured.makespan:.2f} ms, "
            f"bubble {measured.bubble_fraction:.1%}"
        )
        print(
            f"simulated: makespan {1e3 * simulated.makespan:.2f} ms, "
            f"bubble {simulated.bubble_fraction:.1%} (with the measured task times)"
        )
        print(f"simulated / measured makespan: {comparison.predicted_over_measured:.2f}")
        kinds = sorted({task.kind for _, task, _, _ in measured.entries})
        fitted = ", ".join(f"{k} {1e3 * getattr(comparison.costs, k):.3f} ms" for k in kinds)
        print(f"median task times the simulator used: {fitted}")
        assert measured.makespan > 0 and simulated.makespan > 0
        assert sorted(map(str, (t for _, t, _, _ in measured.entries))) == sorted(
            str(t) for row in profile.tasks for t in row
        ), "the profile should hold every task of the schedule once"

        if missing is None:
            path = picture_path(pathlib.Path(args.out), schedule.name)
            path.parent.mkdir(parents=True, exist_ok=True)
            profile.plot(path)
            print(f"drew the measured timeline above the simulated one: {path}")
        else:
            print(f"skipped the picture: {missing}")
        print()
    print("every step's loss equals the unpipelined reference, profiled step included")


if __name__ == "__main__":
    main()
