"""GPT ``tiny`` from the model zoo, pipelined with 1F1B on 4 meshes x 2 data devices.

A character-level model learns the Python standard library's own source. The
first pipelined loss is checked against the same model run unpipelined, and the
loss must fall over the run.

Run:  python examples/02_gpt_pipeline.py --steps 40
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import functools

import jax
import numpy as np
import optax
from flax import nnx

import nnx_mpmd as mp
from nnx_mpmd.apps.data import BatchIterator, CharTokenizer, stdlib_corpus
from nnx_mpmd.models import build_model, lm_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    # Compiled programs are kept in ~/.cache/nnx_mpmd/jax, so the next run starts
    # faster (NNX_MPMD_COMPILE_CACHE=off turns that off).
    mp.enable_compile_cache()

    text = stdlib_corpus(300_000)
    tokenizer = CharTokenizer.from_text(text)
    batches = BatchIterator(tokenizer.encode(text), batch_size=32, seq_len=64, seed=0)

    mesh = mp.MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
    schedule = mp.OneFOneB()
    model = build_model(
        "gpt", "tiny", num_stages=4, rngs=nnx.Rngs(0), vocab_size=tokenizer.vocab_size
    )
    print(model.stage_summary())
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3, b2=0.99), wrt=nnx.Param)

    # The unpipelined loss of the first batch, from an identical fresh model.
    first = batches.batch_at(0)
    reference = build_model(
        "gpt", "tiny", num_stages=4, rngs=nnx.Rngs(0), vocab_size=tokenizer.vocab_size
    )
    expected = float(nnx.jit(lm_loss)(reference, first))

    # donate_argnums: the update writes the new parameters and Adam moments into the
    # old buffers (as with nnx.jit), so no mesh holds its state twice while it updates.
    @functools.partial(
        mp.jit, mesh=mesh, schedule=schedule, num_microbatches=args.microbatches,
        donate_argnums=(0, 1),
    )  # fmt: skip
    def train_step(model, optimizer, batch):
        loss, grads = mp.value_and_grad(lm_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    print(mp.schedules.to_ascii(schedule.tasks(4, 4, args.microbatches)))
    # NNX's cached_partial: the step reads the same Variables without walking the
    # model and optimizer graph on every call (the loop changes no structure).
    cached_step = nnx.cached_partial(train_step, model, optimizer)
    losses = [float(cached_step(next(batches))) for _ in range(args.steps)]
    program = train_step.lower(model, optimizer, first).instructions(0)
    print("mesh 0 starts with:", "; ".join(line.split(": ", 1)[1] for line in program[:6]))
    np.testing.assert_allclose(losses[0], expected, rtol=1e-5)
    print(f"first loss {losses[0]:.4f} equals the unpipelined {expected:.4f}")
    head, tail = np.mean(losses[:3]), np.mean(losses[-3:])
    print(f"loss {head:.3f} (first 3 steps) -> {tail:.3f} (last 3 steps)")
    assert tail < head - 0.2, "the pipelined GPT did not learn"


if __name__ == "__main__":
    main()
