"""Llama ``tiny`` with 8 layers as 8 stages on 4 meshes, Interleaved 1F1B.

Each mesh holds two stages (stage s on mesh s % 4), which shrinks the pipeline
bubble. The pipelined steps are checked against the same steps run
unpipelined under ``nnx.jit``: equal losses and equal parameters at the end.

Run:  python examples/03_llama_interleaved.py --steps 3
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

MESHES, STAGES, MICROBATCHES = 4, 8, 8


def build(vocab_size: int):
    model = build_model(
        "llama", "tiny", num_stages=STAGES, n_layers=8, vocab_size=vocab_size, rngs=nnx.Rngs(0)
    )
    return model, nnx.Optimizer(model, optax.adamw(3e-3, b2=0.99), wrt=nnx.Param)


def train_step(model, optimizer, batch):
    # Outside mp.jit, mp.value_and_grad averages over microbatches without a pipeline.
    loss, grads = mp.value_and_grad(lm_loss, num_microbatches=MICROBATCHES)(model, batch)
    optimizer.update(model, grads)
    return loss


def pipelined_step(model, optimizer, batch):
    loss, grads = mp.value_and_grad(lm_loss)(model, batch)
    optimizer.update(model, grads)
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    # Compiled programs are kept in ~/.cache/nnx_mpmd/jax, so the next run starts
    # faster (NNX_MPMD_COMPILE_CACHE=off turns that off).
    mp.enable_compile_cache()

    text = stdlib_corpus(200_000)
    tokenizer = CharTokenizer.from_text(text)
    batches = BatchIterator(tokenizer.encode(text), batch_size=32, seq_len=32, seed=0)
    schedule = mp.Interleaved1F1B()
    placement = [schedule.mesh_of(s, STAGES, MESHES) for s in range(STAGES)]
    print(f"stage -> mesh: {placement}")
    ideal = mp.schedules.simulate(mp.OneFOneB().tasks(MESHES, MESHES, MICROBATCHES))
    interleaved = mp.schedules.simulate(schedule.tasks(STAGES, MESHES, MICROBATCHES))
    print(
        f"simulated bubble: 1F1B with 4 stages {ideal.bubble_fraction:.1%}, "
        f"interleaved with 8 stages {interleaved.bubble_fraction:.1%}"
    )

    mesh = mp.MpmdMesh(jax.make_mesh((MESHES, 2), ("stage", "data")), "stage")
    model, optimizer = build(tokenizer.vocab_size)
    ref_model, ref_optimizer = build(tokenizer.vocab_size)
    step = mp.jit(pipelined_step, mesh=mesh, schedule=schedule, num_microbatches=MICROBATCHES)
    reference = nnx.jit(train_step)
    for i in range(args.steps):
        batch = batches.batch_at(i)
        loss = float(step(model, optimizer, batch))
        ref_loss = float(reference(ref_model, ref_optimizer, batch))
        print(f"step {i}: pipelined {loss:.5f}  nnx.jit {ref_loss:.5f}")
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-4)

    mp.gather(model)
    got, want = nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4)
    print(f"parameters after {args.steps} steps equal the unpipelined run")


if __name__ == "__main__":
    main()
