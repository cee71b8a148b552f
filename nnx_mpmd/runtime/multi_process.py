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

Example:
    >>> from nnx_mpmd.runtime.multi_process import ENV_NUM_PROCESSES, launch_env
    >>> env = launch_env(1, 2, "127.0.0.1:1234", devices_per_process=4)
    >>> env[ENV_NUM_PROCESSES], env["NNX_MPMD_PROCESS_ID"]
    ('2', '1')
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnx_mpmd.compiler.instructions import Call, Free, Transfer
from nnx_mpmd.compiler.mesh_inference import HOST
from nnx_mpmd.compiler.step import CompiledStep
from nnx_mpmd.errors import DistributedError
from nnx_mpmd.mesh import MpmdMesh
from nnx_mpmd.partition import MpmdArray
from nnx_mpmd.runtime.executor import (
    TaskRecord,
    _assign,
    _build,
    _Shardings,
    _transfer,
    _value_on,
)
from nnx_mpmd.runtime.transport import (
    Transport,
    aval_of,
    get_transport,
    meta_of,
)

__all__ = [
    "ENV_COORDINATOR",
    "ENV_DEVICES_PER_PROCESS",
    "ENV_HEARTBEAT",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ProcessInfo",
    "execute_multi_process",
    "gather",
    "global_view",
    "initialize_from_env",
    "is_remote",
    "launch_env",
    "mesh_owners",
]

ENV_PROCESS_ID = "NNX_MPMD_PROCESS_ID"
ENV_NUM_PROCESSES = "NNX_MPMD_NUM_PROCESSES"
ENV_COORDINATOR = "NNX_MPMD_COORDINATOR"
ENV_DEVICES_PER_PROCESS = "NNX_MPMD_DEVICES_PER_PROCESS"
ENV_HEARTBEAT = "NNX_MPMD_HEARTBEAT_S"
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process stands in the run.

    Attributes:
      process_id: ``jax.process_index()``.
      num_processes: ``jax.process_count()``.
      coordinator: the coordinator address (None for a single-process run).
    """

    process_id: int
    num_processes: int
    coordinator: str | None

    @property
    def is_main(self) -> bool:
        """Whether this is process 0 (the one that should print and write files)."""
        return self.process_id == 0


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
      A new environment dict.

    Example:
      >>> env = launch_env(0, 2, "127.0.0.1:9", devices_per_process=4, base={})
      >>> env["XLA_FLAGS"], env["NNX_MPMD_COORDINATOR"]
      ('--xla_force_host_platform_device_count=4', '127.0.0.1:9')
    """
    env = dict(os.environ if base is None else base)
    env[ENV_PROCESS_ID] = str(process_id)
    env[ENV_NUM_PROCESSES] = str(num_processes)
    env[ENV_COORDINATOR] = coordinator
    if devices_per_process is not None:
        env[ENV_DEVICES_PER_PROCESS] = str(devices_per_process)
        flags = [
            f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)
        ]
        env["XLA_FLAGS"] = " ".join([*flags, f"{_DEVICE_COUNT_FLAG}={devices_per_process}"])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _env_int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise DistributedError(
            f"environment variable {name}={value!r} is not an integer; `nnx-mpmd launch` sets it, "
            "or set it yourself to a whole number."
        ) from None


