"""Restoring a `ScanStack` cut into other layer ranges than the checkpoint's.

A `nnx_mpmd.ScanStack` split into ranges holds one chunk per range, and a
checkpoint stores each stacked leaf once per chunk, under
``<stack>.chunks.<i>.layers.<leaf>`` with the chunk's layers along axis 0
(optimizer state likewise, under its own prefix). A target cut into other
ranges has the same names with other leading sizes, or more or fewer chunks.

`recut_stacks` finds each such group of entries (equal names apart from the
chunk index) whose chunks hold the same layers in total, and stands in for the
target's chunks with proxies of the saved ones: reading and verifying them is
then the ordinary restore. `StackRecut.assemble` slices the saved chunks and
joins the pieces into each target chunk, on that chunk's mesh and sharding.

The same goes between a stack and its unrolled twin, a list of the same layers
(``<stack>.<i>.<leaf>``, one entry per layer, as the zoo's models have without
``scan_layers``): a checkpoint of either restores into the other, each layer
taken from (or put into) its place along the stack's layer axis. Typed PRNG
keys are converted only between stacks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from nnx_mpmd.checkpoint.global_arrays import move_to
from nnx_mpmd.checkpoint.layout import ARRAY, KEY, Entry, Layout
from nnx_mpmd.checkpoint.manifest import STACKED_LEAF, key_impl_name

__all__ = ["StackRecut", "recut_stacks"]


@dataclasses.dataclass(frozen=True)
class StackRecut:
    """One stacked leaf of a `ScanStack`, saved in some layer ranges, restored in others.

    Attributes:
      targets: the target's chunk entries, in layer order (one per layer, without
        the layer axis, when ``targets_stacked`` is False: an unrolled target).
      saved: proxies of the saved chunk entries, in layer order; their values
        are abstract arrays placed where they are read (one per layer, without
        the layer axis, when ``saved_stacked`` is False).
      key_impl: for typed PRNG keys (stored as their key data), their
        implementation's name; None for arrays.
      saved_stacked: whether the saved entries carry the layer axis.
      targets_stacked: whether the target entries carry the layer axis.
    """

    targets: tuple[Entry, ...]
    saved: tuple[Entry, ...]
    key_impl: str | None = None
    saved_stacked: bool = True
    targets_stacked: bool = True

    def assemble(self, arrays: dict[str, Any], lookup: Any) -> None:
        """Sets each target chunk from the saved layers it covers (``lookup(arrays, path)``)."""
        saved_ranges = _ranges(_layer_counts(self.saved, self.saved_stacked))
        target_ranges = _ranges(_layer_counts(self.targets, self.targets_stacked))
        for entry, (start, stop) in zip(self.targets, target_ranges, strict=True):
            pieces = []
            for proxy, (first, last) in zip(self.saved, saved_ranges, strict=True):
                low, high = max(start, first), min(stop, last)
                if low < high:
                    saved = lookup(arrays, proxy.path)
                    piece = _rows(saved, low - first, high - first) if self.saved_stacked else saved
                    pieces.append(piece)
            if not self.targets_stacked:  # one layer, from one saved chunk or entry
                (piece,) = pieces
                layer = _layer(piece) if self.saved_stacked else piece
                entry.variable.set_value(move_to(layer, entry.value.sharding))  # type: ignore[union-attr]
                continue
            if not self.saved_stacked:  # single layers gain the layer axis
                pieces = [_with_layer_axis(p) for p in pieces]
            sharding = _rows_sharding(entry.value.sharding)
            pieces = [move_to(p, sharding) for p in pieces]
            joined = _joined(tuple(pieces), entry.value.sharding, self.key_impl)
            entry.variable.set_value(joined)  # type: ignore[union-attr]


def _layer_counts(entries: tuple[Entry, ...], stacked: bool) -> list[int]:
    return [entry.value.shape[0] if stacked else 1 for entry in entries]


@functools.lru_cache(maxsize=256)
def _layer_program(sharding: jax.sharding.Sharding) -> Any:
    return jax.jit(lambda a: a[0], out_shardings=_without_layer_axis(sharding))


def _layer(array: jax.Array) -> jax.Array:
    """The only layer of a one-layer piece, without the layer axis."""
    return _layer_program(array.sharding)(array)


@functools.lru_cache(maxsize=256)
def _with_layer_axis_program(sharding: jax.sharding.Sharding) -> Any:
    return jax.jit(lambda a: a[None], out_shardings=_with_leading_none(sharding))


def _with_layer_axis(array: jax.Array) -> jax.Array:
    """One layer as a stack of one."""
    return _with_layer_axis_program(array.sharding)(array)


def _without_layer_axis(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    if not isinstance(sharding, NamedSharding) or not len(sharding.spec):
        return sharding
    return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))


def _with_leading_none(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    if not isinstance(sharding, NamedSharding):
        return sharding
    return NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))


def _ranges(lengths: list[int]) -> list[tuple[int, int]]:
    ranges, start = [], 0
    for length in lengths:
        ranges.append((start, start + length))
        start += length
    return ranges


def _rows_sharding(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """``sharding`` with the layer axis unsharded, so any number of layers fits."""
    if not isinstance(sharding, NamedSharding) or not len(sharding.spec):
        return sharding
    return NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec[1:]))


@functools.lru_cache(maxsize=256)
def _rows_program(start: int, stop: int, sharding: jax.sharding.Sharding) -> Any:
    return jax.jit(lambda a: a[start:stop], out_shardings=sharding)


def _rows(array: jax.Array, start: int, stop: int) -> jax.Array:
    """Layers ``start:stop`` of ``array``, where it is."""
    if (start, stop) == (0, array.shape[0]):
        return array
    return _rows_program(start, stop, array.sharding)(array)


@functools.lru_cache(maxsize=256)
def _join_program(sharding: jax.sharding.Sharding, key_impl: str | None) -> Any:
    def join(*pieces: jax.Array) -> jax.Array:
        joined = jnp.concatenate(pieces, axis=0)
        return joined if key_impl is None else jax.random.wrap_key_data(joined, impl=key_impl)

    return jax.jit(join, out_shardings=sharding)


def _joined(
    pieces: tuple[jax.Array, ...], sharding: jax.sharding.Sharding, key_impl: str | None
) -> jax.Array:
    """The pieces joined along the layer axis, with ``sharding``; keys wrapped again."""
    if len(pieces) == 1 and key_impl is None:
        return move_to(pieces[0], sharding)
    return _join_program(sharding, key_impl)(*pieces)


def _groups(names: Any) -> dict[tuple[str, str], dict[int, str]]:
    """``{(head, tail): {chunk index: name}}`` for names of stacked chunk leaves."""
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for name in names:
        match = STACKED_LEAF.match(name)
        if match:
            key = (match["head"], match["tail"])
            groups.setdefault(key, {})[int(match["index"])] = name
    return groups


def _in_order(chunks: dict[int, Any]) -> list[Any] | None:
    """The chunks in index order, or None when the indices are not 0..n-1."""
    if sorted(chunks) != list(range(len(chunks))):
        return None
    return [chunks[i] for i in range(len(chunks))]


def _dtype_or_impl(entry: Entry) -> str:
    return key_impl_name(entry.value) if entry.kind == KEY else str(entry.value.dtype)


def _recut(
    targets: list[Entry], saved: list[str], records: dict[str, dict[str, Any]]
) -> StackRecut | None:
    """The recut of one group, or None when the saved chunks cannot fill the target's."""
    kind = targets[0].kind
    if any(
        entry.kind != kind
        or kind not in (ARRAY, KEY)
        or not isinstance(entry.value, jax.Array)
        or entry.variable is None
        for entry in targets
    ):
        return None
    shapes = [records[name].get("shape") or [] for name in saved]
    if any(records[name].get("kind") != kind or not shape for name, shape in zip(saved, shapes)):
        return None
    target_shapes = [list(entry.value.shape) for entry in targets]
    if [s[0] for s in shapes] == [s[0] for s in target_shapes]:
        return None  # the same cut: restored as it is
    # Besides the shapes, the dtype must agree; for keys (stored as key data), the impl.
    field = "impl" if kind == KEY else "dtype"
    value = _dtype_or_impl(targets[0])
    if (
        sum(s[0] for s in shapes) != sum(s[0] for s in target_shapes)
        or any(s[1:] != target_shapes[0][1:] for s in shapes + target_shapes)
        or any(records[name].get(field) != value for name in saved)
        or any(_dtype_or_impl(entry) != value for entry in targets)
    ):
        return None  # not the same layers: the ordinary mismatch error names it
    target_ranges = _ranges([s[0] for s in target_shapes])
    proxies = []
    for name, shape, (first, last) in zip(saved, shapes, _ranges([s[0] for s in shapes])):
        # Read each saved chunk onto the mesh of the first target chunk that needs it.
        reader = next(
            entry
            for entry, (start, stop) in zip(targets, target_ranges)
            if max(start, first) < min(stop, last)
        )
        abstract = jax.ShapeDtypeStruct(
            tuple(shape), reader.value.dtype, sharding=_rows_sharding(reader.value.sharding)
        )
        proxies.append(Entry(tuple(name.split(".")), abstract, kind, None, None, reader.physical))
    return StackRecut(tuple(targets), tuple(proxies), value if kind == KEY else None)


