"""`MpmdArray`: one logical array with a copy on each of several submeshes.

A value that every mesh needs (an optimizer step count, a loss reported to all
meshes) lives as one ``jax.Array`` per submesh. `MpmdArray` bundles these copies:
it is a pytree *leaf* (not a pytree node), so it can be the value of an NNX
Variable and travel through ``nnx.split`` / ``nnx.merge`` / ``nnx.state`` as is.

An `MpmdArray` reads like the ``jax.Array`` it stands for: ``float(loss)``,
``int(step)``, ``np.asarray(x)``, ``f"{loss:.3f}"``, ``x[0]``, ``x + 1`` and
``x < y`` give what the same operations on one copy give. Reads to the host
check that every copy this process holds has the same value (a wrong number is
never returned); arithmetic and indexing run on one copy and return a
``jax.Array``.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from nnx_mpmd.placement.mesh import MpmdMesh
    >>> mesh = MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
    >>> copies = {i: jax.device_put(jnp.zeros((4, 2)), NamedSharding(mesh.submesh(i), P("data")))
    ...           for i in (0, 3)}
    >>> MpmdArray(copies)
    MpmdArray(shape=(4, 2), dtype=float32, meshes=(0, 3), spec=P('data',))
"""

from __future__ import annotations

import contextlib
import operator
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast, overload

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_mpmd.errors import PlacementError
from nnx_mpmd.placement.mesh import MpmdMesh

__all__ = ["MpmdArray", "normalize_spec"]


