"""Logical layout of a checkpointed tree: which leaf is saved under which path.

A checkpoint stores every array once, under its *logical* path, whatever mesh
or stage it lived on. This module turns a tree of NNX objects and plain leaves
into a flat, ordered list of `Entry` objects keyed by logical path, and knows
how to write restored values back into that tree.

The logical path of a Variable is its graph path with the ``module`` component
that a `Stage` wrapper adds removed (``model.blocks.3.module.kernel`` becomes
``model.blocks.3.kernel``), see `nnx_mpmd.annotate.annotate.logical_paths`.

Optimizer state holds no `Stage` nodes, yet its paths embed the model's
physical paths (``optimizer.opt_state.0.mu.blocks.3.module.kernel``). The rule:
every NNX object in the same tree contributes its Stage-stripped paths to a
*suffix table* ``{physical path: logical path}``; a Variable whose own path had
nothing to strip has its longest suffix found in that table replaced by the
table's logical path. So ``opt_state.0.mu.blocks.3.module.kernel`` becomes
``opt_state.0.mu.blocks.3.kernel`` when the model is saved in the same tree.
When no model is in the tree, optimizer paths keep their ``module``
components: save the model and the optimizer together to stay layout-free.

A Variable reachable twice (a model and ``nnx.state(model)`` in one tree, or a
tied parameter) is saved once, under its first path in tree order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_mpmd.annotate.annotate import array_attributes, logical_paths
from nnx_mpmd.checkpoint.global_arrays import move_to
from nnx_mpmd.errors import CheckpointError
from nnx_mpmd.placement.partition import MpmdArray

__all__ = [
    "ARRAY",
    "KEY",
    "NUMPY",
    "VALUE",
    "AttributeHolder",
    "Entry",
    "Layout",
    "collect",
    "dotted",
    "leaf_kind",
]

ARRAY = "array"
KEY = "key"
NUMPY = "numpy"
VALUE = "value"

_JSON_SCALARS = (bool, int, float, str, type(None))


def dotted(path: tuple[str, ...]) -> str:
    """Renders a logical path the way messages and the manifest show it.

    Example:
      >>> dotted(("model", "blocks", "3", "kernel"))
      'model.blocks.3.kernel'
    """
    return ".".join(path)


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def is_prng_key(value: Any) -> bool:
    """Whether ``value`` (an array or abstract array) holds typed PRNG keys.

    Example:
      >>> import jax
      >>> is_prng_key(jax.random.key(0)), is_prng_key(jax.numpy.zeros(2))
      (True, False)
    """
    dtype = getattr(value, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def leaf_kind(value: Any) -> str:
    """How a leaf is stored: ``array``, ``key``, ``numpy`` or ``value`` (JSON).

    Example:
      >>> import numpy as np
      >>> leaf_kind(3), leaf_kind(np.zeros(2))
      ('value', 'numpy')
    """
    if isinstance(value, MpmdArray):
        return KEY if is_prng_key(value) else ARRAY
    if isinstance(value, jax.Array | jax.ShapeDtypeStruct):
        return KEY if is_prng_key(value) else ARRAY
    if isinstance(value, np.ndarray | np.generic):
        return NUMPY
    if isinstance(value, _JSON_SCALARS):
        return VALUE
    return ""


@dataclasses.dataclass
class Entry:
    """One saved leaf: its logical path, current value and where it goes back.

    Attributes:
      path: the logical path, as strings.
      value: the current value (array, MpmdArray, typed key, numpy, scalar).
      kind: how it is stored (see `leaf_kind`).
      variable: the NNX Variable that holds it (or an `AttributeHolder` for an
        array a module holds as a plain attribute), or None for a plain leaf.
      leaf_index: the position among the tree's flat leaves for a plain leaf.
      physical: the path as it appears in the tree (for messages).

    Example:
      >>> Entry(("step",), 3, "value", None, 0, ("step",)).kind
      'value'
    """

    path: tuple[str, ...]
    value: Any
    kind: str
    variable: nnx.Variable | AttributeHolder | None
    leaf_index: int | None
    physical: tuple[str, ...]

    @property
    def name(self) -> str:
        """The dotted logical path."""
        return dotted(self.path)


@dataclasses.dataclass
class Layout:
    """A flattened tree: its entries plus what is needed to rebuild it.

    Attributes:
      entries: one `Entry` per saved leaf, sorted by logical path.
      leaves: the tree's flat leaves (NNX objects stay whole).
      treedef: the tree structure, for `rebuild`.

    Example:
      >>> layout = collect({"step": 3})
      >>> [e.name for e in layout.entries]
      ['step']
    """

    entries: list[Entry]
    leaves: list[Any]
    treedef: Any

    def rebuild(self, new_leaf_values: dict[int, Any]) -> Any:
        """The tree with plain leaves ``{leaf_index: value}`` replaced."""
        leaves = [new_leaf_values.get(i, leaf) for i, leaf in enumerate(self.leaves)]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def by_name(self) -> dict[str, Entry]:
        """Entries keyed by dotted logical path."""
        return {e.name: e for e in self.entries}


class AttributeHolder:
    """Reads and sets an array that an NNX object holds as a plain attribute.

    Such arrays are Flax data like a Variable's value, without a Variable to
    call ``set_value`` on; this stands in for one in an `Entry`.

    Args:
      root: the NNX object.
      path: the attribute's graph path under ``root``.

    Example:
      >>> import jax.numpy as jnp
      >>> block = nnx.Module()
      >>> block.table = jnp.zeros(2)
      >>> AttributeHolder(block, ("table",)).set_value(jnp.ones(2))
      >>> block.table.tolist()
      [1.0, 1.0]
    """

    def __init__(self, root: Any, path: tuple[Any, ...]) -> None:
        self.root: Any = root
        self.path: tuple[Any, ...] = path

    def get_value(self) -> Any:
        return dict(nnx.to_flat_state(nnx.state(self.root)))[self.path]

    def set_value(self, value: Any) -> None:
        nnx.update(self.root, nnx.from_flat_state([(self.path, value)]))


def _is_nnx_leaf(x: Any) -> bool:
    return isinstance(x, nnx.Pytree | nnx.Variable | MpmdArray)


def _stage_suffix_table(roots: list[tuple[tuple[str, ...], Any]]) -> dict[tuple, tuple]:
    table: dict[tuple, tuple] = {}
    for _, root in roots:
        for physical, logical in logical_paths(root).items():
            if physical != logical:
                table[tuple(str(k) for k in physical)] = tuple(str(k) for k in logical)
    return table


def _strip_by_suffix(path: tuple[str, ...], table: dict[tuple, tuple]) -> tuple[str, ...]:
    for start in range(len(path)):
        logical = table.get(path[start:])
        if logical is not None:
            return path[:start] + logical
    return path


def collect(tree: Any, *, where: str = "tree") -> Layout:
    """The `Layout` of ``tree``: one entry per logical path.

    NNX objects give one per Variable and per plain array attribute; ``nnx.State`` is walked
    like a dict; any other leaf is one entry. ``where`` names the tree in errors.

    Raises:
      CheckpointError: a leaf of an unsupported type, or two leaves whose
        logical paths collide.

    Example:
      >>> from flax import nnx
      >>> layout = collect({"model": nnx.Linear(2, 3, rngs=nnx.Rngs(0))})
      >>> [e.name for e in layout.entries]
      ['model.bias', 'model.kernel']
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_nnx_leaf)
    leaves = [leaf for _, leaf in flat]
    prefixes = [tuple(_key_name(k) for k in key_path) for key_path, _ in flat]
    roots = [(p, leaf) for p, leaf in zip(prefixes, leaves) if isinstance(leaf, nnx.Pytree)]
    suffix_table = _stage_suffix_table(roots)

    entries: list[Entry] = []
    seen_variables: set[int] = set()

    def add_variable(variable: nnx.Variable, physical: tuple[str, ...], logical: tuple[str, ...]):
        if id(variable) in seen_variables:
            return
        seen_variables.add(id(variable))
        if logical == physical:
            logical = _strip_by_suffix(physical, suffix_table)
        value = variable.get_value()
        entries.append(_entry(logical, value, variable, None, physical, where))

    for index, (prefix, leaf) in enumerate(zip(prefixes, leaves)):
        if isinstance(leaf, nnx.Pytree):
            variables = {
                tuple(path): node
                for path, node in nnx.iter_graph(leaf)
                if isinstance(node, nnx.Variable)
            }
            for physical, logical in logical_paths(leaf).items():
                variable = variables[tuple(physical)]
                add_variable(
                    variable,
                    prefix + tuple(str(k) for k in physical),
                    prefix + tuple(str(k) for k in logical),
                )
            for attribute in array_attributes(leaf):
                if id(attribute.value) in seen_variables:
                    continue
                seen_variables.add(id(attribute.value))
                holder = AttributeHolder(leaf, attribute.path)
                physical = prefix + tuple(str(k) for k in attribute.path)
                logical = prefix + tuple(str(k) for k in attribute.logical)
                entries.append(_entry(logical, attribute.value, holder, None, physical, where))
        elif isinstance(leaf, nnx.Variable):
            add_variable(leaf, prefix, prefix)
        else:
            entries.append(_entry(prefix, leaf, None, index, prefix, where))

    entries.sort(key=lambda e: e.path)
    _check_unique(entries, where)
    return Layout(entries=entries, leaves=leaves, treedef=treedef)


