"""Text generation with `nnx_mpmd.apps.sampling` on the tiny zoo models."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnx_mpmd.apps.data import CharTokenizer
from nnx_mpmd.apps.sampling import generate, generate_text
from nnx_mpmd.errors import MpmdError
from nnx_mpmd.models import build_model, lm_loss


@pytest.fixture(scope="module")
def model():
    return build_model("gpt", "tiny", num_stages=2, rngs=nnx.Rngs(0), vocab_size=32, max_len=16)


@nnx.jit
def _forward(model, tokens):
    """``model(tokens)`` compiled once per shape (eager calls compile op by op)."""
    return model(tokens)


def naive_greedy(model, prompt, steps, window):
    tokens = list(prompt)
    for _ in range(steps):
        context = jnp.asarray(tokens[-window:], jnp.int32)[None]
        tokens.append(int(jnp.argmax(_forward(model, context)[0, -1])))
    return tokens


@pytest.mark.parametrize("prompt_len", [1, 5, 20])
def test_greedy_matches_full_recompute_without_padding(model, prompt_len):
    prompt = [(3 * i + 1) % 32 for i in range(prompt_len)]
    got = generate(model, None, prompt, 4, temperature=0.0)
    assert got.dtype == np.int32 and got.shape == (prompt_len + 4,)
    assert got.tolist() == naive_greedy(model, prompt, 4, window=16)


def test_top_k_one_is_greedy_and_seeds_are_reproducible(model):
    prompt = np.array([1, 2, 3], np.int32)
    greedy = generate(model, None, prompt, 6, temperature=0.0)
    assert generate(model, None, prompt, 6, top_k=1, seed=5).tolist() == greedy.tolist()
    first = generate(model, None, prompt, 12, temperature=2.0, seed=1)
    assert first.tolist() == generate(model, None, prompt, 12, temperature=2.0, seed=1).tolist()
    assert first.tolist() != generate(model, None, prompt, 12, temperature=2.0, seed=2).tolist()
    assert first[:3].tolist() == [1, 2, 3]
    assert generate(model, None, prompt, 0).tolist() == [1, 2, 3]


def test_batched_prompts_and_top_k_support(model):
    prompts = np.array([[1, 2, 3], [4, 5, 6]], np.int32)
    out = generate(model, None, prompts, 5, top_k=3, seed=0)
    assert out.shape == (2, 8)
    logits = np.asarray(_forward(model, jnp.asarray(prompts)))[:, -1]
    top3 = np.argsort(logits, axis=-1)[:, -3:]
    assert all(out[b, 3] in top3[b] for b in range(2))


def test_generate_learns_a_repeating_pattern():
    text = "abcd" * 40
    tok = CharTokenizer.from_text(text)
    model = build_model("llama", "tiny", num_stages=2, rngs=nnx.Rngs(0), vocab_size=4)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    tokens = tok.encode(text)
    batch = {
        "inputs": jnp.asarray(np.stack([tokens[i : i + 32] for i in range(4)])),
        "targets": jnp.asarray(np.stack([tokens[i + 1 : i + 33] for i in range(4)])),
    }

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lm_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    for _ in range(40):
        loss = step(model, optimizer, batch)
    assert float(loss) < 0.1
    assert generate_text(model, tok, "bc", 10, temperature=0.0) == "bcdabcdabcda"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(prompt_tokens="ab"), r"prompt is a string but no tokenizer"),
        (dict(prompt_tokens=[]), r"prompt must be non-empty token ids"),
        (dict(max_new_tokens=-1), r"max_new_tokens=-1 must be an int >= 0"),
        (dict(temperature=-0.5), r"temperature=-0.5 must be >= 0"),
        (dict(top_k=0), r"top_k=0 must be >= 1 or None"),
    ],
)
def test_generate_argument_errors(model, kwargs, match):
    args = {"prompt_tokens": [1, 2], "max_new_tokens": 2, **kwargs}
    with pytest.raises(MpmdError, match=match):
        generate(model, None, args.pop("prompt_tokens"), args.pop("max_new_tokens"), **args)


def test_generate_needs_a_window_for_models_without_config():
    def bare(tokens):
        return jnp.zeros((*tokens.shape, 5))

    with pytest.raises(MpmdError, match=r"has no config.max_len; pass window="):
        generate(bare, None, [1], 1)