@overload
def normalize_spec(spec: PartitionSpec) -> PartitionSpec: ...
@overload
def normalize_spec(spec: None) -> None: ...
def normalize_spec(spec: PartitionSpec | None) -> PartitionSpec | None:
    """Drops trailing ``None`` entries, so ``P('a', None)`` and ``P('a')`` compare equal.

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
      >>> from nnx_mpmd.placement.mesh import MpmdMesh
      >>> mesh = MpmdMesh(jax.make_mesh((8,), ("stage",)), "stage")
      >>> step = MpmdArray({i: jax.device_put(jnp.int32(5), mesh.devices(i)[0]) for i in range(8)})
      >>> step.mesh_ids, int(np.asarray(step))
      ((0, 1, 2, 3, 4, 5, 6, 7), 5)

      It reads like the ``jax.Array`` it stands for (host reads check that the
      copies agree; arithmetic returns a ``jax.Array``):

      >>> int(step), f"{step / 2:.2f}", step + 1, step[...] == 5
      (5, '2.50', Array(6, dtype=int32), Array(True, dtype=bool))
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

    # ------------------------------------------------------------------ reading
    # An MpmdArray reads like the jax.Array it stands for. Host reads (int, float,
    # np.asarray, format, ...) check that the copies agree; device operations
    # (indexing, arithmetic, comparison) run on one copy and return a jax.Array.

    __array_priority__ = 100  # like jax.Array: numpy defers `ndarray + x` to x.__radd__
    __hash__: Callable[[object], int] = object.__hash__  # by identity (caches key on it)

    def _readable_copies(self, what: str) -> list[tuple[int, jax.Array]]:
        """``(mesh_id, copy)`` for each copy this process can read, lowest mesh first.

        Raises:
          PlacementError: no copy is fully addressable by this process.
        """
        copies = [(q, self._arrays[q]) for q in self._mesh_ids if _is_readable(self._arrays[q])]
        if not copies:
            raise PlacementError(
                f"cannot {what} {self!r}: this process holds no complete copy of it (its "
                f"copies on meshes {self._mesh_ids} live on other processes' devices). "
                "Bring it here first with mp.gather(...) (mp.distributed.gather: in a "
                "multi-process run a collective, so call it on every process with the same "
                "tree), or read it on a process that owns one of those meshes."
            )
        return copies

    def _checked_copy(self, what: str) -> jax.Array:
        """The lowest readable copy, after checking every readable copy holds its value."""
        copies = self._readable_copies(what)
        first_mesh, first = copies[0]
        if len(copies) > 1:
            reference = np.asarray(first)
            for mesh_id, other in copies[1:]:
                values = np.asarray(other)
                if not _same_values(reference, values):
                    raise PlacementError(
                        f"cannot {what} {self!r}: its copies disagree (mesh {first_mesh} holds "
                        f"{_preview(reference)}, mesh {mesh_id} holds {_preview(values)}), so "
                        "it has no single value. Read one copy explicitly with "
                        "x.array(mesh_id), or mp.gather(...) the state (which keeps the lowest "
                        "mesh's copy). Copies of one value should never differ: please report "
                        "this."
                    )
        return first

    def _copy_near(self, other: Any) -> jax.Array:
        """A readable copy for a device operation with ``other``.

        The copy on the devices of ``other`` when ``other`` is a concrete jax.Array
        and one exists (so JAX sees one device set), else the lowest readable copy.
        """
        copies = [copy for _, copy in self._readable_copies("compute with")]
        if isinstance(other, jax.Array) and not isinstance(other, jax.core.Tracer):
            devices = other.sharding.device_set
            for copy in copies:
                if copy.sharding.device_set == devices:
                    return copy
        return copies[0]

    def _operands(self, other: Any) -> tuple[jax.Array, Any]:
        if isinstance(other, MpmdArray):
            mine = dict(self._readable_copies("compute with"))
            theirs = dict(other._readable_copies("compute with"))
            common = [q for q in mine if q in theirs]
            if common:
                return mine[common[0]], theirs[common[0]]
            # No mesh in common: the other operand crosses via the host.
            return self._copy_near(None), np.asarray(other)
        return self._copy_near(other), other

    def __array__(
        self, dtype: Any = None, context: Any = None, copy: bool | None = None
    ) -> np.ndarray:
        del context  # unused, as in jax.Array
        return self._checked_copy("read").__array__(dtype=dtype, copy=copy)

    def item(self, *args: Any) -> Any:
        """The value as a Python scalar, like ``jax.Array.item``.

        Args:
          *args: optional index, as for ``numpy.ndarray.item``.

        Returns:
          A Python scalar.

        Raises:
          PlacementError: the copies disagree or none is readable here.

        Example:
          >>> import jax.numpy as jnp
          >>> MpmdArray({0: jnp.float32(0.5)}).item()
          0.5
        """
        return self._checked_copy("read").item(*args)

    def tolist(self) -> Any:
        """The value as nested Python lists, like ``jax.Array.tolist``.

        Returns:
          A (nested) list of Python scalars, or a scalar for a 0-d array.

        Raises:
          PlacementError: the copies disagree or none is readable here.

        Example:
          >>> import jax.numpy as jnp
          >>> MpmdArray({0: jnp.arange(3)}).tolist()
          [0, 1, 2]
        """
        return self._checked_copy("read").tolist()

    def __bool__(self) -> bool:
        return bool(self._checked_copy("read"))

    def __int__(self) -> int:
        return int(self._checked_copy("read"))

    def __float__(self) -> float:
        return float(self._checked_copy("read"))

    def __complex__(self) -> complex:
        return complex(self._checked_copy("read"))

    def __index__(self) -> int:
        return operator.index(self._checked_copy("read"))

    def __format__(self, format_spec: str) -> str:
        return format(self._checked_copy("format"), format_spec)

    def __str__(self) -> str:
        if not any(_is_readable(a) for a in self._arrays.values()):
            return repr(self)  # like a jax.Array held by other processes
        return str(self._checked_copy("print"))

    def __len__(self) -> int:
        return len(self._copy_near(None))

    def __iter__(self) -> Iterator[jax.Array]:
        return iter(self._copy_near(None))

    def __getitem__(self, index: Any) -> jax.Array:
        if isinstance(index, MpmdArray):
            index = np.asarray(index)
        copy = self._copy_near(None)
        sharding = copy.sharding
        if isinstance(sharding, NamedSharding) and any(sharding.spec):
            # On Explicit axes JAX cannot index a sharded array without being told
            # where the result goes; a read wants the whole value, so replicate first.
            copy = jax.device_put(copy, NamedSharding(sharding.mesh, PartitionSpec()))
        return copy[index]

    def __setitem__(self, index: Any, value: Any) -> None:
        """Writes ``value`` at ``index`` into every copy, as ``x.at[index].set(value)``.

        This is what ``variable[...] = value`` does to a placed Variable between
        steps (NNX writes into a value that is not a ``jax.Array`` in place):
        each copy is replaced by its updated array, on its own submesh with its
        own sharding, so the copies keep one value.

        Raises:
          PlacementError: a copy lives on another process's devices.
        """
        if isinstance(index, MpmdArray):
            index = np.asarray(index)
        unreadable = [q for q in self._mesh_ids if not _is_readable(self._arrays[q])]
        if unreadable:
            raise PlacementError(
                f"cannot write into {self!r} (x[...] = ...): its copies on meshes "
                f"{unreadable} live on other processes' devices. Write a new value with "
                "variable.set_value(...) on every process (the next mp.jit step places it)."
            )
        # A device value once to the host, whatever device it is on; a Python
        # scalar stays weakly typed, as in `x.at[index].set(3)`.
        host_value = np.asarray(value) if isinstance(value, jax.Array | MpmdArray) else value
        updated = {}
        for mesh_id, copy in self._arrays.items():
            sharding = copy.sharding
            mesh = cast(Mesh, sharding.mesh) if isinstance(sharding, NamedSharding) else None
            # Explicit axes: an eager update of a sharded array needs its mesh.
            with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
                new = copy.at[index].set(host_value)
            updated[mesh_id] = new if new.sharding == sharding else jax.device_put(new, sharding)
        self._arrays = types.MappingProxyType(updated)

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


def _is_readable(array: jax.Array) -> bool:
    """Whether this process holds all of ``array`` (it can read its value)."""
    return bool(array.is_fully_addressable)


def _same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Copies hold one value: equal, or for floats equal up to rounding."""
    if a.shape != b.shape:
        return False
    if jnp.issubdtype(a.dtype, jnp.inexact):
        wide = np.complex128 if jnp.issubdtype(a.dtype, jnp.complexfloating) else np.float64
        return bool(
            np.allclose(a.astype(wide), b.astype(wide), rtol=1e-5, atol=1e-8, equal_nan=True)
        )
    return bool(np.array_equal(a, b))


