"""The public entry points: `jit`, `value_and_grad`, and `Lowered` inspection."""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from nnx_mpmd.compiler.region import active_microbatches, reference_value_and_grad, trace_region
from nnx_mpmd.compiler.step import CompiledStep, FlatArgs, compile_step, flatten_step_args
from nnx_mpmd.errors import CompileError, MeshError, ScheduleError
from nnx_mpmd.placement.mesh import MpmdMesh
from nnx_mpmd.placement.mpmd_array import MpmdArray, normalize_spec
from nnx_mpmd.placement.partition import place
from nnx_mpmd.runtime.executor import MemoryRecorder, TaskRecord, _Shardings, execute
from nnx_mpmd.runtime.precompile import precompile

__all__ = ["MAX_COMPILED_STEPS", "Lowered", "PipelinedFunction", "jit", "value_and_grad"]

# How many input signatures one `PipelinedFunction` keeps compiled (least recently
# used dropped first).
MAX_COMPILED_STEPS = 16


def value_and_grad(
    loss_fn: Callable[..., Any],
    has_aux: bool = False,
    *,
    wrt: Any = nnx.Param,
    num_microbatches: int | None = None,
) -> Callable[[Any, Any], Any]:
    """Marks the pipelined region: the mean loss and mean gradient over microbatches.

    ``value_and_grad(loss_fn)(model, batch)`` splits every leaf of ``batch``
    along axis 0 into microbatches and returns the mean loss and the mean
    gradient (an ``nnx.State`` like ``nnx.value_and_grad`` gives). Inside
    `jit` the region is pipelined with the step's schedule; outside it runs
    unpipelined with the same numbers, so one step works both ways.

    Args:
      loss_fn: ``loss_fn(model, microbatch) -> loss`` (or ``(loss, aux)``).
      has_aux: whether ``loss_fn`` also returns aux values (averaged too).
      wrt: an NNX filter of the differentiated Variables (default ``nnx.Param``).
      num_microbatches: microbatches when run outside `jit` (default 1;
        inside `jit` the step's ``num_microbatches`` is used).

    Returns:
      A function ``(model, batch) -> (loss, grads)`` or ``((loss, aux), grads)``.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import nnx_mpmd as mp
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> loss_fn = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
      >>> batch = {"x": jnp.ones((4, 2)), "y": jnp.zeros((4, 1))}
      >>> loss, grads = mp.value_and_grad(loss_fn, num_microbatches=2)(model, batch)
      >>> grads["kernel"].shape
      (2, 1)
    """

    def wrapped(model: Any, batch: Any) -> Any:
        active = active_microbatches()
        if active is not None:
            if num_microbatches not in (None, active):
                raise CompileError(
                    f"value_and_grad(num_microbatches={num_microbatches}) inside a step "
                    f"compiled with num_microbatches={active}; drop one of them."
                )
            return trace_region(loss_fn, model, batch, has_aux=has_aux, wrt=wrt)
        return reference_value_and_grad(
            loss_fn, model, batch, num_microbatches=num_microbatches or 1, has_aux=has_aux, wrt=wrt
        )

    return wrapped


def _sharding_key(sharding: Any) -> Any:
    if isinstance(sharding, NamedSharding):
        # P() and P(None, None) are the same layout: key them the same.
        return (sharding.mesh, normalize_spec(sharding.spec), sharding.memory_kind)
    return sharding


def _leaf_key(x: Any) -> Any:
    if isinstance(x, MpmdArray):
        shardings = tuple((q, _sharding_key(x.array(q).sharding)) for q in x.mesh_ids)
        return ("mpmd", x.shape, str(x.dtype), shardings)
    if isinstance(x, jax.Array):
        weak = getattr(x, "weak_type", False)  # PRNG key arrays have none
        return ("array", x.shape, str(x.dtype), _sharding_key(x.sharding), weak)
    return ("host", np.shape(x), str(np.result_type(x)))


def _write_back(flat: FlatArgs, new_leaves: list[Any]) -> None:
    """Stores a step's new state leaves into the caller's Variables."""
    if flat.variables is None:
        nnx.update(flat.nodes, jax.tree.unflatten(flat.state_tree, new_leaves))
        return
    for variable, value in zip(flat.variables, new_leaves, strict=True):
        variable.set_raw_value(value)


