"""The arithmetic of a key/value cache: positions, in-place writes, cached attention.

The zoo's `Attention` layer calls these while decoding; `nnx_mpmd.models.kv_cache`
builds and drops the caches on a model. Kept apart so that the layers need not
import the module that looks the layers up.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from nnx_mpmd.errors import MpmdError
from nnx_mpmd.jit.functional_cache import same_explicit_sharding

__all__ = ["cached_attention", "query_positions", "write_cache"]


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
    """Writes ``new`` ``[n, L, heads, head_dim]`` into ``cache`` at each row's positions.

    Only slicing and selects, so rows stay sharded like the call's on an Explicit mesh.

    Args:
      cache: ``[slots, rows, max_len, heads, head_dim]``.
      cache_rows: ``[n]`` contiguous rows of the cache the call's rows are.
      positions: ``[n]`` position of each row's first new token.

    Returns:
      ``(cache, block)``: the updated cache and the call's rows ``[n, max_len, heads, head_dim]``.

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
    """Attention of queries ``[rows, L, heads, head_dim]`` to cached keys up to their positions.

    Grouped heads as in `causal_attention`, which this equals for a whole-sequence cache.

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
