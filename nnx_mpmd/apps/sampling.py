"""Text generation from a trained (unplaced) language model.

Generation recomputes the whole context for every new token: simple, and cheap
for the small models of the zoo. The forward pass always sees a window of the
model's ``max_len`` tokens (the context, right-padded), so it compiles once per
batch size; a causal model's logits at the last real token do not depend on the
padding after it. For a pipelined model, call ``nnx_mpmd.gather`` first so its
parameters are ordinary arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_mpmd.errors import MpmdError

__all__ = ["generate", "generate_text"]


@nnx.jit(static_argnames=("temperature", "top_k", "vocab_size"))
def _next_tokens(
    model: Any,
    window: jax.Array,
    index: jax.Array,
    key: jax.Array,
    temperature: float,
    top_k: int | None,
    vocab_size: int | None = None,
) -> jax.Array:
    logits = model(window)  # [batch, window, vocab]
    last = jax.lax.dynamic_index_in_dim(logits, index, axis=1, keepdims=False)
    if vocab_size is not None and vocab_size < last.shape[-1]:
        # A pretrained model's table can be larger than the tokenizer: never pick those ids.
        last = jnp.where(jnp.arange(last.shape[-1]) < vocab_size, last, -jnp.inf)
    if temperature == 0.0:
        return jnp.argmax(last, axis=-1).astype(jnp.int32)
    last = last.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(last, min(top_k, last.shape[-1]))[0][..., -1:]
        last = jnp.where(last < kth, -jnp.inf, last)
    return jax.random.categorical(key, last, axis=-1).astype(jnp.int32)


def _window_of(model: Any, window: int | None) -> int:
    if window is not None:
        return window
    config = getattr(model, "config", None)
    max_len = getattr(config, "max_len", None)
    if max_len is None:
        raise MpmdError(
            f"generate: {type(model).__name__} has no config.max_len; pass window= the "
            "longest context the model accepts."
        )
    return int(max_len)


def generate(
    model: Any,
    tokenizer_or_none: Any,
    prompt_tokens: str | Sequence[int] | np.ndarray,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
    window: int | None = None,
    vocab_size: int | None = None,
) -> np.ndarray:
    """Continues a prompt by sampling ``max_new_tokens`` tokens.

    Args:
      model: a causal language model ``int tokens [B, T] -> logits [B, T, V]``
        with ordinary (unplaced) parameters, e.g. a zoo model.
      tokenizer_or_none: a tokenizer with ``encode`` (used when the prompt is a
        string), or None.
      prompt_tokens: the prompt: token ids ``[T]`` or ``[B, T]``, or a string
        when a tokenizer is given.
      max_new_tokens: how many tokens to append (>= 0).
      temperature: softmax temperature; 0 means greedy (argmax) decoding.
      top_k: sample only among the ``top_k`` most likely tokens (None: all).
      seed: seed of the sampling randomness; equal seeds give equal outputs.
      window: context length fed to the model (default ``model.config.max_len``);
        longer contexts keep their last ``window`` tokens.
      vocab_size: sample only ids below it (a tokenizer smaller than the model's
        vocabulary); None: every id.

    Returns:
      int32 token ids: the prompt followed by the new tokens, ``[T + n]`` or
      ``[B, T + n]`` like the prompt.

    Example:
      >>> from flax import nnx
      >>> from nnx_mpmd.models import build_model
      >>> model = build_model("gpt", "tiny", num_stages=1, rngs=nnx.Rngs(0))
      >>> generate(model, None, [1, 2, 3], 4, temperature=0.0).shape
      (7,)
    """
    if isinstance(prompt_tokens, str):
        if tokenizer_or_none is None:
            raise MpmdError(
                "generate: the prompt is a string but no tokenizer was given; pass a "
                "tokenizer or token ids."
            )
        prompt_tokens = tokenizer_or_none.encode(prompt_tokens)
    prompt = np.asarray(prompt_tokens, dtype=np.int32)
    squeeze = prompt.ndim == 1
    if squeeze:
        prompt = prompt[None]
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise MpmdError(
            f"generate: prompt must be non-empty token ids [T] or [B, T], got shape "
            f"{np.shape(prompt_tokens)}."
        )
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise MpmdError(f"generate: max_new_tokens={max_new_tokens!r} must be an int >= 0.")
    if temperature < 0:
        raise MpmdError(f"generate: temperature={temperature} must be >= 0 (0 means greedy).")
    if top_k is not None and top_k < 1:
        raise MpmdError(f"generate: top_k={top_k} must be >= 1 or None.")
    size = _window_of(model, window)

    batch, length = prompt.shape
    tokens = np.zeros((batch, length + max_new_tokens), dtype=np.int32)
    tokens[:, :length] = prompt
    base_key = jax.random.key(seed)
    for step in range(max_new_tokens):
        start = max(0, length - size)
        context = np.zeros((batch, size), dtype=np.int32)
        context[:, : length - start] = tokens[:, start:length]
        new = _next_tokens(
            model,
            jnp.asarray(context),
            jnp.asarray(length - 1 - start, dtype=jnp.int32),
            jax.random.fold_in(base_key, step),
            float(temperature),
            top_k,
            vocab_size,
        )
        tokens[:, length] = np.asarray(new)
        length += 1
    return tokens[0] if squeeze else tokens


def generate_text(
    model: Any, tokenizer: Any, prompt: str, max_new_tokens: int, **kwargs: Any
) -> str:
    """`generate` from a string prompt: the prompt and the generated text, decoded.

    ``kwargs`` are `generate`'s; ids are drawn below ``tokenizer.vocab_size``.

    Example:
      >>> from flax import nnx
      >>> from nnx_mpmd.apps.data import CharTokenizer
      >>> from nnx_mpmd.models import build_model
      >>> tok = CharTokenizer.from_text("abc")
      >>> model = build_model("llama", "tiny", num_stages=1, rngs=nnx.Rngs(0), vocab_size=3)
      >>> len(generate_text(model, tok, "ab", 5, seed=1))
      7
    """
    kwargs.setdefault("vocab_size", getattr(tokenizer, "vocab_size", None))
    return tokenizer.decode(generate(model, tokenizer, prompt, max_new_tokens, **kwargs))
