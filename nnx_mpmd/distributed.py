"""Multi-process runs: join a ``jax.distributed`` run and move placed state between processes.

JAX's multi-controller model: every process runs the same script, calls
`initialize` first, builds an `MpmdMesh` over all processes' devices (a
submesh may span processes) and calls the same `nnx_mpmd.jit` steps. A
program runs on the processes that hold its submesh's devices; arrays with no
devices of this process are *remote* (`is_remote`). `gather` brings placed state to every
process as ordinary arrays; `global_view` gives every Variable one global,
replicated value for the duration of a ``with`` block (checkpoints do not need
it: `nnx_mpmd.checkpoint` saves placed state directly). Both are collectives: every process calls them in the same order with
the same tree.

``nnx-mpmd launch --processes N -- python script.py`` starts N local processes
with the environment `initialize` reads; on clusters (SLURM, Open MPI,
Kubernetes, Cloud TPU) ``jax.distributed``'s own detection is used. A dead peer
surfaces as `DistributedError` in the survivors. See the multi-process guide.

Each process may build only its own rows of a batch: `batch_shardings` says
where a step reads each batch leaf, `process_batch_rows` which rows this
process's devices hold there, and `make_microbatched_array` builds the leaf
(a `MicrobatchedArray` the step uses as is) from just those rows.

On one process every function here works too: `initialize` returns a
one-process `ProcessInfo`, `gather` is `nnx_mpmd.gather`, and nothing is remote.

Example:
    >>> import nnx_mpmd as mp
    >>> info = mp.distributed.initialize()  # no launcher and no cluster: one process
    >>> info.num_processes, info.is_main
    (1, True)
"""

from __future__ import annotations

import contextlib
import os
import pkgutil
import socket
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from nnx_mpmd._jax_compat import config_value
from nnx_mpmd.errors import DistributedError
from nnx_mpmd.jit.batch_placement import batch_shardings
from nnx_mpmd.placement.mesh import MpmdMesh
from nnx_mpmd.placement.mpmd_array import MpmdArray
from nnx_mpmd.placement.process_batch import (
    MicrobatchedArray,
    make_microbatched_array,
    process_batch_rows,
)
from nnx_mpmd.runtime.coordination import get_coordination, peer_timeout_s, transfer_address
from nnx_mpmd.runtime.multi_process import (
    ENV_COORDINATOR,
    ENV_COORDINATOR_BIND,
    ENV_DEVICES_PER_PROCESS,
    ENV_HEARTBEAT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ProcessInfo,
    cluster_detected,
    collect_local,
    coordination_state,
    coordinator_bind_address,
    env_int,
)

__all__ = [
    "DistributedError",
    "MicrobatchedArray",
    "ProcessInfo",
    "batch_shardings",
    "gather",
    "global_view",
    "initialize",
    "is_remote",
    "make_microbatched_array",
    "process_batch_rows",
]


