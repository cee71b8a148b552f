"""Which state leaves of a step ``mp.jit(..., donate_argnums=..., donate_argnames=...)`` donates.

As with ``jax.jit`` and ``nnx.jit``, the donated arguments are named by
position or by parameter name. Donation covers the NNX state of graph nodes
(models, optimizers, and nodes inside containers) in those arguments; array
arguments such as the batch are moved into microbatches by transfers and are
never donated. Which programs donate which leaf is the compiler's
(`nnx_mpmd.compiler.final.donate_inputs`).

Example:
  >>> def step(model, optimizer, batch):
  ...     return 0.0
  >>> sorted(donated_positions(step, (0,), ("optimizer",)))
  [0, 1]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from nnx_mpmd.compiler.trace.trace_step import FlatArgs
from nnx_mpmd.jit.static_args import argument_positions

__all__ = ["donated_positions", "donated_state_leaves"]


def donated_positions(
    fn: Callable[..., Any], argnums: tuple[int, ...], argnames: tuple[str, ...]
) -> frozenset[int]:
    """The positions of the donated arguments of ``fn`` (`argument_positions` for the
    checked ``donate_argnums`` / ``donate_argnames``; raises its `CompileError`).

    Example:
      >>> donated_positions(lambda model, batch: None, (), ("model",))
      frozenset({0})
    """
    return argument_positions(fn, argnums, argnames, "donate")


def donated_state_leaves(flat: FlatArgs, positions: frozenset[int]) -> frozenset[int]:
    """Indices of the state leaves of the graph nodes in the donated arguments.

    Args:
      flat: the step's flattened arguments.
      positions: the donated argument positions (`donated_positions`).

    Returns:
      Indices into ``flat.state_leaves``.
    """
    if not positions:
        return frozenset()
    num_leaves = len(flat.args_leaves)
    per_argument = jax.tree.unflatten(flat.args_tree, list(range(num_leaves)))
    donated_args_leaves = {
        leaf
        for p, subtree in enumerate(per_argument)
        if p in positions
        for leaf in jax.tree.leaves(subtree)
    }
    num_arguments = len(flat.nodes) - flat.num_implicit  # implicit Rngs are no argument's
    donated_nodes = {
        node
        for node, leaf in enumerate(flat.node_positions[:num_arguments])
        if leaf in donated_args_leaves
    }
    tree = jax.tree.unflatten(flat.state_tree, list(range(len(flat.state_leaves))))
    return frozenset(
        j
        for path, j in jax.tree_util.tree_flatten_with_path(tree)[0]
        if _node_index(path) in donated_nodes
    )


def _node_index(path: Sequence[Any]) -> int | None:
    first = path[0] if path else None
    index = getattr(first, "idx", getattr(first, "key", None))
    return index if isinstance(index, int) else None