class Lowered:
    """A compiled step for inspection: per-mesh instruction lists and programs.

    Example:
      >>> import jax, optax
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import nnx_mpmd as mp
      >>> class Two(mp.PipelinedModel):
      ...     def __init__(self, rngs):
      ...         self.a = mp.Stage(nnx.Linear(4, 4, rngs=rngs), stage=0)
      ...         self.b = mp.Stage(nnx.Linear(4, 1, rngs=rngs), stage=1)
      ...     def __call__(self, x):
      ...         return self.b(self.a(x))
      >>> mesh = mp.MpmdMesh(jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2]), "stage")
      >>> model = Two(nnx.Rngs(0))
      >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> def step(model, opt, x):
      ...     loss, grads = mp.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2))(model, x)
      ...     opt.update(model, grads)
      ...     return loss
      >>> f = mp.jit(step, mesh=mesh, schedule=mp.GPipe(), num_microbatches=2)
      >>> lowered = f.lower(model, opt, jnp.ones((4, 4)))
      >>> lowered.instructions(mesh=1)[:3]
      ['mesh 1: run init1', 'mesh 1: receive act s0->s1 mb0 (32 B)', 'mesh 1: run F1.0']
    """

    def __init__(self, compiled: CompiledStep, mesh: MpmdMesh) -> None:
        self.compiled = compiled
        self.mesh = mesh

    @property
    def transfers(self) -> list[Any]:
        """Transfers outside the pipelined region (what, src, dst, bytes)."""
        return list(self.compiled.transfers)

    @property
    def programs(self) -> dict[str, Any]:
        """The jitted programs by label (``F0``, ``B1``, ``FB3``, ``post.L0.mesh2``...)."""
        return dict(self.compiled.programs)

    def instructions(self, mesh: int | None = None) -> list[str]:
        """The instruction list in dispatch order, optionally for one mesh."""
        from nnx_mpmd.compiler.instructions import Call, Transfer

        lines = []
        for ins in self.compiled.instructions:
            if isinstance(ins, Call) and mesh in (None, ins.mesh):
                lines.append(f"mesh {ins.mesh}: run {ins.label}")
            elif isinstance(ins, Transfer) and mesh in (None, ins.dst_mesh):
                lines.append(f"mesh {ins.dst_mesh}: receive {ins.label} ({ins.nbytes} B)")
        return lines

    def as_text(self) -> str:
        """Every mesh's instruction list, one section per mesh."""
        out = []
        for q in range(self.mesh.num_meshes):
            out.append(f"== mesh {q} ==")
            out.extend("  " + line.split(": ", 1)[1] for line in self.instructions(q))
        out.append("== programs (one per stage and task kind) ==")
        out.append("  " + ", ".join(sorted(self.compiled.programs)))
        return "\n".join(out)

    def program_text(self, label: str, *args: Any) -> str:
        """The jaxpr of program ``label`` (e.g. ``"F0"``) for the given arguments."""
        return str(jax.make_jaxpr(self.compiled.programs[label])(*args))

    def ir_text(self) -> str:
        """The whole instruction list in the IR's text form, one instruction a line.

        ``compiler.instructions.parse_instructions(text, lowered.programs)`` reads it
        back: every `Call` names its program (``F0``, ``init1``, ``post.L0.mesh2``).
        """
        from nnx_mpmd.compiler.instructions import format_instructions

        return format_instructions(self.compiled.instructions)

    def __str__(self) -> str:
        return self.as_text()


class _DefaultBatchAxis(str):
    """The default ``batch_axis``: ``"data"`` when the submeshes have it, else None."""

    __slots__ = ()


