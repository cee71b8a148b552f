"""Static arguments of a step: ``mp.jit(..., static_argnums=..., static_argnames=...)``.

As with ``jax.jit`` and ``nnx.jit``, a static argument is not traced: the step
sees the Python value itself (so ``if train:`` works), and each distinct value
compiles a step of its own. The value must be hashable and must not hold NNX
objects or arrays (their state would be baked into the programs as constants).

A static value travels through the step's flattened arguments as a `StaticArg`,
a pytree node without children whose auxiliary data is the value: it is part
of the argument tree, and so of the step's cache key, and the tracer unwraps
it before calling the step (`nnx_mpmd.compiler.trace.trace_step`).

Example:
  >>> def step(model, optimizer, batch, train=True):
  ...     return 0.0
  >>> sorted(argument_positions(step, (), ("train",), "static"))
  [3]
  >>> wrap_static((1, 2, True), frozenset({2}), "step")[2]
  StaticArg(True)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from nnx_mpmd.compiler.trace.trace_step import StaticArg, is_graph_node
from nnx_mpmd.errors import CompileError

__all__ = [
    "StaticArg",
    "argument_positions",
    "check_disjoint",
    "checked_argnames",
    "checked_argnums",
    "wrap_static",
]


def checked_argnums(argnums: int | Sequence[int], option: str) -> tuple[int, ...]:
    """``argnums`` as a tuple of positions, each checked to be an int >= 0.

    Args:
      argnums: a position or a sequence of them.
      option: the option's name without its suffix, for messages: ``"donate"``
        or ``"static"``.

    Returns:
      The positions, in the order given.

    Raises:
      CompileError: a position is not an int >= 0.

    Example:
      >>> checked_argnums(1, "donate"), checked_argnums((0, 2), "static")
      ((1,), (0, 2))
    """
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for n in nums:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            example = "(0, 1) for step(model, optimizer, batch)"
            if option == "static":
                example = "(3,) for step(model, optimizer, batch, train)"
            raise CompileError(
                f"mp.jit({option}_argnums=...) takes argument positions (ints >= 0), got "
                f"{n!r}; pass e.g. {option}_argnums={example}."
            )
    return nums


def checked_argnames(argnames: str | Sequence[str]) -> tuple[str, ...]:
    """``argnames`` as a tuple of names (a single name becomes a 1-tuple)."""
    return (argnames,) if isinstance(argnames, str) else tuple(argnames)


def argument_positions(
    fn: Callable[..., Any],
    argnums: tuple[int, ...],
    argnames: tuple[str, ...],
    option: str,
) -> frozenset[int]:
    """The positions of the arguments of ``fn`` that ``argnums`` and ``argnames`` name.

    Args:
      fn: the step.
      argnums: positions, checked (`checked_argnums`).
      argnames: parameter names (`checked_argnames`).
      option: the option's name without its suffix, for messages: ``"donate"``
        or ``"static"``.

    Returns:
      The positions.

    Raises:
      CompileError: a name is not a positional parameter of ``fn``.

    Example:
      >>> sorted(argument_positions(lambda model, batch: None, (1,), ("model",), "donate"))
      [0, 1]
    """
    if not argnames:
        return frozenset(argnums)
    params = [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    unknown = [name for name in argnames if name not in params]
    if unknown:
        raise CompileError(
            f"mp.jit({option}_argnames=...) names {unknown}, which "
            f"{getattr(fn, '__name__', 'the step')} has no positional parameter of "
            f"(it has {params}); name one of those."
        )
    return frozenset(argnums) | {params.index(name) for name in argnames}


def check_disjoint(static: frozenset[int], donated: frozenset[int]) -> None:
    """Raises when an argument is both static and donated.

    Example:
      >>> check_disjoint(frozenset({3}), frozenset({0, 1}))
    """
    both = sorted(static & donated)
    if both:
        raise CompileError(
            f"mp.jit: argument(s) {both} are both static and donated; a static argument is "
            "a Python value, not state to reuse. Drop them from one of the two options."
        )


def _held_object(value: Any) -> str | None:
    """What in ``value`` cannot be static (an NNX object or an array), or None."""
    for leaf in jax.tree.leaves(value, is_leaf=is_graph_node):
        if is_graph_node(leaf):
            return f"an NNX object ({type(leaf).__name__})"
        if isinstance(leaf, jax.Array | np.ndarray):
            return f"an array ({type(leaf).__name__})"
    return None


def wrap_static(args: tuple[Any, ...], positions: frozenset[int], name: str) -> tuple[Any, ...]:
    """``args`` with each static position's value wrapped in a `StaticArg`.

    Args:
      args: the step's positional arguments.
      positions: the static positions (those beyond ``len(args)`` are ignored:
        the step's defaults are not passed).
      name: the step's name, for messages.

    Returns:
      The arguments to flatten.

    Raises:
      CompileError: a static value is unhashable, or holds an NNX object or an array.
    """
    if not positions:
        return args
    wrapped = list(args)
    for i in sorted(p for p in positions if p < len(args)):
        value = args[i]
        held = _held_object(value)
        if held is not None:
            raise CompileError(
                f"argument {i} of {name} is static (mp.jit static_argnums/static_argnames) but "
                f"holds {held}: its state would be compiled in as constants. Pass it as an "
                "ordinary argument, and keep static arguments to Python values such as flags."
            )
        try:
            hash(value)
        except TypeError as e:
            raise CompileError(
                f"argument {i} of {name} is static (mp.jit static_argnums/static_argnames) but "
                f"not hashable ({e}); pass a hashable value (a tuple instead of a list), or "
                "make it an ordinary argument."
            ) from None
        wrapped[i] = StaticArg(value)
    return tuple(wrapped)
