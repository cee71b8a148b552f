"""Pipelined token generation: several sequences in flight through the stages.

A `Generator` decodes a batch of sequences with a forward-only pipelined step
(`nnx_mpmd.jit` without `value_and_grad`): the batch is split into
``num_microbatches`` microbatches that flow through the stages one after the
other, so while one microbatch runs on the last stage the next one runs on
the stage before it. Each decode step feeds a fixed window of
``window`` tokens (the context, right-padded) and picks every sequence's next
token from the logits at its last real token, inside the step, greedily or by
sampling with its own PRNG key; the shapes never change, so the step compiles
once and every later token reuses it.

`Generator.reference` runs the very same step function unpipelined under
``nnx.jit`` on one device with the same keys, so pipelined and unpipelined
decoding give the same tokens.

The context is recomputed for every new token (no KV cache yet): a stage keeps
its parameters, not its attention keys and values, between tokens.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_mpmd.errors import CompileError
from nnx_mpmd.frontend.jit import jit
from nnx_mpmd.placement.mesh import MpmdMesh

__all__ = ["Generator", "next_tokens"]


def next_tokens(
    model: Any,
    window: jax.Array,
    index: jax.Array,
    key_data: jax.Array,
    *,
    temperature: float,
    top_k: int | None,
) -> jax.Array:
    """Each sequence's next token from the logits at its last real token.

    Args:
      model: a causal language model ``int tokens [B, T] -> logits [B, T, V]``.
      window: ``[B, T]`` int32 contexts, right-padded.
      index: ``[B]`` int32 position of each row's last real token.
      key_data: ``[B, ...]`` raw PRNG key data, one key per row (unused when greedy).
      temperature: 0 for greedy (argmax) decoding, else the softmax temperature.
      top_k: sample among the ``top_k`` most likely tokens only (None: all).

    Returns:
      ``[B]`` int32 tokens.

    Example:
      >>> from nnx_mpmd.models import build_model
      >>> model = build_model("gpt", "tiny", num_stages=1, rngs=nnx.Rngs(0), vocab_size=8)
      >>> window = jnp.zeros((2, 4), jnp.int32)
      >>> keys = jax.random.key_data(jax.random.split(jax.random.key(0), 2))
      >>> next_tokens(model, window, jnp.array([0, 2]), keys, temperature=0.0, top_k=None).shape
      (2,)
    """
    logits = model(window)
    last = jnp.take_along_axis(logits, index[:, None, None], axis=1)[:, 0].astype(jnp.float32)
    if temperature == 0.0:
        return jnp.argmax(last, axis=-1).astype(jnp.int32)
    last = last / temperature
    if top_k is not None:
        kth = jax.lax.top_k(last, min(top_k, last.shape[-1]))[0][..., -1:]
        last = jnp.where(last < kth, -jnp.inf, last)
    keys = jax.random.wrap_key_data(key_data)
    return jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, last).astype(jnp.int32)


class Generator:
    """Decodes batches of sequences with a pipelined forward step.

    Args:
      mesh: the `MpmdMesh` (use the training mesh, so the model stays put).
      schedule: any schedule (its forward tasks are kept); e.g. the training one.
      num_microbatches: how many microbatches the batch of sequences is split
        into; they are in flight through the stages together.
      window: the context length fed to the model (its ``max_len``).
      temperature: 0 for greedy decoding, else the sampling temperature.
      top_k: sample among the ``top_k`` most likely tokens (None: all).

    Raises:
      CompileError: a negative temperature, a ``top_k`` below 1 or a window
        below 1.

    Example:
      >>> import nnx_mpmd as mp
      >>> from nnx_mpmd.models import build_model
      >>> model = build_model("gpt", "tiny", num_stages=2, rngs=nnx.Rngs(0), vocab_size=16)
      >>> mesh = mp.MpmdMesh(jax.make_mesh((2, 1), ("stage", "data"),
      ...                    devices=jax.devices()[:2]), "stage")
      >>> gen = mp.Generator(mesh=mesh, schedule=mp.OneFOneB(), num_microbatches=2, window=16)
      >>> out = gen(model, np.ones((4, 3), np.int32), max_new_tokens=5)
      >>> out.shape, gen.num_compiled_steps
      ((4, 8), 1)
    """

    def __init__(
        self,
        *,
        mesh: MpmdMesh,
        schedule: Any,
        num_microbatches: int,
        window: int,
        temperature: float = 0.0,
        top_k: int | None = None,
    ) -> None:
        if not temperature >= 0:
            raise CompileError(f"Generator(temperature={temperature}): use 0 (greedy) or more.")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise CompileError(f"Generator(top_k={top_k!r}): use an int >= 1, or None for all.")
        if not isinstance(window, int) or window < 1:
            raise CompileError(
                f"Generator(window={window!r}): use the model's context length, e.g. "
                "model.config.max_len."
            )
        self.window = window
        self.num_microbatches = num_microbatches
        self._fn = functools.partial(next_tokens, temperature=float(temperature), top_k=top_k)
        self._step = jit(self._fn, mesh=mesh, schedule=schedule, num_microbatches=num_microbatches)
        self._reference = nnx.jit(self._fn)

    @property
    def num_compiled_steps(self) -> int:
        """Input signatures compiled so far (1 for any number of tokens and calls)."""
        return self._step.num_compiled_steps

    def __call__(
        self, model: Any, prompts: Any, max_new_tokens: int, *, seed: int = 0
    ) -> np.ndarray:
        """Appends ``max_new_tokens`` tokens to every prompt, pipelined.

        Args:
          model: the language model (placed on the mesh at the first call).
          prompts: ``[B, P]`` int token ids, one prompt per row, all of length
            ``P``; ``B`` must split into ``num_microbatches`` microbatches.
          max_new_tokens: how many tokens to append (>= 0).
          seed: the sampling seed; equal seeds give equal tokens.

        Returns:
          ``[B, P + max_new_tokens]`` int32: the prompts and their continuations.

        Raises:
          CompileError: bad prompts (not ``[B, P]``, empty, longer than the
            window with the new tokens, rows that do not split into the
            microbatches) or a negative ``max_new_tokens``.
        """
        return self._decode(self._step, model, prompts, max_new_tokens, seed)

    def reference(
        self, model: Any, prompts: Any, max_new_tokens: int, *, seed: int = 0
    ) -> np.ndarray:
        """The same decoding, unpipelined: the step function under ``nnx.jit``.

        Takes the model's arrays as they are; a placed (pipelined) model must be
        gathered first (`nnx_mpmd.gather`). Arguments and result as for calling
        the generator.
        """
        return self._decode(self._reference, model, prompts, max_new_tokens, seed)

    def _decode(
        self, step: Any, model: Any, prompts: Any, max_new_tokens: int, seed: int
    ) -> np.ndarray:
        prompts = self._check(prompts, max_new_tokens)
        batch, length = prompts.shape
        tokens = np.zeros((batch, self.window), np.int32)
        tokens[:, :length] = prompts
        base = jax.random.key(seed)
        for position in range(length, length + max_new_tokens):
            keys = jax.random.split(jax.random.fold_in(base, position), batch)
            index = np.full((batch,), position - 1, np.int32)
            new = step(model, tokens, index, jax.random.key_data(keys))
            tokens[:, position] = np.asarray(jax.device_get(new))
        return tokens[:, : length + max_new_tokens].copy()

    def _check(self, prompts: Any, max_new_tokens: int) -> np.ndarray:
        prompts = np.asarray(prompts)
        if (
            prompts.ndim != 2
            or prompts.shape[1] == 0
            or not np.issubdtype(prompts.dtype, np.integer)
        ):
            raise CompileError(
                f"Generator: prompts must be int token ids [B, P] with P >= 1, got shape "
                f"{prompts.shape} ({prompts.dtype}); stack equal-length prompts into rows."
            )
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise CompileError(f"Generator: max_new_tokens={max_new_tokens!r} must be an int >= 0.")
        if prompts.shape[1] + max_new_tokens > self.window:
            raise CompileError(
                f"Generator: {prompts.shape[1]} prompt tokens + {max_new_tokens} new ones exceed "
                f"the window of {self.window}; shorten the prompt or generate at most "
                f"{self.window - prompts.shape[1]} tokens."
            )
        if prompts.shape[0] % self.num_microbatches:
            raise CompileError(
                f"Generator: {prompts.shape[0]} prompts do not split into "
                f"{self.num_microbatches} microbatches; pass a multiple of "
                f"{self.num_microbatches} prompts (pad with copies) or change num_microbatches."
            )
        return prompts.astype(np.int32)
