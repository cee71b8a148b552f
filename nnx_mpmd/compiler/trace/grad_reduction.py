"""One data-parallel gradient reduction per step: unreduced accumulation, then one reduce.

A stage whose submesh has a data axis (its microbatch sharded over it) used to
reduce its full gradient inside every backward program: once per microbatch
(an all-reduce for a parameter replicated over the axis, a reduce-scatter for
one sharded over it, FSDP). On an *Explicit* data axis, JAX types a value that
holds per-device partial sums as *unreduced* over the axis
(``float32[4,3]{U:data}``); adding such values needs no communication, and one
reduction to the parameter's sharding sums them. So:

* `run_deferring` evaluates a backward (a ``jax.vjp`` function, or the BW part
  of a split backward) equation by equation and gives each reduction over the
  data axis (a ``reduce_sum`` or ``dot_general`` that contracts data-sharded
  dimensions) an unreduced result instead. Where the result was sharded over
  the axis (the gradient of an FSDP parameter, a reduce-scatter), the
  unreduced result has the axis dropped from its partitions: full size over
  the axis, every device holding its partial sums of the whole array. A
  ``reshard`` to a sharding over the axis (how JAX ends the transpose of an
  explicit all-gather of an FSDP weight) keeps such a value as it is. Linear
  operations carry unreduced values on (JAX's own sharding rules check each
  one); any other operation reduces its unreduced inputs first, to the type
  the input had before, exactly where the reduction happened before, so
  batch-coupled code (a BatchNorm, a loss that means over the batch) computes
  the same function.
* the stage's gradient accumulators for float parameters are created
  unreduced (`GradientReduction.zeros_like`; for an FSDP parameter at full
  size), the backward programs add unreduced gradients into them, and one
  ``reduce`` program per stage, called once after the stage's last backward
  (`reduce_gradients_once`), reduces each to its parameter's sharding: one
  all-reduce of the replicated parameters' bytes and one reduce-scatter
  (``psum_scatter``) of the FSDP parameters' full bytes per step. A separate
  small program keeps the backward programs the same for every microbatch
  (one compile each).

Memory: an FSDP parameter's accumulator holds the *full* gradient on every
device of the data axis (the parameter itself holds 1/n of it), for the whole
step. That is the price of one reduce-scatter per step instead of one per
microbatch; with few, large microbatches or no room for a full gradient per
device, use an Auto data axis, which keeps the per-microbatch reduce-scatter
and a sharded accumulator. The ``reduce`` program donates its accumulators
only where it reduce-scatters none (an FSDP result is smaller than its
accumulator, so XLA could not reuse that buffer).

Only float reassociation changes numerics: per device, microbatch gradients
are summed before the sum over devices instead of after it (and a gradient
cast to a lower precision inside the backward is rounded per device before
that sum).

Auto data axes take the same passes with another representation: JAX allows
unreduced values only on Explicit axes, so `grad_reduction_auto` keeps the
partials of parameters replicated over the axis as stacked ``[n, *shape]``
arrays (`RegionInfo.stacked_axis`); FSDP parameters on an Auto axis keep their
per-microbatch reduce-scatter.

Where neither applies the programs are what they were (one reduction per
microbatch): a data axis of size 1 and a replicated batch. The region's data
(`RegionInfo.unreduced_axis`, `RegionInfo.stacked_axis` and each parameter's
sharding type) decides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from nnx_mpmd.compiler.collective_bytes import (
    all_reduce_bytes,
    program_calls,
    reduce_scatter_bytes,
    step_all_reduce_bytes,
    step_reduce_scatter_bytes,
    step_reduced_bytes,
)
from nnx_mpmd.compiler.ir import Call, Instruction

__all__ = [
    "GradientReduction",
    "all_reduce_bytes",
    "program_calls",
    "reduce_gradients_once",
    "reduce_scatter_bytes",
    "run_deferring",
    "step_all_reduce_bytes",
    "step_reduce_scatter_bytes",
    "step_reduced_bytes",
]

# Linear in each float input: an unreduced input can stay unreduced through them
# (JAX's sharding rules still check every such call).
_LINEAR = frozenset(
    {
        "neg",
        "reshape",
        "transpose",
        "convert_element_type",
        "copy",
        "copy_p",
        "squeeze",
        "expand_dims",
        "reduce_sum",
        "broadcast_in_dim",
        "slice",
        "mul",
        "dot_general",
    }
)
# Sums: every float input must be unreduced, or replicated over the axis.
_ADDITIVE = frozenset({"add", "add_any", "sub"})
# Programs inlined so that the reductions inside them are deferred as well.
_INLINED = frozenset({"pjit", "jit", "closed_call", "core_call", "checkpoint", "remat", "remat2"})


def _spec(x: Any) -> PartitionSpec | None:
    sharding = getattr(jax.typeof(x), "sharding", None)
    return getattr(sharding, "spec", None)


def _target_spec(like: Any) -> PartitionSpec | None:
    """The partition spec of ``like``: a PartitionSpec, a sharding, or an array (or tracer)."""
    if like is None or isinstance(like, PartitionSpec):
        return like
    if isinstance(like, jax.sharding.Sharding):
        return getattr(like, "spec", None)
    return _spec(like)


def _partitions(spec: PartitionSpec | None, ndim: int) -> list[Any]:
    parts = list(spec.partitions) if spec is not None else []  # no spec: not partitioned
    return parts + [None] * (ndim - len(parts))


def _names(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _float(x: Any) -> bool:
    return bool(jnp.issubdtype(jax.typeof(x).dtype, jnp.inexact))


@dataclasses.dataclass(frozen=True)
class GradientReduction:
    """Unreduced accumulation over one Explicit mesh axis (the stage's data axis).

    Args:
      axis: the submesh axis the microbatch is sharded over.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,),
      ...                      devices=jax.devices()[:2])
      >>> w = jax.device_put(jnp.ones((4, 3)), NamedSharding(mesh, P()))
      >>> x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))
      >>> red = GradientReduction("data")
      >>> @jax.jit
      ... def grad(w, x):
      ...     _, vjp = jax.vjp(lambda w: jnp.sum(x @ w), w)
      ...     (g,) = run_deferring(vjp, jnp.ones(()), reduction=red)
      ...     return g
      >>> jax.typeof(grad(w, x))
      ShapedArray(float32[4,3]{U:data})
      >>> float(red.reduce(grad(w, x))[0, 0])
      8.0
    """

    axis: str

    def is_unreduced(self, x: Any) -> bool:
        spec = _spec(x)
        return spec is not None and self.axis in spec.unreduced

    def sharded_over(self, x: Any) -> bool:
        """Whether ``x`` is sharded (or varying) over the axis: then it is not a sum."""
        return self.sharded_over_spec(_spec(x))

    def sharded_over_spec(self, spec: Any) -> bool:
        """Whether ``spec`` (a PartitionSpec or sharding, or None) shards over the axis."""
        spec = getattr(spec, "spec", spec)
        return spec is not None and any(self.axis in _names(p) for p in spec.partitions)

    def defers(self, param: Any) -> bool:
        """Whether ``param``'s gradient accumulates unreduced: a float with a sharding type."""
        return _float(param) and _spec(param) is not None

    def _without_axis(self, entry: Any) -> Any:
        names = tuple(n for n in _names(entry) if n != self.axis)
        if not names:
            return None
        return names[0] if len(names) == 1 else names

    def _with_unreduced(
        self, sharding: NamedSharding, ndim: int, unreduced: bool, target: Any = None
    ) -> Any:
        """``sharding`` made unreduced over the axis (its partitions then drop the axis),
        or reduced over it (to ``target``'s partitions if given, else its own)."""
        spec = sharding.spec
        if unreduced:
            axes = spec.unreduced | {self.axis}
            parts = [self._without_axis(p) for p in _partitions(spec, ndim)]
        else:
            axes = spec.unreduced - {self.axis}
            parts = _partitions(spec if target is None else target, ndim)
        new = PartitionSpec(*parts, unreduced=axes, reduced=spec.reduced)
        mesh = sharding.mesh
        types = dict(zip(mesh.axis_names, mesh.axis_types))
        if types.get(self.axis, AxisType.Explicit) != AxisType.Explicit:
            # A constant JAX made without the mesh (the zeros a transpose scatters
            # into) is typed on an Auto copy of it; unreduced needs the Explicit one.
            # (A traced value's sharding holds an AbstractMesh.)
            mesh = cast(AbstractMesh, mesh).update_axis_types({self.axis: AxisType.Explicit})
        return NamedSharding(mesh, new)

    def unreduced(self, x: Any) -> Any:
        """``x`` as an unreduced value over the axis, at full size over it.

        No communication for a value replicated over the axis; one sharded over
        it is gathered first (a fallback: deferred gradients arrive unreduced).
        """
        if self.is_unreduced(x):
            return x
        if self.sharded_over(x):
            x = jax.sharding.reshard(x, self._gathered(jax.typeof(x).sharding, jnp.ndim(x)))
        return jax.sharding.reshard(
            x, self._with_unreduced(jax.typeof(x).sharding, jnp.ndim(x), True)
        )

    def _gathered(self, sharding: NamedSharding, ndim: int) -> NamedSharding:
        """``sharding`` with the axis dropped from its partitions (full size over it)."""
        full = self._with_unreduced(sharding, ndim, True)
        return NamedSharding(full.mesh, PartitionSpec(*full.spec.partitions))

    def reduce(self, x: Any, like: Any = None) -> Any:
        """``x`` summed over the axis if it is unreduced (else ``x``).

        ``like`` gives the result's partitions (default ``x``'s: an all-reduce); sharded over the
        axis (an FSDP parameter) it is a reduce-scatter.
        """
        if not self.is_unreduced(x):
            return x
        target = _target_spec(like)
        sharding = jax.typeof(x).sharding
        reduced = self._with_unreduced(sharding, jnp.ndim(x), False, target=target)
        dim = self._scatter_dimension(x, reduced.spec)
        if dim is None:
            return jax.sharding.reshard(x, reduced)
        # An explicit reduce-scatter (a reshard gives an all-reduce and a slice on CPU).
        return jax.shard_map(
            lambda a: jax.lax.psum_scatter(a, self.axis, scatter_dimension=dim, tiled=True),
            mesh=reduced.mesh,
            in_specs=sharding.spec,
            out_specs=reduced.spec,
        )(x)

    def _scatter_dimension(self, x: Any, target: PartitionSpec) -> int | None:
        """The dimension ``target`` shards over the axis alone, where reducing ``x`` to
        it is a plain reduce-scatter (``x`` has ``target``'s other partitions)."""
        spec, ndim = _spec(x), jnp.ndim(x)
        parts = _partitions(target, ndim)
        dims = [d for d, p in enumerate(parts) if self.axis in _names(p)]
        if (
            len(dims) != 1
            or _names(parts[dims[0]]) != (self.axis,)
            or spec is None
            or spec.unreduced != {self.axis}
        ):
            return None
        if jnp.shape(x)[dims[0]] % dict(jax.typeof(x).sharding.mesh.shape)[self.axis]:
            return None
        expected = [None if d == dims[0] else p for d, p in enumerate(parts)]
        return dims[0] if _partitions(spec, ndim) == expected else None

    def unreduced_like(self, g: Any, acc: Any) -> Any:
        """``g`` typed as the unreduced accumulator ``acc`` (to add them)."""
        if self.is_unreduced(g) and _spec(g) == _spec(acc):
            return g
        g = self.unreduced(self.reduce(g))  # a fallback: communicates in every backward
        if _spec(g) == _spec(acc):
            return g
        return jax.sharding.reshard(g, jax.typeof(acc).sharding)

    def zeros_like(self, param: Any) -> Any:
        """Zeros shaped like ``param``, unreduced over the axis (an accumulator).

        Made at full size over the axis (no gather of a sharded zeros).
        """
        full = self._gathered(jax.typeof(param).sharding, jnp.ndim(param))
        return self.unreduced(
            jnp.zeros(jnp.shape(param), jax.typeof(param).dtype, out_sharding=full)
        )

    def unreduced_sharding(self, sharding: NamedSharding, ndim: int) -> NamedSharding:
        """A concrete accumulator sharding: ``sharding`` made unreduced over the axis."""
        return self._with_unreduced(sharding, ndim, True)

    def out_sharding(self, aval: Any) -> Any:
        """``aval``'s sharding made unreduced over the axis."""
        return self._with_unreduced(aval.sharding, len(aval.shape), True)

    def reduces_over_axis(self, eqn: Any, invals: Sequence[Any]) -> bool:
        """Whether ``eqn`` sums data-sharded dimensions (over the axis).

        Its result may be replicated over the axis (an all-reduce) or sharded
        over it (a reduce-scatter: the gradient of an FSDP parameter).
        """
        out = eqn.outvars[0].aval
        out_spec = getattr(getattr(out, "sharding", None), "spec", None)
        if out_spec is None or len(eqn.outvars) != 1 or not jnp.issubdtype(out.dtype, jnp.inexact):
            return False
        if eqn.primitive.name == "reduce_sum":
            parts = _partitions(_spec(invals[0]), jnp.ndim(invals[0]))
            return any(self.axis in _names(parts[a]) for a in eqn.params["axes"])
        if eqn.primitive.name == "dot_general":
            (lhs, rhs), _ = eqn.params["dimension_numbers"]
            a, b = (_partitions(_spec(v), jnp.ndim(v)) for v in invals)
            return any(
                self.axis in _names(a[i]) and self.axis in _names(b[j]) for i, j in zip(lhs, rhs)
            )
        return False