def initialize_from_env(
    *, heartbeat_timeout_s: int | None = None, initialization_timeout_s: int = 120
) -> ProcessInfo:
    """Joins the ``jax.distributed`` run described by the environment; call it first.

    Under `nnx-mpmd launch` the ``NNX_MPMD_*`` variables say which process this
    is. Without them, ``jax.distributed``'s own cluster detection is used when it
    finds a cluster (SLURM, Open MPI, Kubernetes JobSet, Cloud TPU pods, or
    ``JAX_COORDINATOR_ADDRESS`` & co.); otherwise the script runs as one process.
    Recoverable mode is switched on so that a dead peer surfaces as a
    `DistributedError` in the survivors instead of aborting them.

    Args:
      heartbeat_timeout_s: seconds without heartbeats after which a process
        counts as dead (default ``NNX_MPMD_HEARTBEAT_S`` or 10).
      initialization_timeout_s: how long to wait for every process to join.

    Returns:
      A `ProcessInfo`.

    Raises:
      DistributedError: the environment is incomplete or inconsistent, or the
        processes could not connect.

    Example:
      >>> info = initialize_from_env()  # no launcher, no cluster: one process
      >>> info.num_processes, info.is_main
      (1, True)
    """
    from jax._src import distributed

    if distributed.global_state.client is not None:
        return ProcessInfo(
            jax.process_index(), jax.process_count(), distributed.global_state.coordinator_address
        )
    names = (ENV_PROCESS_ID, ENV_NUM_PROCESSES, ENV_COORDINATOR)
    given = {name: os.environ[name] for name in names if name in os.environ}
    heartbeat = heartbeat_timeout_s or _env_int(ENV_HEARTBEAT, os.environ.get(ENV_HEARTBEAT, "10"))
    if given and len(given) != len(names):
        missing = [name for name in names if name not in given]
        raise DistributedError(
            f"incomplete multi-process environment: {sorted(given)} are set but {missing} are "
            "not. Start the script with `nnx-mpmd launch --processes N -- python script.py`, or "
            "set all three variables."
        )
    devices = os.environ.get(ENV_DEVICES_PER_PROCESS)
    if devices and jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_num_cpu_devices", _env_int(ENV_DEVICES_PER_PROCESS, devices))
    jax.config.update("jax_enable_recoverability", True)
    if given:
        process_id = _env_int(ENV_PROCESS_ID, given[ENV_PROCESS_ID])
        num_processes = _env_int(ENV_NUM_PROCESSES, given[ENV_NUM_PROCESSES])
        if not 0 <= process_id < num_processes:
            raise DistributedError(
                f"{ENV_PROCESS_ID}={process_id} is outside [0, {ENV_NUM_PROCESSES}="
                f"{num_processes}); every process needs a distinct id in that range."
            )
        if num_processes == 1:
            return ProcessInfo(0, 1, None)
        kwargs = {
            "coordinator_address": given[ENV_COORDINATOR],
            "num_processes": num_processes,
            "process_id": process_id,
        }
    else:
        from jax._src.clusters import ClusterEnv

        detected = [env for env in ClusterEnv._cluster_types if env.is_env_present()]
        if not detected and not os.environ.get("JAX_COORDINATOR_ADDRESS"):
            return ProcessInfo(0, 1, None)
        kwargs = {}
    try:
        jax.distributed.initialize(
            **kwargs,
            heartbeat_timeout_seconds=heartbeat,
            initialization_timeout=initialization_timeout_s,
        )
    except Exception as e:
        raise DistributedError(
            f"jax.distributed.initialize({kwargs}) failed: {e}. Check that every process runs, "
            "that the coordinator address is reachable, and that the process ids are distinct."
        ) from e
    return ProcessInfo(
        jax.process_index(), jax.process_count(), distributed.global_state.coordinator_address
    )


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


def is_remote(x: Any) -> bool:
    """Whether ``x`` is a ``jax.Array`` none of whose shards this process holds.

    Args:
      x: any value.

    Returns:
      True for an array that lives only on other processes' devices.

    Example:
      >>> import jax.numpy as jnp
      >>> is_remote(jnp.ones(2)), is_remote(1.0)
      (False, False)
    """
    return isinstance(x, jax.Array) and not x.is_fully_addressable and not x.addressable_shards


