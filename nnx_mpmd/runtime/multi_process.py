"""The multi-controller runtime: every process runs the same step under ``jax.distributed``.

Every process traces and compiles the same step, so all of them hold the same
instruction list, and every process runs all of it through the one
interpreter (`nnx_mpmd.runtime.interpreter`), as JAX's multi-controller model
wants: a program on a submesh runs on the processes that hold its devices (a
submesh may span several processes, and a process may hold devices of several
submeshes), and the other processes get a global ``jax.Array`` with no
addressable shards. Transfers are ``jax.device_put`` calls, made by every
process alike (`nnx_mpmd.runtime.cross_process`).

Arrays on other processes' devices are *remote*: shape, dtype and sharding
only. The step's user outputs (the loss, metrics) are made readable on every
process. At the end of each step a process waits for its own results while
polling the liveness of its peers: a dead peer raises `DistributedError` naming
it within about a second of the coordination service noticing
(``heartbeat_timeout_seconds``), never a hang.

The public entry points (``initialize``, ``gather``, ``global_view``,
``is_remote``) live in `nnx_mpmd.distributed`, a floor above this module.

Example:
    >>> from nnx_mpmd.runtime.multi_process import ENV_NUM_PROCESSES, launch_env
    >>> env = launch_env(1, 2, "127.0.0.1:1234", devices_per_process=4)
    >>> env[ENV_NUM_PROCESSES], env["NNX_MPMD_PROCESS_ID"], env["NNX_MPMD_COORDINATOR_BIND"]
    ('2', '1', '127.0.0.1:1234')
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from nnx_mpmd import _jax_compat
from nnx_mpmd.compiler.final.step import CompiledStep
from nnx_mpmd.compiler.ir import Transfer
from nnx_mpmd.compiler.outer.mesh_inference import HOST
from nnx_mpmd.compiler.trace.stage_programs import check_mesh_context
from nnx_mpmd.errors import DistributedError
from nnx_mpmd.placement.mesh import MpmdMesh
from nnx_mpmd.placement.partition import MpmdArray
from nnx_mpmd.runtime import cross_process, interpreter
from nnx_mpmd.runtime.coordination import Coordination, get_coordination
from nnx_mpmd.runtime.executor import DeviceOperations, Shardings, outputs_of
from nnx_mpmd.runtime.interpreter import PreparedCache, Step
from nnx_mpmd.runtime.observers import Profiler
from nnx_mpmd.runtime.process_env import (  # the launcher's light half, re-exported here
    ENV_COORDINATOR,
    ENV_COORDINATOR_BIND,
    ENV_DEVICES_PER_PROCESS,
    ENV_HEARTBEAT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    coordinator_bind_address,
    launch_env,
)

__all__ = [
    "ENV_COORDINATOR",
    "ENV_COORDINATOR_BIND",
    "ENV_DEVICES_PER_PROCESS",
    "ENV_HEARTBEAT",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ProcessInfo",
    "cluster_detected",
    "collect_local",
    "coordination_state",
    "coordinator_bind_address",
    "ProcessOperations",
    "execute_multi_process",
    "launch_env",
]


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


def env_int(name: str, value: str) -> int:
    """``int(value)`` of environment variable ``name``, or a `DistributedError` saying so.

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
    """``(client, coordinator address)`` of this ``jax.distributed`` run, or ``(None, None)``.

    Example:
      >>> coordination_state()  # a single-process test run
      (None, None)
    """
    return _jax_compat.coordination_state()


def cluster_detected() -> bool:
    """Whether ``jax.distributed`` would find a cluster itself (or ``JAX_COORDINATOR_ADDRESS``).

    Example:
      >>> isinstance(cluster_detected(), bool)
      True
    """
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    return _jax_compat.cluster_environment_present()


_ROUNDS = itertools.count(1)


def _wait_ready(values: Sequence[Any], coordination: Coordination, where: str) -> None:
    """Blocks until this process's shards of ``values`` are ready; a dead peer raises."""
    arrays = []
    for value in jax.tree.leaves(values):
        copies = value.arrays.values() if isinstance(value, MpmdArray) else [value]
        for copy in copies:
            if isinstance(copy, jax.Array):
                arrays.extend(shard.data for shard in copy.addressable_shards)
    while not all(a.is_ready() for a in arrays):
        coordination.check_peers(where)
        time.sleep(0.002)
    try:
        jax.block_until_ready(arrays)
    except Exception as e:
        coordination.blame_peers(where)
        raise DistributedError(
            f"process {coordination.process_id} failed while {where}: {e}. A transfer from a "
            "peer failed (it may have died or timed out); check every process's log."
        ) from None
    coordination.check_peers(where, force=True)


