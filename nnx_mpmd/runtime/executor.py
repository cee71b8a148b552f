"""The device runtime: how instructions run on real arrays, in one process or many.

`DeviceOperations` is the `nnx_mpmd.runtime.interpreter.Operations` of a real
run: a `Call` runs its program, a `Transfer` puts its value on the destination
submesh (keeping the source's PartitionSpec unless the transfer names one,
reshaping a batch into microbatches on the way; a batch on one device is
split by `nnx_mpmd.runtime.batch_split`), a `TransferBatch` moves all its
values in one batched copy (`nnx_mpmd.runtime.batched_copy`; a single transfer
uses the same path), and a `Free` drops the values of its slots. `execute` is the single-controller
runtime, where one process drives every submesh.

The multi-process runtime
(`nnx_mpmd.runtime.multi_process.execute_multi_process`) is the same
operations in every process, JAX's multi-controller model: a program on a
submesh without this process's devices gives arrays with no local shards, and
only the move of a transfer differs, given as ``put``
(`nnx_mpmd.runtime.cross_process.put`).

JAX's asynchronous dispatch lets each submesh run as soon as its inputs are
ready, so meshes overlap as the schedule intends. An optional profiler records
each task's start and end, and an optional memory recorder the bytes of live
arrays per mesh after every instruction (`nnx_mpmd.runtime.observers`).

The host work per instruction is kept small: a compiled step is prepared into
steps once (kept in the runner's `PreparedCache`, never on the step), each a
closure with its slot numbers and shardings built in, and the loop only calls
them.

Example:
  >>> import jax
  >>> from nnx_mpmd.compiler.ir import Call, ProgramKey, Transfer
  >>> meshes = [jax.make_mesh((1,), ("data",), devices=[d]) for d in jax.devices()[:2]]
  >>> ops = DeviceOperations(Shardings(meshes))
  >>> first = Call(0, ProgramKey("F", stage=0), abs, (0,), 1, "F0.0")
  >>> store = [-2.0, None, None]
  >>> ops.call(0, first)(store)
  2.0
  >>> store[1]
  2.0
  >>> ops.transfer(1, Transfer(1, 2, 1, "x", src_mesh=0)) is not None
  True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_mpmd.compiler.final.step import CompiledStep
from nnx_mpmd.compiler.ir import Call, Free, Transfer, TransferBatch
from nnx_mpmd.compiler.outer.mesh_inference import HOST
from nnx_mpmd.compiler.trace.stage_programs import check_mesh_context
from nnx_mpmd.placement.mpmd_array import MpmdArray
from nnx_mpmd.placement.process_batch import MicrobatchedArray, take_microbatched
from nnx_mpmd.runtime import interpreter
from nnx_mpmd.runtime.batch_split import MicrobatchSplitter, microbatched_shape
from nnx_mpmd.runtime.batched_copy import BatchedCopier, BatchPlan
from nnx_mpmd.runtime.interpreter import Observer, PreparedCache, Step, call_step, free_step
from nnx_mpmd.runtime.observers import MemoryRecorder, Profiler, TaskRecord

__all__ = [
    "DeviceOperations",
    "MemoryRecorder",
    "Shardings",
    "TaskRecord",
    "execute",
    "kept_spec",
    "transfer_value",
    "transferred_shape",
]


class Shardings:
    """A cache of ``NamedSharding(submeshes[mesh], spec)``.

    Args:
      submeshes: the jax Mesh of each mesh id.

    Example:
      >>> import jax
      >>> shardings = Shardings([jax.make_mesh((1,), ("data",))])
      >>> shardings(0, P("data")) is shardings(0, P("data"))
      True
    """

    def __init__(self, submeshes: Sequence[Any]) -> None:
        self.submeshes = submeshes
        self.cache: dict[tuple[int, Any], NamedSharding] = {}

    def __call__(self, mesh: int, spec: Any) -> NamedSharding:
        key = (mesh, spec)
        sharding = self.cache.get(key)
        if sharding is None:
            sharding = self.cache[key] = NamedSharding(self.submeshes[mesh], spec)
        return sharding


def transferred_shape(ins: Transfer, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape ``ins`` delivers for a source of ``shape`` (microbatch reshape).

    Example:
      >>> transferred_shape(Transfer(0, 1, 1, "batch", reshape_microbatches=4), (8, 3))
      (4, 2, 3)
    """
    m = ins.reshape_microbatches
    return microbatched_shape(shape, m) if m else tuple(shape)


def kept_spec(sharding: Any) -> Any:
    """The PartitionSpec a transfer without its own ``spec`` keeps from its source."""
    return sharding.spec if isinstance(sharding, NamedSharding) else P()


