"""Small helpers over jaxprs: slicing into sub-programs, evaluating, sizing values."""

from __future__ import annotations

import functools
import math
import re
import struct
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.core
import numpy as np
from jax.extend import core as jcore

__all__ = [
    "named_jit",
    "SubProgram",
    "aval_bytes",
    "is_literal",
    "make_subprogram",
    "structure_key",
    "var_bytes",
]


def is_literal(x: Any) -> bool:
    return isinstance(x, jcore.Literal)


def aval_bytes(aval: Any) -> int:
    """Bytes of a value of abstract type ``aval`` (unsharded)."""
    dtype = getattr(aval, "dtype", None)
    itemsize = getattr(dtype, "itemsize", None)  # NumPy and extended dtypes (PRNG keys)
    if not isinstance(itemsize, int):
        try:
            itemsize = np.dtype(dtype).itemsize
        except TypeError:
            itemsize = 4
    # math.prod, not np.prod: this runs for every value of every equation a pass weighs.
    return math.prod(int(d) for d in getattr(aval, "shape", ())) * int(itemsize)


def var_bytes(v: Any) -> int:
    return aval_bytes(v.aval)


class SubProgram:
    """A slice of a jaxpr's equations, callable as ``fn(*inputs) -> outputs``.

    Args:
      eqns: the equations, in program order.
      invars: the variables the slice reads from outside.
      outvars: the variables (or literals) it returns.
      substitute: a renaming applied to every equation input (used to drop
        identity markers).
    """

    def __init__(
        self,
        eqns: Sequence[Any],
        invars: Sequence[Any],
        outvars: Sequence[Any],
        substitute: dict[Any, Any] | None = None,
    ) -> None:
        substitute = substitute or {}

        def resolve(v: Any) -> Any:
            while not is_literal(v) and v in substitute:
                v = substitute[v]
            return v

        self.invars = [resolve(v) for v in invars]
        self.outvars = [resolve(v) for v in outvars]
        self.eqns = [
            eqn.replace(invars=[resolve(v) for v in eqn.invars]) if substitute else eqn
            for eqn in eqns
        ]
        # Invars may repeat (the same value passed twice); the jaxpr needs unique ones.
        unique: list[Any] = []
        for v in self.invars:
            if v not in unique:
                unique.append(v)
        self._unique = unique
        self._positions = [unique.index(v) for v in self.invars]
        effects = jcore.no_effects
        for eqn in self.eqns:
            effects = effects | eqn.effects
        debug = jcore.DebugInfo("nnx_mpmd", "pipeline program", None, None)
        self.jaxpr = jcore.Jaxpr([], unique, self.outvars, self.eqns, effects, debug)

    def __call__(self, *args: Any) -> list[Any]:
        unique_args: list[Any] = [None] * len(self._unique)
        for pos, arg in zip(self._positions, args, strict=True):
            unique_args[pos] = arg
        return jax.core.eval_jaxpr(self.jaxpr, [], *unique_args)


def make_subprogram(
    eqns: Sequence[Any],
    outvars: Sequence[Any],
    *,
    fixed_invars: Sequence[Any] = (),
    substitute: dict[Any, Any] | None = None,
) -> tuple[SubProgram, list[Any]]:
    """``(SubProgram, inputs)`` reading every free variable of ``eqns``: ``fixed_invars`` first."""
    substitute = substitute or {}

    def resolve(v: Any) -> Any:
        while not is_literal(v) and v in substitute:
            v = substitute[v]
        return v

    defined: set[Any] = set()
    free: list[Any] = [resolve(v) for v in fixed_invars]
    seen = set(free)
    for eqn in eqns:
        for v in eqn.invars:
            v = resolve(v)
            if is_literal(v) or v in defined or v in seen:
                continue
            seen.add(v)
            free.append(v)
        defined.update(eqn.outvars)
    for v in outvars:
        v = resolve(v)
        if not is_literal(v) and v not in defined and v not in seen:
            seen.add(v)
            free.append(v)
    return SubProgram(eqns, free, outvars, substitute), free