def _entry(
    path: tuple[str, ...],
    value: Any,
    variable: nnx.Variable | AttributeHolder | None,
    leaf_index: int | None,
    physical: tuple[str, ...],
    where: str,
) -> Entry:
    kind = leaf_kind(value)
    if not kind:
        raise CheckpointError(
            f"{where} leaf {dotted(physical)!r} has unsupported type {type(value).__name__}; "
            "checkpoints hold NNX objects, nnx.State, jax/numpy arrays, typed PRNG keys and "
            "JSON scalars (int, float, bool, str, None). Convert it to an array or drop it."
        )
    return Entry(path, value, kind, variable, leaf_index, physical)


def _check_unique(entries: list[Entry], where: str) -> None:
    by_name: dict[str, Entry] = {}
    for entry in entries:
        other = by_name.get(entry.name)
        if other is not None:
            raise CheckpointError(
                f"{where} leaves {dotted(other.physical)!r} and {dotted(entry.physical)!r} "
                f"both map to the logical path {entry.name!r}; rename one of them (a dict key "
                "containing '.' or a Stage-wrapped and a plain copy of the same module cause this)."
            )
        by_name[entry.name] = entry


def copies_of(value: Any) -> dict[int | None, Any]:
    """The per-mesh copies of a value: ``{mesh_id: array}``, or ``{None: value}``.

    Example:
      >>> import jax.numpy as jnp
      >>> list(copies_of(jnp.zeros(2)))
      [None]
    """
    if isinstance(value, MpmdArray):
        return {i: value.array(i) for i in value.mesh_ids}
    return {None: value}


