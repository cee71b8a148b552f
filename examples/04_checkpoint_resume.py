"""Checkpoint a pipelined model, "crash", and resume in a different stage layout.

A small 4-stage MLP is placed on 4 submeshes of an 8-device CPU mesh and trained;
a `CheckpointManager` saves every step asynchronously, with the data position in
the JSON metadata. Half-way through the run "crashes" (every object is dropped).
A new run builds the model with a different stage split on 2 submeshes, restores
the latest checkpoint into it, continues from the saved data position, and checks
that its losses equal those of an uninterrupted run.

The train step is compiled with ``nnx_mpmd.jit`` (1F1B) for each layout, so
training, saving and restoring all work on placed, per-mesh state.

Run:  python examples/04_checkpoint_resume.py --steps 4
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import functools
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import nnx_mpmd as mp
from nnx_mpmd.checkpoint import CheckpointManager

WIDTH, LAYERS, BATCH = 16, 4, 32


class MLP(nnx.Module):
    def __init__(self, stages: list[int], rngs: nnx.Rngs) -> None:
        self.layers = nnx.List(
            [mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=s) for s in stages]
        )
        self.head = mp.Stage(nnx.Linear(WIDTH, 1, rngs=rngs), stage=stages[-1])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = jax.nn.gelu(layer(x))
        return self.head(x)[:, 0]


def batch_at(position: int) -> tuple[jax.Array, jax.Array]:
    """Batch number ``position``: the data order depends only on the position."""
    rng = np.random.default_rng(position)
    x = rng.normal(size=(BATCH, WIDTH)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(np.cos(x[:, :4].sum(axis=1)))


def loss_fn(model: MLP, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def make_train_step(mesh: mp.MpmdMesh):
    """The pipelined step for ``mesh`` (1F1B, 4 microbatches)."""

    @functools.partial(mp.jit, mesh=mesh, schedule=mp.OneFOneB(), num_microbatches=4)
    def train_step(model: MLP, optimizer: nnx.Optimizer, batch) -> jax.Array:
        loss, grads = mp.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    return train_step


def build(stages: list[int], num_meshes: int) -> tuple[MLP, nnx.Optimizer, mp.MpmdMesh]:
    mesh = mp.MpmdMesh(jax.make_mesh((num_meshes, 8 // num_meshes), ("stage", "data")), "stage")
    model = MLP(stages, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    mp.place((model, optimizer), mesh)
    return model, optimizer, mesh


def run(directory: str, steps: int, stages: list[int], num_meshes: int, crash_at=None):
    """Trains until ``steps`` (or the crash), resuming from ``directory`` if possible."""
    model, optimizer, mesh = build(stages, num_meshes)
    train_step = make_train_step(mesh)
    losses = {}
    with CheckpointManager(directory, max_to_keep=3) as mgr:
        position = 0
        if mgr.latest_step() is not None:
            mgr.restore({"model": model, "optimizer": optimizer})  # into this run's layout
            position = mgr.metadata()["data_position"]
            print(f"  resumed step {mgr.latest_step()} into {num_meshes} meshes, stages {stages}")
        while position < steps:
            losses[position] = float(train_step(model, optimizer, batch_at(position)))
            print(f"  step {position}: loss {losses[position]:.6f}")
            position += 1
            mgr.save(
                position, {"model": model, "optimizer": optimizer}, {"data_position": position}
            )
            if position == crash_at:
                print("  -- crash! --")
                break
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    args = parser.parse_args()
    # Compiled programs are kept in ~/.cache/nnx_mpmd/jax, so the next run starts
    # faster (NNX_MPMD_COMPILE_CACHE=off turns that off).
    mp.enable_compile_cache()
    root = args.dir or tempfile.mkdtemp(prefix="nnx_mpmd_ckpt_")
    crash_at = max(1, args.steps // 2)

    print("uninterrupted run (4 meshes):")
    reference = run(os.path.join(root, "reference"), args.steps, [0, 1, 2, 3], 4)
    print(f"run that crashes after step {crash_at - 1} (4 meshes):")
    before = run(os.path.join(root, "crashy"), args.steps, [0, 1, 2, 3], 4, crash_at=crash_at)
    print("resumed run (2 meshes, stages [0, 0, 1, 1]):")
    after = run(os.path.join(root, "crashy"), args.steps, [0, 0, 1, 1], 2)

    combined = {**before, **after}
    # Another layout sums gradients in another order: equal up to float rounding.
    if combined.keys() != reference.keys() or not np.allclose(
        [combined[k] for k in sorted(combined)],
        [reference[k] for k in sorted(reference)],
        rtol=1e-5,
    ):
        raise SystemExit(f"resumed losses differ: {combined} vs {reference}")
    print(f"resumed losses match the uninterrupted run over {args.steps} steps")


if __name__ == "__main__":
    main()
