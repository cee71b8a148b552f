"""`MpmdMesh`: one jax Mesh whose ``mpmd_axis`` enumerates the pipeline submeshes.

A pipeline with ``n`` meshes is described by an ordinary jax Mesh with one axis of
size ``n`` (the *mpmd axis*). Slicing the Mesh's device array along that axis
gives ``n`` submeshes; each keeps the other axes, with their names and axis types
(Explicit or Auto), for sharding inside a stage.

Example:
    >>> import jax
    >>> from nnx_mpmd.placement.mesh import MpmdMesh
    >>> mesh = MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
    >>> mesh.num_meshes, mesh.axis_names
    (4, ('data',))
    >>> [d.id for d in mesh.devices(1)]
    [2, 3]
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, cast

import jax
import numpy as np
from jax.sharding import Mesh, Sharding

from nnx_mpmd.errors import MeshError

__all__ = ["MpmdMesh", "mesh_shape_key"]


def mesh_shape_key(mesh: Any) -> tuple[tuple[Any, ...], ...]:
    """``(axis names, axis sizes, axis types)`` of a mesh: equal for equal-shaped submeshes.

    Example:
      >>> import jax
      >>> a = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> b = jax.make_mesh((2,), ("data",), devices=jax.devices()[2:4])
      >>> mesh_shape_key(a) == mesh_shape_key(b)
      True
    """
    return (tuple(mesh.axis_names), tuple(mesh.axis_sizes), tuple(mesh.axis_types))


def _device_ids(devices: Iterable[Any]) -> frozenset[int]:
    return frozenset(int(d.id) for d in devices)


class MpmdMesh:
    """A jax Mesh split into pipeline submeshes along one named axis.

    Args:
      jax_mesh: a concrete ``jax.sharding.Mesh`` (Explicit or Auto axis types).
      mpmd_axis: the name of the axis that enumerates the submeshes.

    Raises:
      MeshError: ``jax_mesh`` is not a concrete Mesh, or it has no axis named
        ``mpmd_axis``.

    Example:
      >>> import jax
      >>> mesh = MpmdMesh(jax.make_mesh((8,), ("stage",)), "stage")
      >>> mesh.num_meshes, mesh.submesh(3).axis_names
      (8, ())
      >>> mesh.mesh_id_of(mesh.submesh(3).devices.flat)
      3
    """

    def __init__(self, jax_mesh: Mesh, mpmd_axis: str) -> None:
        if not isinstance(jax_mesh, Mesh):
            raise MeshError(
                f"MpmdMesh expects a concrete jax.sharding.Mesh, got {type(jax_mesh).__name__}; "
                "build one with jax.make_mesh(shape, axis_names), e.g. "
                'jax.make_mesh((4, 2), ("stage", "data")).'
            )
        if not isinstance(mpmd_axis, str) or mpmd_axis not in jax_mesh.axis_names:
            raise MeshError(
                f"mesh {dict(jax_mesh.shape)} has no axis named {mpmd_axis!r}; its axes are "
                f"{tuple(jax_mesh.axis_names)}. Pass one of them as mpmd_axis, or add an "
                "axis that enumerates the pipeline submeshes."
            )
        self._jax_mesh = jax_mesh
        self._mpmd_axis = mpmd_axis
        self._axis_index = tuple(jax_mesh.axis_names).index(mpmd_axis)
        kept = [i for i in range(len(jax_mesh.axis_names)) if i != self._axis_index]
        self._axis_names = tuple(jax_mesh.axis_names[i] for i in kept)
        self._axis_types = tuple(jax_mesh.axis_types[i] for i in kept)
        # Each submesh keeps the user's axis types: Explicit stays Explicit (reshard and
        # out_sharding= inside a stage), Auto stays Auto (with_sharding_constraint).
        submeshes = []
        for index in range(jax_mesh.shape[mpmd_axis]):
            devices = np.take(jax_mesh.devices, index, axis=self._axis_index)
            submeshes.append(
                Mesh(np.asarray(devices), self._axis_names, axis_types=self._axis_types)
            )
        self._submeshes = tuple(submeshes)
        self._mesh_by_devices = {
            _device_ids(sub.devices.flat): i for i, sub in enumerate(self._submeshes)
        }
        # A NamedSharding over a submesh itself: found without comparing devices.
        self._mesh_by_submesh = {sub: i for i, sub in enumerate(self._submeshes)}

    @property
    def jax_mesh(self) -> Mesh:
        """The whole jax Mesh, including the mpmd axis."""
        return self._jax_mesh

    @property
    def mpmd_axis(self) -> str:
        """The name of the axis that enumerates the submeshes."""
        return self._mpmd_axis

    @property
    def axis_names(self) -> tuple[str, ...]:
        """Axis names of every submesh (the mesh's axes without the mpmd axis)."""
        return self._axis_names

    @property
    def axis_types(self) -> tuple[Any, ...]:
        """Axis types of the submesh axes (in `axis_names` order), as the user's mesh has them."""
        return self._axis_types

    @property
    def num_meshes(self) -> int:
        """How many submeshes (the size of the mpmd axis)."""
        return len(self._submeshes)

    @property
    def submeshes(self) -> tuple[Mesh, ...]:
        """The submeshes, one jax Mesh per mpmd index (stage code traces on their abstract mesh)."""
        return self._submeshes

    def check_submesh_axis(self, name: Any, *, argument: str, fix: str = "") -> str:
        """Checks that ``name`` is an axis of every submesh (not the mpmd axis).

        The mpmd axis does not exist inside a stage; other unknown names would be ignored silently.

        Args:
          name: the axis name the user gave.
          argument: how the user gave it, for the message (e.g.
            ``"mp.jit(batch_axis=...)"``).
          fix: an extra way to fix it, appended to the message (e.g. ``"or
            batch_axis=None to replicate the batch"``).

        Returns:
          ``name``.

        Raises:
          MeshError: ``name`` is not a str, is the mpmd axis, or is not an axis
            of the submeshes. The message lists the submesh axes.

        Example:
          >>> import jax
          >>> mesh = MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
          >>> mesh.check_submesh_axis("data", argument="batch_axis")
          'data'
          >>> try:
          ...     mesh.check_submesh_axis("dp", argument="batch_axis")
          ... except MeshError as e:
          ...     print(str(e).split(" of MpmdMesh")[0])
          batch_axis='dp' is not an axis of the submeshes
        """
        axes = self._axis_names
        choices = (
            f"pass one of the submesh axes {axes}"
            if axes
            else "the submeshes have no axes (the mesh has no axis besides the mpmd axis); "
            "add one to shard inside a stage, e.g. jax.make_mesh((n, d), "
            f"({self._mpmd_axis!r}, 'data'))"
        )
        how = f"{choices}{', ' + fix if fix else ''}."
        if not isinstance(name, str):
            raise MeshError(f"{argument}={name!r} must be one mesh axis name (a str); {how}")
        if name == self._mpmd_axis:
            raise MeshError(
                f"{argument}={name!r} names the mpmd axis of {self!r}, which enumerates the "
                f"pipeline submeshes and does not exist inside a stage; {how}"
            )
        if name not in axes:
            raise MeshError(
                f"{argument}={name!r} is not an axis of the submeshes of {self!r}; {how}"
            )
        return name

    def _check_index(self, mesh_id: int) -> int:
        if (
            isinstance(mesh_id, bool)
            or not isinstance(mesh_id, int | np.integer)
            or not 0 <= mesh_id < self.num_meshes
        ):
            raise MeshError(
                f"submesh index {mesh_id!r} is out of range for {self!r}; use an int in "
                f"[0, {self.num_meshes})."
            )
        return int(mesh_id)

    def submesh(self, mesh_id: int) -> Mesh:
        """The jax Mesh of submesh ``mesh_id``.

        Args:
          mesh_id: an index in ``[0, num_meshes)``.

        Returns:
          The submesh, with the non-mpmd axes of the whole mesh.

        Example:
          >>> import jax
          >>> mesh = MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
          >>> mesh.submesh(0).shape
          OrderedDict([('data', 2)])
        """
        return self._submeshes[self._check_index(mesh_id)]

    def devices(self, mesh_id: int) -> list[Any]:
        """The devices of submesh ``mesh_id`` as a flat list.

        Args:
          mesh_id: an index in ``[0, num_meshes)``.

        Returns:
          The devices in the submesh's row-major order.

        Example:
          >>> import jax
          >>> mesh = MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
          >>> [d.id for d in mesh.devices(3)]
          [6, 7]
        """
        return list(self.submesh(mesh_id).devices.flat)

    def mesh_id_of(self, x: Any) -> int | None:
        """Which submesh ``x`` lives on exactly.

        Args:
          x: a ``jax.Array``, a ``Sharding``, or an iterable of devices.

        Returns:
          The submesh index whose device set equals the devices of ``x``, or None
          when no single submesh has exactly those devices.

        Example:
          >>> import jax
          >>> mesh = MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
          >>> mesh.mesh_id_of(jax.devices()[4:6]), mesh.mesh_id_of(jax.devices()[:1])
          (2, None)
        """
        found = self._submesh_of_sharding(x)
        if found is not None:
            return found
        if isinstance(x, jax.Array):
            try:
                devices = x.sharding.device_set
            except Exception:  # a deleted or abstract array has no devices
                return None
        elif isinstance(x, Sharding):
            devices = x.device_set
        else:
            try:
                devices = list(x)
            except TypeError:
                return None
            if not all(hasattr(d, "id") for d in devices):
                return None
        return self._mesh_by_devices.get(_device_ids(devices))

    def _submesh_of_sharding(self, x: Any) -> int | None:
        try:
            sharding = cast(Any, x.sharding if isinstance(x, jax.Array) else x)
            return self._mesh_by_submesh.get(sharding.mesh)
        except Exception:  # no sharding, a deleted array, or an unhashable mesh
            return None

    def process_indices(self, mesh_id: int) -> set[int]:
        """The indices of the processes that own the devices of submesh ``mesh_id``.

        Args:
          mesh_id: an index in ``[0, num_meshes)``.

        Returns:
          A set of ``jax.process_index()`` values.

        Example:
          >>> import jax
          >>> mesh = MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
          >>> mesh.process_indices(0)
          {0}
        """
        return {int(d.process_index) for d in self.devices(mesh_id)}

    @functools.cached_property
    def local_mesh_ids(self) -> tuple[int, ...]:
        """Submeshes all of whose devices are addressable by this process."""
        me = jax.process_index()
        return tuple(
            i for i in range(self.num_meshes) if all(d.process_index == me for d in self.devices(i))
        )

    @property
    def is_multi_process(self) -> bool:
        """Whether the mesh's devices belong to more than one process."""
        return len({d.process_index for d in self._jax_mesh.devices.flat}) > 1

    def _key(self) -> tuple[Any, ...]:
        devices = self._jax_mesh.devices
        return (
            devices.shape,
            tuple(int(d.id) for d in devices.flat),
            tuple(self._jax_mesh.axis_names),
            tuple(str(t) for t in self._jax_mesh.axis_types),
            self._mpmd_axis,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MpmdMesh):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        inner = ", ".join(
            f"{name!r}: {size}"
            for name, size in zip(self._axis_names, self._submeshes[0].devices.shape)
        )
        types = sorted({str(t).split(".")[-1] for t in self._jax_mesh.axis_types})
        devices = [[int(d.id) for d in sub.devices.flat] for sub in self._submeshes]
        return (
            f"MpmdMesh({self._mpmd_axis!r}: {self.num_meshes}, submesh=({inner}), "
            f"axis_types={'/'.join(types)}, devices={devices})"
        )
