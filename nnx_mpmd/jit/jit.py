"""The public entry points: `jit` (a `PipelinedFunction`) and `value_and_grad`."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from nnx_mpmd._jax_compat import take_cached_partial_nodes
from nnx_mpmd.aot import step_store
from nnx_mpmd.aot.precompile import AwaitedProgram, route_calls, start_precompile
from nnx_mpmd.compiler.final.step import CompiledStep, compile_step
from nnx_mpmd.compiler.trace.trace_step import (
    FlatArgs,
    flatten_step_args,
    refreshed_flat_args,
    reusable_flat_args,
)
from nnx_mpmd.errors import CompileError, MeshError, ScheduleError
from nnx_mpmd.jit import graph_key
from nnx_mpmd.jit.donation import donated_positions, donated_state_leaves
from nnx_mpmd.jit.stages import Compiled as Compiled
from nnx_mpmd.jit.stages import Lowered as Lowered
from nnx_mpmd.jit.static_args import argument_positions, check_disjoint, wrap_static
from nnx_mpmd.placement.abstract import PlacedAval, placed_aval, planned_avals
from nnx_mpmd.placement.mesh import MpmdMesh
from nnx_mpmd.placement.place import place
from nnx_mpmd.runtime.executor import MemoryRecorder, TaskRecord, _Shardings, execute
from nnx_mpmd.runtime.finite_check import FiniteCheck
from nnx_mpmd.runtime.interpreter import forget_prepared
from nnx_mpmd.runtime.timeline_profiler import Profile, TimelineProfiler
from nnx_mpmd.schedules.registry import as_schedule

__all__ = [
    "MAX_COMPILED_STEPS",
    "Compiled",
    "Lowered",
    "PipelinedFunction",
    "jit",
]

# How many input signatures one `PipelinedFunction` keeps compiled (least recently
# used dropped first).
MAX_COMPILED_STEPS = 16


@contextlib.contextmanager
def _older_objects_left_alone() -> Any:
    """Python's collector leaves the objects that existed before the block alone.

    Tracing and lowering a step allocate many objects, so the collector runs
    often, and each full collection walks every object of the process (the
    model, its jaxprs, earlier steps): 0.2-0.3 s of a warm first step of GPT
    tiny. Frozen (`gc.freeze`) for the block, those older objects are skipped;
    garbage among them waits for the first collection after it. Nothing is
    changed when the collector is off or the caller froze objects already.
    """
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _write_back(flat: FlatArgs, new_leaves: list[Any]) -> None:
    """Stores a step's new state leaves into the caller's Variables."""
    if flat.variables is None:
        nnx.update(flat.nodes, jax.tree.unflatten(flat.state_tree, new_leaves))
        return
    for variable, value in zip(flat.variables, new_leaves, strict=True):
        variable.set_raw_value(value)


class _Signature:
    """A step's cache key, hashed once, its graphdef's hash given.

    A dict look-up and its LRU move would hash a tuple key twice, and a Flax
    graphdef recomputes its hash over every node each time.
    """

    __slots__ = ("_hash", "graphdef", "rest")

    def __init__(self, graphdef: Any, graphdef_hash: int, rest: tuple[Any, ...]) -> None:
        self.graphdef, self.rest = graphdef, rest
        self._hash = hash((graphdef_hash, rest))

    def __hash__(self) -> int:
        return self._hash

    def frozen(self) -> _Signature:
        """This key as the cache stores it: unhashable static values copied (`frozen_graphdef`)."""
        stored = object.__new__(_Signature)
        stored.graphdef = graph_key.frozen_graphdef(self.graphdef)
        stored.rest, stored._hash = self.rest, self._hash
        return stored

    def __getitem__(self, index: Any) -> Any:
        """Reads like the tuple ``(graphdef, state_tree, args_tree, state keys, other keys)``."""
        return (self.graphdef, *self.rest)[index]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Signature):
            return NotImplemented
        return (
            self._hash == other._hash
            and (self.graphdef is other.graphdef or self.graphdef == other.graphdef)
            and self.rest == other.rest
        )


class _DefaultBatchAxis(str):
    """The default ``batch_axis``: ``"data"`` when the submeshes have it, else None."""

    __slots__ = ()


DEFAULT_BATCH_AXIS = _DefaultBatchAxis("data")


_PROFILE_MODES = {True: "timeline", "timeline": "timeline", "isolated": "isolated"}


def _profile_mode(profile: Any) -> str | None:
    """``"timeline"``, ``"isolated"`` or None (not profiled) for a call's ``profile=``."""
    if profile is False or profile is None:
        return None
    if isinstance(profile, bool | str) and profile in _PROFILE_MODES:
        return _PROFILE_MODES[profile]
    raise CompileError(
        f"profile={profile!r} is not a profiling mode; use profile=True (or 'timeline': "
        "meshes overlap as they do unprofiled), profile='isolated' (each program waited "
        "for before the next is dispatched: clean per-task times) or profile=False."
    )


