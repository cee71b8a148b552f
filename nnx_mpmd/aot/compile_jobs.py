"""Each distinct program traced, lowered and compiled once, for `precompile`.

`ProgramCompiler.outputs` turns a program and its abstract arguments
(``jax.ShapeDtypeStruct`` values with shardings) into its abstract outputs,
compiling it on the way. With sharing on (one process), a program whose
lowered module equals one compiled for an equal-shaped submesh loads that
executable for its own devices (`nnx_mpmd.aot.program_sharing`), and a
program whose `Call.structure` says so in advance (its *twin* was traced) is
not traced or lowered at all. Failures are never raised here: the value is
`UNKNOWN`, and the real call raises where the error belongs.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, cast

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

from nnx_mpmd.aot import program_sharing
from nnx_mpmd.compiler.codegen import compile_program
from nnx_mpmd.placement.mesh import mesh_shape_key
from nnx_mpmd.placement.process_batch import MicrobatchedArray

__all__ = [
    "UNKNOWN",
    "ProgramCompiler",
    "Unknown",
    "abstract",
    "abstract_outputs",
    "committed_to",
    "on_devices_of",
    "contains_unknown",
    "signature",
    "typed_outputs",
]


class Unknown:
    """A slot whose abstract value could not be derived (its producer failed)."""


UNKNOWN = Unknown()


def abstract(x: Any) -> Any:
    """``x`` with each device array replaced by its ``ShapeDtypeStruct`` (sharding kept)."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=x.sharding, weak_type=getattr(x, "weak_type", False)
        )
    if isinstance(x, jax.ShapeDtypeStruct) or x is None:
        return x
    if isinstance(x, MicrobatchedArray):  # typed like the host batch it stands for
        return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=False)
    if isinstance(x, np.ndarray | np.generic | int | float | bool | complex):
        return x  # host values stay concrete: jit keys them by type and shape
    return jax.tree.map(abstract, x)


def signature(value: Any, equivalent_shardings: bool = False) -> Any:
    """A hashable key of an abstract argument tuple: its tree, shapes, dtypes, shardings.

    With ``equivalent_shardings``, shardings that differ only in their specs' trailing
    Nones (`program_sharing.normal_sharding`) give one key.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
      >>> a, b = (jax.ShapeDtypeStruct((2, 2), jnp.float32, sharding=NamedSharding(mesh, s))
      ...         for s in (P(), P(None, None)))
      >>> signature((a,)) == signature((b,)), signature((a,), True) == signature((b,), True)
      (False, True)
    """
    leaves, tree = jax.tree.flatten(value)
    key = []
    for leaf in leaves:
        if isinstance(leaf, jax.ShapeDtypeStruct):
            sharding = leaf.sharding
            if equivalent_shardings:
                sharding = program_sharing.normal_sharding(sharding)
            key.append((leaf.shape, str(leaf.dtype), sharding, leaf.weak_type))
        else:
            key.append((type(leaf).__name__, np.shape(leaf), str(np.result_type(leaf))))
    return tree, tuple(key)


def abstract_outputs(out_tree: Any, out_avals: Any, shardings: Any) -> Any:
    """Abstract outputs (weak types kept: ``Lowered.out_info`` drops them)."""
    avals = jax.tree.leaves(out_avals)
    if shardings is None:
        flat_shardings = [None] * len(avals)
    else:
        flat_shardings = jax.tree.leaves(
            shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding)
        )
    if not (len(avals) == len(flat_shardings) == out_tree.num_leaves):
        return UNKNOWN
    return jax.tree.unflatten(
        out_tree,
        [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s, weak_type=a.weak_type)
            for a, s in zip(avals, flat_shardings, strict=True)
        ],
    )