class _NoKey(Exception):
    """A value with no equality that says two programs compute the same."""


def _value_key(value: Any) -> Any:
    """``value`` as a hashable key that is equal only for values that act the same.

    Floats compare by their bits (``0.0`` and ``-0.0`` differ, a NaN equals
    itself); arrays by dtype, shape and bytes; containers element by element.
    Anything else keys as itself: hashable objects with their own equality
    (dtypes, shardings, interned contexts) or identity (a function, a jaxpr).
    """
    if isinstance(value, bool | int | str | type(None)):
        return (type(value).__name__, value)
    if isinstance(value, float):
        return ("float", struct.pack("<d", value))
    if isinstance(value, np.ndarray | np.generic):
        return ("array", value.dtype.str, np.shape(value), np.asarray(value).tobytes())
    if isinstance(value, tuple | list):
        return (type(value).__name__, tuple(_value_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _value_key(v)) for k, v in value.items())))
    if isinstance(value, jax.Array):
        raise _NoKey  # a concrete device array: no cheap value equality
    try:
        hash(value)
    except TypeError as e:
        raise _NoKey from e
    return value


def structure_key(
    eqns: Sequence[Any], invars: Sequence[Any], outvars: Sequence[Any]
) -> tuple[Any, ...] | None:
    """A hashable key of the function a slice of equations computes, or None.

    Equal keys: equal primitives, parameters and input types wired alike, so one program
    stands for the other; None when a literal or parameter has no value equality.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def key(fn):
      ...     j = jax.make_jaxpr(fn)(jnp.ones(3), jnp.ones(3)).jaxpr
      ...     return structure_key(j.eqns, j.invars, j.outvars)
      >>> key(lambda a, b: a * 2 + b) == key(lambda x, y: x * 2 + y)
      True
      >>> key(lambda a, b: a * 2 + b) == key(lambda a, b: b * 2 + a)
      False
      >>> key(lambda a, b: a * 0.0) == key(lambda a, b: a * -0.0)
      False
    """
    position: dict[Any, tuple[str, int]] = {}
    for i, v in enumerate(invars):
        position.setdefault(v, ("in", i))

    def atom(v: Any) -> Any:
        if is_literal(v):
            return ("literal", _value_key(v.val), v.aval)
        return position[v]

    try:
        parts: list[Any] = [tuple(v.aval for v in invars)]
        for eqn in eqns:
            params = tuple(sorted((name, _value_key(p)) for name, p in eqn.params.items()))
            parts.append(
                (
                    eqn.primitive,
                    tuple(atom(v) for v in eqn.invars),
                    params,
                    tuple(v.aval for v in eqn.outvars),
                    frozenset(eqn.effects),
                    eqn.ctx,
                )
            )
            for v in eqn.outvars:
                position[v] = ("value", len(position))
        parts.append(tuple(atom(v) for v in outvars))
        key = tuple(parts)
        hash(key)
    except (_NoKey, KeyError, TypeError):
        return None
    return key


def named_jit(fn: Callable[..., Any], label: str, **jit_kwargs: Any) -> Any:
    """``jax.jit(fn)`` whose XLA module is named after ``label`` (``jit_post_L0_mesh2``).

    So profiler traces and HLO dumps read like `Lowered.as_text()`.

    Example:
      >>> import jax.numpy as jnp
      >>> f = named_jit(lambda x: x + 1, "post.L0.mesh1")
      >>> "jit_post_L0_mesh1" in f.lower(jnp.ones(2)).as_text()
      True
    """

    @functools.wraps(fn)
    def program(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    program.__name__ = program.__qualname__ = re.sub(r"\W", "_", label)
    return jax.jit(program, **jit_kwargs)


def put_scalar(value: Any, sharding: Any) -> jax.Array:
    """A NumPy scalar replicated with ``sharding``, built shard by shard on each process.

    A multi-process ``jax.device_put`` is a collective that times out when compiles differ in speed.

    Example:
      >>> import jax, numpy as np
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
      >>> int(put_scalar(np.int32(3), sharding))
      3
    """
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda _: host, dtype=host.dtype)