class _StepState:
    """Per compiled step: its number (equal on every process) and value metadata."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.meta: dict[int, Any] = {}
        self.published: set[int] = set()


_STEPS: dict[int, tuple[CompiledStep, _StepState]] = {}
_ROUND = [0]


def _step_state(step: CompiledStep) -> _StepState:
    entry = _STEPS.get(id(step))
    if entry is None or entry[0] is not step:
        entry = _STEPS[id(step)] = (step, _StepState(len(_STEPS)))
    return entry[1]


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
    """One execution of a compiled step on this process."""

    def __init__(self, step: CompiledStep, mesh: MpmdMesh, shardings: _Shardings) -> None:
        self.step = step
        self.mesh = mesh
        self.shardings = shardings
        self.owners = mesh_owners(mesh)
        self.me = jax.process_index()
        self.local = {q for q, p in enumerate(self.owners) if p == self.me}
        self.transport = get_transport()
        self.state = _step_state(step)
        self.round = _next_round()

    def _send(self, index: int, value: Any, src: int, spec: Any, receivers: Sequence[int]) -> None:
        if not isinstance(value, jax.Array) or spec is not None:
            value = jax.device_put(value, self.shardings(src, spec or PartitionSpec()))
        if index not in self.state.published:
            self.transport.publish(f"meta/{self.state.number}/{index}", meta_of(value))
            self.state.published.add(index)
        for receiver in receivers:
            self.transport.send(_uuid(self.round, index, receiver), [value])

    def _receive(self, index: int, src: int, dst: int) -> jax.Array:
        meta = self.state.meta.get(index)
        peer = self.owners[src]
        if meta is None:
            where = f"waiting for the layout of value {index} from mesh {src}"
            meta = self.state.meta[index] = self.transport.fetch(
                f"meta/{self.state.number}/{index}", peer, where
            )
        aval = aval_of(meta, self.mesh.submesh(dst))
        (value,) = self.transport.receive(_uuid(self.round, index, self.me), peer, [aval])
        return value

    def transfer(self, index: int, ins: Transfer, store: list[Any]) -> None:
        src, dst = ins.src_mesh, ins.dst_mesh
        src_here = src == HOST or src in self.local
        if dst in self.local and src_here:
            store[ins.dst] = _transfer(ins, store[ins.src], self.shardings)
        elif src_here and src != HOST:
            value = store[ins.src]
            if ins.reshape_microbatches:
                m = ins.reshape_microbatches
                value = value.reshape((m, value.shape[0] // m, *value.shape[1:]))
            spec = ins.spec
            if spec is None and isinstance(getattr(value, "sharding", None), NamedSharding):
                spec = value.sharding.spec
            self._send(index, value, src, spec, [self.owners[dst]])
        elif dst in self.local:
            store[ins.dst] = self._receive(index, src, dst)

    def user_output(self, j: int, locations: list[tuple[int, int]], store: list[Any]) -> Any:
        index = len(self.step.instructions) + j
        src, slot = locations[0]
        holders = {self.owners[q] for q, _ in locations}
        receivers = sorted(set(range(jax.process_count())) - holders)
        if self.owners[src] == self.me and receivers:
            self._send(index, store[slot], src, None, receivers)
        mine = {q: store[s] for q, s in locations if q in self.local}
        if not mine:
            return self._receive(index, src, min(self.local))
        if len(mine) == 1:
            return next(iter(mine.values()))
        return MpmdArray(mine)

    def state_output(self, locations: list[tuple[int, int]], old: Any, store: list[Any]) -> Any:
        copies = {}
        for q, slot in locations:
            if q in self.local:
                copies[q] = store[slot]
            else:
                placeholder = _value_on(old, q)
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
    shardings: _Shardings | None = None,
    profile: list[Any] | None = None,
) -> list[Any]:
    """Runs this process's share of ``step`` (see the module docstring).

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
    run = _Run(step, mesh, shardings or _Shardings(list(mesh.submeshes)))
    store: list[Any] = [None] * step.num_slots
    for slot, value in step.constants.items():
        store[slot] = value
    for value, slots_of in zip(inputs, step.input_slots):
        for q, slot in slots_of.items():
            if q == HOST or q in run.local:
                store[slot] = _value_on(value, q)
    clock = time.perf_counter
    t0 = clock()
    for index, ins in enumerate(step.instructions):
        if isinstance(ins, Call):
            if ins.mesh not in run.local:
                continue
            start = clock()
            result = ins.fn(*_build(store, ins.args))
            _assign(store, ins.outs, result)
            if profile is not None:
                jax.block_until_ready(result)
                profile.append(
                    TaskRecord((ins.mesh, ins.label, ins.task, start - t0, clock() - t0))
                )
        elif isinstance(ins, Transfer):
            run.transfer(index, ins, store)
        elif isinstance(ins, Free):
            for slot in ins.slots:
                store[slot] = None
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


