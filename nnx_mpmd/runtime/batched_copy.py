"""One batched move for the values of a `TransferBatch` (in one process).

``jax.device_put(list, shardings)`` spends ~30 µs of Python per array on CPU
(abstractify, sharding checks, avals) before its C++ copy, which costs ~5-15
µs per array when several go together. Between submeshes of one `MpmdMesh`
most moves are the plain case: a fully addressable array copied to a submesh
of the same shape with the same PartitionSpec, shard ``i`` to device ``i``.
`batched_put` makes those with one call of XLA's batched copy
(``batched_copy_array_to_devices_with_sharding``, what ``jax.device_put``
itself calls for them, with the same copy semantics), and everything else
(host values, another layout, arrays spanning processes) with one
``jax.device_put`` of a list.

Which path a value takes is decided once per (source sharding, destination
sharding, shape) and cached, so the per-call work is a dictionary look-up.
A batch that runs again and again (one `TransferBatch` of a compiled step)
keeps a `BatchPlan`: while its sources come with the shardings they had
when the plan was made, and every member took the batched copy, the next
run is one call of the batched copy with the plan's lists, and nothing is
decided per value (`BatchedCopier.planned`).

The private jaxlib calls this needs live in `nnx_mpmd._jax_compat`
(``batched_copy``, ``sharding_device_list``). If they are missing, every value
takes the ``jax.device_put`` path (`FAST_COPY_AVAILABLE` is False).

Example:
  >>> import jax, numpy as np
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> meshes = [jax.make_mesh((2,), ("data",), devices=jax.devices()[i : i + 2]) for i in (0, 2)]
  >>> x = jax.device_put(np.arange(4.0), NamedSharding(meshes[0], P("data")))
  >>> target = NamedSharding(meshes[1], P("data"))
  >>> copier = BatchedCopier()
  >>> y, z = copier([x, 3.0], [target, NamedSharding(meshes[1], P())])
  >>> y.sharding == target, y.tolist(), float(z)
  (True, [0.0, 1.0, 2.0, 3.0], 3.0)
  >>> copier.fast_path(x.sharding, target, x.shape) == FAST_COPY_AVAILABLE
  True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding

from nnx_mpmd._jax_compat import (
    FAST_COPY_AVAILABLE,
    batched_copy,
    batched_copy_prepared,
    copy_semantics,
    sharding_device_list,
)

__all__ = ["FAST_COPY_AVAILABLE", "BatchPlan", "BatchedCopier"]


class _Planned(NamedTuple):
    """The batched copy's arguments for sources with these shardings."""

    sources: tuple[Any, ...]
    device_lists: list[Any]
    targets: list[Any]
    semantics: list[Any]


class BatchPlan:
    """How one batch of values moved last time, reused while their sources keep their shardings.

    One attribute, replaced whole, so a run that reads it while another
    thread remakes it sees either plan, never a mix.

    Attributes:
      current: the sources' shardings and the batched copy's arguments, or None
        before the first run whose members all took the batched copy.

    Example:
      >>> BatchPlan().current is None
      True
    """

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current: _Planned | None = None


class BatchedCopier:
    """Moves lists of values to lists of shardings; see the module docstring.

    Example:
      >>> BatchedCopier().fast_path(None, None, ())  # not NamedShardings
      False
    """

    def __init__(self) -> None:
        self._fast: dict[tuple[Any, Any, tuple[int, ...]], bool] = {}
        self._devices: dict[Any, Any] = {}

    def fast_path(self, source: Any, target: Any, shape: tuple[int, ...]) -> bool:
        """Whether a ``shape`` array with sharding ``source`` moves by the batched copy.

        True for fully addressable NamedShardings of equal-shaped meshes with the same
        spec and memory kind, shard ``i`` of the source being shard ``i`` of the target.
        """
        key = (source, target, shape)
        found = self._fast.get(key)
        if found is None:
            found = self._fast[key] = FAST_COPY_AVAILABLE and _same_layout(source, target, shape)
        return found

    def __call__(self, values: Sequence[Any], targets: Sequence[Any]) -> list[Any]:
        """``values[i]`` placed with ``targets[i]``, in one batched copy and one device_put."""
        fast: list[int] = []
        slow: list[int] = []
        array, fast_path = jax.Array, self.fast_path
        for n, value in enumerate(values):
            if isinstance(value, array) and fast_path(value.sharding, targets[n], value.shape):
                fast.append(n)
            else:
                slow.append(n)
        out: list[Any] = [None] * len(values)
        if fast:
            moved = batched_copy(
                [values[n] for n in fast],
                [self._device_list(targets[n]) for n in fast],
                [targets[n] for n in fast],
            )
            for n, y in zip(fast, moved):
                out[n] = y
        if slow:
            hosted = [
                v if isinstance(v, array) else np.asarray(v) for v in (values[n] for n in slow)
            ]
            moved = jax.device_put(hosted, [targets[n] for n in slow])
            for n, y in zip(slow, moved):
                out[n] = y
        return out

    def planned(
        self,
        values: list[Any],
        sources: tuple[Any, ...] | None,
        plan: BatchPlan,
        targets_of: Any,
    ) -> list[Any]:
        """``values`` moved as `__call__` moves them, by ``plan`` when it holds.

        Args:
          values: the values of one batch, in its members' order.
          sources: their shardings (None when one is not a jax.Array).
          plan: this batch's plan; made or remade here when ``sources`` changed.
          targets_of: ``targets_of(values)``, the destination shardings (called
            only when the plan does not hold).

        Returns:
          The moved arrays, in order.
        """
        current = plan.current
        if current is not None and sources == current.sources:
            return batched_copy_prepared(
                values, current.device_lists, current.targets, current.semantics
            )
        targets = targets_of(values)
        out = self(values, targets)
        if sources is not None and all(
            isinstance(value, jax.Array) and self.fast_path(source, target, value.shape)
            for source, target, value in zip(sources, targets, values)
        ):
            device_lists = [self._device_list(t) for t in targets]
            plan.current = _Planned(
                sources, device_lists, list(targets), copy_semantics(len(targets))
            )
        return out

    def _device_list(self, target: NamedSharding) -> Any:
        devices = self._devices.get(target)
        if devices is None:
            devices = self._devices[target] = sharding_device_list(target)
        return devices


def _same_layout(source: Any, target: Any, shape: tuple[int, ...]) -> bool:
    if not (isinstance(source, NamedSharding) and isinstance(target, NamedSharding)):
        return False
    if not (source.is_fully_addressable and target.is_fully_addressable):
        return False
    if source.memory_kind != target.memory_kind or source.spec != target.spec:
        return False
    if source.mesh.abstract_mesh != target.mesh.abstract_mesh:
        return False
    source_indices = tuple(source.addressable_devices_indices_map(shape).values())
    target_indices = tuple(target.addressable_devices_indices_map(shape).values())
    return source_indices == target_indices
