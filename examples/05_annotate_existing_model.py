"""Pipeline a model that knows nothing about nnx_mpmd, with ``mp.assign_stages``.

``Sequential`` below is plain Flax NNX: no `Stage`, no `PipelinedModel`. Stages
are assigned afterwards by path pattern (exact paths, globs or regular
expressions); then the ordinary train step, compiled with ``mp.jit``, gives the
same losses and parameters as ``nnx.jit`` on an unannotated copy.

Run:  python examples/05_annotate_existing_model.py --steps 3
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

# ---- a model written without nnx_mpmd -------------------------------------------


class Residual(nnx.Module):
    def __init__(self, width: int, *, rngs: nnx.Rngs) -> None:
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.linear = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jax.nn.gelu(self.linear(self.norm(x)))


class Sequential(nnx.Module):
    def __init__(self, *layers: nnx.Module) -> None:
        self.layers = nnx.List(layers)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return x


def make_model() -> Sequential:
    rngs = nnx.Rngs(0)
    blocks = [Residual(32, rngs=rngs) for _ in range(6)]
    return Sequential(nnx.Linear(8, 32, rngs=rngs), *blocks, nnx.Linear(32, 1, rngs=rngs))


def loss_fn(model: Sequential, batch: dict) -> jax.Array:
    return jnp.mean((model(batch["x"])[:, 0] - batch["y"]) ** 2)


def batch_at(step: int) -> dict:
    x = np.random.default_rng(step).normal(size=(64, 8)).astype(np.float32)
    return {"x": x, "y": np.tanh(x @ np.arange(1, 9, dtype=np.float32) / 8)}


# ---- pipelining it ----------------------------------------------------------------

STAGE_OF_PATH = {
    "layers.[0-2]": 0,  # glob: the input projection and two blocks
    "layers.3": 1,  # an exact path
    "layers.(4|5)": 2,  # a regular expression
    "layers.[6-7]": 3,  # the last block and the output projection
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    # Compiled programs are kept in ~/.cache/nnx_mpmd/jax, so the next run starts
    # faster (NNX_MPMD_COMPILE_CACHE=off turns that off).
    mp.enable_compile_cache()

    model = mp.assign_stages(make_model(), STAGE_OF_PATH)
    print(mp.annotate.stage_summary(model))
    try:  # an off-by-one path: Sequential has layers.0 to layers.7
        mp.assign_stages(make_model(), {"layers.8": 3})
    except mp.PartitionError as error:
        print(f"a path that does not exist is reported with the paths next to it:\n  {error}")

    mesh = mp.MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def train_step(model, optimizer, batch):
        return _update(model, optimizer, mp.value_and_grad(loss_fn)(model, batch))

    step = mp.jit(train_step, mesh=mesh, schedule=mp.GPipe(), num_microbatches=4)

    reference = make_model()
    ref_optimizer = nnx.Optimizer(reference, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def reference_step(model, optimizer, batch):
        return _update(model, optimizer, nnx.value_and_grad(loss_fn)(model, batch))

    losses = []
    for i in range(args.steps):
        loss = float(step(model, optimizer, batch_at(i)))
        ref_loss = float(reference_step(reference, ref_optimizer, batch_at(i)))
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        losses.append(loss)
    mp.gather(model)
    ref_leaves = jax.tree.leaves(nnx.state(reference, nnx.Param))
    for got, want in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), ref_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)
    print(f"losses {losses[0]:.4f} -> {losses[-1]:.4f}, equal to nnx.jit at every step")
    print("parameters equal the unpipelined model's")


def _update(model, optimizer, loss_and_grads):
    loss, grads = loss_and_grads
    optimizer.update(model, grads)
    return loss


if __name__ == "__main__":
    main()