def _local_copy(x: Any) -> tuple[jax.Array | None, jax.Array]:
    """(a copy of ``x`` this process holds or None, the copy that is sent when none is)."""
    if isinstance(x, MpmdArray):
        copies = [x.array(q) for q in x.mesh_ids]
    else:
        copies = [x]
    local = [c for c in copies if c.is_fully_addressable]
    return (local[0] if local else None), copies[0]


class _Fetcher:
    """Collects arrays to this process; every process must fetch the same sequence.

    Owners publish each array once; every process without a copy reads it.
    """

    def __init__(self, mesh: MpmdMesh) -> None:
        self.mesh = mesh
        owners = mesh_owners(mesh)
        self.me = jax.process_index()
        self.local = [q for q, p in enumerate(owners) if p == self.me]
        self.transport = get_transport()
        self.round = _next_round()

    def fetch_all(self, values: Sequence[Any], where: str) -> list[Any]:
        results = list(values)
        outgoing_by_index: dict[int, jax.Array] = {}
        incoming: dict[int, list[tuple[int, jax.ShapeDtypeStruct]]] = {}
        for i, x in enumerate(values):
            if not isinstance(x, jax.Array | MpmdArray):
                continue
            mine, sent = _local_copy(x)
            holders: set[int] = set()
            for copy in x.arrays.values() if isinstance(x, MpmdArray) else [x]:
                holders |= {d.process_index for d in copy.sharding.device_set}
            sender = min(holders)
            if self.me == sender and set(range(jax.process_count())) - holders:
                outgoing_by_index[i] = mine
            if mine is None:
                if self.mesh.mesh_id_of(sent) is None:
                    devices = sorted(d.id for d in sent.sharding.device_set)
                    raise DistributedError(
                        f"cannot fetch an array on devices {devices}, which are not a submesh "
                        f"of {self.mesh!r}; place it with mp.place first."
                    )
                aval = aval_of(meta_of(sent), self.mesh.submesh(self.local[0]))
                incoming.setdefault(sender, []).append((i, aval))
            else:
                results[i] = mine
        # State moves through the coordination service's key-value store: bundled
        # transfer-server pulls of many arrays intermittently never completed on
        # jax 0.10.2 / CPU, while the key-value store is reliable.
        for index, array in outgoing_by_index.items():
            self.transport.publish_array(f"fetch/{self.round}/{index}", np.asarray(array))
        for sender, wanted in incoming.items():
            for i, aval in wanted:
                host = self.transport.fetch_array(
                    f"fetch/{self.round}/{i}", sender, aval.shape, aval.dtype, where
                )
                results[i] = jax.device_put(host, aval.sharding)
        where = f"{where} (call {self.round})"
        _wait_ready(results, self.transport, where)
        # The owners keep their offered arrays until every receiver has them.
        self.transport.barrier(f"fetch/{self.round}", where)
        return results


def _variables(tree: Any) -> list[nnx.Variable]:
    """Every Variable of the NNX objects in ``tree``, once, in a deterministic order."""
    found: list[nnx.Variable] = []
    seen: set[int] = set()
    for node in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Pytree | nnx.Variable)):
        if isinstance(node, nnx.Variable):
            candidates = [node]
        elif isinstance(node, nnx.Pytree):
            candidates = [v for _, v in nnx.iter_graph(node) if isinstance(v, nnx.Variable)]
        else:
            continue
        for variable in candidates:
            if id(variable) not in seen:
                seen.add(id(variable))
                found.append(variable)
    return found