DEFAULT_BATCH_AXIS = _DefaultBatchAxis("data")


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

    Calling it runs the step (``profile=True`` records per-task timings in
    ``last_profile``; ``memory=True`` records per-mesh live bytes in
    ``last_memory``); ``lower(*args)`` compiles without running.

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
        self.schedule = schedule
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
        # Compiled steps by input signature, least recently used first; bounded so
        # that a long-lived step called with ever new signatures (a fresh optax
        # transformation each time, say) does not grow without limit.
        self._cache: collections.OrderedDict[Any, CompiledStep] = collections.OrderedDict()
        self._shardings = _Shardings(list(mesh.submeshes))
        self.last_profile: list[TaskRecord] | None = None
        self.last_memory: dict[str, Any] | None = None

    def _prepare(self, args: tuple[Any, ...]) -> tuple[FlatArgs, CompiledStep]:
        from nnx_mpmd.compiler.stage_programs import check_mesh_context

        check_mesh_context(self.mesh)  # before placing: no jax.set_mesh around the call
        flat = flatten_step_args(self.fn, args)
        key = self._key(flat)
        compiled = self._cached(key)
        if compiled is None:
            # Unseen signature: place the state (a no-op for leaves already placed;
            # an unplaced array on a device of submesh 0 is not "placed").
            try:
                place(flat.nodes, self.mesh, self.schedule)
            except ScheduleError as e:
                raise ScheduleError(
                    f"{type(self.schedule).__name__} cannot place this step's state on "
                    f"{self.mesh.num_meshes} meshes: {e}"
                ) from None
            flat = flatten_step_args(self.fn, args)
            key = self._key(flat)
            compiled = self._cached(key)
        if compiled is None:
            compiled = compile_step(
                self.fn,
                flat,
                self.mesh,
                self.schedule,
                self.num_microbatches,
                batch_axis=self.batch_axis,
                transfer_warning_bytes=self.transfer_warning_bytes,
            )
            if self.compile_threads != 1 and not self.mesh.is_multi_process:
                inputs = [*compiled.consts, *flat.state_leaves, *flat.other_leaves]
                precompile(
                    compiled,
                    inputs,
                    list(self.mesh.submeshes),
                    self._shardings,
                    max_workers=self.compile_threads,
                    batch_axis=compiled.batch_axis,  # None where the step replicates it
                )
            self._cache[key] = compiled
            while len(self._cache) > MAX_COMPILED_STEPS:
                self._cache.popitem(last=False)
        return flat, compiled

    def _cached(self, key: Any) -> CompiledStep | None:
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
        return compiled

    @staticmethod
    def _key(flat: FlatArgs) -> Any:
        return (
            flat.graphdef,
            flat.state_tree,
            flat.args_tree,
            tuple(_leaf_key(x) for x in flat.state_leaves),
            tuple(_leaf_key(x) for x in flat.other_leaves),
        )

    def __call__(self, *args: Any, profile: bool = False, memory: bool = False) -> Any:
        flat, compiled = self._prepare(args)
        inputs = [*compiled.consts, *flat.state_leaves, *flat.other_leaves]
        records: list[TaskRecord] | None = [] if profile else None
        recorder = None
        if self.mesh.is_multi_process:
            from nnx_mpmd.runtime.multi_process import execute_multi_process

            outputs = execute_multi_process(compiled, inputs, self.mesh, self._shardings, records)
        else:
            submeshes = list(self.mesh.submeshes)
            recorder = MemoryRecorder(submeshes) if memory else None
            outputs = execute(compiled, inputs, submeshes, self._shardings, records, recorder)
        if profile:
            self.last_profile = records
        if recorder is not None:
            self.last_memory = recorder.summary()
        user = outputs[: compiled.num_user_outputs]
        _write_back(flat, outputs[compiled.num_user_outputs :])
        return jax.tree.unflatten(compiled.out_tree, user)

    def lower(self, *args: Any) -> Lowered:
        """Compiles for ``args`` (placing state if needed) without running."""
        _, compiled = self._prepare(args)
        return Lowered(compiled, self.mesh)

    @property
    def num_compiled_steps(self) -> int:
        """How many distinct input signatures have been compiled."""
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
      schedule: a schedule object (``mp.OneFOneB()``...).
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
        )
    return PipelinedFunction(
        fn,
        mesh=mesh,
        schedule=schedule,
        num_microbatches=num_microbatches,
        batch_axis=batch_axis,
        transfer_warning_bytes=transfer_warning_bytes,
        compile_threads=compile_threads,
    )
