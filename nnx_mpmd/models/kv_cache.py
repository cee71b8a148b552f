"""Key/value caches for the zoo's attention layers: decoding one token at a time.

A cache is a pair of ``nnx.Cache`` Variables on every `Attention` layer,
``cached_key`` and ``cached_value``, each ``[batch, max_len, kv_heads,
head_dim]``. They carry the stage of their layer (``mpmd_stage`` metadata), so
in a pipelined step each stage keeps its layers' caches on its own submesh:
nothing but activations moves between stages while decoding.

A cached call passes two extra ``[rows]`` int arrays through the model:

- ``positions``: the position of each row's first token in the call, so a call
  on ``tokens [rows, L]`` covers positions ``positions[r] .. positions[r]+L-1``;
- ``cache_rows``: which rows of the cache the call's rows are. A pipelined step
  splits every argument into microbatches, so each microbatch writes and reads
  its own rows of one cache, in place.

The call writes the new keys and values at their positions, then attends from
each query to every cached key at or before its position. Entries after a
row's position are never read, so a cache is reused without clearing it.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_mpmd.errors import MpmdError
from nnx_mpmd.frontend.annotate import STAGE_KEY, tag_stage
from nnx_mpmd.frontend.functional_cache import same_explicit_sharding

__all__ = [
    "cached_attention",
    "drop_cache",
    "has_cache",
    "init_cache",
    "query_positions",
    "write_cache",
]


def query_positions(positions: jax.Array, length: int) -> jax.Array:
    """``[rows, length]`` positions of a call's tokens from each row's first position.

    Example:
      >>> query_positions(jnp.array([0, 5]), 2).tolist()
      [[0, 1], [5, 6]]
    """
    return positions.astype(jnp.int32)[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]


def write_cache(
    cache: jax.Array, cache_rows: jax.Array, positions: jax.Array, new: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Writes ``new`` into ``cache`` at each row's positions; returns the cache and its rows.

    The cache is ``[slots, rows per slot, max_len, heads, head_dim]``: a call
    reads and writes one contiguous, aligned block of rows (a microbatch), picked
    by the smallest of ``cache_rows``; a call on every row (unpipelined) sees the
    cache as one block. Only slicing and elementwise selects are used, so the
    rows stay sharded like the call's rows on an Explicit mesh.

    Args:
      cache: ``[slots, rows, max_len, heads, head_dim]``.
      cache_rows: ``[n]`` int rows of the cache the call's rows are (contiguous).
      positions: ``[n]`` int position of each row's first new token.
      new: ``[n, L, heads, head_dim]``, written at ``positions[r] .. positions[r]+L-1``.

    Returns:
      ``(cache, block)``: the updated cache and the call's rows of it
      ``[n, max_len, heads, head_dim]``.

    Raises:
      MpmdError: the call's row count does not divide the cache's rows.

    Example:
      >>> cache = jnp.zeros((2, 1, 4, 1, 1))
      >>> cache, block = write_cache(cache, jnp.array([1]), jnp.array([1]), jnp.ones((1, 2, 1, 1)))
      >>> cache[1, 0, :, 0, 0].tolist(), block.shape
      ([0.0, 1.0, 1.0, 0.0], (1, 4, 1, 1))
    """
    slots, per_slot, max_len = cache.shape[:3]
    n, length = new.shape[:2]
    if (slots * per_slot) % n:
        raise MpmdError(
            f"KV cache of {slots * per_slot} rows called on {n} rows, which do not divide it; "
            "call the model on whole microbatches of the batch init_cache was given."
        )
    blocks = cache if n == per_slot else cache.reshape(slots * per_slot // n, n, *cache.shape[2:])
    slot = jnp.min(cache_rows) // n
    block = jax.lax.dynamic_index_in_dim(blocks, slot, 0, keepdims=False)
    offset = jnp.arange(max_len)[None, :] - positions.astype(jnp.int32)[:, None]  # [n, max_len]
    written = jnp.take_along_axis(new, jnp.clip(offset, 0, length - 1)[:, :, None, None], axis=1)
    inside = (offset >= 0) & (offset < length)
    block = jnp.where(inside[:, :, None, None], written.astype(cache.dtype), block)
    blocks, update = same_explicit_sharding(blocks, block[None])
    blocks = jax.lax.dynamic_update_slice_in_dim(blocks, update, slot, 0)
    return blocks.reshape(cache.shape), block


def cached_attention(
    q: jax.Array, keys: jax.Array, values: jax.Array, positions: jax.Array
) -> jax.Array:
    """Attention of each query to the cached keys at or before its position.

    Query head ``h`` reads key/value head ``h // (n_heads // n_kv_heads)``, as
    in `causal_attention`, which this equals when the cache holds the whole
    sequence.

    Args:
      q: ``[rows, L, n_heads, head_dim]``.
      keys: ``[rows, max_len, n_kv_heads, head_dim]`` (the rows' caches).
      values: like ``keys``.
      positions: ``[rows, L]`` the queries' positions.

    Returns:
      ``[rows, L, n_heads, head_dim]`` in the dtype of ``q``.

    Example:
      >>> q = jnp.ones((1, 1, 2, 4)); kv = jnp.ones((1, 8, 1, 4))
      >>> cached_attention(q, kv, kv, jnp.array([[3]])).shape
      (1, 1, 2, 4)
    """
    rows, length, n_heads, head_dim = q.shape
    n_kv = keys.shape[2]
    qg = q.reshape(rows, length, n_kv, n_heads // n_kv, head_dim)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, keys).astype(jnp.float32)
    scores = scores / math.sqrt(head_dim)
    visible = jnp.arange(keys.shape[1])[None, None, :] <= positions[:, :, None]  # [b, q, s]
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", weights, values)
    return out.reshape(rows, length, n_heads, head_dim).astype(q.dtype)


def _attention_layers(model: Any) -> list[Any]:
    from nnx_mpmd.models.layers import Attention  # layers imports this module

    return [node for _, node in nnx.iter_graph(model) if isinstance(node, Attention)]


def _stacked_layers(model: Any) -> dict[int, int]:
    """``{id(attention layer): layers}`` for the attention layers stacked in a `ScanStack`."""
    from nnx_mpmd.frontend.scan_stack import ScannedLayers
    from nnx_mpmd.models.layers import Attention

    out = {}
    for _, node in nnx.iter_graph(model):
        if isinstance(node, ScannedLayers):
            for _, inner in nnx.iter_graph(node.layers):
                if isinstance(inner, Attention):
                    out[id(inner)] = node.num_layers
    return out


def _stage_of(layer: Any) -> int | None:
    return layer.query.kernel.get_metadata().get(STAGE_KEY)


def init_cache(
    model: Any,
    batch_size: int,
    *,
    num_microbatches: int = 1,
    batch_axis: str | None = None,
    max_len: int | None = None,
) -> None:
    """Gives every attention layer of ``model`` an empty cache for ``batch_size`` rows.

    Each cache is tagged with its layer's stage, so a pipelined step keeps it
    on that stage's submesh, laid out ``[num_microbatches, batch_size /
    num_microbatches, max_len, kv_heads, head_dim]`` and sharded over
    ``batch_axis`` like the microbatches (and over the config's ``tensor`` axis
    like the key heads). Calling it again with the same sizes keeps the caches
    (their contents need no clearing); other sizes replace them.

    Args:
      model: a zoo model (`GPT`, `Llama`) or any module with zoo `Attention` layers.
      batch_size: rows of the cache: the number of sequences decoded together.
      num_microbatches: microbatches the rows are decoded in (a pipelined step's).
      batch_axis: the submesh axis the microbatches are sharded over, or None.
      max_len: positions per row; default: the model's ``config.max_len``.

    An attention layer stacked in a `nnx_mpmd.ScanStack` (a zoo model with
    ``scan_layers=True``) gets its caches stacked along the same layer axis,
    ``[layers, num_microbatches, ...]``, which the stack's scan slices per layer.

    Raises:
      MpmdError: the model has no zoo attention layer, or bad sizes.

    Example:
      >>> from nnx_mpmd.models import GPT, GPTConfig
      >>> model = GPT(GPTConfig.preset("tiny", num_stages=2), rngs=nnx.Rngs(0))
      >>> init_cache(model, 4)
      >>> model.blocks[0].attn.cached_key.shape, has_cache(model)
      ((1, 4, 64, 4, 16), True)
    """
    layers = _attention_layers(model)
    if not layers:
        raise MpmdError(
            f"init_cache: {type(model).__name__} has no nnx_mpmd.models.layers.Attention layer; "
            "a KV cache needs the zoo's attention (or decode without one: "
            "mp.Generator(..., kv_cache=False))."
        )
    if max_len is None:
        max_len = getattr(getattr(model, "config", None), "max_len", None)
    sizes = (("batch_size", batch_size), ("num_microbatches", num_microbatches))
    for name, value in (*sizes, ("max_len", max_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise MpmdError(f"init_cache: {name}={value!r} must be an int >= 1.")
    if batch_size % num_microbatches:
        raise MpmdError(
            f"init_cache: batch_size={batch_size} does not split into num_microbatches="
            f"{num_microbatches}; use a multiple of {num_microbatches} rows."
        )
    tensor = getattr(getattr(model, "config", None), "tensor", None)
    sharding = (None, batch_axis, None, tensor, None)
    per_slot = batch_size // num_microbatches
    stacked = _stacked_layers(model)
    for layer in layers:
        # An attention layer stacked in a ScanStack gets one cache per layer, stacked too.
        lead = (stacked[id(layer)],) if id(layer) in stacked else ()
        shape = (*lead, num_microbatches, per_slot, max_len, layer.n_kv_heads, layer.head_dim)
        current = getattr(layer, "cached_key", None)
        if current is not None and current.shape == shape:
            continue
        # Like the zoo's parameters: sharded when placed on a submesh, not when built.
        layer_sharding = (None,) * len(lead) + sharding
        metadata = (
            {"out_sharding": layer_sharding, "eager_sharding": False} if any(sharding) else {}
        )
        for name in ("cached_key", "cached_value"):
            setattr(layer, name, nnx.Cache(jnp.zeros(shape, layer.cache_dtype), **metadata))
        stage = _stage_of(layer)
        if stage is not None:
            tag_stage(layer, stage)


def has_cache(model: Any) -> bool:
    """Whether every attention layer of ``model`` holds a cache (`init_cache`).

    Example:
      >>> from nnx_mpmd.models import GPT, GPTConfig
      >>> has_cache(GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0)))
      False
    """
    layers = _attention_layers(model)
    return bool(layers) and all(getattr(x, "cached_key", None) is not None for x in layers)


def drop_cache(model: Any) -> None:
    """Removes the caches `init_cache` added (to save their memory, or checkpoints).

    Example:
      >>> from nnx_mpmd.models import GPT, GPTConfig
      >>> model = GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0))
      >>> init_cache(model, 2); drop_cache(model); has_cache(model)
      False
    """
    for layer in _attention_layers(model):
        for name in ("cached_key", "cached_value"):
            if getattr(layer, name, None) is not None:
                delattr(layer, name)
