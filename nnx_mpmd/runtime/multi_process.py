"""The multi-controller runtime: one process per group of submeshes under ``jax.distributed``.

Every process traces and compiles the same step, so all of them hold the same
instruction list. Each process runs the `Call` instructions of the submeshes
it owns and skips the rest; a `Transfer` whose ends live on different processes
becomes a send (``await_pull``) on the source's process and an asynchronous
receive (``pull``) on the destination's process, both through
``jax.experimental.transfer`` (see `nnx_mpmd.runtime.transport`). Neither side
blocks while dispatching, so the instruction order cannot deadlock.

Arrays on submeshes of other processes are *remote*: global ``jax.Array``
objects with no addressable shards (shape, dtype and sharding only). The step's
user outputs (the loss, metrics) are sent to every process that owns none of
their copies, so ``float(loss)`` works everywhere. At the end of each step a
process waits for its own results while polling the liveness of its peers: a
dead peer raises `DistributedError` within about a second of the coordination
service noticing (``heartbeat_timeout_seconds``), never a hang.

The public entry points (``initialize``, ``gather``, ``global_view``,
``is_remote``) live in `nnx_mpmd.distributed`; their old names here still work
for one release and warn.

Example:
    >>> from nnx_mpmd.runtime.multi_process import ENV_NUM_PROCESSES, launch_env
    >>> env = launch_env(1, 2, "127.0.0.1:1234", devices_per_process=4)
    >>> env[ENV_NUM_PROCESSES], env["NNX_MPMD_PROCESS_ID"], env["NNX_MPMD_COORDINATOR_BIND"]
    ('2', '1', '127.0.0.1:1234')
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import os
import time
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from nnx_mpmd import _jax_compat
from nnx_mpmd.compiler.step import CompiledStep
from nnx_mpmd.errors import DistributedError
from nnx_mpmd.placement.mesh import MpmdMesh
from nnx_mpmd.placement.partition import MpmdArray
from nnx_mpmd.runtime import interpreter
from nnx_mpmd.runtime.executor import DeviceOperations, Shardings
from nnx_mpmd.runtime.interpreter import prepared_for, value_on
from nnx_mpmd.runtime.observers import Profiler
from nnx_mpmd.runtime.transport import (
    Transport,
    aval_of,
    get_transport,
    meta_of,
)

__all__ = [
    "ENV_COORDINATOR",
    "ENV_COORDINATOR_BIND",
    "ENV_DEVICES_PER_PROCESS",
    "ENV_HEARTBEAT",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "MAX_CACHED_STEPS",
    "ProcessInfo",
    "cluster_detected",
    "collect_local",
    "coordination_state",
    "coordinator_bind_address",
    "execute_multi_process",
    "launch_env",
    "mesh_owners",
]

ENV_PROCESS_ID = "NNX_MPMD_PROCESS_ID"
ENV_NUM_PROCESSES = "NNX_MPMD_NUM_PROCESSES"
ENV_COORDINATOR = "NNX_MPMD_COORDINATOR"
ENV_COORDINATOR_BIND = "NNX_MPMD_COORDINATOR_BIND"
ENV_DEVICES_PER_PROCESS = "NNX_MPMD_DEVICES_PER_PROCESS"
ENV_HEARTBEAT = "NNX_MPMD_HEARTBEAT_S"
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process stands in the run.

    Attributes:
      process_id: ``jax.process_index()``.
      num_processes: ``jax.process_count()``.
      coordinator: the coordinator address (None for a single-process run).

    Example:
      >>> info = ProcessInfo(0, 2, "127.0.0.1:1234")
      >>> info.is_main, info.num_processes
      (True, 2)
    """

    process_id: int
    num_processes: int
    coordinator: str | None

    @property
    def is_main(self) -> bool:
        """Whether this is process 0 (the one that should print and write files)."""
        return self.process_id == 0


