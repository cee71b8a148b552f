"""Compiling a step's programs concurrently before its first run.

The first run of a compiled step would compile its stage programs one after
the other, each when the executor first reaches it. XLA compilation releases
the GIL, so programs whose argument shapes and shardings are known can compile
side by side. This module runs the instruction list through the same
interpreter as a real run (`nnx_mpmd.runtime.interpreter`), with *abstract*
operations: slots hold ``jax.ShapeDtypeStruct`` values with shardings (or a
pending job that will know them), a call's outputs become known when its
program is compiled (``lowered.out_info`` with the compiled output shardings),
and a transfer's output is its input on the destination mesh. Each distinct
``(program, argument signature)`` is lowered and compiled once in a thread
pool, as soon as its arguments are known; ``jax.jit``'s own cache then serves
the real run.

Programs that are the same module on equal-shaped submeshes (middle stages,
virtual stages) are compiled once when asked (``loaded=``): the others load
that executable for their own devices (`nnx_mpmd.aot.program_sharing`),
and the caller routes their calls to it. A program whose `Call.structure`,
donated arguments and argument types say it is such a program (a stage equal
to another, or an optimizer program of a mesh that holds the same layers as
another) is not even traced or lowered: it waits for its twin's executable.

It is an optimisation only: a program whose abstract arguments turn out to
differ from the real ones is compiled again by the real call, and a program
that fails to lower here raises its error in the real call, where the error
belongs.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from nnx_mpmd.aot import program_sharing
from nnx_mpmd.aot.compile_jobs import (
    UNKNOWN,
    ProgramCompiler,
    abstract,
)
from nnx_mpmd.compiler.final.step import CompiledStep
from nnx_mpmd.compiler.ir import Call, Free, Transfer, slots_in
from nnx_mpmd.compiler.trace.region import microbatch_spec
from nnx_mpmd.runtime import interpreter
from nnx_mpmd.runtime.executor import Shardings, kept_spec, transferred_shape
from nnx_mpmd.runtime.interpreter import Step, build

__all__ = ["AwaitedProgram", "Precompiling", "precompile", "route_calls", "start_precompile"]


_STEP_BATCH_AXIS = object()  # precompile's default: the step's own batch axis


def _assign(store: dict[int, Any], tree: Any, value: Any) -> None:
    if isinstance(tree, int):
        store[tree] = value
        return
    if value is UNKNOWN or not isinstance(value, tuple | list) or len(value) != len(tree):
        for slot in slots_in(tree):
            store[slot] = UNKNOWN
        return
    for t, v in zip(tree, value, strict=True):
        _assign(store, t, v)


class _Pending(NamedTuple):
    """Slot ``slot`` of the dict that ``job`` will hold (None: the job's whole value)."""

    job: Future
    slot: int | None
    traced: Future | None = None  # the same, with shapes only, once traced


def precompile(
    step: CompiledStep,
    inputs: Sequence[Any],
    submeshes: Sequence[Any],
    shardings: Shardings | None = None,
    max_workers: int | None = None,
    batch_axis: Any = _STEP_BATCH_AXIS,
    executables: dict[str, list[Any]] | None = None,
    loaded: dict[str, list[Any]] | None = None,
) -> int:
    """Compiles the programs of ``step``'s first run concurrently; returns how many it compiled.

    A receiver is compiled for a guessed sharding so no stage waits for another's compilation.

    Args:
      inputs: consts, state leaves, other leaves (values or `PlacedAval`).
      submeshes: the jax Mesh of each mesh id.
      executables: if given, receives XLA's compiled programs by program name.
      loaded: if given, receives the programs loaded from an equal compiled module.

    Example:
      >>> # `nnx_mpmd.jit` calls it before a new step's first run.
      >>> callable(precompile)
      True
    """
    return start_precompile(
        step, inputs, submeshes, shardings, max_workers, batch_axis, executables, loaded
    ).finish()


def start_precompile(
    step: CompiledStep,
    inputs: Sequence[Any],
    submeshes: Sequence[Any],
    shardings: Shardings | None = None,
    max_workers: int | None = None,
    batch_axis: Any = _STEP_BATCH_AXIS,
    executables: dict[str, list[Any]] | None = None,
    loaded: dict[str, list[Any]] | None = None,
) -> Precompiling:
    """`precompile`, returning a `Precompiling` handle once every compilation is scheduled.

    Read ``executables[name]`` after ``wait_for(name)``, ``loaded`` after ``finish()`` (once).

    Example:
      >>> # `nnx_mpmd.jit` runs a new step's first tasks while later ones compile.
      >>> callable(start_precompile)
      True
    """
    if batch_axis is _STEP_BATCH_AXIS:
        batch_axis = step.batch_axis
    shardings = shardings or Shardings(submeshes)
    workers = max_workers or min(8, os.cpu_count() or 2)
    slots = interpreter.load_store(step, inputs, convert=abstract)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="nnx-mpmd-compile")
    operations = _AbstractOperations(
        pool, shardings, submeshes, batch_axis, executables, share=loaded is not None
    )
    try:
        interpreter.run(interpreter.prepare(step.instructions, operations), slots)
    except BaseException:
        Precompiling(pool, operations, None).finish()
        raise
    return Precompiling(pool, operations, loaded)


