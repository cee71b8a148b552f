"""Moving arrays between submeshes of a multi-process run with ``jax.device_put``.

Under ``jax.distributed`` every process runs the same instruction list: a
``jax.jit`` program on a submesh runs on the processes that hold its devices,
and the others get a global array with no addressable shards. A transfer is
the same call on every process, `put_between_meshes`, which picks one of:

* the destination sharding is the source's: nothing moves;
* the shard layouts differ (another PartitionSpec): reshard on the source
  submesh first, so both sides cut the array the same way;
* the two submeshes live on disjoint sets of processes and each source
  process sends to one destination process only: ``jax.device_put`` itself,
  which JAX runs as a cross-process transfer (NCCL inside PjRt on GPU; on CPU
  over the socket `nnx_mpmd.distributed.initialize` sets up);
* otherwise, shard by shard: the sets of processes overlap (a stage spanning
  processes 0 and 1 to another one), and JAX moves a whole array between
  processes only when every shard crosses; or one source process would send
  to several processes (processes 2 and 3 to 0 and 1 with the devices paired
  0-0, 1-1, 0-1, 1-0), which JAX 0.10.2 refuses with "PjRtArray has different
  number of buffers than buffer_idxs" (`one_receiver_each`). A shard whose
  process holds it in the source is copied there; the others move as
  one-device arrays, one ``jax.device_put`` each (`_move_shards`).

Values from the host (the batch, Python scalars) go through `put_from_host`:
every process holds the same host value, and each builds only its own shards.

`to_every_process` makes a step's user output (the loss, metrics) readable on
every process: a copy this process holds is kept, and one it does not hold is
sent whole, through the coordination service's key-value store, to each
process that lacks it.

Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> meshes = [jax.make_mesh((2,), ("data",), devices=jax.devices()[i:i + 2]) for i in (0, 2)]
    >>> x = put_from_host(np.arange(4.0), NamedSharding(meshes[0], P("data")))
    >>> y = put_between_meshes(x, NamedSharding(meshes[1], P()))
    >>> y.sharding.spec, y.tolist()
    (P(), [0.0, 1.0, 2.0, 3.0])
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from nnx_mpmd.errors import DistributedError
from nnx_mpmd.placement.mpmd_array import MpmdArray

__all__ = [
    "one_receiver_each",
    "put",
    "put_between_meshes",
    "put_from_host",
    "shard_plan",
    "to_every_process",
]


def _processes(sharding: Any) -> frozenset[int]:
    return frozenset(int(d.process_index) for d in sharding.device_set)


def _canonical_host(value: Any) -> Any:
    """``value`` as an array with JAX's dtype (what ``jax.device_put`` would make of it)."""
    if isinstance(value, jax.Array):
        return value
    host = np.asarray(value)
    return host.astype(jax.dtypes.canonicalize_dtype(host.dtype), copy=False)


def put_from_host(value: Any, sharding: NamedSharding) -> jax.Array:
    """A host value (the same on every process) placed with ``sharding``.

    Each process builds only its own devices' shards, so the sharding may span processes.

    Example:
      >>> import jax
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> put_from_host([1.0, 2.0], NamedSharding(mesh, PartitionSpec("data"))).tolist()
      [1.0, 2.0]
    """
    host = _canonical_host(value)
    if sharding.is_fully_addressable:
        return jax.device_put(host, sharding)
    return jax.make_array_from_callback(
        host.shape, sharding, lambda index: host[index], dtype=host.dtype
    )


@functools.lru_cache(maxsize=256)
def _reshard_program(target: NamedSharding) -> Any:
    return jax.jit(lambda x: x, out_shardings=target)


def _index_key(index: tuple[slice, ...]) -> tuple[tuple[Any, Any, Any], ...]:
    return tuple((s.start, s.stop, s.step) for s in index)


@functools.lru_cache(maxsize=1024)
def _one_device_sharding(device: Any) -> NamedSharding:
    return NamedSharding(Mesh(np.array([device]), ("shard",)), PartitionSpec())


@functools.lru_cache(maxsize=1024)
def shard_plan(src: Any, dst: Any, shape: tuple[int, ...], me: int) -> tuple[tuple, tuple]:
    """``(local, cross)`` ``(source, destination)`` device pairs moving each shard (process ``me``).

    A destination copies from a device of its own process when one holds the shard,
    else from the first holder; ``cross`` is the same on every process.

    Example:
      >>> import jax
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> a, b = (jax.make_mesh((2,), ("d",), devices=jax.devices()[i:i + 2]) for i in (0, 2))
      >>> local, cross = shard_plan(NamedSharding(a, P("d")), NamedSharding(b, P("d")), (4,), 0)
      >>> [(s.id, d.id) for s, d in local], cross
      ([(0, 2), (1, 3)], ())
    """
    holders: dict[tuple[Any, ...], list[Any]] = {}
    for device, index in src.devices_indices_map(shape).items():
        holders.setdefault(_index_key(index), []).append(device)
    local, cross = [], []
    for device, index in dst.devices_indices_map(shape).items():
        candidates = holders[_index_key(index)]
        same = [c for c in candidates if c.process_index == device.process_index]
        if same:
            if device.process_index == me:
                local.append((same[0], device))
        else:
            cross.append((candidates[0], device))
    return tuple(local), tuple(cross)