def initialize(
    *, heartbeat_timeout_s: int | None = None, initialization_timeout_s: int = 120
) -> ProcessInfo:
    """Joins the ``jax.distributed`` run described by the environment; call it first.

    Call it before creating any JAX array. Under ``nnx-mpmd launch`` the
    ``NNX_MPMD_*`` variables say which process this is (a coordinator on
    ``127.0.0.1`` listens on that interface only). Without them,
    ``jax.distributed``'s own cluster detection is used when it finds a cluster
    (SLURM, Open MPI, Kubernetes JobSet, Cloud TPU pods, or
    ``JAX_COORDINATOR_ADDRESS`` & co.); otherwise the script runs as one
    process, so one script works everywhere. In a multi-process run,
    recoverable mode is switched on so that a dead peer surfaces as a
    `DistributedError` in the survivors instead of aborting them, and the
    processes leave in order at exit. On CPU, JAX's cross-process transfers
    (``jax.device_put`` between submeshes of different processes) are set to
    listen on the interface that reaches the coordinator
    (``NNX_MPMD_TRANSFER_ADDRESS=ip:0`` overrides it); GPUs move arrays over
    NCCL and need nothing. Calling it again returns the same answer.

    Args:
      heartbeat_timeout_s: seconds without heartbeats after which a process
        counts as dead (default ``NNX_MPMD_HEARTBEAT_S`` or 10).
      initialization_timeout_s: how long to wait for every process to join.

    Returns:
      A `ProcessInfo` (``process_id``, ``num_processes``, ``coordinator``, ``is_main``).

    Raises:
      DistributedError: the environment is incomplete or inconsistent, or the
        processes could not connect.

    Example:
      >>> info = initialize()  # no launcher, no cluster: one process
      >>> info.process_id, info.num_processes, info.coordinator
      (0, 1, None)
    """
    client, coordinator = coordination_state()
    if client is not None:
        return ProcessInfo(jax.process_index(), jax.process_count(), coordinator)
    names = (ENV_PROCESS_ID, ENV_NUM_PROCESSES, ENV_COORDINATOR)
    given = {name: os.environ[name] for name in names if name in os.environ}
    if given and len(given) != len(names):
        missing = [name for name in names if name not in given]
        raise DistributedError(
            f"incomplete multi-process environment: {sorted(given)} are set but {missing} are "
            "not. Start the script with `nnx-mpmd launch --processes N -- python script.py`, or "
            "set all three variables."
        )
    heartbeat = heartbeat_timeout_s or env_int(ENV_HEARTBEAT, os.environ.get(ENV_HEARTBEAT, "10"))
    devices = os.environ.get(ENV_DEVICES_PER_PROCESS)
    if devices and config_value("jax_platforms") in (None, "", "cpu"):
        jax.config.update("jax_num_cpu_devices", env_int(ENV_DEVICES_PER_PROCESS, devices))
    kwargs: dict[str, Any] = {}
    if given:
        process_id = env_int(ENV_PROCESS_ID, given[ENV_PROCESS_ID])
        num_processes = env_int(ENV_NUM_PROCESSES, given[ENV_NUM_PROCESSES])
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
        bind = coordinator_bind_address(
            given[ENV_COORDINATOR], os.environ.get(ENV_COORDINATOR_BIND)
        )
        if bind is not None:
            kwargs["coordinator_bind_address"] = bind
    elif not cluster_detected():
        return ProcessInfo(0, 1, None)
    jax.config.update("jax_enable_recoverability", True)
    if _runs_on_cpu():
        _enable_cpu_transfers(kwargs.get("coordinator_address") or _cluster_coordinator())
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
    if jax.process_count() > 1:
        get_coordination()  # its exit hook makes the processes leave in order
    return ProcessInfo(jax.process_index(), jax.process_count(), coordination_state()[1])


def _cluster_coordinator() -> str | None:
    """The coordinator address jax's cluster detection would use, if the environment says."""
    return os.environ.get("JAX_COORDINATOR_ADDRESS") or None


def _runs_on_cpu() -> bool:
    """Whether the run's devices will be CPUs (checked before any backend starts).

    ``JAX_PLATFORMS=cpu``, or no platform chosen and no GPU plugin installed.
    """
    platforms = config_value("jax_platforms")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    try:
        # The namespace package of installed PjRt plugins (absent when none is installed).
        import jax_plugins  # pyright: ignore[reportMissingImports]
    except ImportError:
        return True
    names = [m.name for m in pkgutil.iter_modules(getattr(jax_plugins, "__path__", []))]
    return not any("cuda" in name or "rocm" in name for name in names)


def _with_free_port(address: str) -> str:
    """``address`` with port 0 replaced by a port free right now (JAX needs a real one)."""
    host, _, port = address.rpartition(":")
    if port != "0":
        return address
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host.strip("[]"), 0))
        return f"{host}:{probe.getsockname()[1]}"


def _enable_cpu_transfers(coordinator: str | None) -> None:
    """Lets CPU devices of different processes exchange arrays (before the CPU backend starts).

    Sets JAX's cross-host transfer socket, listening on that interface only; set values stay.
    """
    address = transfer_address(coordinator)
    configured = jax.config.values
    if not configured.get("jax_cross_host_transfer_socket_address"):
        jax.config.update("jax_cross_host_transfer_socket_address", _with_free_port(address))
    if not configured.get("jax_cross_host_transport_addresses"):
        jax.config.update("jax_cross_host_transport_addresses", address)
    if configured.get("jax_cross_host_transfer_timeout_seconds") is None:  # a hung peer: bounded
        jax.config.update("jax_cross_host_transfer_timeout_seconds", int(peer_timeout_s()))