def _layer_names(head: str, tail: str, names: Any) -> list[str]:
    """``head.0.<leaf>``, ``head.1.<leaf>``, ... among ``names``: the unrolled twin of the
    stacked leaf ``head.chunks.<i>.<tail>`` (``tail`` is ``layers.<leaf>``)."""
    leaf = tail.removeprefix("layers.")
    found: list[str] = []
    while f"{head}.{len(found)}.{leaf}" in names:
        found.append(f"{head}.{len(found)}.{leaf}")
    return found


def _plain_arrays(entries: list[Entry]) -> bool:
    return all(
        e.kind == ARRAY and isinstance(e.value, jax.Array) and e.variable is not None
        for e in entries
    )


def _saved_as(saved: list[str], records: dict[str, dict[str, Any]], dtype: str) -> bool:
    """Whether the saved entries are plain arrays of ``dtype``."""
    return all(
        records[name].get("kind") == ARRAY and records[name].get("dtype") == dtype for name in saved
    )


def _from_layers(
    targets: list[Entry], saved: list[str], records: dict[str, dict[str, Any]]
) -> StackRecut | None:
    """Unrolled layers saved, restored into a stack's chunks (or None if they do not fit)."""
    if not _plain_arrays(targets):
        return None
    layer_shape, dtype = list(targets[0].value.shape[1:]), str(targets[0].value.dtype)
    counts = [entry.value.shape[0] for entry in targets]
    if (
        sum(counts) != len(saved)
        or any(list(e.value.shape[1:]) != layer_shape or str(e.value.dtype) != dtype
               for e in targets)
        or any(list(records[name].get("shape") or [-1]) != layer_shape for name in saved)
        or not _saved_as(saved, records, dtype)
    ):  # fmt: skip
        return None
    ranges = _ranges(counts)
    proxies = []
    for i, name in enumerate(saved):
        reader = next(e for e, (start, stop) in zip(targets, ranges) if start <= i < stop)
        abstract = jax.ShapeDtypeStruct(
            tuple(layer_shape), reader.value.dtype,
            sharding=_without_layer_axis(reader.value.sharding),
        )  # fmt: skip
        proxies.append(Entry(tuple(name.split(".")), abstract, ARRAY, None, None, reader.physical))
    return StackRecut(tuple(targets), tuple(proxies), None, saved_stacked=False)


