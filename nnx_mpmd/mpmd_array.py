"""`MpmdArray`: one logical array with a copy on each of several submeshes.

A value that every mesh needs (an optimizer step count, a loss reported to all
meshes) lives as one ``jax.Array`` per submesh. `MpmdArray` bundles these copies:
it is a pytree *leaf* (not a pytree node), so it can be the value of an NNX
Variable and travel through ``nnx.split`` / ``nnx.merge`` / ``nnx.state`` as is.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from nnx_mpmd.mesh import MpmdMesh
    >>> mesh = MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
    >>> copies = {i: jax.device_put(jnp.zeros((4, 2)), NamedSharding(mesh.submesh(i), P("data")))
    ...           for i in (0, 3)}
    >>> MpmdArray(copies)
    MpmdArray(shape=(4, 2), dtype=float32, meshes=(0, 3), spec=P('data',))
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from nnx_mpmd.errors import PlacementError
from nnx_mpmd.mesh import MpmdMesh

__all__ = ["MpmdArray", "normalize_spec"]


def normalize_spec(spec: PartitionSpec | None) -> PartitionSpec | None:
    """Drops trailing ``None`` entries, so ``P('a', None)`` and ``P('a')`` compare equal.

    Args:
      spec: a PartitionSpec, or None.

    Returns:
      The spec without trailing ``None`` entries (None stays None).

    Example:
      >>> normalize_spec(PartitionSpec("data", None)) == PartitionSpec("data")
      True
    """
    if spec is None:
        return None
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def _spec_of(array: jax.Array) -> PartitionSpec | None:
    sharding = array.sharding
    return sharding.spec if isinstance(sharding, NamedSharding) else None


class MpmdArray:
    """A logical array that lives on a set of submeshes, one ``jax.Array`` per mesh.

    Args:
      arrays: ``{mesh_id: array}``; every array has the same shape, dtype and
        partition spec (each on its own submesh).
      mesh: optionally the `MpmdMesh`, to check that array ``i`` lies exactly on
        submesh ``i``.

    Raises:
      PlacementError: ``arrays`` is empty, a key is not a mesh index, a value is
        not a ``jax.Array``, the copies disagree in shape, dtype or spec, or (with
        ``mesh``) a copy is not on its submesh.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from nnx_mpmd.mesh import MpmdMesh
      >>> mesh = MpmdMesh(jax.make_mesh((8,), ("stage",)), "stage")
      >>> step = MpmdArray({i: jax.device_put(jnp.int32(5), mesh.devices(i)[0]) for i in range(8)})
      >>> step.mesh_ids, int(np.asarray(step))
      ((0, 1, 2, 3, 4, 5, 6, 7), 5)
    """

    def __init__(self, arrays: Mapping[int, jax.Array], *, mesh: MpmdMesh | None = None) -> None:
        if not isinstance(arrays, Mapping) or not arrays:
            raise PlacementError(
                f"MpmdArray needs a non-empty mapping {{mesh_id: jax.Array}}, got {arrays!r}; "
                "pass one array per submesh the value lives on."
            )
        checked: dict[int, jax.Array] = {}
        for mesh_id, array in arrays.items():
            if (
                isinstance(mesh_id, bool)
                or not isinstance(mesh_id, int | np.integer)
                or mesh_id < 0
            ):
                raise PlacementError(
                    f"MpmdArray key {mesh_id!r} is not a submesh index; use ints >= 0."
                )
            if not isinstance(array, jax.Array):
                raise PlacementError(
                    f"MpmdArray value for mesh {mesh_id} is a {type(array).__name__}, not a "
                    "jax.Array; jax.device_put it onto the submesh first."
                )
            checked[int(mesh_id)] = array
        self._mesh_ids = tuple(sorted(checked))
        self._arrays = types.MappingProxyType({i: checked[i] for i in self._mesh_ids})
        first = self._arrays[self._mesh_ids[0]]
        for mesh_id, array in self._arrays.items():
            if array.shape != first.shape or array.dtype != first.dtype:
                raise PlacementError(
                    f"MpmdArray copies disagree: mesh {self._mesh_ids[0]} has "
                    f"{first.dtype}{list(first.shape)} but mesh {mesh_id} has "
                    f"{array.dtype}{list(array.shape)}; all copies must have one shape and dtype."
                )
            if normalize_spec(_spec_of(array)) != normalize_spec(_spec_of(first)):
                raise PlacementError(
                    f"MpmdArray copies disagree: mesh {self._mesh_ids[0]} has spec "
                    f"{_spec_of(first)} but mesh {mesh_id} has {_spec_of(array)}; shard every "
                    "copy with the same PartitionSpec."
                )
            if mesh is not None and mesh.mesh_id_of(array) != mesh_id:
                raise PlacementError(
                    f"MpmdArray copy for mesh {mesh_id} lies on devices "
                    f"{sorted(d.id for d in array.sharding.device_set)}, not on submesh "
                    f"{mesh_id} of {mesh!r}; device_put it onto mesh.submesh({mesh_id})."
                )

    @property
    def mesh_ids(self) -> tuple[int, ...]:
        """The submeshes holding a copy, sorted."""
        return self._mesh_ids

    @property
    def arrays(self) -> Mapping[int, jax.Array]:
        """A read-only mapping ``{mesh_id: jax.Array}``."""
        return self._arrays

    def array(self, mesh_id: int) -> jax.Array:
        """The copy on submesh ``mesh_id``.

        Args:
          mesh_id: one of `mesh_ids`.

        Returns:
          The ``jax.Array`` on that submesh.

        Raises:
          PlacementError: there is no copy on ``mesh_id``.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> a = MpmdArray({1: jax.device_put(jnp.ones(2), jax.devices()[1])})
          >>> a.array(1).shape
          (2,)
        """
        try:
            return self._arrays[mesh_id]
        except (KeyError, TypeError):
            raise PlacementError(
                f"{self!r} has no copy on mesh {mesh_id!r}; it lives on meshes "
                f"{self._mesh_ids}. Transfer it there or read one of those."
            ) from None

    @property
    def _first(self) -> jax.Array:
        return self._arrays[self._mesh_ids[0]]

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape (the same on every mesh)."""
        return tuple(self._first.shape)

    @property
    def dtype(self) -> Any:
        """The dtype (the same on every mesh)."""
        return self._first.dtype

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return self._first.ndim

    @property
    def size(self) -> int:
        """The number of elements."""
        return int(self._first.size)

    @property
    def nbytes(self) -> int:
        """Bytes of one logical copy."""
        return int(self._first.nbytes)

    @property
    def sharding(self) -> jax.sharding.Sharding:
        """The sharding of the lowest mesh's copy."""
        return self._first.sharding

    @property
    def spec(self) -> PartitionSpec | None:
        """The PartitionSpec inside each submesh (None if not a NamedSharding)."""
        return _spec_of(self._first)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        del copy  # np.asarray of a jax.Array always copies to host
        return np.asarray(self._first, dtype=dtype)

    def block_until_ready(self) -> MpmdArray:
        """Waits until every copy is computed.

        Returns:
          ``self``.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> a = MpmdArray({0: jnp.ones(2)})
          >>> a.block_until_ready() is a
          True
        """
        for array in self._arrays.values():
            array.block_until_ready()
        return self

    def delete(self) -> None:
        """Frees every copy's device memory.

        Example:
          >>> import jax.numpy as jnp
          >>> a = MpmdArray({0: jnp.ones(2)})
          >>> a.delete(); a.is_deleted()
          True
        """
        for array in self._arrays.values():
            if not array.is_deleted():
                array.delete()

    def is_deleted(self) -> bool:
        """Whether every copy has been deleted.

        Returns:
          True when all copies were deleted.

        Example:
          >>> import jax.numpy as jnp
          >>> MpmdArray({0: jnp.ones(2)}).is_deleted()
          False
        """
        return all(array.is_deleted() for array in self._arrays.values())

    def __repr__(self) -> str:
        spec = self.spec
        spec_text = repr(spec)
        if spec_text.startswith("PartitionSpec("):  # older jax spells it out
            spec_text = "P" + spec_text[len("PartitionSpec") :]
        return (
            f"MpmdArray(shape={self.shape}, dtype={self.dtype}, meshes={self._mesh_ids}, "
            f"spec={spec_text})"
        )