def is_remote(x: Any) -> bool:
    """Whether ``x`` is a ``jax.Array`` none of whose shards this process holds.

    Args:
      x: any value.

    Returns:
      True for an array that lives only on other processes' devices (`gather`
      makes it local).

    Example:
      >>> import jax.numpy as jnp
      >>> is_remote(jnp.ones(2)), is_remote(1.0)
      (False, False)
    """
    return isinstance(x, jax.Array) and not x.is_fully_addressable and not x.addressable_shards


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


def _on_default_device(x: Any, device: Any) -> Any:
    if not isinstance(x, jax.Array):
        return x
    # An explicit SingleDeviceSharding also drops Explicit-axis sharding from the type.
    return jax.device_put(x, SingleDeviceSharding(device))


def _default_device() -> Any:
    configured = config_value("jax_default_device")
    return configured if isinstance(configured, jax.Device) else jax.local_devices()[0]


def gather(tree: Any, mesh: MpmdMesh | None = None) -> Any:
    """Brings placed state to every process as ordinary arrays on its default device.

    Like `nnx_mpmd.gather`, and a collective in a multi-process run: every
    process calls it with the same tree. An array held by other processes only
    is sent by the lowest process that holds it; arrays this process holds are
    not copied between processes. NNX objects are updated in place; States and
    other pytrees come back converted. On one process it is `nnx_mpmd.gather`.

    Args:
      tree: placed models, optimizers, States, Variables or pytrees of arrays.
      mesh: the `MpmdMesh` the state is placed on (optional; accepted for
        compatibility, nothing needs it).

    Returns:
      ``tree`` with every array local to this process, on its default device.

    Raises:
      DistributedError: a peer died or timed out.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import nnx_mpmd as mp
      >>> mesh = mp.MpmdMesh(jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2]), "stage")
      >>> model = mp.Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=1)
      >>> _ = mp.place(model, mesh)
      >>> model.kernel.get_value().devices() == {jax.devices()[1]}
      True
      >>> _ = gather(model)
      >>> model.kernel.get_value().devices() == {jax.devices()[0]}
      True
    """
    if jax.process_count() == 1:
        from nnx_mpmd.placement.place import gather as gather_here

        return gather_here(tree)
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
    device = _default_device()
    local = collect_local(values, "gathering state")
    fetched = iter([_on_default_device(x, device) for x in local])
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
    return jax.tree.unflatten(treedef, converted)


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

    A collective (same tree on every process; every array must fit on every device).
    On exit each Variable gets its placement back, keeping values written meanwhile.

    Args:
      tree: NNX models and optimizers (placed on ``mesh``).
      mesh: the `MpmdMesh`.

    Yields:
      ``tree``.

    Raises:
      DistributedError: a peer died or timed out.

    Example:
      >>> import jax
      >>> from flax import nnx
      >>> import nnx_mpmd as mp
      >>> mesh = mp.MpmdMesh(jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2]), "stage")
      >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
      >>> with global_view(model, mesh):
      ...     len(model.kernel.get_value().sharding.device_set)
      2
      >>> len(model.kernel.get_value().sharding.device_set)  # placement restored
      1
    """
    variables = [
        v
        for v in _variables(tree)
        if isinstance(v.get_value(), jax.Array | MpmdArray)
        and not jnp.issubdtype(v.get_value().dtype, jax.dtypes.prng_key)
    ]
    originals = [v.get_value() for v in variables]
    locals_ = collect_local(originals, "building a global view")
    views = [_replicated(local, mesh) for local in locals_]
    for variable, view in zip(variables, views):
        variable.set_value(view)
    try:
        yield tree
    finally:
        for variable, view, original in zip(variables, views, originals):
            current = variable.get_value()
            variable.set_value(original if current is view else _placed_like(current, original))
