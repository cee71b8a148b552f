"""Write a pipeline schedule as text, check it, simulate it, and train with it.

A schedule is one line of tasks per mesh: ``F{stage}.{microbatch}`` for a
forward, ``B...`` for a backward. ``mp.schedules.parse_tasks`` reads the text,
``validate`` rejects impossible orders (with a marked grid), ``simulate`` gives
the makespan, bubble and peak activations, and ``mp.Custom(text=...)`` hands the
same schedule to ``mp.jit``. Tasks joined by ``+`` run overlapped, as one
program (DualPipe's overlapped forward and backward): ``Costs(overlap=...)``
tells the simulator how much time that hides.

Run:  python examples/06_custom_schedule.py --steps 5
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import nnx_mpmd as mp
from nnx_mpmd import schedules

# Mesh 0 keeps two microbatches in flight before its first backward; mesh 1
# (the last stage) runs each backward right after its forward.
EAGER_1F1B = """
mesh 0: F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 B0.3
mesh 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3
"""

# The same order with each backward and the forward after it joined by "+":
# every pair runs as one program (on mesh 0: B0.0 with F0.2, B0.1 with F0.3).
OVERLAPPED = """
mesh 0: F0.0 F0.1 B0.0+F0.2 B0.1+F0.3 B0.2 B0.3
mesh 1: F1.0 B1.0+F1.1 B1.1+F1.2 B1.2+F1.3 B1.3
"""

# Wrong on purpose: mesh 1 runs B1.0 before the forward it differentiates.
BROKEN = """
mesh 0: F0.0 F0.1 B0.0 B0.1
mesh 1: B1.0 F1.0 F1.1 B1.1
"""


class MLP(mp.PipelinedModel):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.first = mp.Stage(nnx.Linear(8, 32, rngs=rngs), stage=0)
        self.second = mp.Stage(nnx.Linear(32, 1, rngs=rngs), stage=1)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.second(jnp.tanh(self.first(x)))[:, 0]


def loss_fn(model: MLP, batch: dict) -> jax.Array:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def train_step(model, optimizer, batch):
    loss, grads = mp.value_and_grad(loss_fn, num_microbatches=4)(model, batch)
    optimizer.update(model, grads)
    return loss


def batch_at(step: int) -> dict:
    x = np.random.default_rng(step).normal(size=(64, 8)).astype(np.float32)
    return {"x": x, "y": np.sin(x[:, 0] + x[:, 1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--gantt", default=None, help="also save a Gantt chart (.png)")
    args = parser.parse_args()
    # Compiled programs are kept in ~/.cache/nnx_mpmd/jax, so the next run starts
    # faster (NNX_MPMD_COMPILE_CACHE=off turns that off).
    mp.enable_compile_cache()

    tasks = schedules.parse_tasks(EAGER_1F1B)
    schedules.validate(tasks)
    try:
        schedules.validate(schedules.parse_tasks(BROKEN))
        raise AssertionError("the broken schedule was accepted")
    except mp.ScheduleError as error:
        print(f"validate rejects the broken schedule:\n{error}\n")

    mine = schedules.simulate(tasks)
    gpipe = schedules.simulate(mp.GPipe().tasks(2, 2, 4))
    print(schedules.to_ascii(mine))
    print(
        f"custom: makespan {mine.makespan:g}, peak activations {mine.peak_activations}; "
        f"GPipe: makespan {gpipe.makespan:g}, peak activations {gpipe.peak_activations}"
    )
    assert mine.makespan <= gpipe.makespan
    assert max(mine.peak_activations) < max(gpipe.peak_activations)
    if args.gantt:
        schedules.plot_gantt(mine, args.gantt, title="custom eager 1F1B")

    # Overlapped pairs. A pair's results arrive when its one program ends, so a
    # pair can delay another mesh: in this 1F1B both meshes are busy all along,
    # and the simulator says the pairs pay only if most of a forward is hidden.
    overlapped = schedules.parse_tasks(OVERLAPPED)
    schedules.validate(overlapped)
    for hidden in (0.0, 0.5, 1.0):
        costs = schedules.Costs(overlap=hidden)
        print(
            f"overlap {hidden:g}: makespan {schedules.simulate(overlapped, costs).makespan:g} "
            f"with the pairs, {schedules.simulate(tasks, costs).makespan:g} without"
        )
    # DualPipeV joins only pairs that delay nothing: the same makespan when
    # nothing is hidden, shorter as soon as something is.
    dual = mp.DualPipeV().tasks(4, 2, 8)
    print("DualPipeV", schedules.format_tasks(dual).splitlines()[1])
    separate = schedules.simulate(mp.DualPipeV(overlap=False).tasks(4, 2, 8))
    assert schedules.simulate(dual).makespan == separate.makespan
    quarter = schedules.simulate(dual, schedules.Costs(overlap=0.25))
    print(f"DualPipeV: makespan {separate.makespan:g}, {quarter.makespan:g} with 0.25 hidden")
    assert quarter.makespan < separate.makespan

    losses = train(EAGER_1F1B, args.steps)
    print(f"trained with the custom schedule: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    train(OVERLAPPED, args.steps)
    print("every step's loss equals the unpipelined reference, with and without overlapped pairs")
    assert losses[-1] < losses[0]


def train(text: str, steps: int) -> list[float]:
    """Trains with the schedule ``text``, checking every loss against ``nnx.jit``."""
    mesh = mp.MpmdMesh(jax.make_mesh((2, 4), ("stage", "data")), "stage")
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = mp.jit(train_step, mesh=mesh, schedule=mp.Custom(text=text), num_microbatches=4)
    reference = MLP(nnx.Rngs(0))
    ref_optimizer = nnx.Optimizer(reference, optax.adam(1e-2), wrt=nnx.Param)
    reference_step = nnx.jit(train_step)
    losses = []
    for i in range(steps):
        losses.append(float(step(model, optimizer, batch_at(i))))
        ref_loss = float(reference_step(reference, ref_optimizer, batch_at(i)))
        np.testing.assert_allclose(losses[-1], ref_loss, rtol=1e-5)
    return losses


if __name__ == "__main__":
    main()
