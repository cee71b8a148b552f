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
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from nnx_mpmd.checkpoint.global_arrays import move_to
from nnx_mpmd.checkpoint.layout import ARRAY, KEY, Entry, Layout
from nnx_mpmd.checkpoint.manifest import key_impl_name

__all__ = ["StackRecut", "recut_stacks"]

_CHUNK = re.compile(r"^(?P<head>.+)\.chunks\.(?P<index>\d+)\.(?P<tail>layers\..+)$")


@dataclasses.dataclass(frozen=True)
class StackRecut:
    """One stacked leaf of a `ScanStack`, saved in some layer ranges, restored in others.

    Attributes:
      targets: the target's chunk entries, in layer order.
      saved: proxies of the saved chunk entries, in layer order; their values
        are abstract arrays placed where they are read.
      key_impl: for typed PRNG keys (stored as their key data), their
        implementation's name; None for arrays.
    """

    targets: tuple[Entry, ...]
    saved: tuple[Entry, ...]
    key_impl: str | None = None

    def assemble(self, arrays: dict[str, Any], lookup: Any) -> None:
        """Sets each target chunk from the saved chunks' layers it covers.

        Args:
          arrays: the arrays read for the proxies, nested by path.
          lookup: ``lookup(arrays, path)`` gives one of them.
        """
        saved_ranges = _ranges([entry.value.shape[0] for entry in self.saved])
        target_ranges = _ranges([entry.value.shape[0] for entry in self.targets])
        for entry, (start, stop) in zip(self.targets, target_ranges, strict=True):
            pieces = []
            for proxy, (first, last) in zip(self.saved, saved_ranges, strict=True):
                low, high = max(start, first), min(stop, last)
                if low < high:
                    piece = _rows(lookup(arrays, proxy.path), low - first, high - first)
                    pieces.append(move_to(piece, _rows_sharding(entry.value.sharding)))
            joined = _joined(tuple(pieces), entry.value.sharding, self.key_impl)
            entry.variable.set_value(joined)  # type: ignore[union-attr]


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
        match = _CHUNK.match(name)
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
    shapes = [records[name].get("shape") for name in saved]
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


def recut_stacks(
    layout: Layout, records: dict[str, dict[str, Any]]
) -> tuple[Layout, list[StackRecut]]:
    """Stands in for scan-stack chunks cut into other ranges than the checkpoint's.

    Args:
      layout: the collected target.
      records: the checkpoint manifest's entries by name.

    Returns:
      ``(layout, recuts)``: the layout with each recut group's target entries
      replaced by proxies of the saved chunks (read and verified like any
      entry), and the recuts whose `StackRecut.assemble` sets the targets
      once the proxies are read. Groups cut alike are left as they are.

    Example:
      >>> from nnx_mpmd.checkpoint.layout import collect
      >>> layout, recuts = recut_stacks(collect({"step": 1}), {"step": {"kind": "value"}})
      >>> [e.name for e in layout.entries], recuts
      (['step'], [])
    """
    by_name = layout.by_name()
    saved_groups = _groups(records)
    recuts = []
    for key, chunks in _groups(by_name).items():
        targets, saved = _in_order(chunks), _in_order(saved_groups.get(key, {}))
        if targets is None or not saved:
            continue
        recut = _recut([by_name[name] for name in targets], saved, records)
        if recut is not None:
            recuts.append(recut)
    if not recuts:
        return layout, []
    replaced = {id(entry) for recut in recuts for entry in recut.targets}
    entries = [e for e in layout.entries if id(e) not in replaced]
    entries += [proxy for recut in recuts for proxy in recut.saved]
    entries.sort(key=lambda e: e.path)
    return dataclasses.replace(layout, entries=entries), recuts