def transfer_value(
    ins: Transfer,
    value: Any,
    shardings: Shardings,
    put: Callable[[Any, NamedSharding, bool], jax.Array] | None = None,
) -> jax.Array:
    """``value`` put on ``ins.dst_mesh`` as ``ins`` says (reshape, spec), by ``put`` if given."""
    if isinstance(value, MicrobatchedArray):  # placed by its maker: used as is
        target = shardings(ins.dst_mesh, ins.spec if ins.spec is not None else P())
        return take_microbatched(value, ins.reshape_microbatches, target)
    if ins.reshape_microbatches:
        value = value.reshape(transferred_shape(ins, value.shape))
    spec = ins.spec
    if spec is None:
        spec = kept_spec(getattr(value, "sharding", None))
    target = shardings(ins.dst_mesh, spec)
    if put is not None:
        return put(value, target, ins.src_mesh == HOST)
    if not isinstance(value, jax.Array):
        value = np.asarray(value)
    return jax.device_put(value, target)


class DeviceOperations:
    """Runs instructions on devices (see the module docstring).

    Every process runs every instruction: a program on a submesh without this
    process's devices gives arrays with no local shards.

    Args:
      shardings: the sharding cache of the step's submeshes.
      put: how a transfer moves a value, ``put(value, sharding, from_host)``
        (default ``jax.device_put``); the multi-process runtime gives
        `nnx_mpmd.runtime.cross_process.put`.

    Example:
      >>> import jax
      >>> meshes = [jax.make_mesh((1,), ("data",), devices=[d]) for d in jax.devices()[:2]]
      >>> DeviceOperations(Shardings(meshes)).put is None  # jax.device_put
      True
    """

    def __init__(
        self,
        shardings: Shardings,
        put: Callable[[Any, NamedSharding, bool], jax.Array] | None = None,
    ) -> None:
        self.shardings = shardings
        self.put = put
        self.copier = BatchedCopier()
        self.splitter = MicrobatchSplitter()

    def call(self, index: int, ins: Call) -> Step | None:
        return call_step(ins)

    def free(self, index: int, ins: Free) -> Step | None:
        return free_step(ins)

    def transfer(self, index: int, ins: Transfer) -> Step | None:
        if self.put is not None:
            return self._put_transfer(ins)
        if ins.reshape_microbatches:
            return self._reshaping_transfer(ins)
        return self._batch_step((ins,), single=True)

    def transfer_batch(self, index: int, ins: TransferBatch) -> Step | None:
        reshaping = any(t.reshape_microbatches for t in ins.transfers)
        if self.put is None and not reshaping:
            return self._batch_step(ins.transfers, single=False)
        # One move per member: the put hook moves one value at a time (across
        # processes, batched moves lose data on CPU with jax 0.10.2; see cross_process).
        steps = [self.transfer(index, t) for t in ins.transfers]

        def each(store: list[Any]) -> Any:
            return tuple(step(store) for step in steps)  # type: ignore[misc]

        return each

    def _put_transfer(self, ins: Transfer) -> Step:
        """A transfer through ``self.put`` (`transfer_value` with that move)."""
        src, dst, shardings, put = ins.src, ins.dst, self.shardings, self.put

        def transfer(store: list[Any]) -> Any:
            value = store[dst] = transfer_value(ins, store[src], shardings, put)
            return value

        return transfer

    def _reshaping_transfer(self, ins: Transfer) -> Step:
        """A batch split into microbatches: by the splitter when it can, else `transfer_value`."""
        src, dst, shardings = ins.src, ins.dst, self.shardings
        m = cast(int, ins.reshape_microbatches)  # set: this transfer splits a batch
        split, dst_mesh, spec = self.splitter.split, ins.dst_mesh, ins.spec

        def transfer(store: list[Any]) -> Any:
            value = store[src]
            target = shardings(
                dst_mesh, spec if spec is not None else kept_spec(getattr(value, "sharding", None))
            )
            moved = split(value, m, target)
            if moved is None:
                moved = transfer_value(ins, value, shardings)
            store[dst] = moved
            return moved

        return transfer

    def _batch_step(self, transfers: Sequence[Transfer], single: bool) -> Step:
        """Transfers (no reshape) made by one call of the batched copier.

        Each member's destination sharding is fixed by its spec, or looked up
        once per source sharding (the source's spec kept, as `transfer_value`).
        The step is generated source over the slot numbers: no loop, no
        branch per member. It hands the copier the sources' shardings, so a
        batch whose sources keep them runs on its `BatchPlan` (one batched copy,
        no decision per value).
        """
        copier, shardings = self.copier, self.shardings
        namespace: dict[str, Any] = {
            "planned": copier.planned,
            "plan": BatchPlan(),
            "target_of": _target_lookup,
        }
        targets = []
        for n, t in enumerate(transfers):
            if t.spec is not None:
                namespace[f"t{n}"] = shardings(t.dst_mesh, t.spec)
                targets.append(f"t{n}")
            else:
                namespace[f"k{n}"] = _KeptSpec(shardings, t.dst_mesh)
                targets.append(f"target_of(k{n}, v[{n}])")
        namespace["targets_of"] = eval(f"lambda v: [{', '.join(targets)}]", namespace)
        sources = "".join(f"v[{n}].sharding, " for n in range(len(transfers)))
        dsts = "".join(f"s[{t.dst}], " for t in transfers)
        lines = [
            "def step(s):",
            f"    v = [{', '.join(f's[{t.src}]' for t in transfers)}]",
            "    try:",
            f"        sources = ({sources})",
            "    except AttributeError:  # a host value: no plan",
            "        sources = None",
            "    r = planned(v, sources, plan, targets_of)",
            f"    {dsts} = r",
            "    return r[0]" if single else "    return r",
        ]
        exec("\n".join(lines), namespace)  # the source holds slot numbers only
        return namespace["step"]


