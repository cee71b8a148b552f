"""Padded, variable-length sequences: the token-weighted mean loss, pipelined.

Sequences of different lengths are padded to one length; the loss averages the
per-token cross entropy over the *real* tokens of the whole batch. Split into
microbatches, the real tokens fall unevenly, so the mean of the microbatches'
means is not that loss. ``mp.value_and_grad(..., reduction="token_mean")``
takes each microbatch's ``(sum, count)`` and returns ``Σ sum / Σ count`` and
its gradient. Every step is checked against the same model trained on the
whole batch at once under ``nnx.jit``.

Run:  python examples/07_token_weighted_loss.py --steps 10
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
from nnx_mpmd.models import build_model

VOCAB, SEQ, BATCH = 64, 32, 32


def token_sum_and_count(model, batch):
    logits = model(batch["inputs"])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(batch["mask"] * nll), jnp.sum(batch["mask"])


def padded_batch(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    tokens = rng.integers(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
    lengths = np.sort(rng.integers(1, SEQ + 1, size=BATCH))[::-1]
    mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    mp.enable_compile_cache()
    mesh = mp.MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")

    def fresh():
        model = build_model("gpt", "tiny", num_stages=4, rngs=nnx.Rngs(0), vocab_size=VOCAB)
        return model, nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)

    model, optimizer = fresh()
    reference, ref_optimizer = fresh()

    def train_step(model, optimizer, batch):
        loss, grads = mp.value_and_grad(token_sum_and_count, reduction="token_mean")(model, batch)
        optimizer.update(model, grads)
        return loss

    @nnx.jit
    def whole_batch_step(model, optimizer, batch):
        loss_fn = lambda m, b: jnp.divide(*token_sum_and_count(m, b))  # noqa: E731
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    step = mp.jit(train_step, mesh=mesh, schedule=mp.OneFOneB(), num_microbatches=args.microbatches)
    for i in range(args.steps):
        batch = padded_batch(i)
        counts = batch["mask"].reshape(args.microbatches, -1).sum(axis=1)
        loss = float(step(model, optimizer, batch))
        expected = float(whole_batch_step(reference, ref_optimizer, batch))
        np.testing.assert_allclose(loss, expected, rtol=2e-4)
        if i == 0:
            print(f"real tokens per microbatch: {counts.astype(int).tolist()}")
        print(f"step {i}: token-weighted loss {loss:.4f} (whole batch: {expected:.4f})")
    print(f"every loss equals the whole-batch token-weighted mean ({args.steps} steps)")


if __name__ == "__main__":
    main()
