"""The stages of a compiled step, like ``jax.stages``: `Traced`, `Lowered`, `Compiled`.

``f.trace(*args)`` reads the step's arguments once (flattened, typed, keyed,
state typed where `mp.place` would put it) into a `Traced`; ``.lower()`` runs
the compiler's passes into a `Lowered`, whose IR is never changed after; its
``.compile()`` compiles every program ahead of time into a `Compiled`, which
binds the executables to a routed copy of the IR and runs the step when
called, keeping the runtime's prepared steps itself (a `PreparedCache`, never
on the IR). ``f.lower(*args)`` is ``f.trace(*args).lower()``. Each stage is made
once per input signature: the step's `StepContext` keeps the lowerings, and a
`Lowered` its `Compiled`. Nothing here runs the step or moves state until a
`Compiled` is called.
"""

from __future__ import annotations

import collections
from typing import Any

import jax

from nnx_mpmd._jax_compat import take_cached_partial_nodes
from nnx_mpmd.compiler.collective_bytes import step_all_reduce_bytes, step_reduce_scatter_bytes
from nnx_mpmd.compiler.final.step import CompiledStep, PassRecord, compile_step, trace_for_step
from nnx_mpmd.compiler.ir import Call, Transfer, TransferBatch, format_instructions
from nnx_mpmd.compiler.trace.trace_step import TracedStep
from nnx_mpmd.errors import CompileError
from nnx_mpmd.jit.arguments import StepArguments, StepCall, StepSignature
from nnx_mpmd.jit.options import JitOptions
from nnx_mpmd.jit.programs import BoundPrograms, older_objects_left_alone
from nnx_mpmd.jit.run import StepRecords, profile_mode, run_step
from nnx_mpmd.placement.abstract import PlacedAval, placed_aval
from nnx_mpmd.placement.mesh import MpmdMesh
from nnx_mpmd.runtime.executor import _Shardings
from nnx_mpmd.runtime.interpreter import PreparedCache

__all__ = ["Compiled", "Lowered", "StepContext", "Traced"]


class StepContext:
    """What the stages of one ``mp.jit`` step share: the step, its options and its lowerings.

    Args:
      fn: the step.
      options: its checked options.
      max_steps: how many input signatures' lowerings to keep (least recently
        used dropped first), so that a long-lived step called with ever new
        signatures does not grow without limit.
    """

    def __init__(self, fn: Any, options: JitOptions, max_steps: int) -> None:
        self.fn = fn
        self.options = options
        self.arguments: StepArguments = StepArguments(fn, options)
        self.shardings: _Shardings = _Shardings(list(options.mesh.submeshes))
        self.records: StepRecords = StepRecords()
        self.lowerings: collections.OrderedDict[StepSignature, Lowered] = collections.OrderedDict()
        self.max_steps = max_steps

    def cached(self, signature: StepSignature) -> Lowered | None:
        """The lowering for ``signature``, marked most recently used, or None."""
        lowered = self.lowerings.get(signature)
        if lowered is not None:
            self.lowerings.move_to_end(signature)
        return lowered

    def remember(self, lowered: Lowered) -> None:
        """Keeps ``lowered``; the least recently used lowering beyond ``max_steps`` goes."""
        self.lowerings[lowered.signature] = lowered
        while len(self.lowerings) > self.max_steps:
            _, evicted = self.lowerings.popitem(last=False)
            evicted.finish_compiling()


class Traced:
    """A step's arguments read for one input signature, and its jaxpr; ``lower()`` it.

    Made by `nnx_mpmd.jit.jit.PipelinedFunction.trace`: the arguments are
    flattened and typed once, state that is not placed yet typed where
    `mp.place` would put it; ``jaxpr`` is traced once, on first use, and
    ``lower()`` runs the passes on it. Nothing runs and no state moves.

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
      >>> traced = f.trace(model, opt, jnp.ones((4, 4)))
      >>> traced.jaxpr.eqns[0].primitive.name  # the pipelined region, then the update
      'mpmd_region'
      >>> traced.lower() is f.lower(model, opt, jnp.ones((4, 4)))
      True
    """

    def __init__(self, context: StepContext, call: StepCall) -> None:
        self._context = context
        self.call = call
        self._traced: TracedStep | None = None

    @property
    def signature(self) -> StepSignature:
        """The input signature (structure, shapes, dtypes, placements) it was read for."""
        return self.call.signature

    @property
    def jaxpr(self) -> Any:
        """The step traced to one jaxpr (before any pipeline pass), over its consts, state and other leaves.

        Traced on first use and kept: `lower` runs its passes on this one.
        """
        return self._traced_step().jaxpr

    def _traced_step(self) -> TracedStep:
        """The compiler's first pass for these arguments, run once."""
        if self._traced is None:
            options, call = self._context.options, self.call
            self._traced = trace_for_step(
                self._context.fn,
                call.flat,
                options.mesh,
                options.num_microbatches,
                state_avals=call.state_avals,
                other_avals=call.other_avals,
                batch_axis=options.batch_axis,
            )
        return self._traced

    def lower(self) -> Lowered:
        """Runs the compiler's passes for these arguments (once per input signature).

        Returns:
          A `Lowered`: its passes, instructions and programs.
        """
        context = self._context
        found = context.cached(self.signature)
        if found is not None:
            return found
        options, call = context.options, self.call
        with older_objects_left_alone():
            traced = self._traced_step()
            step = compile_step(
                context.fn,
                call.flat,
                options.mesh,
                options.schedule,
                options.num_microbatches,
                state_avals=call.state_avals,
                other_avals=call.other_avals,
                batch_axis=options.batch_axis,
                transfer_warning_bytes=options.transfer_warning_bytes,
                donated_state=context.arguments.donated_state(call.flat),
                traced=traced,
            )
        consts = [placed_aval(c, options.mesh) for c in step.consts]
        # Frozen: a config changed in place later must not change the stored key.
        signature = call.signature.frozen()
        lowered = Lowered(step, context, signature, call.abstract_inputs(consts))
        context.remember(lowered)
        return lowered


