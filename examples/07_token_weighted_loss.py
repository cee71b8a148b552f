"""Padded, variable-length sequences: the token-weighted mean loss, pipelined.

Sequences of different lengths are padded to one length; the loss averages the
per-token cross entropy over the *real* tokens of the whole batch. Split into
microbatches, the real tokens fall unevenly, so the mean of the microbatches'
means is not that loss. ``mp.value_and_grad(..., reduction="token_mean")``
takes each microbatch's ``(sum, count)`` and returns ``Σ sum / Σ count`` and
its gradient. The loss also returns each sequence's mean loss as aux;
``aux_reduction="concat"`` gives those for the whole batch, in order (averaging
them over the microbatches would mix different sequences). Every step is
checked against the same model trained on the whole batch at once under
``nnx.jit``.

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
    """``((masked sum, real tokens), per-sequence mean loss)``."""
    logits = model(batch["inputs"])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    per_sequence = jnp.sum(batch["mask"] * nll, axis=1) / jnp.sum(batch["mask"], axis=1)
    return (jnp.sum(batch["mask"] * nll), jnp.sum(batch["mask"])), per_sequence


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
        (loss, per_sequence), grads = mp.value_and_grad(
            token_sum_and_count, has_aux=True, reduction="token_mean", aux_reduction="concat"
        )(model, batch)
        optimizer.update(model, grads)
        return loss, per_sequence

    @nnx.jit
    def whole_batch_step(model, optimizer, batch):
        def loss_fn(m, b):
            (total, count), per_sequence = token_sum_and_count(m, b)
            return total / count, per_sequence

        (loss, per_sequence), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        optimizer.update(model, grads)
        return loss, per_sequence

    step = mp.jit(train_step, mesh=mesh, schedule=mp.OneFOneB(), num_microbatches=args.microbatches)
    for i in range(args.steps):
        batch = padded_batch(i)
        counts = batch["mask"].reshape(args.microbatches, -1).sum(axis=1)
        loss, per_sequence = step(model, optimizer, batch)
        expected, expected_per_sequence = whole_batch_step(reference, ref_optimizer, batch)
        np.testing.assert_allclose(float(loss), float(expected), rtol=2e-4)
        np.testing.assert_allclose(per_sequence, expected_per_sequence, rtol=2e-4, atol=1e-5)
        if i == 0:
            print(f"real tokens per microbatch: {counts.astype(int).tolist()}")
        worst = int(np.argmax(per_sequence))
        print(
            f"step {i}: token-weighted loss {float(loss):.4f} (whole batch: "
            f"{float(expected):.4f}); worst sequence {worst}: {float(per_sequence[worst]):.4f}"
        )
    print(f"every loss, and every sequence's loss, equals the whole batch's ({args.steps} steps)")


if __name__ == "__main__":
    main()