def _move_shards(value: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``value`` moved shard by shard: local copies, and one-device cross-process moves.

    One ``jax.device_put`` per piece, in the same order everywhere: batched, JAX 0.10.2 on
    CPU lost pieces of a ring of stages and the first step hung.
    """
    me = jax.process_index()
    local, cross = shard_plan(value.sharding, sharding, tuple(value.shape), me)
    shards = {shard.device: shard.data for shard in value.addressable_shards}
    arrays = list(jax.device_put([shards[src] for src, _ in local], [dst for _, dst in local]))
    shard_shape = value.sharding.shard_shape(value.shape)
    for src, dst in cross:  # one call per piece: see the docstring
        piece = jax.make_array_from_single_device_arrays(
            shard_shape,
            _one_device_sharding(src),
            [shards[src]] if src in shards else [],
            dtype=value.dtype,
        )
        moved = jax.device_put(piece, _one_device_sharding(dst))
        if dst.process_index == me:
            arrays.append(moved.addressable_shards[0].data)
    return jax.make_array_from_single_device_arrays(
        value.shape, sharding, arrays, dtype=value.dtype
    )


def one_receiver_each(src_devices: Any, dst_devices: Any) -> bool:
    """Whether each source process sends to one destination process only (devices in mesh order).

    Only then does JAX 0.10.2 move an array whole across processes; else shard by shard.

    Example:
      >>> from types import SimpleNamespace as Device
      >>> two, three = Device(process_index=2), Device(process_index=3)
      >>> zero, one = Device(process_index=0), Device(process_index=1)
      >>> one_receiver_each([two, two, three, three], [zero, zero, one, one])
      True
      >>> one_receiver_each([two, two, three, three], [zero, one, zero, one])
      False
    """
    receivers: dict[int, set[int]] = {}
    for src, dst in zip(src_devices, dst_devices, strict=True):
        receivers.setdefault(int(src.process_index), set()).add(int(dst.process_index))
    return all(len(targets) == 1 for targets in receivers.values())


def _mesh_devices(sharding: Any) -> Any:
    """The devices of a NamedSharding's (concrete) mesh, flat, in mesh order."""
    return cast(Mesh, sharding.mesh).devices.flat


def _mesh_shape(mesh: Mesh | AbstractMesh) -> tuple[tuple[str, int], ...]:
    return tuple(mesh.shape.items())


def put_between_meshes(value: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``value`` (on one submesh) moved to ``sharding`` (on another); see the module docstring.

    A collective of both submeshes' processes, same arguments and order on each.

    Raises:
      DistributedError: the source has no NamedSharding, or the submeshes
        differ in shape.

    Example:
      >>> import jax, numpy as np
      >>> meshes = [jax.make_mesh((1,), ("data",), devices=[d]) for d in jax.devices()[:2]]
      >>> x = put_from_host(np.ones(2), NamedSharding(meshes[0], PartitionSpec()))
      >>> put_between_meshes(x, NamedSharding(meshes[1], PartitionSpec())).devices() == {
      ...     jax.devices()[1]}
      True
    """
    src = value.sharding
    if src == sharding:
        return value
    if not isinstance(src, NamedSharding):
        raise DistributedError(
            f"cannot move an array of shape {tuple(value.shape)} with sharding {src} to "
            f"{sharding} between processes: the source has no NamedSharding (no submesh to "
            "reshard on). Stage programs return NamedSharding outputs; please report this."
        )
    if _mesh_shape(src.mesh) != _mesh_shape(sharding.mesh):
        raise DistributedError(
            f"cannot move an array of shape {tuple(value.shape)} from a submesh of shape "
            f"{dict(src.mesh.shape)} to one of shape {dict(sharding.mesh.shape)} across "
            "processes: cross-process transfers need submeshes of the same shape (every "
            "submesh of an MpmdMesh has it)."
        )
    if value.is_fully_addressable and sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    ndim = value.ndim
    aligned = NamedSharding(src.mesh, sharding.spec, memory_kind=sharding.memory_kind)
    if not src.is_equivalent_to(aligned, ndim):
        value = _reshard_program(aligned)(value)  # cut it the destination's way, on its mesh
    if value.sharding == sharding:
        return value
    if _processes(value.sharding).isdisjoint(_processes(sharding)) and one_receiver_each(
        _mesh_devices(value.sharding), _mesh_devices(sharding)
    ):
        return jax.device_put(value, sharding)  # every shard crosses: JAX moves it whole
    return _move_shards(value, sharding)


def put(value: Any, sharding: NamedSharding, from_host: bool) -> jax.Array:
    """A transfer's move: `put_from_host` for host values, else `put_between_meshes`.

    Example:
      >>> import jax
      >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
      >>> put(2.0, NamedSharding(mesh, PartitionSpec()), from_host=True).dtype
      dtype('float32')
    """
    if from_host or not isinstance(value, jax.Array):
        return put_from_host(value, sharding)
    return put_between_meshes(value, sharding)


def _local_value(copy: jax.Array) -> jax.Array:
    """This process's whole copy: the array itself, or one replicated shard of it."""
    if copy.is_fully_addressable:
        return copy
    return copy.addressable_shards[0].data


def _whole_on(copy: jax.Array) -> frozenset[int]:
    """The processes that hold all of ``copy`` (from its sharding: the same everywhere)."""
    processes = _processes(copy.sharding)
    if len(processes) == 1 or copy.sharding.is_fully_replicated:
        return processes
    return frozenset()


def to_every_process(x: Any) -> Any:
    """A step's user output as an array this process holds whole (a collective).

    A missing whole copy is sent by the lowest process holding one, through the key-value
    store; decisions depend on shardings only, so every process makes the same ones.

    Example:
      >>> import jax.numpy as jnp
      >>> to_every_process(jnp.ones(2)).tolist()  # one process: nothing moves
      [1.0, 1.0]
    """
    copies = list(x.arrays.values()) if isinstance(x, MpmdArray) else [x]
    if not all(isinstance(c, jax.Array) for c in copies):
        return x
    if jax.process_count() == 1:
        return x
    me = jax.process_index()
    holders = [_whole_on(c) for c in copies]
    mine = next((_local_value(c) for c, h in zip(copies, holders) if me in h), None)
    missing = sorted(set(range(jax.process_count())).difference(*holders))
    if not missing:
        return mine
    source = next((c for c, h in zip(copies, holders) if h), copies[0])
    if not _whole_on(source):
        sharding = source.sharding
        if not isinstance(sharding, NamedSharding):
            raise DistributedError(
                f"a step output of shape {tuple(x.shape)} is split over processes with sharding "
                f"{sharding}, which names no submesh to replicate it on; please report this."
            )
        source = _reshard_program(NamedSharding(sharding.mesh, PartitionSpec()))(source)
        if me in _processes(source.sharding):
            mine = _local_value(source)
        missing = sorted(set(missing) - _processes(source.sharding))
    if jnp.issubdtype(source.dtype, jax.dtypes.prng_key):
        return _sent_by_device_put(source, missing, mine, me)
    return _sent_by_key_value_store(source, missing, mine, me)


_OUTPUT_ROUNDS = itertools.count(1)


def _sent_by_key_value_store(source: jax.Array, missing: list[int], mine: Any, me: int) -> Any:
    """A whole step output sent to the ``missing`` processes through the key-value store.

    With ``jax.device_put`` one receiver's copy sometimes never arrived on CPU; the store has
    no such race. Each receiver deletes its key once read.
    """
    from nnx_mpmd.runtime.coordination import get_coordination

    coordination = get_coordination()
    round_ = next(_OUTPUT_ROUNDS)  # the same on every process: decided from shardings
    sender = min(_processes(source.sharding))
    keys = {p: f"output/{round_}/{p}" for p in missing}
    if me == sender:
        host = np.asarray(_local_value(source))
        for key in keys.values():
            coordination.publish_array(key, host)
    if me in keys:
        host = coordination.fetch_array(
            keys[me], sender, source.shape, source.dtype, "receiving a step output"
        )
        coordination.delete(keys[me])
        mine = jax.device_put(host, jax.local_devices()[0])
    return mine


def _sent_by_device_put(source: jax.Array, missing: list[int], mine: Any, me: int) -> Any:
    """A whole step output sent to one device of each ``missing`` process (``jax.device_put``)."""
    sender = _first_device(source.sharding)
    whole = [jax.device_put(_local_value(source), sender)] if sender.process_index == me else []
    piece = jax.make_array_from_single_device_arrays(
        source.shape, _one_device_sharding(sender), whole, dtype=source.dtype
    )
    for process in missing:
        receiver = jax.local_devices(process_index=process)[0]
        moved = jax.device_put(piece, _one_device_sharding(receiver))
        if process == me:
            mine = moved.addressable_shards[0].data
    return mine


def _first_device(sharding: Any) -> Any:
    """The first device of ``sharding`` (in mesh order), the same on every process."""
    if isinstance(sharding, NamedSharding):
        return _mesh_devices(sharding)[0]
    return min(sharding.device_set, key=lambda d: d.id)
