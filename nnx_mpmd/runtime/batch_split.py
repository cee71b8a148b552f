"""Splitting a one-device batch into microbatches on a submesh, without ``jax.device_put``.

A step's batch input moves to the meshes that read it reshaped ``[B, ...] ->
[m, B/m, ...]`` and sharded like the microbatches the stages were traced with
(a batch `Transfer` with ``reshape_microbatches``). When the batch is a
``jax.Array`` on one device (``jnp.asarray(batch)``, the usual way a batch
reaches a step), ``jax.device_put`` of the reshaped array slices it into the
destination's shards in Python: ~120 µs per leaf on CPU, the largest single
cost of an overhead-bound step's host work (two leaves were 30% of the tiny
GPT's no-op replay).

`MicrobatchSplitter` does the same move as one cached jitted program on the
batch's device (the reshape and every destination shard's slice), one batched
copy of the slices to their devices, and
``jax.make_array_from_single_device_arrays``: ~35 µs. The result is the array
``jax.device_put(batch.reshape(m, B // m, ...), target)`` gives: same values,
dtype, shape and sharding.

Anything else (host values, arrays on several devices or processes, weakly
typed or extended-dtype arrays, a jaxlib without the batched copy) is not
split here: `MicrobatchSplitter.split` returns None and the caller uses
``jax.device_put``. Which case a batch is is decided once per (sharding,
shape, dtype, m, target) and cached for the process, so the split program
compiles once per kind of batch however many steps are prepared.

Example:
  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[2:4])
  >>> target = NamedSharding(mesh, P(None, "data"))
  >>> batch = jnp.arange(16).reshape(8, 2)
  >>> split = MicrobatchSplitter().split(batch, 4, target)
  >>> expected = jax.device_put(batch.reshape(4, 2, 2), target)
  >>> split.sharding == expected.sharding, bool((split == expected).all())
  (True, True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, SingleDeviceSharding

from nnx_mpmd._jax_compat import FAST_COPY_AVAILABLE, batched_copy, sharding_device_list
from nnx_mpmd.compiler.codegen import compile_program

__all__ = ["MicrobatchSplitter", "microbatched_shape"]


def microbatched_shape(shape: tuple[int, ...], m: int) -> tuple[int, ...]:
    """``[B, ...]`` as ``[m, B // m, ...]``.

    Example:
      >>> microbatched_shape((8, 3), 4)
      (4, 2, 3)
    """
    return (m, shape[0] // m, *shape[1:])


class _SplitPlan(NamedTuple):
    """How one kind of batch is split: the program, where its results go, the result's type."""

    program: Callable[[Any], Any]
    device_lists: list[Any]
    shardings: list[SingleDeviceSharding]
    shape: tuple[int, ...]
    target: NamedSharding


#: Split plans by (sharding, shape, dtype, weak type, m, target); None where declined.
_PLANS: dict[tuple[Any, ...], _SplitPlan | None] = {}
#: Compiled split programs by (microbatched shape, shard slices, batch sharding, dtype).
_PROGRAMS: dict[tuple[Any, ...], Callable[[Any], Any]] = {}


class MicrobatchSplitter:
    """Splits one-device batches into microbatches on a submesh (see the module docstring).

    Example:
      >>> import numpy as np
      >>> MicrobatchSplitter().split(np.zeros((4, 2)), 2, None) is None  # a host value
      True
    """

    def __init__(self) -> None:
        # Shared by every splitter of the process: a step prepared again (another
        # sharding cache, a replay) reuses the compiled split programs.
        self._plans = _PLANS

    def split(self, value: Any, m: int, target: Any) -> jax.Array | None:
        """``value`` ``[B, ...]`` as ``m`` microbatches placed with ``target``, or None.

        None tells the caller to use ``jax.device_put``.
        """
        if not isinstance(value, jax.Array):
            return None
        # A PRNG key array has no ``weak_type``; its extended dtype declines it in `_splittable`.
        weak = getattr(value, "weak_type", None)
        key = (value.sharding, value.shape, value.dtype, weak, m, target)
        try:
            plan = self._plans[key]
        except KeyError:
            plan = self._plans[key] = _plan(value, m, target)
        if plan is None:
            return None
        moved = batched_copy(plan.program(value), plan.device_lists, plan.shardings)
        return jax.make_array_from_single_device_arrays(plan.shape, plan.target, moved)


def _plan(value: jax.Array, m: int, target: Any) -> _SplitPlan | None:
    """The split of batches like ``value``, or None where this path does not apply."""
    if not _splittable(value, m, target):
        return None
    shape = microbatched_shape(value.shape, m)
    indices = target.addressable_devices_indices_map(shape)
    slices = tuple(indices.values())
    shardings = [SingleDeviceSharding(d) for d in indices]
    return _SplitPlan(
        _split_program(value, shape, slices),
        [sharding_device_list(s) for s in shardings],
        shardings,
        shape,
        target,
    )


def _split_program(
    value: jax.Array, shape: tuple[int, ...], slices: tuple[Any, ...]
) -> Callable[[Any], Any]:
    """The compiled split of batches like ``value`` into ``shape``'s shards ``slices``.

    One per (shape, slices, the batch's sharding and dtype): batches that differ
    only in their destination mesh (inputs and labels going to the first and the
    last stage) share it, so it compiles once for them. It compiles like
    nnx_mpmd's other programs (`compile_program`).
    """
    key = (
        shape,
        tuple(tuple((s.start, s.stop, s.step) for s in index) for index in slices),
        value.sharding,
        value.dtype,
    )
    program = _PROGRAMS.get(key)
    if program is None:

        def microbatch_split(batch: jax.Array) -> list[jax.Array]:
            microbatches = batch.reshape(shape)
            return [microbatches[index] for index in slices]

        program = _PROGRAMS[key] = compile_program(jax.jit(microbatch_split).lower(value))
    return program


def _splittable(value: jax.Array, m: int, target: Any) -> bool:
    """A fully addressable one-device array of a plain dtype, going to a local NamedSharding."""
    return (
        FAST_COPY_AVAILABLE
        and isinstance(target, NamedSharding)
        and target.is_fully_addressable
        and value.is_fully_addressable
        and len(value.sharding.device_set) == 1
        and getattr(value, "weak_type", None) is False
        and not jnp.issubdtype(value.dtype, jax.dtypes.extended)
        and value.ndim >= 1
        and m > 0
        and value.shape[0] % m == 0
    )