def _resolve_batch_axis(batch_axis: Any, mesh: MpmdMesh) -> str | None:
    """The batch axis a step uses; a name the submeshes lack is an error, never ignored."""
    if batch_axis is None:
        return None
    if isinstance(batch_axis, _DefaultBatchAxis):  # not given: "data" if there is one
        return "data" if "data" in mesh.axis_names else None
    return mesh.check_submesh_axis(
        batch_axis,
        argument="mp.jit(batch_axis=...): batch_axis",
        fix="or batch_axis=None to replicate the batch on every device of a submesh",
    )


class PipelinedFunction:
    """A step compiled by `jit`; call it like the original function.

    Calling it runs the step (``profile=True`` records when each task ran on
    its mesh in ``last_profile``, a `nnx_mpmd.runtime.timeline_profiler.Profile`
    whose ``plot(path)`` draws the measured timeline beside the simulated one;
    ``profile="isolated"`` waits for each program before dispatching the next,
    for clean per-task times; ``memory=True`` records per-mesh live bytes in
    ``last_memory``); ``lower(*args)`` lowers it without running or moving state, and
    ``lower(*args).compile()`` compiles it ahead of time. Arguments may be
    given by keyword as the step's signature names them (``f(model, opt,
    batch=batch)``), except keyword-only ones; ``profile`` and ``memory`` are
    this object's own.

    Example:
      >>> import jax, optax
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import nnx_mpmd as mp
      >>> model = mp.Stage(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), stage=0)
      >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> def step(model, opt, x):
      ...     loss, grads = mp.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2))(model, x)
      ...     opt.update(model, grads)
      ...     return loss
      >>> mesh = mp.MpmdMesh(jax.make_mesh((1,), ("stage",), devices=jax.devices()[:1]), "stage")
      >>> f = mp.jit(step, mesh=mesh, schedule=mp.GPipe(), num_microbatches=2)
      >>> isinstance(f, mp.PipelinedFunction)
      True
      >>> loss = f(model, opt, jnp.ones((4, 4)), profile=True)
      >>> [record[1] for record in f.last_profile][-1]
      'post.L0.mesh0'
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        mesh: MpmdMesh,
        schedule: Any,
        num_microbatches: int,
        batch_axis: str | None = DEFAULT_BATCH_AXIS,
        transfer_warning_bytes: int = 1 << 20,
        compile_threads: int | None = None,
        donate_argnums: int | Sequence[int] = (),
        donate_argnames: str | Sequence[str] = (),
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
        check_finite: bool = False,
    ) -> None:
        if not isinstance(mesh, MpmdMesh):
            raise MeshError(
                f"mp.jit(mesh=...) needs an mp.MpmdMesh, got {type(mesh).__name__}; wrap it: "
                "mp.MpmdMesh(jax_mesh, 'stage')."
            )
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise CompileError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}.")
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.mesh = mesh
        self.schedule = as_schedule(schedule, "mp.jit(schedule=...)")
        self.num_microbatches = num_microbatches
        self.batch_axis = _resolve_batch_axis(batch_axis, mesh)
        if compile_threads is not None and (
            not isinstance(compile_threads, int) or compile_threads < 1
        ):
            raise CompileError(
                f"compile_threads must be an int >= 1 or None, got {compile_threads!r}; "
                "use 1 to compile each program when the first run reaches it."
            )
        self.transfer_warning_bytes = transfer_warning_bytes
        self.compile_threads = compile_threads
        self.check_finite = _check_finite_option(check_finite)
        self.donate_argnums = donated_positions(fn, donate_argnums, donate_argnames)
        self.static_argnums = argument_positions(fn, static_argnums, static_argnames, "static")
        check_disjoint(self.static_argnums, self.donate_argnums)
        # Compiled steps by input signature, least recently used first; bounded so
        # that a long-lived step called with ever new signatures (a fresh optax
        # transformation each time, say) does not grow without limit.
        self._cache: collections.OrderedDict[Any, CompiledStep] = collections.OrderedDict()
        # XLA executables of each cached step compiled ahead of time, by id of the step.
        self._executables: dict[int, dict[str, list[Any]]] = {}
        # Steps whose first call runs while their programs compile, by id of the step.
        self._compiling: dict[int, tuple[Any, dict[str, AwaitedProgram]]] = {}
        self._shardings = _Shardings(list(mesh.submeshes))
        self._last_graphdef: tuple[Any, int] = (None, 0)  # (graphdef, its hash): _signature
        # Under `nnx.cached_partial`: the structure of its private node copies'
        # flattened arguments (no arrays), by id of its node cache; an entry goes
        # when that cache does (with the partial), so no dropped model stays alive.
        self._cached_partial_args: dict[int, tuple[weakref.ref, FlatArgs]] = {}
        self.last_profile: Profile | None = None
        self.last_memory: dict[str, Any] | None = None

    def _signature(
        self, flat: FlatArgs, state_avals: list[PlacedAval], other_avals: list[PlacedAval]
    ) -> Any:
        """The cache key: structure, shapes, dtypes and placements of the arguments.

        Hashed once (`_Signature`); a graphdef equal to the last one seen is
        replaced by that object, so comparing keys finds it by identity.
        """
        graphdef = flat.graphdef
        last, last_hash = self._last_graphdef
        if last is not None and (last is graphdef or last == graphdef):
            graphdef, graphdef_hash = last, last_hash
        else:
            graphdef_hash = graph_key.graphdef_hash(graphdef)
            self._last_graphdef = (graphdef, graphdef_hash)
        rest = (
            flat.state_tree,
            flat.args_tree,
            tuple(a.key() for a in state_avals),
            tuple(a.key() for a in other_avals),
        )
        return _Signature(graphdef, graphdef_hash, rest)

    def _lowered(
        self, flat: FlatArgs, state_avals: list[PlacedAval], other_avals: list[PlacedAval]
    ) -> CompiledStep:
        """The step lowered for these avals: from the cache, or lowered now."""
        key = self._signature(flat, state_avals, other_avals)
        compiled = self._cached(key)
        if compiled is not None:
            return compiled
        compiled = compile_step(
            self.fn,
            flat,
            self.mesh,
            self.schedule,
            self.num_microbatches,
            state_avals=state_avals,
            other_avals=other_avals,
            batch_axis=self.batch_axis,
            transfer_warning_bytes=self.transfer_warning_bytes,
            donated_state=donated_state_leaves(flat, self.donate_argnums),
        )
        self._cache[key.frozen()] = compiled
        while len(self._cache) > MAX_COMPILED_STEPS:
            evicted = self._cache.popitem(last=False)[1]
            self._finish_compiling(evicted)
            self._executables.pop(id(evicted), None)
        return compiled

    def _cached(self, key: Any) -> CompiledStep | None:
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
        return compiled

    def _planned(self, flat: FlatArgs) -> list[PlacedAval]:
        """Where the state leaves will live once placed (no data moves)."""
        try:
            return planned_avals(flat.nodes, flat.state_leaves, self.mesh, self.schedule)
        except ScheduleError as e:
            raise ScheduleError(
                f"{type(self.schedule).__name__} cannot place this step's state on "
                f"{self.mesh.num_meshes} meshes: {e}"
            ) from None

    def _compile_programs(
        self, compiled: CompiledStep, inputs: list[Any], overlap: bool = False
    ) -> dict[str, list[Any]]:
        """Compiles ``compiled``'s programs ahead of time, once per lowered step.

        In one process, a program whose lowered module equals one compiled for
        an equal-shaped submesh is not compiled again: the executable is loaded
        for its devices. Every call in ``compiled.instructions`` then goes to
        its program's executables (`nnx_mpmd.aot.program_sharing.SharedProgram`),
        set before the step first runs, so that no module is loaded twice.

        With ``overlap`` (a step's first call, one process), this returns once
        the compilations are scheduled: each program's first call waits for
        its own (`nnx_mpmd.aot.precompile.AwaitedProgram`), so the first
        tasks run while later programs compile; `_finish_compiling` then
        routes the calls to their executables directly, and stores them for
        later processes (`nnx_mpmd.aot.step_store`). A step that an earlier
        process stored is neither traced nor compiled: its calls go to the
        stored executables.
        """
        found = self._executables.get(id(compiled))
        if found is not None:
            if not overlap:
                self._finish_compiling(compiled)
            return found
        found = self._executables[id(compiled)] = {}
        loaded: dict[str, list[Any]] | None = None if self.mesh.is_multi_process else {}
        key = None
        if loaded is not None:  # an earlier process may have stored this step's programs
            key, stored = step_store.lookup(
                compiled, inputs, self.mesh, self.schedule, self.num_microbatches
            )
            if stored is not None:
                found.update(stored)
                route_calls(compiled, lambda name, fn: step_store.stored_program(fn, stored, name))
                forget_prepared(compiled)
                return found
        compiling = start_precompile(
            compiled,
            inputs,
            list(self.mesh.submeshes),
            self._shardings,
            max_workers=self.compile_threads,
            batch_axis=compiled.batch_axis,  # None where the step replicates it
            executables=found,
            loaded=loaded,
        )
        if loaded is None:  # several processes: every program runs its own jit function
            compiling.finish()
            return found
        # Before the step is first prepared (the prepared steps are cached on it).
        awaited = route_calls(compiled, lambda name, fn: AwaitedProgram(name, fn, compiling, found))
        self._compiling[id(compiled)] = (compiling, awaited, key)
        if not overlap:
            self._finish_compiling(compiled)
        return found

    def _finish_compiling(self, compiled: CompiledStep) -> None:
        """Waits for ``compiled``'s ahead-of-time compilations; calls go to their executables."""
        pending = self._compiling.pop(id(compiled), None)
        if pending is None:
            return
        compiling, awaited, key = pending
        compiling.finish()
        if key is not None:
            step_store.store_step(key, self._executables.get(id(compiled), {}), compiling.sources)
        route_calls(compiled, lambda name, fn: awaited[name].resolved())
        forget_prepared(compiled)

    def _prepare(
        self,
        args: tuple[Any, ...],
        compiling: contextlib.ExitStack | None = None,
        partial_nodes: Any = None,
    ) -> tuple[FlatArgs, CompiledStep]:
        from nnx_mpmd.compiler.trace.stage_programs import check_mesh_context

        check_mesh_context(self.mesh)  # before placing: no jax.set_mesh around the call
        flat = self._flatten(args, partial_nodes)
        state_avals = [placed_aval(x, self.mesh) for x in flat.state_leaves]
        other_avals = [placed_aval(x, self.mesh) for x in flat.other_leaves]
        # Every cached lowering is for state placed where `place` puts it: a hit
        # means the state is placed; a miss places it (a no-op for placed leaves).
        compiled = self._cached(self._signature(flat, state_avals, other_avals))
        if compiled is None:
            if compiling is not None:
                compiling.enter_context(_older_objects_left_alone())
            planned = self._planned(flat)
            if [a.key() for a in planned] != [a.key() for a in state_avals]:
                place(flat.nodes, self.mesh, self.schedule)
                flat = self._flatten(args, partial_nodes)
                state_avals = [placed_aval(x, self.mesh) for x in flat.state_leaves]
            compiled = self._lowered(flat, state_avals, other_avals)
        if self.compile_threads != 1 and not self.mesh.is_multi_process:
            inputs = [*compiled.consts, *flat.state_leaves, *flat.other_leaves]
            self._compile_programs(compiled, inputs, overlap=True)
        return flat, compiled

    def _flatten(self, args: tuple[Any, ...], partial_nodes: Any) -> FlatArgs:
        """The step's arguments flattened; under `nnx.cached_partial`, without walking the graph.

        ``nnx.cached_partial(step, model, optimizer)`` passes private copies of
        the nodes whose structure cannot change (``partial_nodes`` is its node
        cache), so after the first call their flattening is kept and only the
        Variables' arrays are read again.
        """
        if partial_nodes is None:
            return flatten_step_args(self.fn, args)
        known = self._cached_partial_args.get(id(partial_nodes))
        if known is not None and known[0]() is partial_nodes:
            flat = refreshed_flat_args(known[1], self.fn, args)
            if flat is not None:
                return flat
        flat = flatten_step_args(self.fn, args)
        if reusable_flat_args(flat, partial_nodes):
            key, entries = id(partial_nodes), self._cached_partial_args
            ref = weakref.ref(partial_nodes, lambda _: entries.pop(key, None))
            structure = dataclasses.replace(flat, state_leaves=[], other_leaves=[], args_leaves=[])
            self._cached_partial_args[key] = (ref, structure)
        return flat

    def __call__(
        self, *args: Any, profile: bool | str = False, memory: bool = False, **kwargs: Any
    ) -> Any:
        # First: an error raised while nnx.cached_partial's cache is still set would
        # surface as Flax's "no context consumed it" instead of our own.
        partial_nodes = take_cached_partial_nodes()
        mode = _profile_mode(profile)
        with contextlib.ExitStack() as compiling:
            positional = self._positional(args, kwargs)
            flat, compiled = self._prepare(positional, compiling, partial_nodes)
            try:
                return self._run(flat, compiled, mode, memory)
            finally:
                self._finish_compiling(compiled)

    def _positional(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """``args`` and ``kwargs`` as the step's positional arguments, static ones wrapped.

        A parameter left out before one given by keyword takes its default.
        """
        name = getattr(self.fn, "__name__", "step")
        return wrap_static(self._bound(args, kwargs), self.static_argnums, name)

    def _bound(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        if not kwargs:
            return args
        name = getattr(self.fn, "__name__", "step")
        try:
            bound = inspect.signature(self.fn).bind(*args, **kwargs)
        except TypeError as e:
            raise CompileError(f"cannot call {name} with these arguments: {e}.") from None
        positional = [
            p
            for p in bound.signature.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        given = [i for i, p in enumerate(positional) if p.name in bound.arguments]
        for p in positional[: max(given, default=-1) + 1]:  # a default before a given one
            bound.arguments.setdefault(p.name, p.default)
        if bound.kwargs:
            raise CompileError(
                f"{name} takes {', '.join(sorted(bound.kwargs))} by keyword only; mp.jit "
                "passes a step's arguments by position: make them ordinary parameters "
                "(before any *args) or pass them positionally."
            )
        return bound.args

    def _run(
        self, flat: FlatArgs, compiled: CompiledStep, profile: str | None, memory: bool
    ) -> Any:
        inputs = [*compiled.consts, *flat.state_leaves, *flat.other_leaves]
        records: list[TaskRecord] = []
        profiler: Any = None
        if profile == "timeline":
            profiler = TimelineProfiler(records)
        elif profile == "isolated":
            profiler = records
        recorder = None
        check = [FiniteCheck(compiled)] if self.check_finite else []
        if self.mesh.is_multi_process:
            from nnx_mpmd.runtime.multi_process import execute_multi_process

            outputs = execute_multi_process(
                compiled, inputs, self.mesh, self._shardings, profiler, check
            )
        else:
            submeshes = list(self.mesh.submeshes)
            recorder = MemoryRecorder(submeshes) if memory else None
            outputs = execute(
                compiled, inputs, submeshes, self._shardings, profiler, recorder, check
            )
        if profile is not None:
            timed = isinstance(profiler, TimelineProfiler)
            self.last_profile = Profile(
                records,
                tasks=compiled.tasks,
                transfers=profiler.transfers if timed else (),
                mode=profile,
                approximate=profiler.approximate if timed else 0,
            )
        if recorder is not None:
            self.last_memory = recorder.summary()
        user = outputs[: compiled.num_user_outputs]
        _write_back(flat, outputs[compiled.num_user_outputs :])
        for finite_check in check:
            if self.mesh.is_multi_process:
                finite_check.agree_across_processes()  # every process raises the same
            finite_check.raise_if_found()  # after the write-back: the donated state is whole
        return jax.tree.unflatten(compiled.out_tree, user)

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Lowers the step for ``args`` without running it or moving any state.

        State that is not placed yet is lowered for where `mp.place` would put
        it; a later call (which places it) finds this lowering in the cache.

        Returns:
          A `Lowered`: its passes, instructions and programs; ``compile()`` it for
          a `Compiled` with XLA's memory and cost analyses.
        """
        with _older_objects_left_alone():
            compiled, abstract_inputs = self._lower_abstract(self._positional(args, kwargs))

        def compile_programs(step: CompiledStep) -> dict[str, list[Any]]:
            with _older_objects_left_alone():
                return self._compile_programs(step, abstract_inputs)

        return Lowered(compiled, self.mesh, compile_fn=compile_programs, run_fn=self)

    def _lower_abstract(self, args: tuple[Any, ...]) -> tuple[CompiledStep, list[PlacedAval]]:
        """The lowering for ``args`` as placed by `mp.place`, and its abstract inputs."""
        from nnx_mpmd.compiler.trace.stage_programs import check_mesh_context

        check_mesh_context(self.mesh)
        flat = flatten_step_args(self.fn, args)
        state_avals = self._planned(flat)
        other_avals = [placed_aval(x, self.mesh) for x in flat.other_leaves]
        compiled = self._lowered(flat, state_avals, other_avals)
        consts = [placed_aval(c, self.mesh) for c in compiled.consts]
        return compiled, [*consts, *state_avals, *other_avals]

    @property
    def num_compiled_steps(self) -> int:
        """How many distinct input signatures have been lowered (and are cached)."""
        return len(self._cache)


def jit(
    fn: Callable[..., Any] | None = None,
    *,
    mesh: MpmdMesh,
    schedule: Any,
    num_microbatches: int,
    batch_axis: str | None = DEFAULT_BATCH_AXIS,
    transfer_warning_bytes: int = 1 << 20,
    compile_threads: int | None = None,
    donate_argnums: int | Sequence[int] = (),
    donate_argnames: str | Sequence[str] = (),
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    check_finite: bool = False,
) -> Any:
    """Compiles an NNX train step into per-mesh programs driven by a schedule.

    The step is an ordinary function of NNX objects (models, optimizers) and
    pytrees. Its pipelined region is the call of `value_and_grad`; everything
    else (the optimizer update, clipping, metrics) runs on the meshes that use
    its results. NNX objects are updated in place after the call, like
    ``nnx.jit``; state is placed on the first call if needed and stays placed.
    Compiled programs are cached per input structure, shapes, dtypes and
    shardings.

    Args:
      fn: the step (or None, to use ``jit`` as a decorator factory).
      mesh: the `MpmdMesh` whose submeshes run the stages.
      schedule: a schedule object (``mp.OneFOneB()``...) or a registered name
        (``"1f1b"``, as `nnx_mpmd.schedules.get_schedule` reads it).
      num_microbatches: microbatches per step (the batch's leading axis must
        divide into them).
      batch_axis: the submesh axis that shards each microbatch's leading axis
        when it divides evenly (None: replicate the batch). Default: ``"data"``
        when the submeshes have that axis, else None. A name the submeshes lack
        (or the mpmd axis) raises `MeshError` here, at ``jit`` time.
      transfer_warning_bytes: warn about transfers outside the pipelined region
        larger than this.
      compile_threads: threads that compile a new step's programs side by side
        before its first run (default: the number of CPUs, at most 8; 1 compiles
        each program when the run first reaches it, one after the other).
      donate_argnums: positions of NNX arguments (model, optimizer) whose state
        the step may reuse for its new state, as with ``nnx.jit``: the update
        writes new parameters and optimizer state into the old buffers instead
        of holding both. After the call the old arrays are deleted; the
        objects hold the new ones. Array arguments (the batch) are not donated.
      donate_argnames: the same by parameter name.
      static_argnums: positions of arguments that are not traced, as with
        ``jax.jit``: the step sees the Python value (``if train:`` works) and
        each distinct value compiles a step of its own. Values must be hashable
        and hold no NNX objects or arrays.
      static_argnames: the same by parameter name.
      check_finite: check every stage task's outputs, input cotangents and
        parameter gradients for NaN and inf, and raise `NonFiniteError` after
        the step naming the first (stage, task, parameter path). Off, the step
        passes NaN and inf through as JAX does, at no cost; on, each task is
        waited for. In a multi-process run each process checks what it holds and
        all of them name the same first value.

    Returns:
      A `PipelinedFunction`.

    Example:
      >>> import functools, jax, optax
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import nnx_mpmd as mp
      >>> class MLP(mp.PipelinedModel):
      ...     def __init__(self, rngs):
      ...         self.a = mp.Stage(nnx.Linear(4, 4, rngs=rngs), stage=0)
      ...         self.b = mp.Stage(nnx.Linear(4, 1, rngs=rngs), stage=1)
      ...     def __call__(self, x):
      ...         return self.b(jnp.tanh(self.a(x)))
      >>> mesh = mp.MpmdMesh(jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2]), "stage")
      >>> model = MLP(nnx.Rngs(0))
      >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> loss_fn = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
      >>> @functools.partial(mp.jit, mesh=mesh, schedule=mp.OneFOneB(), num_microbatches=2)
      ... def step(model, opt, batch):
      ...     loss, grads = mp.value_and_grad(loss_fn)(model, batch)
      ...     opt.update(model, grads)
      ...     return loss
      >>> batch = {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 1))}
      >>> float(step(model, opt, batch)) > 0
      True
    """
    if fn is None:
        return functools.partial(
            jit,
            mesh=mesh,
            schedule=schedule,
            num_microbatches=num_microbatches,
            batch_axis=batch_axis,
            transfer_warning_bytes=transfer_warning_bytes,
            compile_threads=compile_threads,
            donate_argnums=donate_argnums,
            donate_argnames=donate_argnames,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            check_finite=check_finite,
        )
    return PipelinedFunction(
        fn,
        mesh=mesh,
        schedule=schedule,
        num_microbatches=num_microbatches,
        batch_axis=batch_axis,
        transfer_warning_bytes=transfer_warning_bytes,
        compile_threads=compile_threads,
        donate_argnums=donate_argnums,
        donate_argnames=donate_argnames,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        check_finite=check_finite,
    )


def _check_finite_option(check_finite: Any) -> bool:
    """``mp.jit(check_finite=...)``, checked: a bool (any mesh, multi-process ones too)."""
    if not isinstance(check_finite, bool):
        raise CompileError(f"check_finite must be True or False, got {check_finite!r}.")
    return check_finite