def _into_layers(
    targets: list[Entry], saved: list[str], records: dict[str, dict[str, Any]]
) -> StackRecut | None:
    """A stack's chunks saved, restored into unrolled layers (or None if they do not fit)."""
    if not _plain_arrays(targets):
        return None
    layer_shape, dtype = list(targets[0].value.shape), str(targets[0].value.dtype)
    shapes = [list(records[name].get("shape") or []) for name in saved]
    if (
        any(list(e.value.shape) != layer_shape or str(e.value.dtype) != dtype for e in targets)
        or any(len(shape) != len(layer_shape) + 1 or shape[1:] != layer_shape for shape in shapes)
        or sum(shape[0] for shape in shapes) != len(targets)
        or not _saved_as(saved, records, dtype)
    ):
        return None
    proxies = []
    for name, shape, (first, _) in zip(saved, shapes, _ranges([s[0] for s in shapes])):
        reader = targets[first]
        abstract = jax.ShapeDtypeStruct(
            tuple(shape), reader.value.dtype, sharding=_with_leading_none(reader.value.sharding)
        )
        proxies.append(Entry(tuple(name.split(".")), abstract, ARRAY, None, None, reader.physical))
    return StackRecut(tuple(targets), tuple(proxies), None, targets_stacked=False)


def recut_stacks(
    layout: Layout, records: dict[str, dict[str, Any]]
) -> tuple[Layout, list[StackRecut]]:
    """``(layout, recuts)`` standing in for scan-stack chunks cut unlike the checkpoint's.

    Also a stack saved unrolled and restored stacked, or the reverse; proxies of the saved chunks
    replace the targets, and each `StackRecut.assemble` sets them once the proxies are read.

    Example:
      >>> from nnx_mpmd.checkpoint.layout import collect
      >>> layout, recuts = recut_stacks(collect({"step": 1}), {"step": {"kind": "value"}})
      >>> [e.name for e in layout.entries], recuts
      (['step'], [])
    """
    by_name = layout.by_name()
    saved_groups, target_groups = _groups(records), _groups(by_name)
    recuts = []
    for key, chunks in target_groups.items():
        targets = _in_order(chunks)
        if targets is None:
            continue
        entries = [by_name[name] for name in targets]
        saved = _in_order(saved_groups.get(key, {}))
        if saved:
            recut = _recut(entries, saved, records)
        else:  # saved unrolled?
            layers = [n for n in _layer_names(*key, records) if n not in by_name]
            recut = _from_layers(entries, layers, records) if layers else None
        if recut is not None:
            recuts.append(recut)
    for key, chunks in saved_groups.items():  # saved stacked, restored unrolled?
        saved = _in_order(chunks)
        layers = [n for n in _layer_names(*key, by_name) if n not in records]
        if key in target_groups or not saved or not layers:
            continue
        recut = _into_layers([by_name[name] for name in layers], saved, records)
        if recut is not None:
            recuts.append(recut)
    if not recuts:
        return layout, []
    replaced = {id(entry) for recut in recuts for entry in recut.targets}
    entries = [e for e in layout.entries if id(e) not in replaced]
    entries += [proxy for recut in recuts for proxy in recut.saved]
    entries.sort(key=lambda e: e.path)
    return dataclasses.replace(layout, entries=entries), recuts