def _preview(values: np.ndarray) -> str:
    text = repr(values.tolist()) if values.size <= 6 else np.array2string(values, threshold=6)
    return text if len(text) <= 80 else text[:77] + "..."


def _binary_operator(name: str) -> Callable[[MpmdArray, Any], Any]:
    def method(self: MpmdArray, other: Any) -> Any:
        mine, theirs = self._operands(other)
        return getattr(mine, name)(theirs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"``jax.Array.{name}`` on one copy; returns a ``jax.Array``."
    return method


def _unary_operator(name: str) -> Callable[[MpmdArray], Any]:
    def method(self: MpmdArray) -> Any:
        return getattr(self._copy_near(None), name)()

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"``jax.Array.{name}`` on one copy; returns a ``jax.Array``."
    return method


_BINARY_OPERATORS = [
    f"__{prefix}{op}__"
    for op in (
        "add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "divmod", "pow",
        "lshift", "rshift", "and", "or", "xor",
    )
    for prefix in ("", "r")
] + ["__lt__", "__le__", "__eq__", "__ne__", "__gt__", "__ge__"]  # fmt: skip
for _name in _BINARY_OPERATORS:
    setattr(MpmdArray, _name, _binary_operator(_name))
for _name in ("__neg__", "__pos__", "__abs__", "__invert__"):
    setattr(MpmdArray, _name, _unary_operator(_name))
del _name
