"""Checkpoints of multi-process runs: the global arrays as they are, with one exception.

Under ``jax.distributed`` every process calls `nnx_mpmd.checkpoint.save` (and
``restore``) with the same tree of placed state: the same logical paths,
shapes, dtypes and shardings. Orbax writes a global ``jax.Array`` from every
process at once: each process writes the replica-0 shards it holds into its own
OCDBT database, and the primary process merges them when the save commits.
Parameters of a stage whose submesh spans processes are saved exactly as they
are placed: nothing is copied between devices or processes.

The exception is an array whose devices all belong to ONE process (a stage
that lives on one host). Orbax 0.12.8 refuses to serialize an array that is
fully addressable in a multi-process run (``ArrayHandler.serialize``: "Cannot
serialize host local jax.Array ... in multi-host setting"), because it cannot
tell it from a per-process (``pmap``-style) array. `savable` gives such an
array a sharding that spans two processes, moving as little as possible:

* on a submesh of several devices, the same mesh and PartitionSpec with the
  mesh's last device replaced by a device of another process: one shard moves
  (the whole array when the spec replicates it, 1/n of it when it is split n
  ways), every other shard stays where it is;
* on one device, replicated on that device and a device of another process:
  the whole array moves.

Orbax writes replica 0 of every shard, so the moved copy of a replicated array
is not written again; it only makes the array span processes, and it is freed
when the save returns.

The replicate-everything alternative (`nnx_mpmd.distributed.global_view`)
copies every array to every device of every process: for P processes it moves
``(P - 1) * size`` bytes between processes per array and needs the whole state
in every device's memory.

Fingerprints (see `nnx_mpmd.checkpoint.manifest`) are computed where each array
lives and brought to every process (`fingerprints`), batched per sharding, so
that every process writes the same manifest and every process sees the same
verification result (an error raised on one process only would leave the others
waiting in a collective).

On one process every function here is the identity (or ``jax.device_put``).

Example:
  >>> import jax.numpy as jnp
  >>> savable(jnp.ones(2)).tolist()  # one process: nothing to do
  [1.0, 1.0]
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_mpmd.errors import CheckpointError
from nnx_mpmd.runtime.cross_process import put_between_meshes, shard_plan

__all__ = ["fingerprints", "move_to", "savable", "spanning_sharding"]


def multi_process() -> bool:
    """Whether this is a multi-process run (``jax.process_count() > 1``)."""
    return jax.process_count() > 1


def _processes(sharding: jax.sharding.Sharding) -> frozenset[int]:
    return frozenset(int(d.process_index) for d in sharding.device_set)


def _device_of_another_process(processes: frozenset[int]) -> Any:
    """The first device (in ``jax.devices()`` order) of a process not in ``processes``."""
    for device in jax.devices():
        if int(device.process_index) not in processes:
            return device
    raise CheckpointError(
        f"cannot save an array held by processes {sorted(processes)} only: no other process "
        "has devices. Orbax needs arrays that span processes in a multi-process run; start "
        "every process with at least one device."
    )


def _as_named(sharding: jax.sharding.Sharding) -> NamedSharding:
    if isinstance(sharding, NamedSharding):
        return sharding
    devices = sorted(sharding.device_set, key=lambda d: d.id)
    if len(devices) == 1:
        return NamedSharding(Mesh(np.array(devices), ("device",)), PartitionSpec())
    raise CheckpointError(
        f"cannot save an array with sharding {sharding} in a multi-process run: it lives on "
        "one process and has no NamedSharding to extend to another process. Place it with a "
        "NamedSharding (nnx_mpmd.place does) before saving."
    )


def spanning_sharding(sharding: jax.sharding.Sharding) -> NamedSharding:
    """A sharding like ``sharding`` (on one process) that also uses a device of another process.

    Args:
      sharding: the array's sharding; all its devices belong to one process.

    Returns:
      The same mesh shape and PartitionSpec with the mesh's last device
      replaced by a device of another process (every shard keeps its
      shape); for a one-device sharding, that device and a device of another
      process, replicated.

    Raises:
      CheckpointError: no other process has devices (a one-process run).

    Example:
      >>> import jax
      >>> try:  # one process: there is no other process to span
      ...     spanning_sharding(jax.sharding.SingleDeviceSharding(jax.devices()[0]))
      ... except CheckpointError as error:
      ...     print(str(error)[:45])
      cannot save an array held by processes [0] on
    """
    named = _as_named(sharding)
    other = _device_of_another_process(_processes(named))
    mesh = named.mesh
    if mesh.devices.size > 1:
        devices = np.array(mesh.devices).reshape(-1).copy()
        devices[-1] = other
        swapped = Mesh(devices.reshape(mesh.devices.shape), mesh.axis_names, mesh.axis_types)
        return NamedSharding(swapped, named.spec, memory_kind=named.memory_kind)
    pair = Mesh(np.array([mesh.devices.reshape(-1)[0], other]), ("ckpt",))
    return NamedSharding(pair, PartitionSpec(), memory_kind=named.memory_kind)


@functools.lru_cache(maxsize=1024)
def _one_device(device: Any) -> NamedSharding:
    return NamedSharding(Mesh(np.array([device]), ("shard",)), PartitionSpec())


def _move_shards(value: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``value`` onto ``sharding``, whose shards are cut like the source's.

    A shard held in the destination device's process is copied there; the
    others move between processes as one-device arrays in one batched
    ``jax.device_put``. A collective: every process calls it with the same
    arguments (`nnx_mpmd.runtime.cross_process` moves stage outputs the same way).
    """
    me = jax.process_index()
    local, cross = shard_plan(value.sharding, sharding, tuple(value.shape), me)
    shards = {shard.device: shard.data for shard in value.addressable_shards}
    arrays = list(jax.device_put([shards[src] for src, _ in local], [dst for _, dst in local]))
    if cross:
        shard_shape = sharding.shard_shape(value.shape)
        pieces = [
            jax.make_array_from_single_device_arrays(
                shard_shape,
                _one_device(src),
                [shards[src]] if src in shards else [],
                dtype=value.dtype,
            )
            for src, _ in cross
        ]
        moved = jax.device_put(pieces, [_one_device(dst) for _, dst in cross])
        arrays.extend(
            piece.addressable_shards[0].data
            for piece, (_, dst) in zip(moved, cross)
            if dst.process_index == me
        )
    return jax.make_array_from_single_device_arrays(
        value.shape, sharding, arrays, dtype=value.dtype
    )


