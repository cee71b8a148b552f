"""Decoding a model that keeps its own functional KV cache, pipelined.

Many published NNX decoders keep their cache outside the model: a pytree of
arrays (``{"layer_0": {"k": ..., "v": ..., "index": ...}, ...}``) that the
caller makes with a method like ``init_cache(batch_size, max_len)`` and that
every call takes and returns, ``logits, cache = model(tokens, cache,
positions)``. `FunctionalKVCache` wraps such a model, unchanged, so that
`nnx_mpmd.Generator` decodes it with its cache: the wrapper keeps the cache as
``nnx.Cache`` Variables, each leaf tagged with the stage whose layer reads it
(found by dataflow, from a trace of one call), so every layer's cache lives on
its stage's submesh and only activations move between stages.

Rows are laid out per microbatch, like the zoo's cache
(`nnx_mpmd.models.kv_cache`): a leaf whose size follows the batch is stored
``[num_microbatches, rows per microbatch, ...]`` (its batch axis first), any
other leaf (a scalar write index) once per microbatch, and each call reads and
writes the block of the rows it is given (``cache_rows``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_mpmd.annotate.markers import pipeline_tracing
from nnx_mpmd.annotate.stage import tag_stage
from nnx_mpmd.compiler.trace.stages import input_stages
from nnx_mpmd.errors import CompileError

__all__ = ["FunctionalKVCache", "same_explicit_sharding"]


def _default_init(model: Any, batch_size: int, max_len: int) -> Any:
    return model.init_cache(batch_size, max_len)


def _default_apply(model: Any, tokens: Any, cache: Any, positions: Any) -> Any:
    return model(tokens, cache, positions)


def _explicit_sharding(x: jax.Array) -> Any:
    """The sharding in ``x``'s type on an Explicit mesh, else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not mesh.axis_names or not mesh.are_all_axes_explicit:
        return None
    return sharding