def primary_copy(value: Any) -> Any:
    """The copy that is saved: the lowest mesh's copy of an `MpmdArray`, else the value.

    Example:
      >>> primary_copy(3)
      3
    """
    if isinstance(value, MpmdArray):
        return value.array(min(value.mesh_ids))
    return value


def rebuild_like(
    target: Any,
    restored: Any,
    convert: Callable[[Any], Any],
    other_copies: dict[int, Any] | None = None,
) -> Any:
    """Places ``restored`` (on the primary copy's sharding) like ``target``, converting each copy.

    An `MpmdArray`'s other copies come from ``other_copies`` or are copied from ``restored``.

    Example:
      >>> import jax.numpy as jnp
      >>> rebuild_like(jnp.zeros(2), jnp.ones(2), lambda x: x).tolist()
      [1.0, 1.0]
    """
    if isinstance(target, MpmdArray):
        lowest = min(target.mesh_ids)
        others = other_copies or {}
        arrays = {}
        for mesh_id in target.mesh_ids:
            copy = restored
            if mesh_id != lowest:
                copy = others.get(mesh_id)
                if copy is None:
                    copy = move_to(restored, target.array(mesh_id).sharding)
            arrays[mesh_id] = convert(copy)
        return MpmdArray(arrays)
    return convert(restored)
