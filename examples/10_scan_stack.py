"""Split a stack of scanned layers across pipeline stages by ranges of layers.

Deep models often create their blocks stacked along a leading axis
(``nnx.vmap``) and run them with ``nnx.scan``: one compiled loop body instead of
one copy per block. ``mp.ScanStack(Block, 8, rngs=rngs)`` is such a stack as a
module, and ``mp.assign_stages(model, {"blocks[0:4]": 0, "blocks[4:8]": 1})``
cuts it into ranges: every stacked Variable is sliced along its layer axis, and
each range becomes a ``Stage`` that scans its own layers. The pipelined step
computes the same scan range by range, so every step's loss equals the unsplit
model under ``nnx.jit``; and each stage's program still holds one loop over its
layers, compiled once and run for every microbatch. A checkpoint of the split
stack restores into a stack cut into other ranges, or not cut at all.

Run:  python examples/10_scan_stack.py --steps 5
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import nnx_mpmd as mp

WIDTH, NUM_LAYERS = 16, 8
RANGES = {"embed": 0, "blocks[0:4]": 0, "blocks[4:8]": 1, "head": 1}


class Block(nnx.Module):
    """One residual block: ``x -> x`` (extra arguments, such as a mask, would reach every layer)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.mlp = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(self.mlp(self.norm(x)))


class Deep(mp.PipelinedModel):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Linear(8, WIDTH, rngs=rngs)
        # NUM_LAYERS Blocks made with nnx.vmap (one split of rngs each), run with nnx.scan.
        self.blocks = mp.ScanStack(Block, NUM_LAYERS, rngs=rngs)
        self.head = nnx.Linear(WIDTH, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(self.blocks(self.embed(x)))[:, 0]


def loss_fn(model: Deep, batch: dict) -> jax.Array:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def train_step(model, optimizer, batch):
    loss, grads = mp.value_and_grad(loss_fn, num_microbatches=4)(model, batch)
    optimizer.update(model, grads)
    return loss


def batch_at(step: int) -> dict:
    x = np.random.default_rng(step).normal(size=(64, 8)).astype(np.float32)
    return {"x": x, "y": np.sin(x[:, 0] + x[:, 1])}


def count_loops(hlo_text: str) -> int:
    """The number of while loops (a scan lowers to one) in a compiled program's HLO."""
    return len(re.findall(r"\swhile\(", hlo_text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    mp.enable_compile_cache()

    # Ranges must cut the stack into consecutive pieces; a gap is an error that says where.
    try:
        mp.assign_stages(Deep(nnx.Rngs(0)), {"blocks[0:3]": 0, "blocks[4:8]": 1})
        raise AssertionError("a gap between the ranges was accepted")
    except mp.PartitionError as error:
        print(f"a gap is refused: {error}\n")

    model = mp.assign_stages(Deep(nnx.Rngs(0)), RANGES)
    print(model.stage_summary())  # the chunks read as their ranges, blocks[0:4] ...
    ranges = model.blocks.chunk_ranges()
    for (start, stop), chunk in zip(ranges, model.blocks.chunks):
        kernel = chunk.module.layers.mlp.kernel
        print(
            f"blocks[{start}:{stop}] -> stage {chunk.stage} (stacked kernel {tuple(kernel.shape)})"
        )
    assert [(c.stage, c.module.num_layers) for c in model.blocks.chunks] == [(0, 4), (1, 4)]

    mesh = mp.MpmdMesh(jax.make_mesh((2, 4), ("stage", "data")), "stage")
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = mp.jit(train_step, mesh=mesh, schedule=mp.OneFOneB(), num_microbatches=4)

    # One program per stage and task kind, reused for every microbatch; the
    # stage's 4 blocks are one scan in it (a while loop: the body compiled
    # once), not 4 unrolled copies. FB1 is the last stage's fused forward and
    # backward: one loop each way.
    compiled = step.lower(model, optimizer, batch_at(0)).compile()
    executables = compiled.executables()
    loops = {name: count_loops(executables[name][0].as_text()) for name in ("F0", "B0", "FB1")}
    print(f"\nprograms: {', '.join(sorted(executables))}")
    print(
        "scan loops per stage program (4 blocks each): "
        + ", ".join(f"{name} {n}" for name, n in loops.items())
    )
    assert loops == {"F0": 1, "B0": 1, "FB1": 2}, loops

    reference = Deep(nnx.Rngs(0))  # the same stack, not split, on one device
    ref_optimizer = nnx.Optimizer(reference, optax.adam(1e-2), wrt=nnx.Param)
    reference_step = nnx.jit(train_step)
    losses = []
    for i in range(args.steps):
        losses.append(float(step(model, optimizer, batch_at(i))))
        ref_loss = float(reference_step(reference, ref_optimizer, batch_at(i)))
        np.testing.assert_allclose(losses[-1], ref_loss, rtol=1e-5)
    assert step.num_compiled_steps == 1
    print(f"trained the split stack: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print("every step's loss equals the unpipelined reference")
    assert losses[-1] < losses[0]

    # The checkpoint stores each chunk as it is cut; a stack cut into other ranges
    # is assembled from the saved layers on restore, optimizer state included.
    with tempfile.TemporaryDirectory() as directory:
        mp.checkpoint.save(f"{directory}/ckpt", {"model": model, "optimizer": optimizer})
        other_cut = {"embed": 0, "blocks[0:2]": 0, "blocks[2:8]": 1, "head": 1}
        recut = mp.assign_stages(Deep(nnx.Rngs(1)), other_cut)
        recut_optimizer = nnx.Optimizer(recut, optax.adam(1e-2), wrt=nnx.Param)
        mp.checkpoint.restore(f"{directory}/ckpt", {"model": recut, "optimizer": recut_optimizer})
        unsplit = Deep(nnx.Rngs(2))  # for one device, e.g. to evaluate or export
        mp.checkpoint.restore(f"{directory}/ckpt", {"model": unsplit}, partial=True)
    probe = batch_at(999)["x"]
    np.testing.assert_allclose(unsplit(probe), reference(probe), rtol=1e-5, atol=1e-6)
    recut_step = mp.jit(train_step, mesh=mesh, schedule=mp.OneFOneB(), num_microbatches=4)
    recut_loss = float(recut_step(recut, recut_optimizer, batch_at(args.steps)))
    ref_loss = float(reference_step(reference, ref_optimizer, batch_at(args.steps)))
    np.testing.assert_allclose(recut_loss, ref_loss, rtol=1e-5)
    print(
        f"restored into blocks[0:2] + blocks[2:8]: the next step's loss {recut_loss:.4f} "
        "equals the reference's; restored unsplit on one device: the same predictions"
    )


if __name__ == "__main__":
    main()