def savable(array: Any) -> Any:
    """``array`` as orbax saves it in this run: as it is, unless it lives on one process.

    A collective in a multi-process run (every process calls it with the same
    array). See the module docstring for what moves.

    Args:
      array: a global ``jax.Array`` (or any other leaf, returned unchanged).

    Returns:
      ``array``, or a copy whose sharding spans two processes.

    Example:
      >>> import jax.numpy as jnp
      >>> savable(jnp.zeros(3)).shape
      (3,)
    """
    if not multi_process() or not isinstance(array, jax.Array):
        return array
    if len(_processes(array.sharding)) > 1:
        return array
    target = spanning_sharding(array.sharding)
    source = array
    if not isinstance(array.sharding, NamedSharding):
        shards = [s.data for s in array.addressable_shards]
        source = jax.make_array_from_single_device_arrays(
            array.shape, _as_named(array.sharding), shards, dtype=array.dtype
        )
    return _move_shards(source, target)


def move_to(array: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """``array`` copied onto ``sharding`` (another submesh), in one process or many.

    A collective in a multi-process run.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> move_to(jnp.ones(2), jax.sharding.SingleDeviceSharding(jax.devices()[1])).devices() == {
      ...     jax.devices()[1]}
      True
    """
    if not multi_process() or (array.is_fully_addressable and sharding.is_fully_addressable):
        return jax.device_put(array, sharding)
    return put_between_meshes(array, sharding)


@functools.lru_cache(maxsize=64)
def _stack_program(sharding: jax.sharding.Sharding) -> Any:
    """Stacks fingerprint rows, replicated on the devices that hold them."""
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, PartitionSpec())
    return jax.jit(lambda *rows: jnp.stack(rows), out_shardings=sharding)


def _on_every_process(stacked: jax.Array) -> np.ndarray:
    """A small replicated array, as numpy on every process (a collective).

    Processes that hold it read their own copy; each other process gets one
    copy from the array's first device, as a one-device array.
    """
    me = jax.process_index()
    holders = _processes(stacked.sharding)
    missing = [p for p in range(jax.process_count()) if p not in holders]
    if missing:
        source = min(stacked.sharding.device_set, key=lambda d: d.id)
        held = [s.data for s in stacked.addressable_shards if s.device == source]
        piece = jax.make_array_from_single_device_arrays(
            stacked.shape, _one_device(source), held, dtype=stacked.dtype
        )
        first = {}
        for device in jax.devices():
            first.setdefault(int(device.process_index), device)
        for process in missing:  # one call per receiver: one buffer sent twice in one
            moved = jax.device_put(piece, _one_device(first[process]))  # call arrived once
            if process == me:
                mine = np.asarray(moved.addressable_shards[0].data)
        if me in missing:
            return mine
    return np.asarray(stacked.addressable_shards[0].data)


def fingerprints(rows: Sequence[Any]) -> list[list[int]]:
    """Fingerprint rows, computed on the arrays' devices, as host ints on every process.

    In a multi-process run the rows of arrays that live on other processes are
    fetched: the rows with the same sharding are stacked on their devices and
    sent together, so the number of transfers is the number of distinct
    shardings times the processes that lack them, not the number of arrays. A
    collective: every process calls it with rows of the same shardings.

    Args:
      rows: one small device array per checkpoint entry, or a host list of ints.

    Returns:
      Every row as a list of ints, the same on every process.

    Example:
      >>> import jax.numpy as jnp
      >>> fingerprints([jnp.array([1, 2], jnp.uint32), [3, 4]])
      [[1, 2], [3, 4]]
    """
    out: list[list[int]] = [[] for _ in rows]
    groups: dict[Any, list[int]] = {}
    for i, row in enumerate(rows):
        if isinstance(row, jax.Array):
            groups.setdefault(row.sharding if multi_process() else None, []).append(i)
        else:
            out[i] = [int(v) for v in row]
    for key, members in groups.items():
        if key is None:
            fetched = jax.device_get([rows[i] for i in members])
        else:
            stacked = _stack_program(key)(*[rows[i] for i in members])
            fetched = _on_every_process(stacked)
        for i, values in zip(members, fetched):
            out[i] = [int(v) for v in np.asarray(values)]
    return out
