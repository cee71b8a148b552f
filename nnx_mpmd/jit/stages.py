"""The stages of a compiled step, like ``jax.stages``: `Lowered`, then `Compiled`.

``f.lower(*args)`` traces and lowers a step for its arguments' shapes and
placements without running it or moving any state (state that is not placed
yet is lowered for where `mp.place` would put it). ``lowered.compile()``
compiles every program ahead of time and gives a `Compiled`, which runs the
step when called and reports XLA's memory and cost analyses per program.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from nnx_mpmd.compiler.collective_bytes import step_all_reduce_bytes, step_reduce_scatter_bytes
from nnx_mpmd.compiler.final.step import CompiledStep, PassRecord
from nnx_mpmd.compiler.ir import Call, Transfer, TransferBatch, format_instructions
from nnx_mpmd.placement.mesh import MpmdMesh

__all__ = ["Compiled", "Lowered"]


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
        mesh: MpmdMesh,
        compile_fn: Callable[[CompiledStep], dict[str, list[Any]]] | None = None,
        run_fn: Callable[..., Any] | None = None,
    ) -> None:
        self.compiled = compiled  # the compiler's CompiledStep (instructions, programs)
        self.mesh = mesh
        self._compile_fn = compile_fn
        self._run_fn = run_fn

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

        Returns:
          A `Compiled`: call it like the step; ``memory_analysis()`` and
          ``cost_analysis()`` give XLA's figures per program.
        """
        executables = self._compile_fn(self.compiled) if self._compile_fn else {}
        return Compiled(self, executables, self._run_fn)

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

    Calling it runs the step through the `PipelinedFunction` it came from
    (placing state that is not placed yet), which finds these programs in its
    cache: nothing compiles again.

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

    def __init__(
        self,
        lowered: Lowered,
        executables: dict[str, list[Any]],
        run_fn: Callable[..., Any] | None,
    ) -> None:
        self.lowered = lowered
        self._executables = executables
        self._run_fn = run_fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._run_fn is None:
            raise TypeError("this Compiled step was built without a function to run it")
        return self._run_fn(*args, **kwargs)

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
