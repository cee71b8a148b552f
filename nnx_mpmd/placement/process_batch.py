"""Batch leaves each process builds from only its own rows, already split into microbatches.

A pipelined step moves every batch leaf ``[B, ...]`` to the submesh of the
stage that reads it as ``[m, B/m, ...]`` (``m`` microbatches), each microbatch
sharded over the submesh's batch axis (``P(None, batch_axis)``) when that axis
divides it, else replicated (also where the step's code rejects a sharded batch). A device at position ``k`` of a batch axis of size
``d`` therefore holds rows ``k*b/d .. (k+1)*b/d`` of every microbatch
(``b = B/m``): not one contiguous block of the batch. So a leaf placed in
advance is placed in that microbatched form, and wrapped in a
`MicrobatchedArray`, which `nnx_mpmd.jit` treats as a batch leaf of shape
``[B, ...]`` (the same compiled step as a host batch) and uses as is when it
is already where the step puts it.

The step says where it puts each batch leaf (``step.batch_shardings(...)``,
`nnx_mpmd.jit`); `process_batch_rows` says which global rows of the batch a
process's devices hold there (none when it has no device on that submesh), and
`make_microbatched_array` builds the global array from just those rows with
``jax.make_array_from_process_local_data``.

Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import PartitionSpec as P
    >>> submesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[4:])
    >>> sharding = NamedSharding(submesh, P(None, "data"))  # 2 microbatches of 8 rows
    >>> rows = process_batch_rows(sharding, batch_size=16, num_microbatches=2)
    >>> rows.tolist() == list(range(16))  # one process holds every device
    True
    >>> leaf = make_microbatched_array(np.arange(16)[rows], sharding, 16, 2)
    >>> leaf.shape, leaf.array.shape
    ((16,), (2, 8))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from nnx_mpmd.errors import PlacementError

__all__ = [
    "MicrobatchedArray",
    "make_microbatched_array",
    "process_batch_rows",
    "take_microbatched",
]


class MicrobatchedArray:
    """A batch leaf already split into microbatches on the submesh that reads it.

    ``nnx_mpmd.jit`` sees it as a batch leaf of shape ``[B, ...]`` and dtype
    ``array.dtype`` (the step compiled for a host batch of that shape serves),
    and uses ``array`` as is when its sharding is the one the step gives that
    leaf. Build it with `make_microbatched_array`.

    Args:
      array: the global ``[m, B/m, ...]`` array on one submesh.

    Example:
      >>> import jax.numpy as jnp
      >>> MicrobatchedArray(jnp.zeros((2, 4, 3))).shape
      (8, 3)
    """

    def __init__(self, array: jax.Array) -> None:
        if not isinstance(array, jax.Array) or array.ndim < 2:
            raise PlacementError(
                f"MicrobatchedArray: expected a jax.Array [m, B/m, ...], got "
                f"{type(array).__name__} of shape {np.shape(array)}; build it with "
                "make_microbatched_array."
            )
        self.array = array

    @property
    def num_microbatches(self) -> int:
        """``m``: the leading axis of ``array``."""
        return int(self.array.shape[0])

    @property
    def shape(self) -> tuple[int, ...]:
        """The batch leaf's shape ``[B, ...]``."""
        m, b, *rest = self.array.shape
        return (m * b, *rest)

    @property
    def dtype(self) -> Any:
        """The leaf's dtype."""
        return self.array.dtype

    @property
    def ndim(self) -> int:
        """The leaf's number of dimensions."""
        return self.array.ndim - 1

    def __repr__(self) -> str:
        return (
            f"MicrobatchedArray(shape={self.shape}, dtype={self.dtype}, "
            f"microbatches={self.num_microbatches}, sharding={self.array.sharding})"
        )


def process_batch_rows(
    sharding: NamedSharding,
    batch_size: int,
    num_microbatches: int,
    *,
    process: int | None = None,
    process_of: Callable[[Any], int] | None = None,
) -> np.ndarray:
    """The sorted global rows of a ``[B]`` batch leaf that one process's devices hold.

    The step reads it as ``[m, B/m, ...]``; row ``i*B/m + j`` is held where slot ``j`` lies.

    Args:
      sharding: the step's sharding of the leaf (``step.batch_shardings(...)``).
      process_of: the process of a device (default ``device.process_index``; tests fake it).

    Raises:
      PlacementError: ``batch_size`` does not split into ``num_microbatches``.

    Example:
      >>> import jax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
      >>> sharding = NamedSharding(mesh, P(None, "data"))
      >>> owner = lambda d: d.id // 2  # devices 0, 1 on process 0; 2, 3 on process 1
      >>> process_batch_rows(sharding, 8, 2, process=1, process_of=owner).tolist()
      [2, 3, 6, 7]
    """
    if num_microbatches < 1 or batch_size % num_microbatches:
        raise PlacementError(
            f"batch size {batch_size} does not split into {num_microbatches} microbatches; "
            "use a batch size divisible by the number of microbatches."
        )
    per_microbatch = batch_size // num_microbatches
    me = jax.process_index() if process is None else process
    owner = process_of or (lambda d: int(d.process_index))
    holds = np.zeros(per_microbatch, bool)
    for device, index in sharding.devices_indices_map((num_microbatches, per_microbatch)).items():
        if owner(device) == me:
            holds[index[1]] = True
    slots = np.flatnonzero(holds)
    starts = np.arange(num_microbatches) * per_microbatch
    return (starts[:, None] + slots[None, :]).reshape(-1).astype(np.int64)