class ProcessOperations(DeviceOperations):
    """`DeviceOperations` whose transfers move through the put hook and say which one failed.

    A transfer that raises (a peer died mid-transfer, JAX refused the move)
    becomes a `DistributedError` naming it: its index and label, the source
    and destination meshes and the processes that hold them. Before that,
    ``on_failure`` (the coordination's ``blame_peers``) gets a chance to name a
    dead peer instead, which is the likelier cause.

    Args:
      shardings: the sharding cache of the submeshes.
      put: how a transfer moves a value (`nnx_mpmd.runtime.cross_process.put`).
      on_failure: called with a description of what failed before the error
        is raised (may raise itself); None: nothing.

    Example:
      >>> import jax
      >>> from nnx_mpmd.runtime.executor import Shardings
      >>> meshes = [jax.make_mesh((1,), ("data",), devices=[d]) for d in jax.devices()[:2]]
      >>> def refuse(value, sharding, from_host):
      ...     raise RuntimeError("socket closed")
      >>> ops = ProcessOperations(Shardings(meshes), put=refuse)
      >>> step = ops.transfer(7, Transfer(0, 1, dst_mesh=1, label="act s0->s1 mb0", src_mesh=0))
      >>> try:
      ...     step([jax.numpy.ones(2), None])
      ... except DistributedError as e:
      ...     print(str(e).split(". If")[0])
      transfer 7 'act s0->s1 mb0' from mesh 0 (processes [0]) to mesh 1 (processes [0]) failed on
      process 0: RuntimeError: socket closed
    """

    def __init__(
        self,
        shardings: Shardings,
        put: Any = cross_process.put,
        on_failure: Any = None,
    ) -> None:
        super().__init__(shardings, put=put)
        self.on_failure = on_failure

    def transfer(self, index: int, ins: Transfer) -> Step | None:
        step = super().transfer(index, ins)
        if step is None:
            return None
        on_failure, submeshes = self.on_failure, self.shardings.submeshes

        def named(store: list[Any]) -> Any:
            try:
                return step(store)  # type: ignore[misc]
            except Exception as e:
                what = describe_transfer(index, ins, submeshes)
                if on_failure is not None and not isinstance(e, DistributedError):
                    on_failure(f"making {what}")  # a dead peer is named first
                raise DistributedError(
                    f"{what} failed on process {jax.process_index()}: "
                    f"{type(e).__name__}: {e}. If a process died or stalled, its log says why; "
                    "otherwise every process must run the same step with the same arguments."
                ) from e

        return named


def describe_transfer(index: int, ins: Transfer, submeshes: Sequence[Any]) -> str:
    """``transfer 3 'act s0->s1 mb0' from mesh 0 (processes [0, 1]) to mesh 1 (...)``.

    Example:
      >>> import jax
      >>> meshes = [jax.make_mesh((1,), ("data",), devices=[d]) for d in jax.devices()[:2]]
      >>> describe_transfer(0, Transfer(0, 1, dst_mesh=1, label="batch"), meshes)
      "transfer 0 'batch' from the host to mesh 1 (processes [0])"
    """

    def where(mesh: int) -> str:
        if mesh == HOST:
            return "the host"
        processes = sorted({int(d.process_index) for d in submeshes[mesh].devices.flat})
        return f"mesh {mesh} (processes {processes})"

    return f"transfer {index} {ins.label!r} from {where(ins.src_mesh)} to {where(ins.dst_mesh)}"


