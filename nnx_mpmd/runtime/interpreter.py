"""The one interpreter of the instruction list (`Call`, `Transfer`, `TransferBatch`, `Free`).

A compiled step is a flat list of instructions over numbered slots. Running it
has two phases:

1. `prepare` turns each instruction into a *step*: a closure ``step(store)``
   that does the instruction's work on the slot list ``store`` and returns
   what it produced. Which closure is made is decided by an `Operations`
   object, once per instruction: the device operations
   (`nnx_mpmd.runtime.executor.DeviceOperations`) run programs and
   ``jax.device_put`` transfers (in every process of a multi-process run, JAX's
   multi-controller model); the abstract operations of
   `nnx_mpmd.aot.precompile` compile programs ahead of time. An operation
   may return None: the instruction has nothing to do here and leaves no step.
   A `TransferBatch` runs through ``operations.transfer_batch`` where the
   operations have it, else as its members' transfer steps one after another.
2. `run` calls the steps in order. With no observer that is the whole loop;
   `Observer` objects (the profiler, the memory recorder of
   `nnx_mpmd.runtime.observers`) wrap every step with their hooks instead of
   copying the loop.

The slot-store helpers shared by every runtime (`load_store`, `call_step`,
`free_step`, `build`, `value_on`) and the cache of a compiled step's prepared
steps (`PreparedCache`, held by its runner, not by the step) live here too.

Example:
  >>> import jax.numpy as jnp
  >>> from nnx_mpmd.compiler.ir import Call, Free, ProgramKey
  >>> class Plain:  # runs every Call; a transfer has nothing to do (no step)
  ...     def call(self, index, ins):
  ...         return call_step(ins)
  ...     def transfer(self, index, ins):
  ...         return None
  ...     def free(self, index, ins):
  ...         return free_step(ins)
  >>> double = Call(0, ProgramKey("F", stage=0), lambda x: 2 * x, (0,), 1, "F0.0")
  >>> prepared = prepare([double, Free((0,))], Plain())
  >>> store = [jnp.ones(2), None]
  >>> run(prepared, store)
  >>> store[0], store[1].tolist()
  (None, [2.0, 2.0])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

from nnx_mpmd.compiler.ir import Call, Free, Instruction, Transfer, TransferBatch
from nnx_mpmd.compiler.outer.mesh_inference import HOST
from nnx_mpmd.errors import CompileError
from nnx_mpmd.placement.abstract import PlacedAval
from nnx_mpmd.placement.mpmd_array import MpmdArray

__all__ = [
    "Observer",
    "Operations",
    "Prepared",
    "PreparedStep",
    "PreparedCache",
    "Step",
    "build",
    "call_step",
    "free_step",
    "load_store",
    "prepare",
    "run",
    "value_on",
]

#: One prepared instruction: does its work on the slot list, returns what it produced.
Step = Callable[[list[Any]], Any]


class Operations(Protocol):
    """How each kind of instruction runs: a `Step` for it, or None to skip it.

    Called once per instruction by `prepare` (never in the hot loop), with the
    instruction's index in the list (a stable id: multi-process transfers are
    keyed by it).
    """

    def call(self, index: int, ins: Call) -> Step | None: ...

    def transfer(self, index: int, ins: Transfer) -> Step | None: ...

    def free(self, index: int, ins: Free) -> Step | None: ...

    # Optional: ``transfer_batch(index, ins: TransferBatch) -> Step | None`` makes a
    # batch in one move; without it, a batch runs as its members' `transfer` steps.


class Observer:
    """Watches a run: hooks around every prepared step (each a no-op here).

    Subclasses override what they need. An observer that needs a step's result
    finished (timing, memory) waits for it in `after`.
    """

    def start(self, store: list[Any]) -> None:
        """Called once before the first step, with the loaded slot list."""

    def before(self, index: int, ins: Instruction, store: list[Any]) -> None:
        """Called before the step of instruction ``index`` runs."""

    def after(self, index: int, ins: Instruction, result: Any, store: list[Any]) -> None:
        """Called after the step of instruction ``index`` ran, with what it produced."""

    def finish(self, store: list[Any]) -> None:
        """Called once after the last step, also when a step raised."""


class PreparedStep(NamedTuple):
    """A step and the instruction it came from."""

    index: int  # pyright: ignore[reportIncompatibleMethodOverride]: tuple.index is unused here
    instruction: Instruction
    run: Step


class Prepared(NamedTuple):
    """An instruction list turned into steps (skipped instructions left out).

    Attributes:
      entries: each step with its instruction, in order.
      steps: the bare steps, for the loop without observers.
    """

    entries: tuple[PreparedStep, ...]
    steps: tuple[Step, ...]


def prepare(instructions: Sequence[Instruction], operations: Operations) -> Prepared:
    """The `Prepared` steps of ``instructions``, each made by ``operations`` (None: no step).

    Raises:
      CompileError: an instruction is not a `Call`, `Transfer` or `Free`.

    Example:
      >>> from nnx_mpmd.compiler.ir import Free
      >>> class FreeOnly:
      ...     def free(self, index, ins):
      ...         return free_step(ins)
      >>> [entry.index for entry in prepare([Free((0,)), Free((1,))], FreeOnly()).entries]
      [0, 1]
    """
    entries = []
    for index, ins in enumerate(instructions):
        if isinstance(ins, Call):
            step = operations.call(index, ins)
        elif isinstance(ins, Transfer):
            step = operations.transfer(index, ins)
        elif isinstance(ins, Free):
            step = operations.free(index, ins)
        elif isinstance(ins, TransferBatch):
            step = _batch_step(index, ins, operations)
        else:
            raise CompileError(
                f"instruction {index} ({ins!r}) is a {type(ins).__name__}, which the runtime "
                "cannot run: it runs Call, Transfer, TransferBatch and Free. Lower the step to "
                "those (a compiler pass that adds an instruction kind must also teach "
                "nnx_mpmd.runtime.interpreter)."
            )
        if step is not None:
            entries.append(PreparedStep(index, ins, step))
    return Prepared(tuple(entries), tuple(entry.run for entry in entries))


def _batch_step(index: int, ins: TransferBatch, operations: Operations) -> Step | None:
    """``operations.transfer_batch``'s step, else the members' transfer steps in turn."""
    batch = getattr(operations, "transfer_batch", None)
    if batch is not None:
        return batch(index, ins)
    steps = [operations.transfer(index, t) for t in ins.transfers]
    members = tuple(step for step in steps if step is not None)
    if not members:
        return None

    def each(store: list[Any]) -> Any:
        return tuple(step(store) for step in members)

    return each


def run(prepared: Prepared, store: list[Any], observers: Sequence[Observer] = ()) -> None:
    """Runs the prepared steps in order on ``store`` (in place); ``observers`` wrap each step.

    Example:
      >>> record = []
      >>> class Seen(Observer):
      ...     def after(self, index, ins, result, store):
      ...         record.append(index)
      >>> class FreeOnly:
      ...     def free(self, index, ins):
      ...         return free_step(ins)
      >>> run(prepare([Free((0,))], FreeOnly()), [1], [Seen()])
      >>> record
      [0]
    """
    if not observers:
        for step in prepared.steps:
            step(store)
        return
    for observer in observers:
        observer.start(store)
    try:
        for step in tuple(_observed(entry, tuple(observers)) for entry in prepared.entries):
            step(store)
    finally:
        for observer in observers:
            observer.finish(store)


def _observed(entry: PreparedStep, observers: tuple[Observer, ...]) -> Step:
    index, ins, inner = entry

    def step(store: list[Any]) -> Any:
        for observer in observers:
            observer.before(index, ins, store)
        result = inner(store)
        for observer in observers:
            observer.after(index, ins, result, store)
        return result

    return step


OperationsT = TypeVar("OperationsT", bound=Operations)


class PreparedCache:
    """The prepared steps of one compiled step, by key, held by whoever runs it.

    Preparing is paid once per step and key, so a run pays only for the loop.
    The cache belongs to its runner (`nnx_mpmd.jit.stages.Compiled` makes one),
    never to the step: the step IR is not changed by running it. It holds one
    step at a time; a run of another step (a routed copy made once its programs
    compiled) starts it afresh. At most ``max_entries`` keys are kept (one per
    sharding cache and process kind), the oldest dropped first.

    Args:
      max_entries: how many keys' prepared steps to keep.

    Example:
      >>> from types import SimpleNamespace
      >>> step, cache = SimpleNamespace(instructions=[]), PreparedCache()
      >>> ops, prepared = cache.get(step, "k", object)
      >>> cache.get(step, "k", object)[0] is ops, cache.keys(step), vars(step)
      (True, ['k'], {'instructions': []})
    """

    def __init__(self, max_entries: int = 4) -> None:
        self.max_entries = max_entries
        self._step: Any = None
        self._entries: dict[Any, tuple[Any, Prepared]] = {}

    def get(
        self, step: Any, key: Any, make_operations: Callable[[], OperationsT]
    ) -> tuple[OperationsT, Prepared]:
        """``(operations, prepared)`` for ``step``'s instructions under ``key``, made once.

        ``make_operations`` is called only when ``step`` has no prepared steps under ``key``.
        """
        if step is not self._step:
            self._step, self._entries = step, {}
        entries = self._entries
        entry = entries.get(key)
        if entry is None:
            operations = make_operations()
            entry = entries[key] = (operations, prepare(step.instructions, operations))
            while len(entries) > self.max_entries:
                del entries[next(iter(entries))]
        return entry

    def keys(self, step: Any) -> list[Any]:
        """The keys holding prepared steps of ``step``, oldest first (none for another step)."""
        return list(self._entries) if step is self._step else []


# ---------------------------------------------------------------- slot store


def value_on(x: Any, mesh: int) -> Any:
    """The copy of input ``x`` that mesh ``mesh`` reads (``x`` itself unless an `MpmdArray`).

    A `PlacedAval` (an input known by type and placement only, for ahead-of-time
    compilation) gives its copy's ``jax.ShapeDtypeStruct``.
    """
    if mesh != HOST and isinstance(x, MpmdArray):
        return x.array(mesh)
    if isinstance(x, PlacedAval):
        return x.aval if mesh == HOST else x.on(mesh)
    return x


def load_store(
    step: Any,
    inputs: Sequence[Any],
    *,
    convert: Callable[[Any], Any] | None = None,
) -> list[Any]:
    """The ``num_slots`` slot values of a step before its first instruction (None: not loaded).

    ``convert`` is applied to every loaded value (precompile makes them abstract).

    Example:
      >>> from types import SimpleNamespace
      >>> step = SimpleNamespace(num_slots=3, constants={2: 7.0}, input_slots=[{0: 0, 1: 1}])
      >>> load_store(step, [5])
      [5, 5, 7.0]
    """
    store: list[Any] = [None] * step.num_slots
    for slot, value in step.constants.items():
        store[slot] = value if convert is None else convert(value)
    for value, slots_of in zip(inputs, step.input_slots, strict=False):
        if convert is None and not isinstance(value, _PER_MESH):
            for slot in slots_of.values():  # the same value on every mesh (value_on)
                store[slot] = value
            continue
        for q, slot in slots_of.items():
            loaded = value_on(value, q)
            store[slot] = loaded if convert is None else convert(loaded)
    return store


#: Inputs whose copy differs per mesh (`value_on`); any other value is read as is.
_PER_MESH = (MpmdArray, PlacedAval)


def build(store: Any, tree: Any) -> Any:
    """The value of a nested tuple of slots (an ``int`` leaf is ``store[slot]``)."""
    if isinstance(tree, int):
        return store[tree]
    return tuple(build(store, t) for t in tree)


def _build_expr(tree: Any) -> str:
    if isinstance(tree, int):
        return f"s[{tree}]"
    inner = "".join(f"{_build_expr(t)}, " for t in tree)
    return f"({inner})"


def _assign_lines(tree: Any, value: str, lines: list[str]) -> None:
    if isinstance(tree, int):
        lines.append(f"    s[{tree}] = {value}")
        return
    lines.append(f"    if len({value}) != {len(tree)}: mismatch({value}, {len(tree)})")
    for j, t in enumerate(tree):
        _assign_lines(t, f"{value}[{j}]", lines)


def call_step(ins: Call, fn: Callable[..., Any] | None = None) -> Step:
    """The step of ``ins``: calls its program (``fn`` if given) on the slots, stores the results.

    Generated source over the slot numbers: one frame per call, no walk of the slot tree.
    The step raises `CompileError` if the program returns another number of results.

    Example:
      >>> from nnx_mpmd.compiler.ir import Call, ProgramKey
      >>> key = ProgramKey("F", stage=0)
      >>> sum_and_product = Call(0, key, lambda a, b: (a + b, a * b), (0, 1), (2, 3), "F0.0")
      >>> store = [2, 3, None, None]
      >>> call_step(sum_and_product)(store)
      (5, 6)
      >>> store
      [2, 3, 5, 6]
    """

    def mismatch(result: Any, expected: int) -> None:
        raise CompileError(
            f"program {ins.program} ({ins.label}, mesh {ins.mesh}) returned {len(result)} values "
            f"where its instruction stores {expected} (outs={ins.outs!r}); the program and its "
            "instruction disagree, which is a bug in nnx_mpmd's compiler: please report it."
        )

    args = "".join(f"{_build_expr(a)}, " for a in ins.args)
    lines = ["def step(s):", f"    r = fn({args})"]
    _assign_lines(ins.outs, "r", lines)
    lines.append("    return r")
    namespace: dict[str, Any] = {"fn": ins.fn if fn is None else fn, "mismatch": mismatch}
    exec("\n".join(lines), namespace)  # the source holds slot numbers only
    return namespace["step"]


def free_step(ins: Free) -> Step:
    """The step of ``ins``: drops the values of its slots.

    Example:
      >>> store = [1, 2, 3]
      >>> free_step(Free((0, 2)))(store), store
      (None, [None, 2, None])
    """
    if not ins.slots:
        return lambda store: None
    targets = " = ".join(f"s[{int(slot)}]" for slot in ins.slots)
    namespace: dict[str, Any] = {}
    exec(f"def free(s):\n    {targets} = None", namespace)  # slot numbers only
    return namespace["free"]