class Precompiling:
    """A step's programs compiling in a thread pool (see `start_precompile`).

    Args:
      pool: the pool the compilations run in.
      operations: the abstract run that scheduled them.
      loaded: `precompile`'s ``loaded``, filled in by ``finish()``.
    """

    def __init__(
        self, pool: ThreadPoolExecutor, operations: Any, loaded: dict[str, list[Any]] | None
    ) -> None:
        self._pool, self._operations, self._loaded = pool, operations, loaded
        self._compiled: int | None = None

    @property
    def sources(self) -> dict[int, Any]:
        """How to serialize each executable, by id (`compile_jobs.ProgramCompiler.sources`)."""
        return self._operations.compiler.sources

    def wait_for(self, name: str) -> None:
        """Waits until every compilation of program ``name`` has finished (or failed)."""
        wait(self._operations.by_name.get(name, ()))

    def finish(self) -> int:
        """Waits for every compilation; returns how many programs were compiled here."""
        if self._compiled is None:
            wait(self._operations.jobs)  # before the pool closes: jobs submit their dependants
            self._pool.shutdown(wait=True)
            compiler = self._operations.compiler
            if self._loaded is not None:
                self._loaded.update(compiler.loaded)
            self._compiled = int(compiler.compiled)
        return self._compiled


class AwaitedProgram:
    """A program's callable that waits for its ahead-of-time compilations on first call.

    Then it runs `program_sharing.SharedProgram` over the executables compiled
    or loaded for it (``resolved()``), or, if there are none, the program's own
    ``jit`` function.

    Args:
      name: the program's name (``F0``).
      fn: its jitted function.
      compiling: the step's `Precompiling`.
      executables: the dict `start_precompile` fills, by program name.
    """

    def __init__(
        self, name: str, fn: Any, compiling: Precompiling, executables: dict[str, list[Any]]
    ) -> None:
        self.name, self.fn, self._compiling, self._executables = name, fn, compiling, executables
        self._run: Any = None

    def resolved(self) -> Any:
        """The callable calls go to once this program's compilations are done."""
        if self._run is None:
            self._compiling.wait_for(self.name)
            found = self._executables.get(self.name)
            self._run = program_sharing.SharedProgram(self.fn, found) if found else self.fn
        return self._run

    def __call__(self, *args: Any) -> Any:
        return (self._run or self.resolved())(*args)

    def __repr__(self) -> str:
        return f"AwaitedProgram({self.name!r})"


