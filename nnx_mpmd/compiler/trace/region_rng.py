"""RNG counters inside the pipelined region: derived from the microbatch index.

An NNX RNG stream adds 1 to its counter per key drawn, independently of the
data. Run one microbatch after another, the counter a stage reads depends on
every earlier microbatch's stages, which would chain the stages of one stream
together and stop them from pipelining. `trace_region` therefore rewrites the
traced body so that each counter is read as ``count0 + index * K`` (``index``
the microbatch's position, ``K`` the keys drawn per microbatch) and left
unchanged, and advances every counter by ``m * K`` after the region. The keys
drawn are then the ones the unpipelined step draws, microbatch by microbatch.

``K`` is found by evaluating the counter's update at two concrete counts; an
update that is not such a shift is refused (`CompileError`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.core import ShapedArray
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_mpmd._jax_compat import concrete_mesh, convert_constvars_jaxpr, dce_jaxpr
from nnx_mpmd.compiler.jaxpr_utils import put_scalar
from nnx_mpmd.errors import CompileError

__all__ = ["advance_counts", "rng_count_inputs", "rng_counts_from_index"]


def rng_count_inputs(other_state: Any, n_other: int, captured: Sequence[Any]) -> list[int]:
    """Positions of the RNG counters among the region's state inputs: held ones, then ``captured``.

    Example:
      >>> from flax import nnx
      >>> _, state = nnx.split(nnx.Rngs(0))
      >>> rng_count_inputs(state, len(jax.tree.leaves(state)), [])
      [0]
    """
    return _count_positions(other_state) + [
        n_other + i for i, c in enumerate(captured) if isinstance(c.variable, nnx.RngCount)
    ]


def rng_counts_from_index(
    closed: Any,
    counts: list[int],
    num_diff: int,
    first_out: int,
    in_avals: list[Any],
    paths: list[str],
    *,
    index_aval: Any,
    submesh: Mesh | None,
) -> tuple[Any, list[Any], dict[int, int]]:
    """The body with RNG counters derived from the microbatch index, if any advance.

    ``counts``: the counters' positions among the state leaves; ``first_out``: the first
    state leaf's among the outputs. Returns ``(body, its consts, {counter position: K})``.

    Raises:
      CompileError: a counter is changed other than by drawing keys.
    """
    first_in = len(closed.consts) + num_diff
    increments = _count_increments(
        convert_constvars_jaxpr(closed.jaxpr), counts, first_in, first_out, paths, submesh
    )
    if not any(np.any(k) for k in increments.values()):
        return closed, list(closed.consts), {}
    derived, body_consts = _derive_counts(
        closed, increments, num_diff, first_out, in_avals, index_aval
    )
    return derived, [*derived.consts, *body_consts], increments


def advance_counts(
    leaves: list[Any], increments: dict[int, int], num_microbatches: int
) -> list[Any]:
    """``leaves`` with counter ``j`` advanced to ``count + num_microbatches * increments[j]``.

    Example:
      >>> advance_counts([np.uint32(3), 1.5], {0: 2}, 4)
      [Array(11, dtype=uint32), 1.5]
    """
    out = list(leaves)
    for j, k in increments.items():
        count = leaves[j]
        out[j] = count + jnp.asarray(num_microbatches * k, jnp.result_type(count))
    return out


def _concrete_count(count: int, shape: tuple[int, ...], submesh: Mesh | None) -> Any:
    """An RNG counter value to evaluate a counter update with eagerly, committed to ``submesh``.

    On Explicit axes an eager computation takes its devices from an argument.
    """
    value = np.full(shape, count, np.uint32)
    if submesh is None or not submesh.axis_names:
        return value
    return put_scalar(value, NamedSharding(submesh, PartitionSpec()))


def _count_positions(state: Any, first: int = 0) -> list[int]:
    """Leaf positions (from ``first``) of the RNG counters among ``state``'s leaves."""
    positions, cursor = [], first
    for variable in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        n = len(jax.tree.leaves(variable))
        if isinstance(variable, nnx.RngCount) and n == 1:
            positions.append(cursor)
        cursor += n
    return positions


def _count_increments(
    jaxpr: jcore.Jaxpr,
    counts: list[int],
    first_in: int,
    first_out: int,
    paths: list[str],
    submesh: Mesh | None,
) -> dict[int, int]:
    """``{other index: K}``: how much each RNG counter advances per microbatch.

    Each counter's update is cut out and evaluated at two counts to find ``K``.

    Raises:
      CompileError: a counter's new value depends on anything but the counter, or
        is not the counter plus a constant.
    """
    increments: dict[int, Any] = {}
    for j in counts:
        keep = [i == first_out + j for i in range(len(jaxpr.outvars))]
        sub, used = dce_jaxpr(jaxpr, keep, instantiate=False)
        used_inputs = [i for i, u in enumerate(used) if u]
        fn = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(sub, []))
        shape = tuple(cast(ShapedArray, jaxpr.invars[first_in + j].aval).shape)

        def at(count: int, fn: Any = fn, shape: tuple[int, ...] = shape) -> np.ndarray:
            # The concrete submesh in context: an update that runs a scan (the
            # streams of stacked layers) is compiled, and needs its devices.
            on_devices = concrete_mesh(submesh) if submesh is not None else contextlib.nullcontext()
            with on_devices, jax.ensure_compile_time_eval():
                return np.asarray(fn(_concrete_count(count, shape, submesh))[0], np.int64)

        # A new value that does not read the counter (a constant) is never a shift.
        k = at(0) if used_inputs == [first_in + j] else None
        if k is None or np.any(at(1000) != (1000 + k) % (1 << 32)):
            raise CompileError(
                f"the RNG counter {paths[j]} is changed in a way other than drawing keys (its "
                "new value is not its old value plus the number of keys drawn). Pipelined "
                "microbatches derive each counter from the microbatch index; do not assign "
                "RNG counters inside the loss function."
            )
        increments[j] = int(k) if k.ndim == 0 else k  # one K per layer of a stack
    return increments


def _derive_counts(
    closed: Any,
    increments: dict[int, int],
    first_in: int,
    first_out: int,
    in_avals: list[Any],
    index_aval: Any,
) -> Any:
    """The body with each RNG counter read as ``count0 + index * K`` and left unchanged.

    The new body takes one more input, the microbatch index (a ``[1]`` uint32
    array, one per microbatch), and returns each counter's input as its new
    value: stages that draw from one stream need no value from each other, so
    they pipeline; the counters advance by ``m * K`` after the region.
    """
    jaxpr = convert_constvars_jaxpr(closed.jaxpr)
    consts = list(closed.consts)
    run = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(jaxpr, []))

    def body(const_vals: list[Any], args: list[Any], index: Any) -> list[Any]:
        args = list(args)
        inputs = list(args)
        for j, k in increments.items():
            count = args[first_in + j]
            args[first_in + j] = count + index[0].astype(count.dtype) * jnp.asarray(k, count.dtype)
        outs = list(run(*const_vals, *args))
        for j in increments:
            outs[first_out + j] = inputs[first_in + j]
        return outs

    const_avals = [jax.ShapeDtypeStruct(jnp.shape(c), jnp.result_type(c)) for c in consts]
    derived = jax.make_jaxpr(body)(const_avals, in_avals, index_aval)
    return derived, consts