def _sharding_params(
    eqn: Any, red: GradientReduction, ndim: int, full_size: bool
) -> dict[str, Any]:
    """The equation's params with its result sharding (if it names one) made unreduced.

    An axis in that sharding stays (the input is reduced first) unless the input is already
    full-size over it (a deferred reduce-scatter): then the axis is dropped.
    """
    params = dict(eqn.params)
    for name in ("out_sharding", "sharding"):
        value = params.get(name)
        if isinstance(value, NamedSharding) and (
            full_size or not red.sharded_over_spec(value.spec)
        ):
            params[name] = red._with_unreduced(value, ndim, True)
    return params


def _bind(eqn: Any, invals: Sequence[Any], params: dict[str, Any]) -> list[Any]:
    out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _try_unreduced(eqn: Any, invals: list[Any], red: GradientReduction) -> list[Any] | None:
    """``eqn`` on unreduced inputs with unreduced results, or None where JAX's rules refuse."""
    name = eqn.primitive.name
    if name in _ADDITIVE:
        if any(red.sharded_over(v) for v in invals if not red.is_unreduced(v)):
            return None
        invals = [red.unreduced(v) if _float(v) else v for v in invals]
    elif name not in _LINEAR or sum(red.is_unreduced(v) for v in invals) != 1:
        return None
    if len(eqn.outvars) != 1 or not jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.inexact):
        return None
    full_size = any(
        red.is_unreduced(x) and red.sharded_over_spec(getattr(v.aval, "sharding", None))
        for v, x in zip(eqn.invars, invals)
        if not isinstance(v, jcore.Literal)
    )
    params = _sharding_params(eqn, red, len(eqn.outvars[0].aval.shape), full_size)
    try:
        outs = _bind(eqn, invals, params)
    except Exception:  # JAX has no unreduced rule for this call: reduce first
        return None
    if all(red.is_unreduced(o) and not red.sharded_over(o) for o in outs):
        return outs
    return None