class _AbstractOperations:
    """The interpreter's operations over abstract values (see the module docstring).

    A slot holds its abstract value, or a `_Pending` while the job that derives
    it runs. A call's job starts in the pool once every job it reads from has
    finished, so threads never wait on each other (except on a duplicate
    signature's compilation); a transfer's job is cheap and runs in the thread
    that finished its input. Frees change nothing here.
    """

    def __init__(
        self,
        pool: ThreadPoolExecutor,
        shardings: Shardings,
        submeshes: Sequence[Any],
        batch_axis: str | None,
        executables: dict[str, list[Any]] | None = None,
        share: bool = False,
    ) -> None:
        self.pool = pool
        self.shardings = shardings
        self.submeshes = submeshes
        self.batch_axis = batch_axis
        self.compiler = ProgramCompiler(executables, share)
        self.jobs: list[Future] = []
        self.by_name: dict[str, list[Future]] = {}  # program name -> its compile jobs

    def call(self, index: int, ins: Call) -> Step:
        def start_compiling(slots: list[Any]) -> Future:
            reads = {slot: slots[slot] for slot in ins.reads()}
            traced: Future = Future()
            mesh = self.submeshes[ins.mesh] if 0 <= ins.mesh < len(self.submeshes) else None
            job = _after(
                self.pool, reads.values(), _run_call, self.compiler, ins, reads, traced, mesh
            )
            self.jobs += [job, traced]
            self.by_name.setdefault(str(ins.program), []).append(job)
            for slot in ins.writes():
                slots[slot] = _Pending(job, slot, traced)
            return job

        return start_compiling

    def transfer(self, index: int, ins: Transfer) -> Step:
        def derive(slots: list[Any]) -> Future | None:
            if ins.value_type is not None and ins.spec is not None:
                # the compiler knows the moved value's type: no need to wait for its program
                shape, dtype, weak = ins.value_type
                slots[ins.dst] = jax.ShapeDtypeStruct(
                    transferred_shape(ins, shape),
                    jax.numpy.dtype(dtype),
                    sharding=self.shardings(ins.dst_mesh, ins.spec),
                    weak_type=weak,
                )
                return None
            source = slots[ins.src]
            guess = None
            if ins.per_microbatch and ins.spec is None and 0 <= ins.dst_mesh < len(self.submeshes):
                guess = _Guess(self.submeshes[ins.dst_mesh], self.batch_axis)
            if (
                guess is not None
                and guess.reliable()
                and isinstance(source, _Pending)
                and source.traced is not None
            ):
                early = _Pending(source.traced, source.slot)
                job = _after(None, [early], _run_transfer, ins, early, self.shardings, guess)
            else:
                job = _after(None, [source], _run_transfer, ins, source, self.shardings, None)
            self.jobs.append(job)
            slots[ins.dst] = _Pending(job, None)
            return job

        return derive

    def free(self, index: int, ins: Free) -> None:
        return None


