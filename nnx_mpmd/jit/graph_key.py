"""Step cache keys for graphdefs whose static attributes cannot be hashed.

Published NNX models often keep a plain ``@dataclasses.dataclass`` config (or a
list or dict of settings) as a module attribute. Flax stores it in the graphdef
as a static attribute, and a dataclass with ``eq=True`` is unhashable, so
``hash(graphdef)`` raises. ``nnx.jit`` still accepts such a model: JAX's pytree
definitions hash their structure only and compare static data with ``==``. The
step cache of `nnx_mpmd.jit` does the same: `graphdef_hash` hashes what it can
and stands an unhashable part in by its type; equality decides the rest.

A key stored in the cache must not change afterwards. An unhashable static
value is usually mutable, and the graphdef holds the model's own object, so
`frozen_graphdef` stores a deep copy of each such value: a config changed in
place after the step compiled compares unequal to the key, and the step
compiles again instead of running the program traced for the old value.

Example:
  >>> import dataclasses
  >>> from flax import nnx
  >>> @dataclasses.dataclass
  ... class Config:
  ...     width: int = 8
  >>> class Net(nnx.Module):
  ...     def __init__(self):
  ...         self.config = Config()
  >>> net = Net()
  >>> graphdef = nnx.graphdef(net)
  >>> isinstance(graphdef_hash(graphdef), int)
  True
  >>> stored = frozen_graphdef(graphdef)
  >>> stored == graphdef
  True
  >>> net.config.width = 4
  >>> stored == nnx.graphdef(net)
  False
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any, TypeGuard

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["frozen_graphdef", "graphdef_hash"]


def _part_hash(part: Any) -> int:
    """``hash(part)``; an unhashable part hashes by its type, a tuple part by its items."""
    try:
        return hash(part)
    except TypeError:
        if isinstance(part, tuple):
            return hash(tuple(_part_hash(item) for item in part))
        value = getattr(part, "value", part)  # flax's Static(value)
        return hash((type(part).__name__, type(value).__name__))


def graphdef_hash(graphdef: Any) -> int:
    """A hash of ``graphdef`` that exists even where a static attribute is unhashable.

    Graphdefs equal under ``==`` hash the same. An unhashable static value
    counts by its type only, so two graphdefs that differ in it alone share a
    hash and are told apart by ``==``.

    Args:
      graphdef: a Flax ``GraphDef`` (or anything hashable).

    Returns:
      The hash: ``hash(graphdef)`` when that works.

    Example:
      >>> from flax import nnx
      >>> graphdef = nnx.graphdef(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
      >>> graphdef_hash(graphdef) == hash(graphdef)
      True
    """
    try:
        return hash(graphdef)
    except TypeError:
        pass
    nodes = getattr(graphdef, "nodes", None)
    attributes = getattr(graphdef, "attributes", None)
    if nodes is None or attributes is None:  # not a Flax GraphDef: by type, as above
        return _part_hash(graphdef)
    return hash(
        (
            tuple(_part_hash(node) for node in nodes),
            tuple(_part_hash(attribute) for attribute in attributes),
        )
    )


_NO_VALUE = object()  # a static attribute without a value


def _is_dataclass_instance(x: Any) -> TypeGuard[DataclassInstance]:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _frozen_attribute(attribute: Any) -> Any:
    """A ``(key, Static(value))`` pair with an unhashable value deep-copied; else as is."""
    try:
        hash(attribute)
        return attribute
    except TypeError:
        pass
    if not (isinstance(attribute, tuple) and len(attribute) == 2):
        return attribute
    key, static = attribute
    held = getattr(static, "value", _NO_VALUE)
    if held is _NO_VALUE or not _is_dataclass_instance(static):
        return attribute
    try:
        value = copy.deepcopy(held)
    except Exception:  # an object that cannot be copied: compared as it is now
        return attribute
    return key, dataclasses.replace(static, value=value)


def frozen_graphdef(graphdef: Any) -> Any:
    """``graphdef`` with every unhashable static value deep-copied: a key that stays put.

    Args:
      graphdef: a Flax ``GraphDef``.

    Returns:
      ``graphdef`` itself when it hashes (its static values are then immutable
      as far as equality goes); else an equal copy whose unhashable static
      values are copies, which later changes to the model's objects leave alone.

    Example:
      >>> from flax import nnx
      >>> graphdef = nnx.graphdef(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
      >>> frozen_graphdef(graphdef) is graphdef
      True
    """
    try:
        hash(graphdef)
        return graphdef
    except TypeError:
        pass
    attributes = getattr(graphdef, "attributes", None)
    if attributes is None or not _is_dataclass_instance(graphdef):
        return graphdef
    return dataclasses.replace(
        graphdef, attributes=[_frozen_attribute(attribute) for attribute in attributes]
    )
