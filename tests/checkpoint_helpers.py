"""Shared helpers for the checkpoint tests: a small staged model, placement, training.

Used by tests/checkpoint/test_checkpoint*.py and by the subprocess script
tests/checkpoint_worker.py. Placement here is by hand (``jax.device_put`` onto
submeshes) so that the tests do not depend on how `nnx_mpmd.placement.place.place`
chooses shardings; the `place`-based tests live in the test files.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_mpmd as mp
from nnx_mpmd.annotate.annotate import logical_paths, variable_stage
from nnx_mpmd.placement.mesh import MpmdMesh

WIDTH = 8
NUM_LAYERS = 4


class Block(nnx.Module):
    def __init__(self, width: int, *, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(width, width, rngs=rngs)
        self.norm = nnx.LayerNorm(width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(self.linear(self.norm(x)))


class Net(nnx.Module):
    """``NUM_LAYERS`` blocks and a head; ``stages=None`` builds it without `Stage`."""

    def __init__(self, stages: Sequence[int] | None = None, *, seed: int = 0) -> None:
        rngs = nnx.Rngs(seed)
        blocks = [Block(WIDTH, rngs=rngs) for _ in range(NUM_LAYERS)]
        head = nnx.Linear(WIDTH, 1, rngs=rngs)
        if stages is not None:
            blocks = [mp.Stage(b, stage=s) for b, s in zip(blocks, stages)]
            head = mp.Stage(head, stage=stages[-1])
        self.blocks = nnx.List(blocks)
        self.head = head

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return self.head(x)[..., 0]


def make_mesh(num_meshes: int) -> MpmdMesh:
    return MpmdMesh(jax.make_mesh((num_meshes, 8 // num_meshes), ("stage", "data")), "stage")


def spec_for(value: jax.Array) -> P:
    """Shards the first axis over ``data`` when it divides, else replicates."""
    return P("data") if value.ndim >= 1 and value.shape[0] % 2 == 0 else P()


def hand_place(tree: object, mesh: MpmdMesh, mesh_of_stage=lambda s: s) -> None:
    """Puts every staged Variable on its stage's submesh (others on mesh 0), in place."""
    for _, node in nnx.iter_graph(tree):
        if isinstance(node, nnx.Variable):
            value = node.get_value()
            if not isinstance(value, jax.Array) or jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
                continue
            stage = variable_stage(node)
            mesh_id = 0 if stage is None else mesh_of_stage(stage)
            sharding = NamedSharding(mesh.submesh(mesh_id), spec_for(value))
            node.set_value(jax.device_put(value, sharding))


def batches(seed: int, count: int, batch: int = 8) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        x = rng.normal(size=(batch, WIDTH)).astype(np.float32)
        out.append((x, np.sin(x.sum(axis=1))))
    return out


def batch_at(position: int, batch: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """The deterministic batch number ``position`` (data order from a saved position)."""
    return batches(1000 + position, 1, batch)[0]


def make_optimizer(model: Net) -> nnx.Optimizer:
    return nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


@nnx.jit
def train_step(model: Net, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    def loss_fn(model: Net) -> jax.Array:
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def to_default_device(x: jax.Array) -> jax.Array:
    return jax.device_put(x, jax.devices()[0])


def run_steps(model: Net, optimizer: nnx.Optimizer, data) -> list[float]:
    """Runs the train step on unplaced copies of the batch; returns the losses."""
    losses = []
    for x, y in data:
        losses.append(float(train_step(model, optimizer, jnp.asarray(x), jnp.asarray(y))))
    return losses


def param_values(model: nnx.Module) -> dict[tuple[str, ...], np.ndarray]:
    """Parameter values by logical path, as numpy (for layout-free comparisons)."""
    paths = logical_paths(model)
    values = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable):
            logical = paths.get(tuple(path), tuple(path))
            values[tuple(str(k) for k in logical)] = np.asarray(node.get_value())
    return values
