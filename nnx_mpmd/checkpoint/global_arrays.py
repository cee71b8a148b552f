"""Checkpoints of multi-process runs: global arrays, completed so that orbax takes them.

Under ``jax.distributed`` every process calls `nnx_mpmd.checkpoint.save` (and
``restore``) with the same tree of placed state: the same logical paths,
shapes, dtypes and shardings. Orbax writes a global ``jax.Array`` from every
process at once: each process writes the replica-0 shards it holds into its own
OCDBT database, and the primary process merges them when the save commits.

Orbax 0.12.8 takes an array in a multi-process save only when every process
holds a shard of it: it refuses an array that is fully addressable on the
calling process ("Cannot serialize host local jax.Array ... in multi-host
setting", ``ArrayHandler.serialize``), and fails on one with no shard there
(``replica_slices.get_replica_slices`` reads ``addressable_shards[0]``). An
array of a stage whose submesh spans every process is saved exactly as it is
placed. Any other array (a stage on one host, or on some hosts) first gets a
sharding with a device on every process, moving as little as possible
(`savable`, `spanning_sharding`):

* when its submesh has at least as many devices as there are processes, the
  same mesh shape and PartitionSpec with, for each process that holds none of
  it, one device of a process holding several replaced by a device of that
  process: one shard moves per such process (``size / n`` bytes for an array
  split ``n`` ways over its stage, ``size`` for a replicated one), every other
  shard stays where it is;
* otherwise, replicated on one device per process: ``size`` moves to each
  process that holds none of it.

Orbax writes replica 0 of every shard, so a moved replica of a replicated array
is not written again: it only lets that process take part. The moved shards
live until the save has copied the arrays to the host, spread over the
receiving processes' devices. The replicate-everything alternative
(`nnx_mpmd.distributed.global_view`) moves ``(P - 1) * size`` bytes between P
processes per array and holds every array on every device.

Fingerprints (see `nnx_mpmd.checkpoint.manifest`) are computed where each array
lives and brought to every process (`fingerprints`: each process puts a small
table into the coordination service's key-value store and reads the others'),
so that every process writes the same manifest and every process sees the same
verification result (an error raised on one process only would leave the others
waiting). The exchange goes through the key-value store, not a device
all-gather: a process that dies during it is named in a `DistributedError`
(the waits poll the peers' heartbeats), where a device collective on CPU
(gloo) can abort the survivors.

On one process every function here is the identity (or ``jax.device_put``).

Example:
  >>> import jax.numpy as jnp
  >>> savable(jnp.ones(2)).tolist()  # one process: nothing to do
  [1.0, 1.0]
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Sequence
from typing import Any, cast

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_mpmd.errors import CheckpointError
from nnx_mpmd.runtime.coordination import get_coordination, peer_timeout_s
from nnx_mpmd.runtime.cross_process import put_between_meshes

__all__ = [
    "exchange",
    "fingerprints",
    "move_to",
    "savable",
    "settle_moves",
    "spanning_sharding",
    "use_coordination_barriers",
    "worst_of",
]


def multi_process() -> bool:
    """Whether this is a multi-process run (``jax.process_count() > 1``)."""
    return jax.process_count() > 1


_ORBAX_BARRIER_FLAG = "experimental_orbax_use_distributed_barrier"


def use_coordination_barriers() -> None:
    """Makes orbax's barriers wait in the coordination service, not in a device collective.

    A peer dying in a device collective aborts or hangs the others; this one raises.

    Example:
      >>> use_coordination_barriers()  # one process: nothing to change
    """
    from absl import flags

    if not multi_process() or _ORBAX_BARRIER_FLAG not in flags.FLAGS:
        return
    flag = flags.FLAGS[_ORBAX_BARRIER_FLAG]
    if not flag.present:
        flag.value = True
        flag.present = 1  # readable before absl parsed a command line


def _process_of(device: Any) -> int:
    return int(device.process_index)


def _devices_by_process() -> dict[int, list[Any]]:
    found: dict[int, list[Any]] = {}
    for device in jax.devices():
        found.setdefault(_process_of(device), []).append(device)
    return found


def _as_named(sharding: jax.sharding.Sharding) -> NamedSharding:
    if isinstance(sharding, NamedSharding):
        return sharding
    devices = sorted(sharding.device_set, key=lambda d: d.id)
    if len(devices) == 1:
        return NamedSharding(Mesh(np.array(devices), ("device",)), PartitionSpec())
    raise CheckpointError(
        f"cannot save an array with sharding {sharding} in a multi-process run: it does not "
        "span every process and has no NamedSharding to extend to the others. Place it with "
        "a NamedSharding (nnx_mpmd.place does) before saving."
    )


def spanning_sharding(sharding: jax.sharding.Sharding, turn: int = 0) -> NamedSharding:
    """A sharding like ``sharding`` with at least one device on every process.

    Same mesh shape and spec with a device swapped in per missing process (one shard moves
    each), or, with fewer devices than processes, one device per process, replicated.
    ``turn`` spreads the added shards over a receiving process's devices.

    Raises:
      CheckpointError: a one-process run (nothing to span), or a sharding that
        is neither a NamedSharding nor on one device.

    Example:
      >>> import jax
      >>> try:  # one process: there is no other process to span
      ...     spanning_sharding(jax.sharding.SingleDeviceSharding(jax.devices()[0]))
      ... except CheckpointError as error:
      ...     print(str(error)[:38])
      a one-process run has no processes to
    """
    by_process = _devices_by_process()
    if len(by_process) < 2:
        raise CheckpointError(
            "a one-process run has no processes to spread an array over; checkpoints of one "
            "process save arrays as they are (nothing to do)."
        )
    named = _as_named(sharding)
    mesh = cast(Mesh, named.mesh)  # typed Mesh | AbstractMesh; an array's mesh is concrete
    devices = list(mesh.devices.flat)
    present = {_process_of(d) for d in devices}
    missing = [p for p in sorted(by_process) if p not in present]
    if not missing:
        return named
    receivers = {p: by_process[p][turn % len(by_process[p])] for p in missing}
    if len(devices) < len(by_process):
        first_here = {}
        for device in devices:
            first_here.setdefault(_process_of(device), device)
        row = [first_here.get(p) or receivers[p] for p in sorted(by_process)]
        return NamedSharding(
            Mesh(np.array(row), ("ckpt",)), PartitionSpec(), memory_kind=named.memory_kind
        )
    counts: dict[int, int] = {}
    for device in devices:
        counts[_process_of(device)] = counts.get(_process_of(device), 0) + 1
    swapped = set()
    for process in missing:  # pigeonhole: some process still has two or more
        position = next(
            i
            for i in reversed(range(len(devices)))
            if i not in swapped and counts[_process_of(devices[i])] > 1
        )
        counts[_process_of(devices[position])] -= 1
        devices[position] = receivers[process]
        swapped.add(position)
    new_mesh = Mesh(np.array(devices).reshape(mesh.devices.shape), mesh.axis_names, mesh.axis_types)
    return NamedSharding(new_mesh, named.spec, memory_kind=named.memory_kind)


@functools.lru_cache(maxsize=1024)
def _one_device(device: Any) -> NamedSharding:
    return NamedSharding(Mesh(np.array([device]), ("shard",)), PartitionSpec())


def _move_shards(
    value: jax.Array, sharding: NamedSharding, kept: list[Any] | None = None
) -> jax.Array:
    """``value`` onto ``sharding`` (cut like the source's), in one process or many (a collective).

    Other processes' shards move as one-device arrays appended to ``kept``, which the
    sender keeps until they arrive (`settle_moves`).
    """
    me = jax.process_index()
    local, cross = _shard_moves(value.sharding, sharding, tuple(value.shape), me)
    shards = {shard.device: shard.data for shard in value.addressable_shards}
    arrays = list(jax.device_put([shards[src] for src, _ in local], [dst for _, dst in local]))
    shard_shape = sharding.shard_shape(value.shape)
    for batch in _batches_with_distinct_sources(cross):
        pieces = [
            jax.make_array_from_single_device_arrays(
                shard_shape,
                _one_device(src),
                [shards[src]] if src in shards else [],
                dtype=value.dtype,
            )
            for src, _ in batch
        ]
        moved = jax.device_put(pieces, [_one_device(dst) for _, dst in batch])
        if kept is not None:
            kept.extend(pieces)
            kept.extend(moved)
        arrays.extend(
            piece.addressable_shards[0].data
            for piece, (_, dst) in zip(moved, batch)
            if dst.process_index == me
        )
    return jax.make_array_from_single_device_arrays(
        value.shape, sharding, arrays, dtype=value.dtype
    )


def _index_key(index: tuple[slice, ...]) -> tuple[tuple[Any, Any, Any], ...]:
    return tuple((s.start, s.stop, s.step) for s in index)


def _shard_moves(src: Any, dst: Any, shape: tuple[int, ...], me: int) -> tuple[list, list]:
    """``(local, cross)`` (source, destination) device pairs moving ``src`` to ``dst``.

    ``local``: this process's copies (a device that already holds its shard
    keeps it). ``cross``: every move between processes (the same list on every
    process), each taking the shard from the holder used least so far, so that
    the sources differ where they can.
    """
    holders: dict[Any, list[Any]] = {}
    for device, index in src.devices_indices_map(shape).items():
        holders.setdefault(_index_key(index), []).append(device)
    local, cross = [], []
    uses: dict[Any, int] = {}
    for device, index in dst.devices_indices_map(shape).items():
        candidates = holders[_index_key(index)]
        same = [c for c in candidates if c.process_index == device.process_index]
        if same:
            if device.process_index == me:
                local.append((device if device in same else same[0], device))
            continue
        source = min(candidates, key=lambda c: (uses.get(c, 0), c.id))
        uses[source] = uses.get(source, 0) + 1
        cross.append((source, device))
    return local, cross


def _batches_with_distinct_sources(cross: list) -> list[list]:
    """``cross`` in batches of one move each: JAX 0.10.2 on CPU lost moves batched together."""
    return [[pair] for pair in cross]


def savable(array: Any, turn: int = 0, kept: list[Any] | None = None) -> Any:
    """``array`` as orbax can save it, copied when some process holds none of it (a collective).

    ``turn`` picks a receiving process's device (a running count); ``kept`` goes to `settle_moves`.

    Example:
      >>> import jax.numpy as jnp
      >>> savable(jnp.zeros(3)).shape  # one process: nothing to do
      (3,)
    """
    if not multi_process() or not isinstance(array, jax.Array):
        return array
    target = spanning_sharding(array.sharding, turn)
    if target is array.sharding:
        return array
    source = array
    if not isinstance(array.sharding, NamedSharding):
        shards = [s.data for s in array.addressable_shards]
        source = jax.make_array_from_single_device_arrays(
            array.shape, _as_named(array.sharding), shards, dtype=array.dtype
        )
    source_mesh = cast(NamedSharding, source.sharding).mesh
    fewer_devices_than_processes = target.mesh.axis_sizes != source_mesh.axis_sizes
    if fewer_devices_than_processes and not source.sharding.is_fully_replicated:
        source = _replicate_program(source.sharding)(source)  # replicated first, on its mesh
    return _move_shards(source, target, kept)


_SETTLE_ROUNDS = itertools.count()


def settle_moves(kept: list[Any]) -> None:
    """Waits until every shard `savable` moved has arrived, on every process, then empties ``kept``.

    A collective, bounded by ``NNX_MPMD_PEER_TIMEOUT`` (the others' barrier then times out).

    Raises:
      CheckpointError: a moved shard did not arrive in time (names its device).
      DistributedError: a peer died or did not reach the barrier.

    Example:
      >>> settle_moves([])  # nothing moved
    """
    if not kept or not multi_process():
        kept.clear()
        return
    waiting = [shard for array in kept for shard in array.addressable_shards]
    deadline = time.monotonic() + peer_timeout_s()
    while waiting:
        waiting = [shard for shard in waiting if not shard.data.is_ready()]
        if waiting and time.monotonic() > deadline:
            raise CheckpointError(
                f"{len(waiting)} shard(s) moved to this process (process {jax.process_index()}) "
                f"for a checkpoint save did not arrive within {peer_timeout_s():.0f} s (the "
                f"first on device {waiting[0].device}); a peer died or a cross-process "
                "transfer was lost. Retry the save; raise NNX_MPMD_PEER_TIMEOUT if peers are "
                "just slow."
            )
        if waiting:
            time.sleep(0.01)
    get_coordination().barrier(
        f"checkpoint/moves/{next(_SETTLE_ROUNDS)}", "saving a checkpoint (moved shards)"
    )
    kept.clear()


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
    return put_between_meshes(array, cast(NamedSharding, sharding))


@functools.lru_cache(maxsize=64)
def _replicate_program(sharding: NamedSharding) -> Any:
    return jax.jit(lambda row: row, out_shardings=NamedSharding(sharding.mesh, PartitionSpec()))


def _known_here(row: jax.Array) -> np.ndarray | None:
    """The row's values if this process holds a copy of it, else None."""
    if not row.sharding.is_fully_replicated and isinstance(row.sharding, NamedSharding):
        row = _replicate_program(row.sharding)(row)  # on the devices that hold it
    if not row.addressable_shards:
        return None
    return np.asarray(row.addressable_shards[0].data)


def fingerprints(rows: Sequence[Any]) -> list[list[int]]:
    """Fingerprint rows computed on the arrays' devices, as host int lists on every process.

    A collective: each process fills the rows it holds and one `exchange` shares them.

    Example:
      >>> import jax.numpy as jnp
      >>> fingerprints([jnp.array([1, 2], jnp.uint32), [3, 4]])
      [[1, 2], [3, 4]]
    """
    out: list[list[int]] = [
        [int(v) for v in row] if not isinstance(row, jax.Array) else [] for row in rows
    ]
    on_devices = [i for i, row in enumerate(rows) if isinstance(row, jax.Array)]
    if not on_devices:
        return out
    if not multi_process():
        for i, values in zip(on_devices, jax.device_get([rows[i] for i in on_devices])):
            out[i] = [int(v) for v in np.asarray(values)]
        return out
    width = max(int(np.prod(rows[i].shape)) for i in on_devices)
    table = np.zeros((len(on_devices), width + 1), np.uint32)  # last column: known here
    for k, i in enumerate(on_devices):
        values = _known_here(rows[i])
        if values is not None:
            table[k, : values.size] = values.reshape(-1)
            table[k, width] = 1
    gathered = exchange(table, "saving or verifying a checkpoint (exchanging checksums)")
    for k, i in enumerate(on_devices):
        holders = np.flatnonzero(gathered[:, k, width])
        if holders.size == 0:
            raise CheckpointError(
                f"no process holds fingerprint row {k} (shape {rows[i].shape}, sharding "
                f"{rows[i].sharding}); every array must live on some device of the run. "
                "This is a bug in nnx_mpmd: please report it with the mesh."
            )
        size = int(np.prod(rows[i].shape))
        out[i] = [int(v) for v in gathered[holders[0], k, :size]]
    return out


def worst_of(outcome: int) -> int:
    """The largest ``outcome`` of all processes, so that all take the same branch (a collective).

    Example:
      >>> worst_of(0)
      0
    """
    if not multi_process():
        return outcome
    outcomes = exchange(np.array([outcome], np.int32), "reading a checkpoint (agreeing on it)")
    return int(outcomes.max())


_EXCHANGES = itertools.count()


def exchange(table: np.ndarray, where: str) -> np.ndarray:
    """Every process's small ``table``, stacked by process index (a collective).

    Uses the coordination key-value store, so a dead peer is named within the timeout.

    Raises:
      DistributedError: a peer died, or did not take part within ``NNX_MPMD_PEER_TIMEOUT``.

    Example:
      >>> exchange(np.array([3], np.int32), "testing").tolist()  # one process
      [[3]]
    """
    table = np.ascontiguousarray(table)
    if not multi_process():
        return table[None]
    coordination = get_coordination()
    me, turn = jax.process_index(), next(_EXCHANGES)
    coordination.publish_array(f"checkpoint/exchange/{turn}/{me}", table)
    if turn >= 2:
        coordination.delete(f"checkpoint/exchange/{turn - 2}/{me}")
    rows = [
        table
        if peer == me
        else coordination.fetch_array(
            f"checkpoint/exchange/{turn}/{peer}", peer, table.shape, table.dtype, where
        )
        for peer in range(jax.process_count())
    ]
    return np.stack(rows)