def same_explicit_sharding(stored: jax.Array, update: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``stored`` and ``update`` on one Explicit sharding, as a slice update needs.

    State inside a pipelined region may be typed without a mesh while the rows
    a call computes carry the microbatch's sharding: the state then takes the
    update's sharding (where the cache is placed anyway). State with a sharding
    keeps it and the update is resharded to it.

    Example:
      >>> a, b = same_explicit_sharding(jnp.zeros(2), jnp.ones(2))  # no mesh: unchanged
      >>> a.tolist(), b.tolist()
      ([0.0, 0.0], [1.0, 1.0])
    """
    have, written = _explicit_sharding(stored), _explicit_sharding(update)
    if written is None or (have is not None and have.spec == written.spec):
        return stored, update
    if have is None:
        return jax.sharding.reshard(stored, written), update
    return stored, jax.sharding.reshard(update, have)


def _path_text(path: Any) -> str:
    return "cache" + jax.tree_util.keystr(path)


def _batch_axis(path: Any, small: Any, large: Any, batch_size: int) -> int | None:
    """The axis of a cache leaf whose size follows the batch (None: no such axis).

    Raises:
      CompileError: the leaf's shape changes with the batch in another way.
    """
    differ = [i for i, (a, b) in enumerate(zip(small.shape, large.shape, strict=True)) if a != b]
    if not differ:
        return None
    if len(differ) == 1 and small.shape[differ[0]] == batch_size:
        return differ[0]
    raise CompileError(
        f"FunctionalKVCache: {_path_text(path)} has shape {small.shape} for {batch_size} rows "
        f"and {large.shape} for {2 * batch_size}: a cache leaf needs one axis of batch_size "
        "rows (or none, like a shared write index). Make init_cache return such leaves."
    )


class FunctionalKVCache(nnx.Module):
    """A model with its own functional KV cache, made decodable by `Generator`.

    The protocol: ``init_cache(model, batch_size, max_len)`` returns the cache,
    a pytree of arrays, each with one axis of ``batch_size`` rows or none (a
    write index shared by the rows); ``apply(model, tokens, cache, positions)``
    runs the model on ``tokens [rows, L]`` at ``positions [rows, L]`` (absolute
    positions) and returns ``(logits [rows, L, vocab], new_cache)``, the new
    cache of the same structure, shapes and dtypes. With ``cache=None``
    (decoding without a cache, ``Generator(kv_cache=False)``) it returns the
    logits of the whole window, alone or first in a tuple. The defaults call
    ``model.init_cache(batch_size, max_len)`` and ``model(tokens, cache,
    positions)``; pass small functions for other signatures.

    Each cache leaf becomes an ``nnx.Cache`` Variable of the stage that reads
    it, so a pipelined step keeps it on that stage's submesh and each
    microbatch updates its own rows in place. The model itself is not changed.

    Args:
      model: the model (annotated with `assign_stages` or `Stage` wrappers).
      init_cache: ``(model, batch_size, max_len) -> cache``.
      apply: ``(model, tokens, cache, positions) -> (logits, cache)``.

    Example:
      >>> import nnx_mpmd as mp
      >>> class Lm(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.embed = nnx.Embed(16, 8, rngs=rngs)
      ...         self.head = nnx.Linear(8, 16, rngs=rngs)
      ...     def init_cache(self, batch_size, max_len):
      ...         return {"sum": jnp.zeros((batch_size, 8))}
      ...     def __call__(self, tokens, cache, positions):
      ...         x = self.embed(tokens)
      ...         if cache is None:
      ...             return self.head(jnp.cumsum(x, axis=1)), None
      ...         x = cache["sum"][:, None] + jnp.cumsum(x, axis=1)
      ...         return self.head(x), {"sum": x[:, -1]}
      >>> lm = Lm(nnx.Rngs(0))
      >>> _ = mp.assign_stages(lm, {"embed": 0, "head": 1})
      >>> mesh = mp.MpmdMesh(jax.make_mesh((2, 1), ("stage", "data"),
      ...                    devices=jax.devices()[:2]), "stage")
      >>> gen = mp.Generator(mesh=mesh, schedule=mp.GPipe(), num_microbatches=2, window=8)
      >>> gen(mp.FunctionalKVCache(lm), jnp.ones((4, 2), jnp.int32), max_new_tokens=3).shape
      (4, 5)
    """

    def __init__(
        self,
        model: Any,
        *,
        init_cache: Callable[[Any, int, int], Any] | None = None,
        apply: Callable[[Any, Any, Any, Any], Any] | None = None,
    ) -> None:
        if init_cache is None and not callable(getattr(model, "init_cache", None)):
            raise CompileError(
                f"FunctionalKVCache: {type(model).__name__} has no init_cache(batch_size, "
                "max_len) method; pass init_cache=lambda model, batch_size, max_len: ... "
                "returning the model's cache."
            )
        self.model = model
        self._init = nnx.static(init_cache or _default_init)
        self._apply = nnx.static(apply or _default_apply)
        self.cache_leaves: nnx.List | None = nnx.data(None)
        self._layout: Any = nnx.static(None)

    def init_cache(
        self,
        batch_size: int,
        *,
        num_microbatches: int = 1,
        batch_axis: str | None = None,
        max_len: int,
    ) -> None:
        """Makes a fresh cache for ``batch_size`` rows (`Generator` calls it).

        Args:
          batch_size: rows decoded together.
          num_microbatches: microbatches the rows are decoded in.
          batch_axis: the submesh axis the microbatches are sharded over, or None.
          max_len: positions per row (the generator's window).

        Raises:
          CompileError: bad sizes, or the model does not follow the protocol
            (see the class): a cache leaf without a clear batch axis, a call
            that does not return ``(logits, cache)`` with the cache unchanged
            in structure, shapes and dtypes.
        """
        if batch_size % num_microbatches:
            raise CompileError(
                f"FunctionalKVCache: batch_size={batch_size} does not split into "
                f"num_microbatches={num_microbatches}; use a multiple of {num_microbatches}."
            )
        per_slot = batch_size // num_microbatches
        init = self._init
        small = jax.eval_shape(lambda: init(self.model, batch_size, max_len))
        large = jax.eval_shape(lambda: init(self.model, 2 * batch_size, max_len))
        paths, treedef = jax.tree_util.tree_flatten_with_path(small)
        large_leaves = treedef.flatten_up_to(large)
        axes = tuple(
            _batch_axis(path, leaf, big, batch_size)
            for (path, leaf), big in zip(paths, large_leaves, strict=True)
        )
        values = jax.tree.leaves(init(self.model, batch_size, max_len))
        stored = [
            _to_slots(jnp.asarray(value), axis, num_microbatches)
            for value, axis in zip(values, axes, strict=True)
        ]
        self._layout = nnx.static((treedef, axes, per_slot))
        stages = self._leaf_stages([path for path, _ in paths], stored, per_slot)
        leaves = []
        for value, axis, stage in zip(stored, axes, stages, strict=True):
            sharded = axis is not None and batch_axis is not None
            sharding = (None, batch_axis) + (None,) * (value.ndim - 2) if sharded else None
            metadata = {"out_sharding": sharding, "eager_sharding": False} if sharding else {}
            leaf = nnx.Cache(value, **metadata)
            tag_stage(leaf, stage)
            leaves.append(leaf)
        self.cache_leaves = nnx.data(nnx.List(leaves))

    def drop_cache(self) -> None:
        """Removes the cache (the wrapped model never held it)."""
        self.cache_leaves = nnx.data(None)

    def __call__(
        self, tokens: jax.Array, positions: jax.Array | None = None, cache_rows: Any = None
    ) -> jax.Array:
        """Logits ``[rows, L, vocab]``; with a cache, reads and updates the rows' block.

        Args:
          tokens: ``[rows, L]`` int tokens.
          positions: ``[rows]`` each row's first position (default 0).
          cache_rows: ``[rows]`` the cache rows the call's rows are (contiguous).
        """
        rows, length = tokens.shape
        first = jnp.zeros((rows,), jnp.int32) if positions is None else positions
        where = first.astype(jnp.int32)[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]
        if self.cache_leaves is None:
            return _logits(self._apply(self.model, tokens, None, where))
        rows_in = jnp.arange(rows, dtype=jnp.int32) if cache_rows is None else cache_rows
        treedef, axes, per_slot = self._layout
        slot = jnp.min(rows_in) // per_slot
        blocks = [
            _read_block(leaf[...], axis, slot, rows, per_slot)
            for leaf, axis in zip(self.cache_leaves, axes, strict=True)
        ]
        cache = jax.tree.unflatten(treedef, blocks)
        logits, new = _check_output(self._apply(self.model, tokens, cache, where), cache)
        for leaf, axis, value in zip(self.cache_leaves, axes, jax.tree.leaves(new), strict=True):
            leaf[...] = _write_block(leaf[...], axis, slot, value, rows, per_slot)
        return logits

    def _leaf_stages(self, paths: list[Any], stored: list[jax.Array], per_slot: int) -> list[int]:
        """The stage of each cache leaf: the first stage whose code reads it.

        A trace of one one-token call on one microbatch, under the compiler's
        stage markers, gives which stage reads each leaf; a leaf no stage reads
        goes to stage 0.
        """
        treedef, axes, _ = self._layout
        graphdef, state = nnx.split(self.model)
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        blocks = [
            jax.ShapeDtypeStruct(_block_shape(value.shape, axis, per_slot), value.dtype)
            for value, axis in zip(stored, axes, strict=True)
        ]
        tokens = jax.ShapeDtypeStruct((per_slot, 1), jnp.int32)
        apply = self._apply

        def call(blocks: list[Any], tokens: Any, positions: Any, state: Any) -> Any:
            cache = jax.tree.unflatten(treedef, blocks)
            out = apply(nnx.merge(graphdef, state), tokens, cache, positions)
            return _check_output(out, cache)

        with pipeline_tracing():
            jaxpr = jax.make_jaxpr(call)(blocks, tokens, tokens, state).jaxpr
        readers = input_stages(jaxpr)
        return [min(readers.get(i, [0])) for i in range(len(paths))]


def _to_slots(value: jax.Array, axis: int | None, num_microbatches: int) -> jax.Array:
    """A leaf as ``[microbatches, rows per microbatch, ...]`` (batch axis first), or one copy
    per microbatch for a leaf without a batch axis."""
    if axis is None:
        return jnp.broadcast_to(value, (num_microbatches, *value.shape))
    value = jnp.moveaxis(value, axis, 0)
    return value.reshape(num_microbatches, value.shape[0] // num_microbatches, *value.shape[1:])


def _block_shape(stored: tuple[int, ...], axis: int | None, rows: int) -> tuple[int, ...]:
    """The shape ``apply`` sees for a block of ``rows`` rows of a stored leaf."""
    if axis is None:
        return tuple(stored[1:])
    rest = list(stored[2:])
    rest.insert(axis, rows)
    return tuple(rest)


def _slots_of(rows: int, per_slot: int, total: int) -> int:
    """How many microbatch slots a call on ``rows`` rows covers."""
    if rows % per_slot or (rows // per_slot) > total:
        raise CompileError(
            f"FunctionalKVCache: a call on {rows} rows does not cover whole microbatches of "
            f"{per_slot} rows; call it on a microbatch or on every row init_cache was given."
        )
    return rows // per_slot


def _read_block(
    stored: jax.Array, axis: int | None, slot: jax.Array, rows: int, per_slot: int
) -> jax.Array:
    """The call's rows of a stored leaf, in the layout ``apply`` takes."""
    count = _slots_of(rows, per_slot, stored.shape[0])
    block = jax.lax.dynamic_slice_in_dim(stored, slot, count, axis=0)
    if axis is None:
        return block[0]
    block = block.reshape(rows, *stored.shape[2:])
    return jnp.moveaxis(block, 0, axis)


def _write_block(
    stored: jax.Array, axis: int | None, slot: jax.Array, value: jax.Array, rows: int, per_slot: int
) -> jax.Array:
    """``stored`` with the call's block replaced by ``value`` (from ``apply``)."""
    count = _slots_of(rows, per_slot, stored.shape[0])
    if axis is None:
        update = jnp.broadcast_to(value, (count, *value.shape))
    else:
        update = jnp.moveaxis(value, axis, 0).reshape(count, per_slot, *stored.shape[2:])
    stored, update = same_explicit_sharding(stored, update.astype(stored.dtype))
    return jax.lax.dynamic_update_slice_in_dim(stored, update, slot, axis=0)


def _logits(out: Any) -> jax.Array:
    """The logits of an ``apply`` result: the result, or its first element."""
    if isinstance(out, tuple | list) and out:
        out = out[0]
    if not isinstance(out, jax.Array):  # a tracer is a jax.Array too
        raise CompileError(
            f"FunctionalKVCache: apply returned {type(out).__name__}, not logits "
            "[rows, L, vocab] (alone or first in a tuple)."
        )
    return out


def _check_output(out: Any, cache: Any) -> tuple[jax.Array, Any]:
    """``(logits, new_cache)`` from ``apply``, checked against the cache it was given.

    Raises:
      CompileError: not a pair, or a new cache of another structure, shape or dtype.
    """
    if not isinstance(out, tuple | list) or len(out) != 2:
        if isinstance(out, tuple | list):
            got = f"a {type(out).__name__} of {len(out)}"
        elif hasattr(out, "shape"):
            got = f"one array {out.dtype}{list(out.shape)}"
        else:
            got = type(out).__name__
        raise CompileError(
            f"FunctionalKVCache: apply must return (logits, new_cache), got {got}; pass "
            "apply=lambda model, tokens, cache, positions: ... returning that pair."
        )
    logits, new = out
    treedef = jax.tree.structure(cache)
    if jax.tree.structure(new) != treedef:
        raise CompileError(
            f"FunctionalKVCache: apply returned a cache of structure {jax.tree.structure(new)}, "
            f"but was given {treedef}: return the updated cache with the same keys and leaves."
        )
    for (path, old), value in zip(
        jax.tree_util.tree_flatten_with_path(cache)[0], jax.tree.leaves(new), strict=True
    ):
        if (value.shape, value.dtype) != (old.shape, old.dtype):
            raise CompileError(
                f"FunctionalKVCache: apply returned {_path_text(path)} as "
                f"{value.dtype}{list(value.shape)}, given {old.dtype}{list(old.shape)}: a "
                "cache keeps its shapes and dtypes (write new entries into it)."
            )
    return _logits(logits), new