def coordinator_bind_address(coordinator: str, configured: str | None = None) -> str | None:
    """The address the coordination service (on process 0) should listen on.

    ``jax.distributed`` listens on every interface (``[::]:port``) by default.
    A coordinator on the loopback interface is only ever reached locally, so it
    listens on that interface alone; other coordinators keep jax's default.

    Args:
      coordinator: ``host:port`` every process connects to.
      configured: an explicit bind address (``NNX_MPMD_COORDINATOR_BIND``); wins when set.

    Returns:
      ``host:port`` to pass as ``coordinator_bind_address``, or None for jax's default
      (which also honours ``JAX_COORDINATOR_BIND_ADDRESS``).

    Example:
      >>> coordinator_bind_address("127.0.0.1:9876")
      '127.0.0.1:9876'
      >>> coordinator_bind_address("10.0.0.5:9876") is None
      True
    """
    if configured:
        return configured
    host, _, port = coordinator.rpartition(":")
    if host.strip("[]") in _LOOPBACK_HOSTS and port:
        return coordinator  # listen exactly where the processes connect
    return None


def launch_env(
    process_id: int,
    num_processes: int,
    coordinator: str,
    *,
    devices_per_process: int | None = None,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment `nnx-mpmd launch` gives process ``process_id``.

    Args:
      process_id: the process's index.
      num_processes: how many processes.
      coordinator: ``host:port`` of the coordination service (process 0 hosts it).
      devices_per_process: simulated CPU devices per process (sets ``XLA_FLAGS``).
      base: the environment to extend (default: ``os.environ``).

    Returns:
      A new environment dict. A loopback coordinator also gets
      ``NNX_MPMD_COORDINATOR_BIND`` (see `coordinator_bind_address`), so the
      coordination service does not listen on other interfaces.

    Example:
      >>> env = launch_env(0, 2, "127.0.0.1:9", devices_per_process=4, base={})
      >>> env["XLA_FLAGS"], env["NNX_MPMD_COORDINATOR"], env["NNX_MPMD_COORDINATOR_BIND"]
      ('--xla_force_host_platform_device_count=4', '127.0.0.1:9', '127.0.0.1:9')
    """
    env = dict(os.environ if base is None else base)
    env[ENV_PROCESS_ID] = str(process_id)
    env[ENV_NUM_PROCESSES] = str(num_processes)
    env[ENV_COORDINATOR] = coordinator
    bind = coordinator_bind_address(coordinator)
    if bind is not None:
        env[ENV_COORDINATOR_BIND] = bind
    else:
        env.pop(ENV_COORDINATOR_BIND, None)
    if devices_per_process is not None:
        env[ENV_DEVICES_PER_PROCESS] = str(devices_per_process)
        flags = [
            f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)
        ]
        env["XLA_FLAGS"] = " ".join([*flags, f"{_DEVICE_COUNT_FLAG}={devices_per_process}"])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def env_int(name: str, value: str) -> int:
    """``int(value)`` of environment variable ``name``, or a `DistributedError` saying so.

    Args:
      name: the variable's name (for the message).
      value: its text.

    Returns:
      The integer.

    Raises:
      DistributedError: ``value`` is not an integer.

    Example:
      >>> env_int("NNX_MPMD_PROCESS_ID", "3")
      3
    """
    try:
        return int(value)
    except ValueError:
        raise DistributedError(
            f"environment variable {name}={value!r} is not an integer; `nnx-mpmd launch` sets it, "
            "or set it yourself to a whole number."
        ) from None


def coordination_state() -> tuple[Any, str | None]:
    """``(client, coordinator address)`` of this process's ``jax.distributed`` run.

    Returns:
      ``(None, None)`` when ``jax.distributed.initialize`` has not been called.

    Example:
      >>> coordination_state()  # a single-process test run
      (None, None)
    """
    return _jax_compat.coordination_state()


def cluster_detected() -> bool:
    """Whether ``jax.distributed`` would find a cluster (SLURM, MPI, TPU pod, ...) by itself.

    Returns:
      True when one of jax's cluster environments is present, or
      ``JAX_COORDINATOR_ADDRESS`` is set.

    Example:
      >>> isinstance(cluster_detected(), bool)
      True
    """
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    return _jax_compat.cluster_environment_present()


def mesh_owners(mesh: MpmdMesh) -> list[int]:
    """The process that owns each submesh.

    Args:
      mesh: the `MpmdMesh`.

    Returns:
      ``owners[q]``: the process index of submesh ``q``'s devices.

    Raises:
      DistributedError: a submesh spans several processes, or a process owns
        no submesh.

    Example:
      >>> import jax
      >>> mesh = MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
      >>> mesh_owners(mesh)
      [0, 0, 0, 0]
    """
    owners = []
    for q in range(mesh.num_meshes):
        processes = sorted(mesh.process_indices(q))
        if len(processes) != 1:
            raise DistributedError(
                f"submesh {q} of {mesh!r} spans processes {processes}; the multi-process runtime "
                "needs each submesh on one process. Order the devices by process, e.g. "
                "Mesh(np.array(jax.devices()).reshape(num_meshes, -1), ('stage', 'data'))."
            )
        owners.append(processes[0])
    idle = sorted(set(range(jax.process_count())) - set(owners))
    if mesh.is_multi_process and idle:
        raise DistributedError(
            f"process(es) {idle} own no submesh of {mesh!r}; use a mesh over all "
            f"{jax.process_count()} processes' devices (jax.devices(), not jax.local_devices())."
        )
    return owners


class _StepState:
    """Per compiled step: its number (equal on every process) and value metadata."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.meta: dict[int, Any] = {}
        self.published: set[int] = set()


#: How many compiled steps keep their per-step state (least recently run evicted first).
MAX_CACHED_STEPS = 32

# id(step) -> (weak reference to the step, its state), least recently run first. The
# weak reference lets a dropped step (and whatever it holds) be freed; its entry goes
# with it. An evicted step that runs again gets a fresh number and state on every
# process alike, because every process runs the same steps in the same order.
_STEPS: collections.OrderedDict[int, tuple[weakref.ref, _StepState]] = collections.OrderedDict()
_STEP_NUMBERS = itertools.count()
_ROUND = [0]


def _forget_step(key: int, ref: weakref.ref) -> None:
    entry = _STEPS.get(key)
    if entry is not None and entry[0] is ref:
        del _STEPS[key]


def _step_state(step: CompiledStep) -> _StepState:
    key = id(step)
    entry = _STEPS.get(key)
    if entry is not None and entry[0]() is step:
        _STEPS.move_to_end(key)
        return entry[1]
    state = _StepState(next(_STEP_NUMBERS))
    _STEPS[key] = (weakref.ref(step, functools.partial(_forget_step, key)), state)
    _STEPS.move_to_end(key)
    while len(_STEPS) > MAX_CACHED_STEPS:
        _STEPS.popitem(last=False)
    return state


def _next_round() -> int:
    _ROUND[0] += 1
    return _ROUND[0]


def _uuid(round_: int, index: int, receiver: int) -> int:
    # Unique per (call, instruction, receiving process) and equal on every process.
    return (round_ << 32) | (index << 12) | receiver


def _wait_ready(values: Sequence[Any], transport: Transport, where: str) -> None:
    """Blocks until this process's shards of ``values`` are ready; a dead peer raises."""
    arrays = []
    for value in jax.tree.leaves(values):
        copies = value.arrays.values() if isinstance(value, MpmdArray) else [value]
        for copy in copies:
            if isinstance(copy, jax.Array):
                arrays.extend(shard.data for shard in copy.addressable_shards)
    while not all(a.is_ready() for a in arrays):
        transport.check_peers(where)
        time.sleep(0.002)
    try:
        jax.block_until_ready(arrays)
    except Exception as e:
        transport.check_peers(where, force=True)
        raise DistributedError(
            f"process {transport.process_id} failed while {where}: {e}. A peer's transfer "
            "failed (it may have died or timed out); check every process's log."
        ) from None
    transport.check_peers(where, force=True)


class _Run:
    """One execution of a compiled step on this process: the `Channel` between processes.

    Sends through the transport (``await_pull``) under an id unique to this
    call, the instruction and the receiver; receives (``pull``) with the layout
    the sender published once per step.
    """

    def __init__(
        self,
        step: CompiledStep,
        mesh: MpmdMesh,
        shardings: Shardings,
        owners: Sequence[int],
        process: int,
    ) -> None:
        self.step = step
        self.mesh = mesh
        self.shardings = shardings
        self.owners = list(owners)
        self.me = process
        self.local = {q for q, p in enumerate(self.owners) if p == self.me}
        self.transport = get_transport()
        self.state = _step_state(step)
        self.round = _next_round()

    def send(
        self, index: int, value: Any, src_mesh: int, spec: Any, receivers: Sequence[int]
    ) -> None:
        if not isinstance(value, jax.Array) or spec is not None:
            value = jax.device_put(value, self.shardings(src_mesh, spec or PartitionSpec()))
        if index not in self.state.published:
            self.transport.publish(f"meta/{self.state.number}/{index}", meta_of(value))
            self.state.published.add(index)
        for receiver in receivers:
            self.transport.send(_uuid(self.round, index, receiver), [value])

    def receive(self, index: int, src_mesh: int, dst_mesh: int) -> jax.Array:
        meta = self.state.meta.get(index)
        peer = self.owners[src_mesh]
        if meta is None:
            where = f"waiting for the layout of value {index} from mesh {src_mesh}"
            meta = self.state.meta[index] = self.transport.fetch(
                f"meta/{self.state.number}/{index}", peer, where
            )
        aval = aval_of(meta, self.mesh.submesh(dst_mesh))
        (value,) = self.transport.receive(_uuid(self.round, index, self.me), peer, [aval])
        return value

    def user_output(self, j: int, locations: list[tuple[int, int]], store: list[Any]) -> Any:
        index = len(self.step.instructions) + j
        src, slot = locations[0]
        holders = {self.owners[q] for q, _ in locations}
        receivers = sorted(set(range(jax.process_count())) - holders)
        if self.owners[src] == self.me and receivers:
            self.send(index, store[slot], src, None, receivers)
        mine = {q: store[s] for q, s in locations if q in self.local}
        if not mine:
            return self.receive(index, src, min(self.local))
        if len(mine) == 1:
            return next(iter(mine.values()))
        return MpmdArray(mine)

    def state_output(self, locations: list[tuple[int, int]], old: Any, store: list[Any]) -> Any:
        copies = {}
        for q, slot in locations:
            if q in self.local:
                copies[q] = store[slot]
            else:
                placeholder = value_on(old, q)
                if not isinstance(placeholder, jax.Array) or self.mesh.mesh_id_of(placeholder) != q:
                    raise DistributedError(
                        f"state leaf on remote mesh {q} has no placed input ({type(old).__name__}); "
                        "place the state with mp.place(...) on every process before the step."
                    )
                copies[q] = placeholder
        if len(copies) == 1:
            return next(iter(copies.values()))
        return MpmdArray(copies)


def execute_multi_process(
    step: CompiledStep,
    inputs: Sequence[Any],
    mesh: MpmdMesh,
    shardings: Shardings | None = None,
    profile: list[Any] | None = None,
) -> list[Any]:
    """Runs this process's share of ``step`` (see the module docstring).

    The same interpreter as one process runs (`nnx_mpmd.runtime.interpreter`),
    with device operations that know which process owns each mesh
    (`nnx_mpmd.runtime.executor.DeviceOperations`) and this call's `_Run`
    as their channel between processes.

    Args:
      step: the compiled step (identical on every process).
      inputs: one value per input of the step (consts, state leaves, other leaves).
      mesh: the `MpmdMesh`; each submesh must belong to one process.
      shardings: a sharding cache to reuse across calls.
      profile: if a list is given, a `TaskRecord` per local `Call` is appended.

    Returns:
      One value per output: user outputs are local arrays on every process;
      state outputs are local arrays, remote arrays, or `MpmdArray` of both.

    Raises:
      DistributedError: a peer died or timed out, or the mesh does not split by process.

    Example:
      >>> execute_multi_process.__name__  # needs a jax.distributed run; see the guide
      'execute_multi_process'
    """
    owners, me = mesh_owners(mesh), jax.process_index()
    shardings = shardings or Shardings(list(mesh.submeshes))
    operations, prepared = prepared_for(
        step,
        ("processes", shardings, tuple(owners), me),
        lambda: DeviceOperations(shardings, owners, me),
    )
    run = operations.channel = _Run(step, mesh, shardings, owners, me)
    store = interpreter.load_store(step, inputs, owns=operations.owns)
    interpreter.run(prepared, store, [] if profile is None else [Profiler(profile)])
    n_user, n_consts = step.num_user_outputs, len(step.consts)
    outputs = []
    for j, locations in enumerate(step.output_slots):
        if j < n_user:
            outputs.append(run.user_output(j, locations, store))
        else:
            old = inputs[n_consts + j - n_user]
            outputs.append(run.state_output(locations, old, store))
    _wait_ready(outputs, run.transport, f"running step {run.state.number} (call {run.round})")
    return outputs


def _whole_copies(x: jax.Array | MpmdArray, me: int) -> tuple[set[int], jax.Array | None]:
    """(the processes that hold all of ``x``, this process's whole copy or None).

    A copy on one process's devices is whole there; a fully replicated copy is
    whole on every process it touches. Computed from shardings only, so every
    process gets the same set.
    """
    copies = list(x.arrays.values()) if isinstance(x, MpmdArray) else [x]
    providers: set[int] = set()
    mine = None
    for copy in copies:
        processes = {d.process_index for d in copy.sharding.device_set}
        if len(processes) == 1 or copy.sharding.is_fully_replicated:
            providers |= processes
            if mine is None and me in processes:
                mine = copy if copy.is_fully_addressable else copy.addressable_shards[0].data
    return providers, mine


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_host(x: jax.Array) -> np.ndarray:
    return np.asarray(jax.random.key_data(x) if _is_key(x) else x)


def _from_host(host: np.ndarray, like: Any, device: Any) -> jax.Array:
    value = jax.device_put(host, device)
    return (
        jax.random.wrap_key_data(value, impl=jax.random.key_impl(like)) if _is_key(like) else value
    )


def collect_local(values: Sequence[Any], where: str) -> list[Any]:
    """Every array of ``values`` as an array this process holds whole.

    A collective: every process calls it with the same sequence (same shapes,
    dtypes and shardings). An array (or `MpmdArray`) that this process holds
    whole comes back as that local copy; one it does not hold is sent by the
    lowest process that does, through the coordination service's key-value
    store, and arrives on this process's first local device. Other values come
    back unchanged. The keys are deleted once every process has read them.

    Args:
      values: arrays, `MpmdArray` objects and other values.
      where: what the caller is doing, for error messages.

    Returns:
      A list like ``values`` with only local arrays.

    Raises:
      DistributedError: an array is split over several processes with no
        process holding all of it, or a peer died or timed out.

    Example:
      >>> import jax.numpy as jnp
      >>> array, label = collect_local([jnp.ones(3), "a label"], "running an example")
      >>> array.shape, label  # one process holds everything: nothing moves
      ((3,), 'a label')
    """
    me = jax.process_index()
    everyone = set(range(jax.process_count()))
    results = list(values)
    outgoing: dict[int, jax.Array] = {}
    incoming: list[tuple[int, int, Any]] = []
    for i, x in enumerate(values):
        if not isinstance(x, jax.Array | MpmdArray):
            continue
        providers, mine = _whole_copies(x, me)
        if not providers:
            copy = x.array(x.mesh_ids[0]) if isinstance(x, MpmdArray) else x
            processes = sorted({d.process_index for d in copy.sharding.device_set})
            raise DistributedError(
                f"while {where}: value {i} (shape {tuple(x.shape)}, sharding {copy.sharding}) is "
                f"split over processes {processes} and no process holds all of it. Keep each "
                "array on one process's devices (each submesh on one process) or replicate it."
            )
        if mine is None:
            incoming.append((i, min(providers), x))
        else:
            results[i] = mine
        if me == min(providers) and everyone - providers:
            outgoing[i] = mine
    exchanged = any(
        everyone - _whole_copies(x, me)[0] for x in values if isinstance(x, jax.Array | MpmdArray)
    )
    if not exchanged:  # the same decision on every process: no collective needed
        return results
    transport = get_transport()
    round_ = _next_round()
    keys = {i: f"fetch/{round_}/{i}" for i in outgoing}
    for i, array in outgoing.items():
        transport.publish_array(keys[i], _to_host(array))
    device = jax.local_devices()[0]
    for i, sender, like in incoming:
        shape = jax.eval_shape(jax.random.key_data, like) if _is_key(like) else like
        host = transport.fetch_array(f"fetch/{round_}/{i}", sender, shape.shape, shape.dtype, where)
        results[i] = _from_host(host, like, device)
    where = f"{where} (call {round_})"
    _wait_ready(results, transport, where)
    # Every receiver has its copy once all arrived here: the keys can go.
    transport.barrier(f"fetch/{round_}", where)
    for key in keys.values():
        transport.delete(key)
    return results


# Public names that moved to `nnx_mpmd.distributed` (old name -> new name).
_MOVED = {
    "initialize_from_env": "initialize",
    "gather": "gather",
    "global_view": "global_view",
    "is_remote": "is_remote",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        new = _MOVED[name]
        warnings.warn(
            f"nnx_mpmd.runtime.multi_process.{name} is deprecated and will be removed in the "
            f"next release; use nnx_mpmd.distributed.{new} (mp.distributed.{new}) instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        from nnx_mpmd import distributed

        return getattr(distributed, new)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