class _Env:
    """Values of a jaxpr's variables, with each unreduced one's reduced form cached.

    ``pending`` holds the gathers JAX emits before a scatter-add (the transpose
    of an embedding lookup): ``{var: (reshard equation, its data-sharded input)}``,
    done only if something other than `_local_scatter_add` reads the variable.
    """

    def __init__(self, red: GradientReduction) -> None:
        self.red, self.values, self.reduced = red, {}, {}
        self.pending: dict[Any, tuple[Any, Any]] = {}

    def read(self, v: Any) -> Any:
        if isinstance(v, jcore.Literal):
            return v.val
        if v in self.pending:
            eqn, x = self.pending.pop(v)
            self.values[v] = _bind(eqn, [x], dict(eqn.params))[0]
        return self.values[v]

    def read_reduced(self, v: Any) -> Any:
        x = self.read(v)
        if isinstance(v, jcore.Literal) or not self.red.is_unreduced(x):
            return x
        if v not in self.reduced:
            # Reduced to the variable's own type: a reduce-scatter if it was sharded.
            self.reduced[v] = self.red.reduce(x, like=getattr(v.aval, "sharding", None))
        return self.reduced[v]


def _reshard(eqn: Any, x: Any, red: GradientReduction) -> list[Any]:
    """A reshard of an unreduced value: kept unreduced when it only changes that.

    JAX ends a transpose with such a reshard; to an FSDP target it is a deferred reduce-scatter.
    """
    target = eqn.params.get("dst_sharding")
    spec = target if isinstance(target, PartitionSpec) else getattr(target, "spec", None)
    ndim, x_spec = jnp.ndim(x), _spec(x)
    same = spec is not None and [red._without_axis(p) for p in _partitions(spec, ndim)] == (
        _partitions(x_spec, ndim)
    )
    if (
        same
        and spec is not None
        and x_spec is not None
        and red.axis not in spec.unreduced
        and spec.unreduced <= x_spec.unreduced
    ):
        return [x]
    return _bind(eqn, [x], dict(eqn.params))