def typed_outputs(out_avals: Any, mesh: Any) -> Any:
    """The outputs' shardings as their types say, on a submesh whose axes are all Explicit.

    There the traced types are the shardings the call will produce, so a
    transfer of a traced output needs no guess (see `precompile`); elsewhere
    (Auto axes: XLA chooses) None.
    """
    types = getattr(mesh, "axis_types", ())
    if not types or any(t != AxisType.Explicit for t in types):
        return None
    shardings = []
    for aval in jax.tree.leaves(out_avals):
        spec = getattr(getattr(aval, "sharding", None), "spec", None)
        if spec is None:
            return None
        shardings.append(NamedSharding(mesh, spec))
    return shardings


def _traced_outputs(traced: Any, mesh: Any) -> Any:
    """A traced program's abstract outputs on ``mesh``, before it is compiled."""
    return abstract_outputs(
        traced.out_tree, traced.out_avals, typed_outputs(traced.out_avals, mesh)
    )


def committed_to(args: Any, mesh: Any) -> bool:
    """Whether some argument is on ``mesh`` and none elsewhere (then jit runs on ``mesh``)."""
    on_mesh = False
    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            continue
        if not (isinstance(sharding, NamedSharding) and sharding.mesh == mesh):
            return False
        on_mesh = True
    return on_mesh


def on_devices_of(args: Any, mesh: Any) -> bool:
    """Whether some argument is on ``mesh``'s devices, in its order, and none elsewhere.

    Unlike `committed_to`, other axis types count (an Auto copy of an Explicit submesh).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
      >>> explicit = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> auto = jax.make_mesh((2,), ("data",), (AxisType.Auto,), devices=jax.devices()[:2])
      >>> x = jax.device_put(jnp.ones(4), NamedSharding(auto, P("data")))
      >>> on_devices_of((x,), explicit), committed_to((x,), explicit), on_devices_of((x,), None)
      (True, False, False)
    """
    if mesh is None:
        return False
    on_mesh = False
    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            continue
        if not isinstance(sharding, NamedSharding) or not program_sharing.same_devices(
            cast(Mesh, sharding.mesh), mesh
        ):
            return False
        on_mesh = True
    return on_mesh


def contains_unknown(value: Any) -> bool:
    """Whether some leaf of ``value`` is `UNKNOWN`."""
    return any(leaf is UNKNOWN for leaf in jax.tree.leaves(value, is_leaf=lambda x: x is UNKNOWN))


