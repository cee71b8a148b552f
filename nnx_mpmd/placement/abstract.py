"""Abstract placed values: a leaf's shape, dtype and where it lives, without its data.

The compiler works on these, not on arrays, so that ``lower()`` can compile a
step for state that is not placed yet (where `place` *would* put it) without
moving anything, like ``jax.jit(f).lower(...)`` on ``jax.ShapeDtypeStruct``s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from nnx_mpmd.errors import PlacementError
from nnx_mpmd.placement.mesh import MpmdMesh
from nnx_mpmd.placement.mpmd_array import MpmdArray, normalize_spec
from nnx_mpmd.placement.place import placement_decisions
from nnx_mpmd.placement.process_batch import MicrobatchedArray

__all__ = ["PlacedAval", "placed_aval", "planned_avals"]


@dataclasses.dataclass(frozen=True)
class PlacedAval:
    """A leaf's type and placement: ``shardings`` holds ``(mesh id, sharding)`` pairs.

    No pairs means the value is on the host (a NumPy array, a Python number) or
    on no single submesh.

    Example:
      >>> import jax
      >>> mesh = MpmdMesh(jax.make_mesh((2, 4), ("stage", "data")), "stage")
      >>> aval = placed_aval(jax.device_put(jax.numpy.ones(8), mesh.submesh(1).devices.flat[0]), mesh)
      >>> aval.mesh_ids, aval.shape
      ((), (8,))
    """

    shape: tuple[int, ...]
    dtype: Any
    shardings: tuple[tuple[int, Any], ...] = ()
    weak_type: bool = False

    @property
    def mesh_ids(self) -> tuple[int, ...]:
        """The meshes holding a copy (empty: host)."""
        return tuple(q for q, _ in self.shardings)

    def sharding(self, mesh_id: int) -> Any:
        """The sharding of the copy on ``mesh_id``."""
        return dict(self.shardings)[mesh_id]

    def on(self, mesh_id: int) -> jax.ShapeDtypeStruct:
        """The copy on ``mesh_id`` as a ``jax.ShapeDtypeStruct`` with its sharding."""
        return jax.ShapeDtypeStruct(
            self.shape, self.dtype, sharding=self.sharding(mesh_id), weak_type=self.weak_type
        )

    @property
    def aval(self) -> jax.ShapeDtypeStruct:
        """Shape and dtype only, without a placement."""
        return jax.ShapeDtypeStruct(self.shape, self.dtype, weak_type=self.weak_type)

    def traced_on(self, abstract_mesh: AbstractMesh) -> jax.ShapeDtypeStruct:
        """The value typed on the submeshes' abstract mesh, with its placement's sharding.

        So on Explicit axes an op mixing it with a computed value types as under ``nnx.jit``.

        Example:
          >>> import jax, numpy as np
          >>> mesh = MpmdMesh(jax.make_mesh((2, 4), ("stage", "data")), "stage")
          >>> aval = placed_aval(np.zeros((8, 3), np.float32), mesh)
          >>> aval.traced_on(mesh.submesh(0).abstract_mesh).sharding.spec
          P()
        """
        spec = PartitionSpec()
        for _, sharding in self.shardings:
            if isinstance(sharding, NamedSharding) and (
                sharding.mesh.axis_names == abstract_mesh.axis_names
            ):
                spec = normalize_spec(sharding.spec)
                break
        return jax.ShapeDtypeStruct(
            self.shape,
            self.dtype,
            sharding=NamedSharding(abstract_mesh, spec),
            weak_type=self.weak_type,
        )

    def key(self) -> tuple[Any, ...]:
        """A hashable signature (P() and P(None) count as the same layout).

        Computed once per object (the object is frozen); `placed_aval` hands out
        one object per placement, so a step's signature reuses them.
        """
        key = self.__dict__.get("_key")
        if key is None:
            key = (
                "placed",
                self.shape,
                str(self.dtype),
                self.weak_type,
                tuple((q, _sharding_key(s)) for q, s in self.shardings),
            )
            self.__dict__["_key"] = key  # a cache, not a field: equality ignores it
        return key


def _sharding_key(sharding: Any) -> Any:
    if isinstance(sharding, NamedSharding):
        return (sharding.mesh, normalize_spec(sharding.spec), sharding.memory_kind)
    return sharding


def placed_aval(x: Any, mesh: MpmdMesh) -> PlacedAval:
    """Where ``x`` lives now, as a `PlacedAval` (an array on no single submesh counts as host).

    Example:
      >>> import jax, numpy as np
      >>> mesh = MpmdMesh(jax.make_mesh((2, 4), ("stage", "data")), "stage")
      >>> placed_aval(np.zeros((2, 3), np.float32), mesh).shape
      (2, 3)
    """
    if isinstance(x, MpmdArray):
        pairs = tuple((q, x.array(q).sharding) for q in x.mesh_ids)
        return PlacedAval(tuple(x.shape), x.dtype, pairs)
    if isinstance(x, jax.Array):
        try:
            sharding = x.sharding
        except Exception:  # a deleted or abstract array: no cache, as before
            sharding = None
        weak = bool(getattr(x, "weak_type", False))
        if sharding is None:
            q = mesh.mesh_id_of(x)
            return PlacedAval(
                tuple(x.shape), x.dtype, () if q is None else ((q, x.sharding),), weak
            )
        cache = _avals_on(mesh)
        key = (x.shape, x.dtype, sharding, weak)
        aval = cache.get(key)
        if aval is None:
            if len(cache) >= _MAX_CACHED_AVALS:
                cache.clear()
            q = mesh.mesh_id_of(x)
            pairs = () if q is None else ((q, sharding),)
            aval = cache[key] = PlacedAval(tuple(x.shape), x.dtype, pairs, weak)
        return aval
    if isinstance(x, MicrobatchedArray):  # compiled like the host batch it stands for
        return PlacedAval(x.shape, x.dtype)
    # The runtime passes host values through np.asarray: never weakly typed.
    return PlacedAval(tuple(np.shape(x)), jnp.result_type(x))


# The PlacedAval of a jax.Array depends on its shape, dtype, sharding and weak type
# and on the MpmdMesh (which submesh the sharding's devices are): one object per
# placement, per mesh object. A mesh is held strongly while cached (its id cannot be
# reused by another mesh meanwhile); at most a few meshes and avals are kept.
_AVALS_BY_MESH: dict[int, tuple[MpmdMesh, dict[Any, PlacedAval]]] = {}
_MAX_MESHES = 8
_MAX_CACHED_AVALS = 4096


def _avals_on(mesh: MpmdMesh) -> dict[Any, PlacedAval]:
    entry = _AVALS_BY_MESH.get(id(mesh))
    if entry is None or entry[0] is not mesh:
        if len(_AVALS_BY_MESH) >= _MAX_MESHES:
            del _AVALS_BY_MESH[next(iter(_AVALS_BY_MESH))]
        entry = _AVALS_BY_MESH[id(mesh)] = (mesh, {})
    return entry[1]


def planned_avals(
    nodes: Sequence[Any], state_leaves: Sequence[Any], mesh: MpmdMesh, schedule: Any
) -> list[PlacedAval]:
    """One `PlacedAval` per state leaf of ``nodes``: where `place` would put it, moving nothing.

    A leaf `place` leaves alone keeps its current placement.

    Example:
      >>> import jax
      >>> from flax import nnx
      >>> from nnx_mpmd.annotate.stage import Stage
      >>> mesh = MpmdMesh(jax.make_mesh((2, 4), ("stage", "data")), "stage")
      >>> model = Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=1)
      >>> _, state = nnx.split((model,))
      >>> [a.mesh_ids for a in planned_avals((model,), jax.tree.leaves(state), mesh, None)]
      [(1,), (1,)]
    """
    decisions = {
        id(leaf): decision for _, _, leaf, _, decision in placement_decisions(nodes, mesh, schedule)
    }
    _, state = nnx.split(tuple(nodes))
    variables = jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    avals: list[PlacedAval] = []
    for variable in variables:
        leaves = jax.tree.leaves(variable)
        decision = decisions.get(id(variable))
        for leaf in leaves:
            if decision is None:
                avals.append(placed_aval(leaf, mesh))
                continue
            mesh_ids, spec = decision
            avals.append(_planned(leaf, mesh_ids, spec, mesh))
    if len(avals) != len(state_leaves):
        raise PlacementError(
            f"{len(state_leaves)} state leaves but {len(avals)} leaves under their Variables: "
            "cannot plan their placement; call mp.place(...) before lower()."
        )
    return avals


def _planned(
    leaf: Any, mesh_ids: tuple[int, ...], spec: PartitionSpec, mesh: MpmdMesh
) -> PlacedAval:
    """``leaf`` as `place` leaves it: on ``mesh_ids`` with ``spec``."""
    current = placed_aval(leaf, mesh)
    pairs = tuple((q, NamedSharding(mesh.submesh(q), spec)) for q in mesh_ids)
    # jax.device_put keeps a Python scalar weakly typed.
    weak = current.weak_type or (
        isinstance(leaf, int | float | complex) and not isinstance(leaf, bool)
    )
    return dataclasses.replace(current, shardings=pairs, weak_type=weak)