def _scatter_updates(jaxpr: Any) -> set[Any]:
    """Variables made by a ``reshard`` and read only as a scatter-add's updates."""
    reads: dict[Any, int] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal):
                reads[v] = reads.get(v, 0) + 1
    for v in jaxpr.outvars:
        if not isinstance(v, jcore.Literal):
            reads[v] = reads.get(v, 0) + 2  # returned: never deferred
    made = {e.outvars[0] for e in jaxpr.eqns if e.primitive.name == "reshard"}
    updates = [
        e.invars[2] for e in jaxpr.eqns if e.primitive.name == "scatter-add" and len(e.invars) == 3
    ]
    return {v for v in updates if v in made and reads.get(v) == 1}


def _local_scatter_add(eqn: Any, env: _Env) -> list[Any] | None:
    """A scatter-add of data-sharded updates as per-device scatters: an unreduced result.

    JAX transposes a lookup ``table[ids]`` of a data-sharded batch into a gather
    of the row cotangents onto every device, then a scatter-add. Scattering
    each device's own rows instead (``shard_map``) gives per-device partial
    sums of the same linear function: unreduced, with no communication.
    """
    if len(eqn.invars) != 3:
        return None
    red, (operand_var, indices_var, updates_var) = env.red, eqn.invars
    if updates_var not in env.pending or isinstance(operand_var, jcore.Literal):
        return None
    operand, indices = env.read(operand_var), env.read(indices_var)
    updates = env.pending[updates_var][1]
    dnums, ndim = eqn.params["dimension_numbers"], jnp.ndim(updates)
    scatter_dims = [d for d in range(ndim) if d not in dnums.update_window_dims]
    parts = _partitions(_spec(updates), ndim)
    if dnums.operand_batching_dims or any(_spec(x) is None for x in (operand, indices)):
        return None
    if red.is_unreduced(operand) or any(_partitions(_spec(operand), jnp.ndim(operand))):
        return None
    if any(
        p is not None and (_names(p) != (red.axis,) or d not in scatter_dims)
        for d, p in enumerate(parts)
    ) or not red.sharded_over(updates):
        return None
    index_parts = [parts[d] for d in scatter_dims] + [None] * (
        jnp.ndim(indices) - len(scatter_dims)
    )
    mesh = jax.typeof(updates).sharding.mesh
    indices = jax.sharding.reshard(indices, NamedSharding(mesh, PartitionSpec(*index_parts)))

    def local(i: Any, u: Any) -> Any:
        zeros = jax.lax.pcast(jnp.zeros(operand.shape, operand.dtype), red.axis, to="varying")
        return eqn.primitive.bind(zeros, i, u, **eqn.params)

    out_spec = PartitionSpec(*[None] * jnp.ndim(operand), unreduced=frozenset({red.axis}))
    specs = (PartitionSpec(*index_parts), PartitionSpec(*parts))
    try:
        partial = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_spec)(
            indices, updates
        )
    except Exception:  # JAX refuses this layout: scatter the gathered rows as before
        return None
    env.pending.pop(updates_var)
    return [red.unreduced(operand) + partial]


