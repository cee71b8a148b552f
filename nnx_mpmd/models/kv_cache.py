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

from typing import Any

import jax.numpy as jnp
from flax import nnx

from nnx_mpmd.annotate.annotate import STAGE_KEY, tag_stage
from nnx_mpmd.annotate.scan_stack import ScannedLayers
from nnx_mpmd.errors import MpmdError
from nnx_mpmd.models.cache_ops import cached_attention, query_positions, write_cache
from nnx_mpmd.models.layers import Attention

__all__ = [
    "cached_attention",
    "drop_cache",
    "has_cache",
    "init_cache",
    "query_positions",
    "write_cache",
]


def _attention_layers(model: Any) -> list[Any]:
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, Attention)]


def _stacked_layers(model: Any) -> dict[int, int]:
    """``{id(attention layer): layers}`` for the attention layers stacked in a `ScanStack`."""

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