def make_microbatched_array(
    local_rows: Any,
    sharding: NamedSharding,
    batch_size: int,
    num_microbatches: int,
) -> MicrobatchedArray:
    """A batch leaf where the step reads it, built from this process's rows only.

    Args:
      local_rows: the rows `process_batch_rows` names for this process, in
        that order (``[len(rows), ...]``; none on a process without devices there).
      sharding: where the step reads the leaf (as in `process_batch_rows`).
      batch_size: ``B``.
      num_microbatches: ``m``, the step's microbatches.

    Returns:
      The `MicrobatchedArray` to pass to the step in place of the leaf.

    Raises:
      PlacementError: ``local_rows`` is not this process's share.

    Example:
      >>> import jax, numpy as np
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> sharding = NamedSharding(mesh, P(None, "data"))
      >>> leaf = make_microbatched_array(np.arange(8 * 3).reshape(8, 3), sharding, 8, 2)
      >>> leaf.shape, leaf.array.shape
      ((8, 3), (2, 4, 3))
    """
    rows = process_batch_rows(sharding, batch_size, num_microbatches)
    local = np.asarray(local_rows)
    given = local.shape[0] if local.ndim else 0
    if given != len(rows):
        raise PlacementError(
            f"make_microbatched_array: process {jax.process_index()} gave {given} rows for "
            f"{sharding}, but its devices hold {len(rows)} of the batch of {batch_size}; "
            "pass the rows process_batch_rows names, in its order."
        )
    per_microbatch = batch_size // num_microbatches
    global_shape = (num_microbatches, per_microbatch, *local.shape[1:])
    local = local.reshape(num_microbatches, len(rows) // num_microbatches, *local.shape[1:])
    if not sharding.addressable_devices:  # this process has no device there
        array = jax.make_array_from_single_device_arrays(
            global_shape, sharding, [], dtype=local.dtype
        )
    elif _contiguous(rows[: len(rows) // num_microbatches]):
        array = jax.make_array_from_process_local_data(sharding, local, global_shape)
    else:  # the process's devices are not neighbours along the axis: place slot by slot
        position = np.full(per_microbatch, -1)
        position[rows[: len(rows) // num_microbatches]] = np.arange(local.shape[1])

        def rows_at(index: Any) -> np.ndarray:  # index: a tuple of slices, one per dimension
            return local[index[0], position[index[1]]]

        array = jax.make_array_from_callback(global_shape, sharding, rows_at)
    return MicrobatchedArray(array)


def _contiguous(slots: np.ndarray) -> bool:
    return slots.size == 0 or int(slots[-1] - slots[0]) + 1 == slots.size


def take_microbatched(value: MicrobatchedArray, num_microbatches: int | None, target: Any) -> Any:
    """``value.array`` for a batch transfer to ``target``: used as is, never moved.

    Raises:
      PlacementError: not the step's batch split (read outside ``mp.value_and_grad``),
        or the leaf is elsewhere.

    Example:
      >>> import jax, numpy as np
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> leaf = make_microbatched_array(np.zeros(8), NamedSharding(mesh, P()), 8, 2)
      >>> take_microbatched(leaf, 2, leaf.array.sharding) is leaf.array
      True
    """
    if not num_microbatches:
        raise PlacementError(
            f"{value!r} is read outside mp.value_and_grad (the step moves it whole to "
            f"{target}); pass a NumPy or jax array for a batch leaf the step uses there."
        )
    array = value.array
    if value.num_microbatches != num_microbatches or not _same_sharding(array, target):
        raise PlacementError(
            f"{value!r} is not where the step reads it: the step splits it into "
            f"{num_microbatches} microbatches with sharding {target}. Build it with "
            "make_microbatched_array for the submesh of the stage that reads it, the "
            "step's num_microbatches and batch_axis, or pass the whole batch as a NumPy array."
        )
    return array


def _same_sharding(array: jax.Array, target: Any) -> bool:
    sharding = array.sharding
    return sharding == target or (
        isinstance(target, NamedSharding)
        and isinstance(sharding, NamedSharding)
        and sharding.mesh == target.mesh
        and sharding.is_equivalent_to(target, array.ndim)
    )