def _eval_eqn(eqn: Any, env: _Env, deferred_updates: set[Any]) -> list[Any]:
    red = env.red
    if eqn.primitive.name == "scatter-add":
        outs = _local_scatter_add(eqn, env)
        if outs is not None:
            return outs
    if eqn.primitive.name == "reshard" and eqn.outvars[0] in deferred_updates:
        x = env.read(eqn.invars[0])
        if red.sharded_over(x) and _float(x):
            env.pending[eqn.outvars[0]] = (eqn, x)
            return [None]
    invals = [env.read(v) for v in eqn.invars]
    if eqn.primitive.name in _INLINED and "jaxpr" in eqn.params:
        inner = eqn.params["jaxpr"]
        closed = inner if isinstance(inner, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(inner, [])
        return _eval_jaxpr(closed.jaxpr, closed.consts, invals, red)
    if any(red.is_unreduced(x) for x in invals):
        if eqn.primitive.name == "reshard":
            return _reshard(eqn, invals[0], red)
        outs = _try_unreduced(eqn, invals, red)
        if outs is not None:
            return outs
        return _bind(eqn, [env.read_reduced(v) for v in eqn.invars], dict(eqn.params))
    if eqn.primitive.name in ("reduce_sum", "dot_general") and red.reduces_over_axis(eqn, invals):
        params = dict(eqn.params)
        params["out_sharding"] = red.out_sharding(eqn.outvars[0].aval)
        return _bind(eqn, invals, params)
    return _bind(eqn, invals, dict(eqn.params))


def _eval_jaxpr(
    jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], red: GradientReduction
) -> list[Any]:
    env = _Env(red)
    env.values.update(zip(jaxpr.constvars, consts, strict=True))
    env.values.update(zip(jaxpr.invars, args, strict=True))
    deferred_updates = _scatter_updates(jaxpr)
    for eqn in jaxpr.eqns:
        outs = _eval_eqn(eqn, env, deferred_updates)
        for v, x in zip(eqn.outvars, outs, strict=True):
            if v not in env.pending:
                env.values[v] = x
    return [env.read(v) for v in jaxpr.outvars]