def _after(pool: ThreadPoolExecutor | None, inputs: Any, fn: Any, *args: Any) -> Future:
    """A future of ``fn(*args)``, run once every pending input is done.

    It runs in ``pool``, or with no pool (cheap work) in the thread that
    finished the last input.
    """
    result: Future = Future()
    deps = [value.job for value in inputs if isinstance(value, _Pending)]
    remaining = [len(deps)]
    lock = threading.Lock()

    def run() -> None:
        try:
            value = fn(*args)
        except Exception:  # an optimisation only: the real run reports errors
            value = UNKNOWN
        if isinstance(value, Future):
            value.add_done_callback(lambda done: result.set_result(done.result()))
        else:
            result.set_result(value)

    def on_done(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            ready = remaining[0] == 0
        if ready:
            start()

    def start() -> None:
        if pool is None:
            run()
        else:
            pool.submit(run)

    if not deps:
        start()
    for dep in deps:
        dep.add_done_callback(on_done)
    return result


def _resolve(value: Any) -> Any:
    if not isinstance(value, _Pending):
        return value
    result = value.job.result()
    if result is UNKNOWN or value.slot is None:
        return result
    return result.get(value.slot, UNKNOWN)


def _run_call(
    compiler: ProgramCompiler, ins: Call, reads: dict[int, Any], traced: Future, mesh: Any = None
) -> Any:
    def by_slot(result: Any) -> Any:
        out: dict[int, Any] = {}
        _assign(out, ins.outs, result)
        return out

    def on_traced(result: Any) -> None:
        if not traced.done():
            traced.set_result(by_slot(result))

    try:
        values = {slot: _resolve(value) for slot, value in reads.items()}
        args = tuple(build(values, a) for a in ins.args)
        # Calls of one program may donate differently (`donate_dead_arguments`).
        structure = None if ins.structure is None else (ins.structure, ins.donated)
        result = compiler.outputs(ins.fn, args, on_traced, str(ins.program), mesh, structure)
    except Exception:
        result = UNKNOWN
    if isinstance(result, Future):  # a duplicate: finish when its owner does
        finished: Future = Future()

        def done(owner: Future) -> None:
            on_traced(owner.result())
            finished.set_result(by_slot(owner.result()))

        result.add_done_callback(done)
        return finished
    on_traced(UNKNOWN)  # a no-op once traced: transfers waiting on it go on
    return by_slot(result)


class _Guess(NamedTuple):
    """How a per-microbatch value on Auto axes is laid out, before its program compiles.

    XLA chooses the layout of an Auto-typed result when it compiles; guessing it
    lets the reader's compilation start early. A wrong guess costs a second
    compilation of the reader, inside the step, so it is only made where the
    batch axis is the submesh's only axis of more than one device (rows over
    it, or replicated); elsewhere (a "model" axis, say) the transfer waits.
    """

    mesh: Any
    batch_axis: str | None

    def reliable(self) -> bool:
        return all(
            size == 1 or name == self.batch_axis for name, size in dict(self.mesh.shape).items()
        )

    def spec(self, shape: tuple[int, ...]) -> Any:
        # As each microbatch is placed (on Explicit axes, a spec is part of the
        # type, so a size-1 axis must not be named where the batch is not).
        spec = microbatch_spec(shape, self.mesh, self.batch_axis)
        return P() if spec is None else spec


def _run_transfer(ins: Transfer, source: Any, shardings: Shardings, guess: _Guess | None) -> Any:
    value = _resolve(source)
    if isinstance(value, np.ndarray | np.generic | int | float | bool | complex):
        # a host value: the transfer puts np.asarray(value), a committed array of its
        # canonical dtype that is never weakly typed (a Python scalar included)
        dtype = jax.dtypes.canonicalize_dtype(np.result_type(value))
        value = jax.ShapeDtypeStruct(np.shape(value), dtype, weak_type=False)
    if not isinstance(value, jax.ShapeDtypeStruct):
        return UNKNOWN
    shape = transferred_shape(ins, value.shape)
    spec = ins.spec
    if spec is None and guess is not None and value.sharding is None:
        spec = guess.spec(value.shape)
    elif spec is None:
        spec = kept_spec(value.sharding)
    return jax.ShapeDtypeStruct(
        shape, value.dtype, sharding=shardings(ins.dst_mesh, spec), weak_type=value.weak_type
    )


def route_calls(
    compiled: CompiledStep, make: Callable[[str, Callable[..., Any]], Callable[..., Any]]
) -> tuple[CompiledStep, dict[str, Any]]:
    """A copy of ``compiled`` whose calls go to ``make(program name, function)``; the step itself
    stays as lowered, and the runtime's per-step caches start afresh on the copy.

    Returns:
      The routed copy, and the callables made, by program name.

    Example:
      >>> # `nnx_mpmd.jit.programs` routes a step's calls to their compiled executables.
      >>> callable(route_calls)
      True
    """
    made: dict[str, Any] = {}
    routed = []
    for ins in compiled.instructions:
        if isinstance(ins, Call):
            name = str(ins.program)
            if name not in made:
                made[name] = make(name, ins.fn)
            ins = dataclasses.replace(ins, fn=made[name])
        routed.append(ins)
    return dataclasses.replace(compiled, instructions=routed), made