class Lowered:
    """A lowered step: its passes, instruction lists and programs; ``compile()`` it.

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

    def __init__(
        self,
        compiled: CompiledStep,
        context: StepContext,
        signature: StepSignature,
        abstract_inputs: list[PlacedAval],
    ) -> None:
        self.compiled = compiled  # the compiler's CompiledStep (instructions, programs)
        self.mesh: MpmdMesh = context.options.mesh
        self.signature = signature
        self._context = context
        self._abstract_inputs = abstract_inputs
        self._compiled: Compiled | None = None
        self._compiled_ahead = False

    @property
    def passes(self) -> list[PassRecord]:
        """The lowering passes in order, each with the IR's text after it (``.text``).

        ``trace`` (the step's jaxpr), ``cut_stages``, ``stage_vjp``, ``schedule``,
        the region's passes (``lower_schedule``, ``insert_transfers``, ...), the
        mesh-inference passes, ``insert_frees`` and ``dedupe_programs``.
        """
        return list(self.compiled.passes)

    def pass_text(self, name: str) -> str:
        """The IR's text after pass ``name`` (see `passes`)."""
        for record in self.compiled.passes:
            if record.name == name:
                return record.text
        known = ", ".join(r.name for r in self.compiled.passes)
        raise KeyError(f"no lowering pass named {name!r}; the passes were: {known}")

    def compile(self) -> Compiled:
        """Compiles every program of the step ahead of time (no state is moved).

        Made once: a second call, or a step call that compiled the programs
        already, gives the same `Compiled`.

        Returns:
          A `Compiled`: call it like the step; ``memory_analysis()`` and
          ``cost_analysis()`` give XLA's figures per program.
        """
        if self._compiled is not None and self._compiled_ahead:
            self._compiled.bound_programs.finish()
            return self._compiled
        context = self._context
        with older_objects_left_alone():
            bound = BoundPrograms.compile(
                self.compiled, self._abstract_inputs, context.options, context.shardings
            )
        self._compiled, self._compiled_ahead = Compiled(self, bound, context), True
        return self._compiled

    def compiled_for_call(self, call: StepCall) -> Compiled:
        """The `Compiled` a step call runs: made on the first call, compiling as it runs.

        Programs compile in threads while the first run dispatches
        (`BoundPrograms.compile` with ``overlap``), or, with ``compile_threads=1``
        or several processes, when the run first reaches each.
        """
        if self._compiled is not None:
            return self._compiled
        context = self._context
        options = context.options
        if options.compiles_ahead:
            inputs = call.inputs(self.compiled.consts)
            bound = BoundPrograms.compile(
                self.compiled, inputs, options, context.shardings, overlap=True
            )
        else:
            bound = BoundPrograms.jit_on_first_call(self.compiled)
        self._compiled, self._compiled_ahead = (
            Compiled(self, bound, context),
            options.compiles_ahead,
        )
        return self._compiled

    def finish_compiling(self) -> None:
        """Waits for compilations a first call left running (the lowering is dropped)."""
        if self._compiled is not None:
            self._compiled.bound_programs.finish()

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
        lines = []
        for ins in self.compiled.instructions:
            if isinstance(ins, Call) and mesh in (None, ins.mesh):
                lines.append(f"mesh {ins.mesh}: run {ins.label}")
            elif isinstance(ins, (Transfer, TransferBatch)):
                members = ins.transfers if isinstance(ins, TransferBatch) else (ins,)
                lines.extend(
                    f"mesh {t.dst_mesh}: receive {t.label} ({t.nbytes} B)"
                    for t in members
                    if mesh in (None, t.dst_mesh)
                )
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

        ``compiler.ir.parse_instructions(text, lowered.programs)`` reads it
        back: every `Call` names its program (``F0``, ``init1``, ``post.L0.mesh2``).
        """
        return format_instructions(self.compiled.instructions)

    def __str__(self) -> str:
        return self.as_text()


class Compiled:
    """A lowered step whose programs are compiled: call it like the step.

    Calling it runs the step on these programs (placing state that is not
    placed yet, as the step does): nothing is traced or compiled again.
    Arguments of other types raise a `CompileError`; call the step for those.

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
      >>> compiled = f.lower(model, opt, jnp.ones((4, 4))).compile()
      >>> sorted(compiled.memory_analysis())[:2]
      ['B0', 'F0']
      >>> float(compiled(model, opt, jnp.ones((4, 4)))) > 0
      True
    """

    def __init__(self, lowered: Lowered, bound: BoundPrograms, context: StepContext) -> None:
        self.lowered = lowered
        self.bound_programs = bound
        self._context = context
        self._executables = bound.executables
        # The runtime's prepared steps live here, not on the step: the IR never changes.
        self._prepared = PreparedCache()

    def __call__(
        self, *args: Any, profile: bool | str = False, memory: bool = False, **kwargs: Any
    ) -> Any:
        # First: an error raised while nnx.cached_partial's cache is still set would
        # surface as Flax's "no context consumed it" instead of our own.
        partial_nodes = take_cached_partial_nodes()
        mode = profile_mode(profile)
        arguments = self._context.arguments
        call = arguments.read(args, kwargs, partial_nodes)
        if call.signature != self.lowered.signature:
            call = arguments.placed(call)  # state lowered for where mp.place puts it
        if call.signature != self.lowered.signature:
            raise CompileError(
                f"this Compiled {arguments.name} was compiled for other argument types "
                "(structure, shapes, dtypes or placements); call the mp.jit step itself, "
                "which compiles for each, or lower and compile it for these arguments."
            )
        return self.run(call, mode, memory)

    def run(self, call: StepCall, profile: str | None = None, memory: bool = False) -> Any:
        """Runs the step on ``call``'s arguments, read and placed for this signature."""
        context = self._context
        bound = self.bound_programs
        try:
            return run_step(
                bound.step,
                call,
                context.options,
                context.shardings,
                context.records,
                profile,
                memory,
                self._prepared,
            )
        finally:
            bound.finish()

    @property
    def last_profile(self) -> Any:
        """The profile of the step's last run with ``profile=`` (see `PipelinedFunction`)."""
        return self._context.records.last_profile

    @property
    def last_memory(self) -> dict[str, Any] | None:
        """Per-mesh live bytes of the step's last run with ``memory=True``."""
        return self._context.records.last_memory

    def executables(self) -> dict[str, list[Any]]:
        """XLA's compiled programs by name; a program called with several
        argument types (a transfer's sharding, say) has one per type."""
        return {name: list(found) for name, found in self._executables.items()}

    def memory_analysis(self) -> dict[str, Any]:
        """XLA's memory analysis of each program (its first compiled variant), by name.

        Each value has ``argument_size_in_bytes``, ``output_size_in_bytes``,
        ``temp_size_in_bytes`` and ``generated_code_size_in_bytes``.
        """
        return {n: found[0].memory_analysis() for n, found in self._executables.items() if found}

    def cost_analysis(self) -> dict[str, Any]:
        """XLA's cost analysis (``flops``, ``bytes accessed``, ...) of each program, by name."""
        return {n: found[0].cost_analysis() for n, found in self._executables.items() if found}

    def all_reduce_bytes(self) -> int:
        """Bytes one step all-reduces, counted from XLA's compiled HLO.

        Each program's all-reduce bytes (its first compiled variant) times the
        number of times the step calls it. A data-parallel stage on an Explicit
        data axis reduces its gradients once per step, so this is about the
        stages' parameter bytes, not the number of microbatches times them.
        Parameters sharded over the data axis (FSDP) are reduce-scattered
        instead, and not counted here (see `reduce_scatter_bytes`).

        Returns:
          The total over every program the step calls.

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
          >>> devices = jax.devices()[:1]
          >>> mesh = mp.MpmdMesh(jax.make_mesh((1,), ("stage",), devices=devices), "stage")
          >>> f = mp.jit(step, mesh=mesh, schedule=mp.GPipe(), num_microbatches=2)
          >>> f.lower(model, opt, jnp.ones((4, 4))).compile().all_reduce_bytes()  # one device
          0
        """
        return step_all_reduce_bytes(self.lowered.compiled.instructions, self._executables)

    def reduce_scatter_bytes(self) -> int:
        """Bytes one step reduce-scatters (operand bytes), counted from XLA's compiled HLO.

        Like `all_reduce_bytes`, each program's count times its calls. A stage
        whose parameters are sharded over an Explicit data axis (FSDP)
        reduce-scatters their gradients once per step, in its ``reduce{k}``
        program: about those parameters' full bytes.

        Returns:
          The total over every program the step calls.

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
          >>> devices = jax.devices()[:1]
          >>> mesh = mp.MpmdMesh(jax.make_mesh((1,), ("stage",), devices=devices), "stage")
          >>> f = mp.jit(step, mesh=mesh, schedule=mp.GPipe(), num_microbatches=2)
          >>> f.lower(model, opt, jnp.ones((4, 4))).compile().reduce_scatter_bytes()
          0
        """
        instructions = self.lowered.compiled.instructions
        return step_reduce_scatter_bytes(instructions, self._executables)

    def as_text(self) -> str:
        """The lowered step's per-mesh instruction lists (`Lowered.as_text`)."""
        return self.lowered.as_text()
