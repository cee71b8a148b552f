"""How the pipelined region combines each aux value over the microbatches.

A loss function's aux values (``has_aux=True``) are either summaries of the
microbatch (an accuracy, a token count: averaged over the microbatches, like
the loss) or per-example values (logits, per-token losses, intermediates:
concatenated in microbatch order, so that the step returns the full batch's
values as ``nnx.value_and_grad`` on the full batch would). `aux_modes` decides
which, per aux leaf, from the user's ``aux_reduction``:

* ``"mean"``: the mean over the microbatches (integers average to float32);
* ``"concat"``: the microbatches' values stacked to ``[m, *shape]`` inside the
  region, then joined along axis 0 (`join_stacked`); a scalar gives ``[m]``;
* ``None`` (the default): ``"mean"``, except that a leaf whose leading axis has
  the microbatch's row count is ambiguous (a per-example value would be
  averaged into nonsense) and raises a `CompileError` asking for one of the two.

``aux_reduction`` may be one of those for every leaf, or a pytree prefix of the
aux value with one per subtree, like ``optax.microbatching``'s accumulators.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.core
from jax.sharding import NamedSharding, PartitionSpec

from nnx_mpmd.errors import CompileError

__all__ = [
    "AUX_REDUCTIONS",
    "aux_modes",
    "join_stacked",
    "stacked_aval",
    "stacked_spec",
    "value_spec",
]

AUX_REDUCTIONS = ("mean", "concat")
"""The per-leaf aux reductions `value_and_grad` accepts (or None: mean, checked)."""

_CHECKED = "mean, unless per-example"  # what None stands for inside a prefix tree


def _leaf_mode(mode: Any, aval: Any, rows: int, where: str) -> str:
    if mode in AUX_REDUCTIONS:
        return mode
    if mode != _CHECKED:
        raise CompileError(
            f"value_and_grad(aux_reduction=...) gives {mode!r} for the aux value {where}; "
            f"use one of {AUX_REDUCTIONS} (or None for the default), for every leaf or as a "
            "pytree prefix of the aux value."
        )
    shape = tuple(aval.shape)
    if shape and shape[0] == rows:
        raise CompileError(
            f"the aux value {where} has shape {shape}: its leading axis has the microbatch's "
            f"{rows} rows, so it looks per-example (logits, per-token losses), and averaging "
            "it over the microbatches would mix different examples. Pass "
            "value_and_grad(..., aux_reduction='concat') to get the full batch's values in "
            "order, or aux_reduction='mean' if it is a summary to average (a pytree prefix "
            "of the aux value picks per leaf, e.g. {'logits': 'concat', 'accuracy': 'mean'})."
        )
    return "mean"


def aux_modes(aux_reduction: Any, aux_tree: Any, aux_avals: Sequence[Any], rows: int) -> tuple:
    """Per aux leaf, ``"mean"`` or ``"concat"``, from the user's ``aux_reduction`` (a prefix).

    Raises:
      CompileError: an unknown mode, a prefix that does not match the aux
        value, or (default) a leaf that looks per-example.

    Example:
      >>> import jax, numpy as np
      >>> aux = {"acc": np.float32(0), "logits": np.zeros((4, 10), np.float32)}
      >>> leaves, tree = jax.tree.flatten(aux)
      >>> aux_modes({"acc": "mean", "logits": "concat"}, tree, leaves, rows=4)
      ('mean', 'concat')
    """
    chosen = jax.tree.map(
        lambda mode: _CHECKED if mode is None else mode, aux_reduction, is_leaf=lambda x: x is None
    )
    aux = jax.tree.unflatten(aux_tree, list(aux_avals))
    try:
        per_leaf = jax.tree.map(
            lambda mode, sub: jax.tree.map(lambda _: mode, sub), chosen, aux
        )  # fmt: skip
    except ValueError as e:
        raise CompileError(
            f"value_and_grad(aux_reduction=...) is not a pytree prefix of the aux value "
            f"({aux_tree}): {e}. Give one mode for every leaf ('mean' or 'concat') or a "
            "tree with the aux value's structure down to where the modes apply."
        ) from None
    with_paths = jax.tree_util.tree_flatten_with_path(aux)[0]
    modes = jax.tree.leaves(per_leaf)
    return tuple(
        _leaf_mode(mode, aval, rows, jax.tree_util.keystr(path) or "(the whole aux)")
        for mode, (path, aval) in zip(modes, with_paths, strict=True)
    )


def value_spec(aval: Any) -> PartitionSpec | None:
    """The PartitionSpec in ``aval``'s type (Explicit axes); None if replicated or untyped.

    Example:
      >>> import jax.numpy as jnp
      >>> value_spec(jax.core.ShapedArray((2, 3), jnp.float32)) is None
      True
    """
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    if spec is None or all(entry is None for entry in spec):
        return None
    return PartitionSpec(*spec)


def stacked_spec(aval: Any) -> PartitionSpec | None:
    """The PartitionSpec of values of ``aval`` stacked on a new leading axis; None if replicated.

    Example:
      >>> import jax.numpy as jnp
      >>> stacked_spec(jax.core.ShapedArray((2, 3), jnp.float32)) is None
      True
    """
    spec = value_spec(aval)
    return None if spec is None else PartitionSpec(None, *spec)


def stacked_aval(aval: Any, num_microbatches: int) -> Any:
    """``[m, *aval.shape]``, sharded like each microbatch (an Explicit type stays).

    Example:
      >>> import jax.numpy as jnp
      >>> stacked_aval(jax.core.ShapedArray((2, 3), jnp.float32), 4).shape
      (4, 2, 3)
    """
    shape = (num_microbatches, *aval.shape)
    spec = stacked_spec(aval)
    if spec is None:
        return jax.core.ShapedArray(shape, aval.dtype)
    return aval.update(shape=shape, sharding=NamedSharding(aval.sharding.mesh, spec))


def join_stacked(stacked: Any) -> Any:
    """``[m, rows, ...]`` joined to ``[m * rows, ...]`` (microbatch order); ``[m]`` stays.

    A leaf sharded along its rows is gathered first: a device's joined rows are not contiguous.

    Example:
      >>> import jax.numpy as jnp
      >>> join_stacked(jnp.arange(6).reshape(3, 2)).tolist()
      [0, 1, 2, 3, 4, 5]
    """
    if stacked.ndim < 2:
        return stacked
    aval = jax.typeof(stacked)
    if stacked_spec(aval) is not None:
        stacked = jax.sharding.reshard(stacked, NamedSharding(aval.sharding.mesh, PartitionSpec()))
    return stacked.reshape(stacked.shape[0] * stacked.shape[1], *stacked.shape[2:])