def run_deferring(fn: Callable[..., Any], *args: Any, reduction: GradientReduction) -> Any:
    """``fn(*args)`` traced on Explicit axes, its sums over ``reduction.axis`` left unreduced."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    outs = _eval_jaxpr(closed.jaxpr, closed.consts, jax.tree.leaves(args), reduction)
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def reduce_gradients_once(program: Sequence[Instruction], ctx: Any) -> list[Instruction]:
    """Pass: each stage's ``reduce`` call right after its last backward (a new list).

    Only for a training region that `RegionInfo.reduces_once`; ``reduce`` donates the
    gradient accumulators and writes them reduced to the parameters' shardings.
    """
    if not ctx.with_grad or not getattr(ctx.plan.info, "reduces_once", False):
        return list(program)
    last: dict[int, int] = {}
    for n, ins in enumerate(program):
        for part in ins.program.parts() if isinstance(ins, Call) else ():
            if part.kind in ("B", "BW", "FB"):
                last[cast(int, part.stage)] = n  # a stage task's program has a stage
    after: dict[int, Call] = {}
    for k, n in last.items():
        if ctx.fns[k].param_inputs:
            key, fn = ctx.program("reduce", k)
            gacc, q = ctx.grad_accumulators(k), ctx.stage_mesh[k]
            params = tuple(ctx.input(r, q) for r in ctx.fns[k].param_inputs)
            structure = ctx.fns[k].structure("reduce")
            after[n] = Call(q, key, fn, (gacc, params), gacc, f"reduce{k}", structure=structure)
    result: list[Instruction] = []
    for n, ins in enumerate(program):
        result.append(ins)
        if n in after:
            result.append(after[n])
    return result
