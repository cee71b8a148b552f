"""Pipelined generation: train GPT ``tiny`` briefly, then decode with the pipeline.

The prompts are split into microbatches that are in flight through the 4
stages together, each stage keeping its layers' KV cache on its own submesh;
greedy and sampled decoding are checked token for token against the same model
decoding unpipelined on one device.

Run:  python examples/08_generate.py --steps 20
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
from nnx_mpmd.models import build_model, kv_cache, lm_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    mp.enable_compile_cache()

    text = stdlib_corpus(200_000)
    tokenizer = CharTokenizer.from_text(text)
    batches = BatchIterator(tokenizer.encode(text), batch_size=32, seq_len=64, seed=0)
    mesh = mp.MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
    schedule = mp.OneFOneB()
    model = build_model(
        "gpt", "tiny", num_stages=4, rngs=nnx.Rngs(0), vocab_size=tokenizer.vocab_size
    )
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3, b2=0.99), wrt=nnx.Param)

    def train_step(model, optimizer, batch):
        loss, grads = mp.value_and_grad(lm_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    step = mp.jit(train_step, mesh=mesh, schedule=schedule, num_microbatches=8)
    for _ in range(args.steps):
        loss = float(step(model, optimizer, next(batches)))
    print(f"trained {args.steps} steps, loss {loss:.3f}")

    prompts = np.stack([tokenizer.encode(p) for p in ("def ", "for ", "if x", "cla ")] * 2)
    copy = mp.gather(nnx.clone(model))  # unplaced arrays for the one-device run
    for temperature, top_k in ((0.0, None), (0.8, 8)):
        generator = mp.Generator(
            mesh=mesh, schedule=schedule, num_microbatches=4, window=model.config.max_len,
            temperature=temperature, top_k=top_k,
        )  # fmt: skip
        tokens = generator(model, prompts, args.new_tokens, seed=1)
        np.testing.assert_array_equal(
            tokens, generator.reference(copy, prompts, args.new_tokens, seed=1)
        )
        kind = "greedy" if temperature == 0 else f"T={temperature}, top-{top_k}"
        print(f"{kind}: {tokenizer.decode(tokens[0])!r}")
    print(f"{generator.num_compiled_steps} compiled steps (prefill and one token, KV-cached)")
    print("pipelined tokens equal the one-device decoding, greedy and sampled")
    kv_cache.drop_cache(model)  # before training or checkpointing the model again


if __name__ == "__main__":
    main()
