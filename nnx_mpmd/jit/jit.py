"""The public entry points: `jit` (a `PipelinedFunction`) and `value_and_grad`."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

from nnx_mpmd._jax_compat import take_cached_partial_nodes
from nnx_mpmd.jit.options import DEFAULT_BATCH_AXIS, JitOptions
from nnx_mpmd.jit.programs import older_objects_left_alone
from nnx_mpmd.jit.run import profile_mode
from nnx_mpmd.jit.stages import Compiled as Compiled
from nnx_mpmd.jit.stages import Lowered as Lowered
from nnx_mpmd.jit.stages import StepContext
from nnx_mpmd.jit.stages import Traced as Traced
from nnx_mpmd.placement.mesh import MpmdMesh

__all__ = [
    "MAX_COMPILED_STEPS",
    "Compiled",
    "Lowered",
    "PipelinedFunction",
    "Traced",
    "jit",
]

# How many input signatures one `PipelinedFunction` keeps compiled (least recently
# used dropped first).
MAX_COMPILED_STEPS = 16


class PipelinedFunction:
    """A step compiled by `jit`; call it like the original function.

    Calling it runs the step (``profile=True`` records when each task ran on
    its mesh in ``last_profile``, a `nnx_mpmd.runtime.timeline_profiler.Profile`
    whose ``plot(path)`` draws the measured timeline beside the simulated one;
    ``profile="isolated"`` waits for each program before dispatching the next,
    for clean per-task times; ``memory=True`` records per-mesh live bytes in
    ``last_memory``); ``trace(*args)`` reads its arguments into a `Traced`,
    ``lower(*args)`` (``trace(*args).lower()``) lowers it without running or
    moving state, and ``lower(*args).compile()`` compiles it ahead of time; a
    call looks up (or makes) the `Compiled` for its arguments and runs it. Its
    checked ``mp.jit`` options are ``options``, a `JitOptions`. Arguments may be
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

    def __init__(self, fn: Callable[..., Any], options: JitOptions) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.options = options
        self._context = StepContext(fn, options, MAX_COMPILED_STEPS)
        self._cache = self._context.lowerings  # lowerings by input signature, LRU first

    @property
    def mesh(self) -> MpmdMesh:
        """The `MpmdMesh` the step runs on."""
        return self.options.mesh

    @property
    def schedule(self) -> Any:
        """The schedule object."""
        return self.options.schedule

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step."""
        return self.options.num_microbatches

    @property
    def batch_axis(self) -> str | None:
        """The submesh axis microbatches are sharded over (None: replicated)."""
        return self.options.batch_axis

    @property
    def transfer_warning_bytes(self) -> int:
        """Transfers outside the pipelined region larger than this are reported."""
        return self.options.transfer_warning_bytes

    @property
    def compile_threads(self) -> int | None:
        """Threads that compile a new step's programs (None: the default)."""
        return self.options.compile_threads

    @property
    def check_finite(self) -> bool:
        """Whether every task's outputs are checked for NaN and inf."""
        return self.options.check_finite

    @property
    def donate_argnums(self) -> frozenset[int]:
        """Positions of the donated arguments (``donate_argnums`` and ``donate_argnames``)."""
        return self._context.arguments.donated

    @property
    def static_argnums(self) -> frozenset[int]:
        """Positions of the static arguments (``static_argnums`` and ``static_argnames``)."""
        return self._context.arguments.static

    @property
    def last_profile(self) -> Any:
        """The `Profile` of the last call with ``profile=``, or None."""
        return self._context.records.last_profile

    @property
    def last_memory(self) -> dict[str, Any] | None:
        """Per-mesh live bytes of the last call with ``memory=True``, or None."""
        return self._context.records.last_memory

    def __call__(
        self, *args: Any, profile: bool | str = False, memory: bool = False, **kwargs: Any
    ) -> Any:
        # First: an error raised while nnx.cached_partial's cache is still set would
        # surface as Flax's "no context consumed it" instead of our own.
        partial_nodes = take_cached_partial_nodes()
        mode = profile_mode(profile)
        arguments = self._context.arguments
        call = arguments.read(args, kwargs, partial_nodes)
        with contextlib.ExitStack() as compiling:
            # Every lowering is for state placed where `place` puts it: a hit means
            # the state is placed; a miss places it (placed leaves stay).
            lowered = self._context.cached(call.signature)
            if lowered is None:
                compiling.enter_context(older_objects_left_alone())
                call = arguments.placed(call)
                lowered = Traced(self._context, call).lower()
            return lowered.compiled_for_call(call).run(call, mode, memory)

    def trace(self, *args: Any, **kwargs: Any) -> Traced:
        """Reads the step's arguments for lowering, without running it or moving any state.

        Returns:
          A `Traced`; ``lower()`` it.

        Example:
          >>> # ``f.trace(*args).lower()`` is ``f.lower(*args)``: see `Traced`.
        """
        return Traced(self._context, self._context.arguments.read_planned(args, kwargs))

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Lowers the step for ``args`` without running it or moving any state.

        State that is not placed yet is lowered for where `mp.place` would put
        it; a later call (which places it) finds this lowering in the cache.

        Returns:
          A `Lowered`: its passes, instructions and programs; ``compile()`` it for
          a `Compiled` with XLA's memory and cost analyses.
        """
        return self.trace(*args, **kwargs).lower()

    @property
    def num_compiled_steps(self) -> int:
        """How many distinct input signatures have been lowered (and are cached)."""
        return len(self._context.lowerings)


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
    options = JitOptions.parse(
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
    if fn is None:
        return functools.partial(PipelinedFunction, options=options)
    return PipelinedFunction(fn, options)