class _KeptSpec(dict):
    """Destination shardings of a transfer that keeps its source's spec, by source sharding."""

    def __init__(self, shardings: Shardings, dst_mesh: int) -> None:
        super().__init__()
        self.shardings, self.dst_mesh = shardings, dst_mesh

    def __missing__(self, source: Any) -> NamedSharding:
        target = self[source] = self.shardings(self.dst_mesh, kept_spec(source))
        return target


def _target_lookup(kept: _KeptSpec, value: Any) -> NamedSharding:
    return kept[getattr(value, "sharding", None)]


def _single_process_shardings(
    step: CompiledStep, submeshes: Sequence[Any], prepared: PreparedCache
) -> Shardings:
    """The sharding cache the step was last prepared with, else a new one."""
    for key in reversed(prepared.keys(step)):
        if key[0] == "single":
            return key[1]
    return Shardings(submeshes)


def outputs_of(step: CompiledStep, store: list[Any]) -> list[Any]:
    """The step's outputs from the final slot list: an `MpmdArray` for several copies."""
    outputs = []
    for locations in step.output_slots:
        if len(locations) == 1:
            outputs.append(store[locations[0][1]])
        else:
            outputs.append(MpmdArray({q: store[slot] for q, slot in locations}))
    return outputs


def execute(
    step: CompiledStep,
    inputs: Sequence[Any],
    submeshes: Sequence[Any],
    shardings: Shardings | None = None,
    profile: list[Any] | Observer | None = None,
    memory: MemoryRecorder | None = None,
    watch: Sequence[Observer] = (),
    prepared: PreparedCache | None = None,
) -> list[Any]:
    """Runs ``step`` on ``inputs`` (consts, state leaves, other leaves); returns its outputs.

    Outputs are a jax.Array on one mesh, an `MpmdArray` on several.

    Args:
      submeshes: the jax Mesh of each mesh id.
      profile: a list to append a `TaskRecord` per call to, or an `Observer` recording them
        (each call is waited for).
      memory: records live bytes per mesh after every instruction (each is waited for).
      watch: more observers of the run (`nnx_mpmd.runtime.finite_check.FiniteCheck`).
      prepared: the runner's cache of the step's prepared steps (reused across
        calls); None prepares the step for this call only.

    Raises:
      MeshError: the call is under a ``jax.set_mesh`` context (see `check_mesh_context`).

    Example:
      >>> # Called by `nnx_mpmd.jit` steps: ``step(*args, memory=True)`` fills
      >>> # ``step.last_memory`` through a `MemoryRecorder` passed here.
      >>> callable(execute)
      True
    """
    if submeshes:
        check_mesh_context(submeshes)
    if prepared is None:
        prepared = PreparedCache()
    if shardings is None:
        shardings = _single_process_shardings(step, submeshes, prepared)
    _, steps = prepared.get(step, ("single", shardings), lambda: DeviceOperations(shardings))
    store = interpreter.load_store(step, inputs)
    observers: list[Observer] = []
    if profile is not None:
        observers.append(profile if isinstance(profile, Observer) else Profiler(profile))
    if memory is not None:
        observers.append(memory)
    observers.extend(watch)
    interpreter.run(steps, store, observers)
    return outputs_of(step, store)


#: The old private name of `Shardings` (``nnx_mpmd.jit.jit`` imports it).
_Shardings = Shardings