def gather(tree: Any, mesh: MpmdMesh) -> Any:
    """Brings placed state to every process as ordinary arrays on its default device.

    A collective: every process calls it with the same tree. Arrays held by
    another process are sent by their owner; NNX objects are updated in place,
    other pytrees come back converted (like ``mp.gather``).

    Args:
      tree: placed models, optimizers, States or pytrees.
      mesh: the `MpmdMesh` the state is placed on.

    Returns:
      ``tree`` with every array local to this process.

    Raises:
      DistributedError: a peer died or timed out.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> mesh = MpmdMesh(jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2]), "stage")
      >>> gather({"w": jnp.ones(2)}, mesh)["w"].shape  # one process: a local copy
      (2,)
    """
    from nnx_mpmd.partition import gather as gather_local

    if not mesh.is_multi_process:
        return gather_local(tree)
    leaves, treedef = jax.tree.flatten(
        tree, is_leaf=lambda x: isinstance(x, nnx.State | nnx.Pytree | nnx.Variable | MpmdArray)
    )
    # Phase 1: every array value, in one deterministic order on every process.
    values: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, nnx.State):
            values.extend(
                v.get_value() if isinstance(v, nnx.Variable) else v
                for _, v in nnx.to_flat_state(leaf)
            )
        elif isinstance(leaf, nnx.Pytree | nnx.Variable):
            values.extend(v.get_value() for v in _variables(leaf))
        else:
            values.append(leaf)
    fetched = iter(_Fetcher(mesh).fetch_all(values, "gathering state"))
    # Phase 2: put the local arrays back in the same order.
    converted = []
    for leaf in leaves:
        if isinstance(leaf, nnx.State):
            converted.append(
                nnx.from_flat_state(
                    [
                        (path, v.replace(next(fetched)))
                        if isinstance(v, nnx.Variable)
                        else (path, next(fetched))
                        for path, v in nnx.to_flat_state(leaf)
                    ]
                )
            )
        elif isinstance(leaf, nnx.Pytree | nnx.Variable):
            for variable in _variables(leaf):
                value, new = variable.get_value(), next(fetched)
                if new is not value:
                    variable.set_value(new)
            converted.append(leaf)
        else:
            converted.append(next(fetched))
    fetched = jax.tree.unflatten(treedef, converted)
    return gather_local(fetched)


def _replicated(local: jax.Array, mesh: MpmdMesh) -> jax.Array:
    host = np.asarray(local)
    sharding = NamedSharding(mesh.jax_mesh, PartitionSpec())
    return jax.make_array_from_callback(
        host.shape, sharding, lambda index: host[index], dtype=host.dtype
    )


def _placed_like(value: Any, like: Any) -> Any:
    """``value`` (a replicated global array) with the placement of ``like``."""
    if isinstance(like, MpmdArray):
        return MpmdArray({q: _placed_like(value, like.array(q)) for q in like.mesh_ids})
    if not isinstance(value, jax.Array) or not isinstance(like, jax.Array):
        return value
    host = np.asarray(value.addressable_shards[0].data)
    return jax.make_array_from_callback(
        host.shape, like.sharding, lambda index: host[index], dtype=host.dtype
    )


@contextlib.contextmanager
def global_view(tree: Any, mesh: MpmdMesh) -> Iterator[Any]:
    """Temporarily gives every Variable in ``tree`` a fully replicated global value.

    Checkpointing libraries (orbax) need every process to pass the same global
    arrays. Inside the block each Variable of the NNX objects in ``tree`` holds
    one ``jax.Array`` replicated over all devices of ``mesh``; on exit each
    Variable gets its placement back, keeping any value written meanwhile (a
    restore). A collective: every process enters it with the same tree.
    It needs each array to fit in every process's memory.

    Args:
      tree: NNX models and optimizers (placed on ``mesh``).
      mesh: the `MpmdMesh`.

    Yields:
      ``tree``.

    Raises:
      DistributedError: a peer died or timed out.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import numpy as np
      >>> from flax import nnx
      >>> mesh = MpmdMesh(jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2]), "stage")
      >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
      >>> with global_view(model, mesh):
      ...     len(model.kernel.get_value().sharding.device_set)
      2
    """
    variables = [
        v
        for v in _variables(tree)
        if isinstance(v.get_value(), jax.Array | MpmdArray)
        and not jax.dtypes.issubdtype(v.get_value().dtype, jax.dtypes.prng_key)
    ]
    originals = [v.get_value() for v in variables]
    if mesh.is_multi_process:
        locals_ = _Fetcher(mesh).fetch_all(originals, "building a global view")
    else:
        locals_ = [_local_copy(value)[0] for value in originals]
    views = [_replicated(local, mesh) for local in locals_]
    for variable, view in zip(variables, views):
        variable.set_value(view)
    try:
        yield tree
    finally:
        for variable, view, original in zip(variables, views, originals):
            current = variable.get_value()
            variable.set_value(original if current is view else _placed_like(current, original))
