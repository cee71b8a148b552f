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

With a KV cache (the default for models that have one, like the zoo's `GPT`
and `Llama`), a first *prefill* step feeds the prompts and writes their keys
and values into every attention layer's cache; each later step feeds one
token per sequence. The caches are ``nnx.Cache`` Variables of their stage,
updated in place by each microbatch on its own rows, so they stay on their
stage's submesh between tokens. Two step signatures are compiled (prefill and
one-token decode). Without a cache, the whole window is recomputed per token.

A model decodes with a cache when it has ``init_cache(batch_size, *,
num_microbatches, batch_axis)`` and its
``__call__`` takes ``positions=`` and ``cache_rows=`` (``[batch]`` ints: each
row's first position in the call, and its row in the cache); see
`nnx_mpmd.models.kv_cache`. A model that takes and returns its own cache
pytree (``logits, cache = model(tokens, cache, positions)``) decodes with it
wrapped in `FunctionalKVCache`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_mpmd.errors import CompileError
from nnx_mpmd.jit.functional_cache import FunctionalKVCache
from nnx_mpmd.jit.jit import jit
from nnx_mpmd.placement.mesh import MpmdMesh

__all__ = ["Generator", "next_tokens", "next_tokens_cached"]


def next_tokens(
    model: Any,
    window: jax.Array,
    index: jax.Array,
    key_data: jax.Array,
    *,
    temperature: float,
    top_k: int | None,
    vocab_size: int | None = None,
) -> jax.Array:
    """Each sequence's next token from the logits at its last real token.

    Args:
      model: a causal language model ``int tokens [B, T] -> logits [B, T, V]``.
      window: ``[B, T]`` int32 contexts, right-padded.
      index: ``[B]`` int32 position of each row's last real token.
      key_data: ``[B, ...]`` raw PRNG key data, one key per row (unused when greedy).
      temperature: 0 for greedy (argmax) decoding, else the softmax temperature.
      top_k: sample among the ``top_k`` most likely tokens only (None: all).
      vocab_size: choose only ids below it (None: every id of the logits).

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
    return _pick(logits, index, key_data, temperature, top_k, vocab_size)


def next_tokens_cached(
    model: Any,
    tokens: jax.Array,
    positions: jax.Array,
    cache_rows: jax.Array,
    index: jax.Array,
    key_data: jax.Array,
    *,
    temperature: float,
    top_k: int | None,
    vocab_size: int | None = None,
) -> jax.Array:
    """Like `next_tokens`, reading and writing the model's KV cache.

    Args:
      model: a causal language model with a cache (``init_cache`` called).
      tokens: ``[B, L]`` int32, the tokens after what the cache holds.
      positions: ``[B]`` int32 position of each row's first token.
      cache_rows: ``[B]`` int32 row of the cache each row uses.
      index: ``[B]`` int32 position, within ``tokens``, of the token to continue.
      key_data: ``[B, ...]`` raw PRNG key data, one key per row.
      temperature: 0 for greedy decoding, else the softmax temperature.
      top_k: sample among the ``top_k`` most likely tokens only (None: all).
      vocab_size: choose only ids below it (None: every id of the logits).

    Returns:
      ``[B]`` int32 tokens.

    Example:
      >>> from nnx_mpmd.models import build_model
      >>> model = build_model("gpt", "tiny", num_stages=1, rngs=nnx.Rngs(0), vocab_size=8)
      >>> model.init_cache(2)
      >>> keys = jax.random.key_data(jax.random.split(jax.random.key(0), 2))
      >>> zeros = jnp.zeros((2,), jnp.int32)
      >>> next_tokens_cached(model, jnp.zeros((2, 3), jnp.int32), zeros, jnp.arange(2),
      ...                    zeros + 2, keys, temperature=0.0, top_k=None).shape
      (2,)
    """
    logits = model(tokens, positions=positions, cache_rows=cache_rows)
    return _pick(logits, index, key_data, temperature, top_k, vocab_size)


def _pick(
    logits: jax.Array,
    index: jax.Array,
    key_data: jax.Array,
    temperature: float,
    top_k: int | None,
    vocab_size: int | None,
) -> jax.Array:
    """Each row's next token from its logits at ``index``: argmax or a sample."""
    last = jnp.take_along_axis(logits, index[:, None, None], axis=1)[:, 0].astype(jnp.float32)
    if vocab_size is not None and vocab_size < last.shape[-1]:
        # A pretrained model's table can be larger than its tokenizer: never pick those ids.
        last = jnp.where(jnp.arange(last.shape[-1]) < vocab_size, last, -jnp.inf)
    if temperature == 0.0:
        return jnp.argmax(last, axis=-1).astype(jnp.int32)
    last = last / temperature
    if top_k is not None:
        kth = jax.lax.top_k(last, min(top_k, last.shape[-1]))[0][..., -1:]
        last = jnp.where(last < kth, -jnp.inf, last)
    keys = jax.random.wrap_key_data(key_data)
    return jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, last).astype(jnp.int32)


