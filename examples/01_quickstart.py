"""Quick start: a 4-stage MLP trained with 1F1B on 4 submeshes of 8 CPU devices.

Run:  python examples/01_quickstart.py --steps 30
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import nnx_mpmd as mp


class MLP(mp.PipelinedModel):
    """Four hidden layers, one pipeline stage each; the head joins the last stage."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([mp.Stage(nnx.Linear(16, 16, rngs=rngs), stage=s) for s in range(4)])
        self.head = mp.Stage(nnx.Linear(16, 1, rngs=rngs), stage=3)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return self.head(x)[:, 0]


def loss_fn(model: MLP, batch: dict) -> jax.Array:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def batch_at(step: int) -> dict:
    x = np.random.default_rng(step).normal(size=(64, 16)).astype(np.float32)
    return {"x": x, "y": np.sin(x[:, :4].sum(axis=1))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    # Compiled programs are kept in ~/.cache/nnx_mpmd/jax, so the next run starts
    # faster (NNX_MPMD_COMPILE_CACHE=off turns that off).
    mp.enable_compile_cache()

    # 4 submeshes ("stage" axis) of 2 devices each ("data" axis).
    mesh = mp.MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @functools.partial(mp.jit, mesh=mesh, schedule=mp.OneFOneB(), num_microbatches=8)
    def train_step(model, optimizer, batch):
        loss, grads = mp.value_and_grad(loss_fn)(model, batch)  # the pipelined region
        optimizer.update(model, grads)  # runs on each parameter's mesh
        return loss

    losses = [float(train_step(model, optimizer, batch_at(step))) for step in range(args.steps)]
    print(f"loss: step 0 {losses[0]:.4f} -> step {args.steps - 1} {losses[-1]:.4f}")
    assert losses[-1] < 0.5 * losses[0], "the pipelined MLP did not learn"


if __name__ == "__main__":
    main()