class ProgramCompiler:
    """Traces, lowers and compiles each distinct (program, signature) once.

    With ``share=True``, a program whose lowered module equals one compiled
    for an equal-shaped submesh (`nnx_mpmd.aot.program_sharing`) is not
    compiled: once that compilation finishes, the other's executable is loaded
    for its devices, or, on the same devices, used as it is (two argument
    signatures that lower to one module, ``P()`` and ``P(None, None)`` say),
    and recorded in ``loaded`` by program name.
    """

    def __init__(
        self, executables: dict[str, list[Any]] | None = None, share: bool = False
    ) -> None:
        self.lock = threading.Lock()
        self.jobs: dict[Any, Future] = {}
        self.compiled = 0
        # XLA's compiled programs by program name, for Compiled.memory_analysis().
        self.executables = executables
        self.share = share
        # share key -> Future of (executable, submesh) of the program compiled for it
        self.shared: dict[Any, Future] = {}
        # twin key -> Future of (traced, share key) of the first program traced for it
        self.twins: dict[Any, Future] = {}
        self.loaded: dict[str, list[Any]] = {}
        # How to serialize each executable for `nnx_mpmd.aot.step_store`, by its
        # id: ``(thunk, submesh)``; none for one that JAX's persistent cache loaded.
        self.sources: dict[int, tuple[Any, Any]] = {}

    def outputs(
        self,
        fn: Any,
        args: tuple[Any, ...],
        on_traced: Any,
        name: str = "",
        mesh: Any = None,
        structure: Any = None,
    ) -> Any:
        """The abstract outputs of ``fn(*args)``, or a Future of them.

        A Future when another job compiles the same signature (or a twin's module), so no thread
        waits; ``on_traced`` gets the output shapes as soon as known. A twin is not even traced.
        """
        if contains_unknown(args) or not hasattr(fn, "trace"):
            on_traced(UNKNOWN)
            return UNKNOWN
        # Sharing on, calls go to `SharedProgram`, which runs one executable for equivalent
        # shardings: those compile once (the accumulators' P() from an init, P(None, None) later).
        routed = self.share and self.executables is not None
        key = (id(fn), signature(args, equivalent_shardings=routed))
        with self.lock:
            job = self.jobs.get(key)
            owner = job is None
            if owner:
                job = self.jobs[key] = Future()
        if not owner:
            return job
        twin: Future | None = None
        mesh_free = _mesh_free_signature(args) if structure is not None else None
        if self.share and mesh_free is not None and committed_to(args, mesh):
            twin_key = (structure, mesh_free, mesh_shape_key(mesh))
            with self.lock:
                first = self.twins.get(twin_key)
                if first is None:
                    twin = self.twins[twin_key] = Future()
            if first is not None:
                return self._load_twin(first, fn, args, job, name, mesh, on_traced)
        return self._trace_and_compile(fn, args, on_traced, name, mesh, job, twin)

    def _trace_and_compile(
        self,
        fn: Any,
        args: tuple[Any, ...],
        on_traced: Any,
        name: str,
        mesh: Any,
        job: Future,
        twin: Future | None,
    ) -> Any:
        """The owner's work: trace, lower, then compile or load an equal module's executable.

        ``twin``, if given, receives ``(traced, share key)`` (None if there is none)
        for the programs that will load this one's executable without tracing.
        """
        shared: Future | None = None
        try:
            traced = fn.trace(*args)
            on_traced(_traced_outputs(traced, mesh))
            lowered = traced.lower()
            share = None
            if self.share and on_devices_of(args, mesh):
                interface = program_sharing.interface_key(lowered)
                share = program_sharing.share_key(lowered.as_text(), mesh, interface)
            if share is not None:
                with self.lock:
                    source = self.shared.get(share)
                    if source is None:
                        shared = self.shared[share] = Future()
                if twin is not None:
                    twin.set_result((traced, share))
                if source is not None:
                    return self._load(
                        share, source, traced, job, name, mesh, lambda: compile_program(lowered)
                    )
            elif twin is not None:
                twin.set_result(None)
            recalled = None
            if shared is None:
                compiled, fresh = program_sharing.compile_fresh(lowered)
                if fresh and mesh is not None and program_sharing.runs_on(compiled, mesh):
                    self._note_source(
                        compiled, program_sharing.serialized, compiled, mesh, mesh=mesh
                    )
            else:
                # An equal module compiled earlier (another step of this process, or
                # another submesh in an earlier process): loaded for this submesh.
                recalled = _recalled(share, mesh)
                if recalled is not None:
                    compiled, fresh = recalled, False
                    self._note_source(compiled, program_sharing.recall, share, mesh=mesh)
                else:
                    compiled, fresh = program_sharing.compile_fresh(lowered)
                runs_here = program_sharing.runs_on(compiled, mesh)
                shared.set_result((compiled, mesh, fresh) if runs_here else None)
                if fresh and runs_here:
                    program_sharing.keep_fresh(share, compiled, mesh)
                    self._note_source(compiled, program_sharing.recall_in_process, share, mesh=mesh)
            job.set_result(
                abstract_outputs(traced.out_tree, traced.out_avals, compiled.output_shardings)
            )
            with self.lock:
                if recalled is None:
                    self.compiled += 1
                else:
                    self.loaded.setdefault(name, []).append(compiled)
                if self.executables is not None:
                    self.executables.setdefault(name, []).append(compiled)
        except Exception:  # the real call raises it where it belongs
            if shared is not None and not shared.done():
                shared.set_result(None)
            if twin is not None and not twin.done():
                twin.set_result(None)
            job.set_result(UNKNOWN)
        return job.result()

    def _note_source(self, compiled: Any, serialize: Any, *args: Any, mesh: Any) -> None:
        """``serialize(*args)`` gives ``compiled`` as `program_sharing.Serialized`, for ``mesh``."""
        with self.lock:
            self.sources[id(compiled)] = (lambda: serialize(*args), mesh)

    def _load_twin(
        self,
        first: Future,
        fn: Any,
        args: tuple[Any, ...],
        job: Future,
        name: str,
        mesh: Any,
        on_traced: Any,
    ) -> Future:
        """``job``, done once the twin's executable is loaded for ``mesh``.

        The twin's trace gives this program's output types early; without a shareable twin
        module, this program is traced and compiled as usual.
        """

        def go(done: Future) -> None:
            try:
                found = done.result()
                if found is None:
                    self._trace_and_compile(fn, args, on_traced, name, mesh, job, None)
                    return
                traced, share = found
                on_traced(_traced_outputs(traced, mesh))  # the twin's types, on this mesh
                with self.lock:
                    source = self.shared[share]
                compile_here = lambda: compile_program(fn.trace(*args).lower())  # noqa: E731
                self._load(share, source, traced, job, name, mesh, compile_here)
            except Exception:  # the real call compiles it, or raises where it belongs
                if not job.done():
                    job.set_result(UNKNOWN)

        first.add_done_callback(go)
        return job

    def _load(
        self,
        key: Any,
        source: Future,
        traced: Any,
        job: Future,
        name: str,
        mesh: Any,
        compile_here: Any,
    ) -> Future:
        """``job``, done once ``source``'s executable is loaded for ``mesh`` (or compiled).

        ``compile_here()`` compiles this program itself, where loading cannot be done.
        """

        def load(done: Future) -> None:
            try:
                found = done.result()
                source, source_mesh, fresh = found if found is not None else (None, mesh, False)
                if source is not None and program_sharing.same_devices(source_mesh, mesh):
                    compiled, shared = source, True  # the same program: never load it twice
                elif source is not None and (fresh or program_sharing.recall(key) is not None):
                    # a fresh executable of this module: this step's, or an earlier step's
                    # (the copy JAX's disk cache gave this step cannot be serialized again)
                    executable = program_sharing.recall(key)
                    if executable is None:
                        executable = program_sharing.serialized(source, source_mesh)
                        program_sharing.remember(key, executable)
                    compiled, shared = program_sharing.load_serialized(executable, mesh), True
                    self._note_source(compiled, lambda: executable, mesh=mesh)
                else:  # the first one failed, runs elsewhere, or only the disk cache has it
                    compiled, shared = compile_here(), False
                with self.lock:
                    if shared:
                        self.loaded.setdefault(name, []).append(compiled)
                    else:
                        self.compiled += 1
                with self.lock:
                    if self.executables is not None:
                        self.executables.setdefault(name, []).append(compiled)
                shardings = compiled.output_shardings
                job.set_result(abstract_outputs(traced.out_tree, traced.out_avals, shardings))
            except Exception:  # the real call compiles it, or raises where it belongs
                job.set_result(UNKNOWN)

        source.add_done_callback(load)
        return job


def _mesh_free_signature(args: Any) -> Any:
    """`signature` with each sharding's mesh reduced to its shape: equal for twins.

    Specs are compared up to trailing Nones, as `program_sharing.SharedProgram` does.
    """
    leaves, tree = jax.tree.flatten(args)
    key = []
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            return None
        key.append(
            (
                leaf.shape,
                str(leaf.dtype),
                leaf.weak_type,
                program_sharing.normal_sharding(sharding)[1:4],
                sharding.memory_kind,
                mesh_shape_key(sharding.mesh),
            )
        )
    return tree, tuple(key)


def _recalled(key: Any, mesh: Any) -> Any:
    """An executable kept for ``key``, loaded on ``mesh``; or None.

    Kept by this process (an earlier step), or stored in the cache directory
    by an earlier one: a module that process loaded from an equal submesh's
    executable has no entry of its own in JAX's persistent cache (its module
    name differs), so without the stored copy a later process would compile it.
    """
    executable = program_sharing.recall(key)
    if executable is None:
        return None
    try:
        return program_sharing.load_serialized(executable, mesh)
    except Exception:  # an optimisation only: compile instead
        return None