def _ignore(tokens: np.ndarray) -> None:
    """The ``on_token`` of a caller that does not stream."""


def _check_zoo_cache_protocol(model: Any) -> None:
    """Raises unless ``model.init_cache`` takes the zoo's keywords.

    A model whose ``init_cache(batch_size, max_len)`` returns a cache for its
    call to take and return (a functional cache) gets told to use the wrapper.
    """
    try:
        parameters = inspect.signature(model.init_cache).parameters
    except (TypeError, ValueError):  # no signature to read: let the call decide
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    missing = [name for name in ("num_microbatches", "batch_axis") if name not in parameters]
    if missing:
        raise CompileError(
            f"Generator: {type(model).__name__}.init_cache{inspect.signature(model.init_cache)} "
            f"takes no {' or '.join(missing)}: it is not the cache protocol of the zoo models "
            "(Variables the model updates itself). A model that takes and returns its own cache "
            "decodes wrapped: generator(mp.FunctionalKVCache(model), prompts, ...); or pass "
            "kv_cache=False to recompute the window per token."
        )


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
      kv_cache: decode with the model's KV cache (True), recompute the window
        for every token (False), or use the cache when the model has one
        (None, the default: a model with ``init_cache``). A model that takes
        and returns its own cache pytree decodes with it wrapped in
        `FunctionalKVCache`.
      vocab_size: choose only token ids below it, greedy or sampled: the
        tokenizer's size when the model's vocabulary is larger (a checkpoint
        whose embedding table has more rows than its tokenizer has ids). None
        (the default): every id of the logits.

    Raises:
      CompileError: a negative temperature, a ``top_k``, ``vocab_size`` or
        window below 1; at the call, ``kv_cache=True`` for a model without a
        cache.

    Example:
      >>> import nnx_mpmd as mp
      >>> from nnx_mpmd.models import build_model
      >>> model = build_model("gpt", "tiny", num_stages=2, rngs=nnx.Rngs(0), vocab_size=16)
      >>> mesh = mp.MpmdMesh(jax.make_mesh((2, 1), ("stage", "data"),
      ...                    devices=jax.devices()[:2]), "stage")
      >>> gen = mp.Generator(mesh=mesh, schedule=mp.OneFOneB(), num_microbatches=2, window=16)
      >>> out = gen(model, np.ones((4, 3), np.int32), max_new_tokens=5)
      >>> out.shape, gen.num_compiled_steps  # prefill and one-token steps, KV-cached
      ((4, 8), 2)
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
        kv_cache: bool | None = None,
        vocab_size: int | None = None,
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
        if kv_cache not in (None, True, False):
            raise CompileError(f"Generator(kv_cache={kv_cache!r}): use True, False or None.")
        whole = isinstance(vocab_size, int | np.integer) and not isinstance(vocab_size, bool)
        if vocab_size is not None and (not whole or vocab_size < 1):
            raise CompileError(
                f"Generator(vocab_size={vocab_size!r}): use the tokenizer's vocab_size (an int "
                ">= 1), or None for every id the model scores."
            )
        self.window = window
        self.num_microbatches = num_microbatches
        self.kv_cache = kv_cache
        self.vocab_size: int | None = None if vocab_size is None else int(vocab_size)
        pick = {"temperature": float(temperature), "top_k": top_k, "vocab_size": self.vocab_size}
        pipelined = functools.partial(
            jit, mesh=mesh, schedule=schedule, num_microbatches=num_microbatches
        )
        window_fn = functools.partial(next_tokens, **pick)
        cached_fn = functools.partial(next_tokens_cached, **pick)
        self._steps = {False: pipelined(window_fn), True: pipelined(cached_fn)}
        # The cache is sharded like the microbatches: over the batch axis, if it splits them.
        axis = self._steps[True].batch_axis
        self._cache_axis = axis if axis and mesh.submesh(0).shape[axis] > 1 else None
        # A FunctionalKVCache is sharded like the rows only on an Auto axis: on an Explicit
        # one a step may replicate the rows (ReplicatedBatchWarning), and the cache with them.
        types = dict(zip(mesh.submesh(0).axis_names, mesh.submesh(0).axis_types, strict=True))
        explicit = types.get(self._cache_axis) == jax.sharding.AxisType.Explicit
        self._functional_cache_axis = None if explicit else self._cache_axis
        self._references = {False: nnx.jit(window_fn), True: nnx.jit(cached_fn)}

    @property
    def num_compiled_steps(self) -> int:
        """Input signatures compiled so far: 1 without a KV cache, 2 with one
        (prefill and one token), for any number of tokens and calls with
        prompts of one shape."""
        return sum(step.num_compiled_steps for step in self._steps.values())

    def uses_cache(self, model: Any) -> bool:
        """Whether decoding ``model`` uses its KV cache (see ``kv_cache``).

        Raises:
          CompileError: ``kv_cache=True`` and the model has no ``init_cache``.
            (A model whose ``init_cache`` lacks the zoo's keywords is told, at
            the call, to wrap it in `FunctionalKVCache`.)
        """
        has = callable(getattr(model, "init_cache", None))
        if self.kv_cache and not has:
            raise CompileError(
                f"Generator(kv_cache=True): {type(model).__name__} has no init_cache(batch_size) "
                "method; use a model with a KV cache (nnx_mpmd.models GPT or Llama), wrap a "
                "model that takes and returns its own cache in mp.FunctionalKVCache(model), or "
                "pass kv_cache=False to recompute the window per token."
            )
        return has if self.kv_cache is None else self.kv_cache

    def __call__(
        self,
        model: Any,
        prompts: Any,
        max_new_tokens: int,
        *,
        seed: int = 0,
        on_token: Callable[[np.ndarray], None] | None = None,
    ) -> np.ndarray:
        """Appends ``max_new_tokens`` tokens to every prompt, pipelined.

        Args:
          model: the language model (placed on the mesh at the first call).
          prompts: ``[B, P]`` int token ids, one prompt per row, all of length
            ``P``; ``B`` must split into ``num_microbatches`` microbatches.
          max_new_tokens: how many tokens to append (>= 0).
          seed: the sampling seed; equal seeds give equal tokens.
          on_token: called after every decoding step with the ``[B]`` int32 tokens
            it chose (one per prompt), as they come: for streaming them out.

        Returns:
          ``[B, P + max_new_tokens]`` int32: the prompts and their continuations.

        Raises:
          CompileError: bad prompts (not ``[B, P]``, empty, longer than the
            window with the new tokens, rows that do not split into the
            microbatches) or a negative ``max_new_tokens``.
        """
        cached = self.uses_cache(model)
        step = self._steps[cached]
        return self._decode(step, cached, model, prompts, max_new_tokens, seed, on_token)

    def reference(
        self,
        model: Any,
        prompts: Any,
        max_new_tokens: int,
        *,
        seed: int = 0,
        on_token: Callable[[np.ndarray], None] | None = None,
    ) -> np.ndarray:
        """The same decoding, unpipelined: the step function under ``nnx.jit``.

        Takes the model's arrays as they are; a placed (pipelined) model must be
        gathered first (`nnx_mpmd.gather`). Arguments and result as for calling
        the generator.
        """
        cached = self.uses_cache(model)
        step = self._references[cached]
        return self._decode(step, cached, model, prompts, max_new_tokens, seed, on_token)

    def _decode(
        self,
        step: Any,
        cached: bool,
        model: Any,
        prompts: Any,
        max_new_tokens: int,
        seed: int,
        on_token: Callable[[np.ndarray], None] | None,
    ) -> np.ndarray:
        prompts = self._check(prompts, max_new_tokens)
        report = on_token if on_token is not None else _ignore
        if cached:
            self._check_cache_length(model)
            return self._decode_cached(step, model, prompts, max_new_tokens, seed, report)
        batch, length = prompts.shape
        tokens = np.zeros((batch, self.window), np.int32)
        tokens[:, :length] = prompts
        base = jax.random.key(seed)
        step = nnx.cached_partial(step, model)  # no graph walk per token (see _decode_cached)
        for position in range(length, length + max_new_tokens):
            keys = jax.random.split(jax.random.fold_in(base, position), batch)
            index = np.full((batch,), position - 1, np.int32)
            new = step(tokens, index, jax.random.key_data(keys))
            tokens[:, position] = np.asarray(jax.device_get(new))
            report(tokens[:, position].copy())
        return tokens[:, : length + max_new_tokens].copy()

    def _decode_cached(
        self,
        step: Any,
        model: Any,
        prompts: np.ndarray,
        max_new_tokens: int,
        seed: int,
        report: Callable[[np.ndarray], None],
    ) -> np.ndarray:
        batch, length = prompts.shape
        out = np.zeros((batch, length + max_new_tokens), np.int32)
        out[:, :length] = prompts
        if not max_new_tokens:
            return out
        # The zoo's init_cache keeps a cache of this layout (stale entries are never read);
        # a FunctionalKVCache makes a fresh one of the window's length (its index restarts).
        axis, sizes = self._cache_axis, {}
        if isinstance(model, FunctionalKVCache):
            axis, sizes = self._functional_cache_axis, {"max_len": self.window}
        else:
            _check_zoo_cache_protocol(model)
        model.init_cache(batch, num_microbatches=self.num_microbatches, batch_axis=axis, **sizes)
        rows = np.arange(batch, dtype=np.int32)
        tokens, first, index = prompts, np.zeros_like(rows), np.full_like(rows, length - 1)
        base = jax.random.key(seed)
        # The model keeps its structure while it decodes (the cache was made above and
        # only its values change), so the step reads its Variables without walking
        # the graph for every token.
        step = nnx.cached_partial(step, model)
        for position in range(length, length + max_new_tokens):
            keys = jax.random.split(jax.random.fold_in(base, position), batch)
            new = step(tokens, first, rows, index, jax.random.key_data(keys))
            out[:, position] = np.asarray(jax.device_get(new))
            report(out[:, position].copy())
            tokens, first = out[:, position : position + 1], np.full_like(rows, position)
            index = np.zeros_like(rows)
        return out

    def _check_cache_length(self, model: Any) -> None:
        max_len = getattr(getattr(model, "config", None), "max_len", None)
        if isinstance(max_len, int) and self.window > max_len:
            raise CompileError(
                f"Generator(window={self.window}) is longer than the model's max_len={max_len}: "
                f"positions past it have no cache entry or position embedding. Use "
                f"window={max_len} (model.config.max_len)."
            )

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