def execute_multi_process(
    step: CompiledStep,
    inputs: Sequence[Any],
    mesh: MpmdMesh,
    shardings: Shardings | None = None,
    profile: Any = None,
    observers: Sequence[Any] = (),
    prepared: PreparedCache | None = None,
) -> list[Any]:
    """Runs ``step`` in this process of a multi-process run (see the module docstring).

    Every process calls it alike. User outputs come back whole on every process; state
    outputs are global arrays (remote where this process has no devices).

    Args:
      step: the compiled step; inputs: its consts, state leaves and other leaves.
      mesh: the multi-process `MpmdMesh`; shardings: its sharding cache (None: a new one).
      profile: a list for `TaskRecord` s, or an observer recording them.
      observers: more observers of the run (`nnx_mpmd.runtime.finite_check.FiniteCheck`).
      prepared: the runner's cache of the step's prepared steps (reused across
        calls); None prepares the step for this call only.

    Raises:
      DistributedError: a peer died or timed out, or a transfer cannot be made
        (the message names it).

    Example:
      >>> execute_multi_process.__name__  # needs a jax.distributed run; see the guide
      'execute_multi_process'
    """
    submeshes = list(mesh.submeshes)
    check_mesh_context(submeshes)
    shardings = shardings or Shardings(submeshes)
    coordination = get_coordination()
    _, steps = (prepared or PreparedCache()).get(
        step,
        ("processes", shardings),
        lambda: ProcessOperations(shardings, on_failure=coordination.blame_peers),
    )
    where = f"running a step (call {next(_ROUNDS)})"
    store = interpreter.load_store(step, inputs)
    try:
        watching = list(observers)
        if isinstance(profile, interpreter.Observer):
            watching.append(profile)
        elif profile is not None:
            watching.append(Profiler(profile))
        interpreter.run(steps, store, watching)
    except DistributedError:
        raise
    except Exception:  # a transfer or program refused while a peer was dying: say so
        coordination.blame_peers(where)
        raise
    outputs = outputs_of(step, store)
    n_user = step.num_user_outputs
    outputs[:n_user] = [cross_process.to_every_process(x) for x in outputs[:n_user]]
    _wait_ready(outputs, coordination, where)
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
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_host(x: jax.Array) -> np.ndarray:
    return np.asarray(jax.random.key_data(x) if _is_key(x) else x)


def _from_host(host: np.ndarray, like: Any, device: Any) -> jax.Array:
    value = jax.device_put(host, device)
    return (
        jax.random.wrap_key_data(value, impl=jax.random.key_impl(like)) if _is_key(like) else value
    )


def collect_local(values: Sequence[Any], where: str) -> list[Any]:
    """Every array of ``values`` as an array this process holds whole (a collective).

    A missing one is sent by the lowest holder through the key-value store (split ones are
    replicated on their submesh first); other values come back unchanged.

    Raises:
      DistributedError: a peer died or timed out.

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
    exchanged = False  # from shardings only: the same on every process
    for i, x in enumerate(values):
        if not isinstance(x, jax.Array | MpmdArray):
            continue
        providers, mine = _whole_copies(x, me)
        if not providers:  # split over processes: replicate it on its own submesh first
            x = _replicated_on_own_mesh(x)
            providers, mine = _whole_copies(x, me)
        if not providers:
            copy = x.array(x.mesh_ids[0]) if isinstance(x, MpmdArray) else x
            processes = sorted({d.process_index for d in copy.sharding.device_set})
            raise DistributedError(
                f"while {where}: value {i} (shape {tuple(x.shape)}, sharding {copy.sharding}) is "
                f"split over processes {processes} and no process holds all of it, even after "
                "replicating it on its own submesh. This is a bug in nnx_mpmd: please report "
                "it with the mesh and the array's sharding."
            )
        if mine is None:
            incoming.append((i, min(providers), x))
        else:
            results[i] = mine
        if everyone - providers:
            exchanged = True
            if me == min(providers):
                outgoing[i] = cast(jax.Array, mine)  # a provider holds a whole copy
    if not exchanged:  # the same decision on every process: no collective needed
        return results
    coordination = get_coordination()
    round_ = next(_ROUNDS)
    keys = {i: f"fetch/{round_}/{i}" for i in outgoing}
    for i, array in outgoing.items():
        coordination.publish_array(keys[i], _to_host(array))
    device = jax.local_devices()[0]
    for i, sender, like in incoming:
        shape = jax.eval_shape(jax.random.key_data, like) if _is_key(like) else like
        host = coordination.fetch_array(
            f"fetch/{round_}/{i}", sender, shape.shape, shape.dtype, where
        )
        results[i] = _from_host(host, like, device)
    where = f"{where} (call {round_})"
    _wait_ready(results, coordination, where)
    # Every receiver has its copy once all arrived here: the keys can go.
    coordination.barrier(f"fetch/{round_}", where)
    for key in keys.values():
        coordination.delete(key)
    return results


def _replicated_on_own_mesh(x: jax.Array | MpmdArray) -> jax.Array | MpmdArray:
    """``x`` with its first copy replicated over that copy's submesh (a collective)."""
    copy = x.array(x.mesh_ids[0]) if isinstance(x, MpmdArray) else x
    if not isinstance(copy.sharding, NamedSharding):
        return copy
    return jax.device_put(copy, NamedSharding(copy.sharding.mesh, PartitionSpec()))
