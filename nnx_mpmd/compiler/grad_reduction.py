"""One data-parallel gradient reduction per step: unreduced accumulation, then one reduce.

A stage whose submesh has a data axis (its microbatch sharded over it, its
parameters replicated over it) used to all-reduce its full gradient inside every
backward program: once per microbatch. On an *Explicit* data axis, JAX types a
value that holds per-device partial sums as *unreduced* over the axis
(``float32[4,3]{U:data}``); adding such values needs no communication, and one
``jax.sharding.reshard`` to the parameter's sharding reduces them (an
all-reduce). So:

* `run_deferring` evaluates a backward (a ``jax.vjp`` function, or the BW part
  of a split backward) equation by equation and gives each reduction over the
  data axis (a ``reduce_sum`` or ``dot_general`` that contracts data-sharded
  dimensions into a replicated result) an unreduced result instead. Linear
  operations carry unreduced values on (JAX's own sharding rules check each
  one); any other operation reduces its unreduced inputs first, exactly where
  the reduction happened before, so batch-coupled code (a BatchNorm, a loss
  that means over the batch) computes the same function.
* the stage's gradient accumulators for parameters replicated over the data
  axis are created unreduced (`unreduced_zeros`), the backward programs add
  unreduced gradients into them, and one ``reduce`` program per stage, called
  once after the stage's last backward (`reduce_gradients_once`), reduces them:
  one all-reduce of the parameter bytes per step. A separate small program
  keeps the backward programs the same for every microbatch (one compile each).

Only float reassociation changes numerics: per device, microbatch gradients
are summed before the sum over devices instead of after it.

Auto data axes take the same passes with another representation: JAX allows
unreduced values only on Explicit axes, so `grad_reduction_auto` keeps the
partials as stacked ``[n, *shape]`` arrays (`RegionInfo.stacked_axis`).

Where neither applies the programs are what they were (one reduction per
microbatch): a data axis of size 1, a replicated batch, and parameters sharded
over the data axis (FSDP; their per-microbatch reduce-scatter stays). The
region's data (`RegionInfo.unreduced_axis` and each parameter's sharding type)
decides.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from nnx_mpmd.compiler.instructions import Call, Instruction

__all__ = [
    "GradientReduction",
    "all_reduce_bytes",
    "program_calls",
    "reduce_gradients_once",
    "run_deferring",
    "step_all_reduce_bytes",
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


def _partitions(spec: PartitionSpec, ndim: int) -> list[Any]:
    parts = list(spec.partitions)
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
        spec = _spec(x)
        if spec is None:
            return False
        return any(self.axis in _names(p) for p in spec.partitions)

    def defers(self, param: Any) -> bool:
        """Whether ``param``'s gradient accumulates unreduced: float, replicated over the axis."""
        return _float(param) and _spec(param) is not None and not self.sharded_over(param)

    def _with_unreduced(self, sharding: NamedSharding, ndim: int, unreduced: bool) -> Any:
        spec = sharding.spec
        axes = spec.unreduced | {self.axis} if unreduced else spec.unreduced - {self.axis}
        new = PartitionSpec(*_partitions(spec, ndim), unreduced=axes, reduced=spec.reduced)
        mesh = sharding.mesh
        types = dict(zip(mesh.axis_names, mesh.axis_types))
        if types.get(self.axis, AxisType.Explicit) != AxisType.Explicit:
            # A constant JAX made without the mesh (the zeros a transpose scatters
            # into) is typed on an Auto copy of it; unreduced needs the Explicit one.
            mesh = mesh.update_axis_types({self.axis: AxisType.Explicit})
        return NamedSharding(mesh, new)

    def unreduced(self, x: Any) -> Any:
        """``x`` as an unreduced value over the axis (no communication)."""
        if self.is_unreduced(x):
            return x
        sharding = jax.typeof(x).sharding
        return jax.sharding.reshard(x, self._with_unreduced(sharding, jnp.ndim(x), True))

    def reduce(self, x: Any) -> Any:
        """``x`` summed over the axis (an all-reduce), if it is unreduced."""
        if not self.is_unreduced(x):
            return x
        sharding = jax.typeof(x).sharding
        return jax.sharding.reshard(x, self._with_unreduced(sharding, jnp.ndim(x), False))

    def unreduced_sharding(self, sharding: NamedSharding, ndim: int) -> NamedSharding:
        """A concrete accumulator sharding: ``sharding`` made unreduced over the axis."""
        return self._with_unreduced(sharding, ndim, True)

    def out_sharding(self, aval: Any) -> Any:
        """``aval``'s sharding made unreduced over the axis."""
        return self._with_unreduced(aval.sharding, len(aval.shape), True)

    def reduces_over_axis(self, eqn: Any, invals: Sequence[Any]) -> bool:
        """Whether ``eqn`` sums data-sharded dimensions into a result replicated over the axis."""
        out = eqn.outvars[0].aval
        out_spec = getattr(getattr(out, "sharding", None), "spec", None)
        if out_spec is None or len(eqn.outvars) != 1 or not jnp.issubdtype(out.dtype, jnp.inexact):
            return False
        if any(self.axis in _names(p) for p in out_spec.partitions):
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


def _sharding_params(eqn: Any, red: GradientReduction, ndim: int) -> dict[str, Any]:
    """The equation's params with its result sharding (if it names one) made unreduced."""
    params = dict(eqn.params)
    for name in ("out_sharding", "sharding"):
        value = params.get(name)
        if isinstance(value, NamedSharding):
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
    params = _sharding_params(eqn, red, len(eqn.outvars[0].aval.shape))
    try:
        outs = _bind(eqn, invals, params)
    except Exception:  # JAX has no unreduced rule for this call: reduce first
        return None
    return outs if all(red.is_unreduced(o) for o in outs) else None


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
            self.reduced[v] = self.red.reduce(x)
        return self.reduced[v]


def _reshard(eqn: Any, x: Any, red: GradientReduction) -> list[Any]:
    """A reshard of an unreduced value: kept unreduced when it only changes that.

    JAX ends a transpose with a reshard to the primal's sharding; when that
    differs from ``x``'s only by the reduction, it is the reduction being
    deferred. To a sharding over the axis it is a reduce-scatter, done here.
    """
    target = eqn.params.get("dst_sharding")
    spec = target if isinstance(target, PartitionSpec) else getattr(target, "spec", None)
    ndim = jnp.ndim(x)
    same = spec is not None and _partitions(spec, ndim) == _partitions(_spec(x), ndim)
    if same and red.axis not in spec.unreduced and spec.unreduced <= _spec(x).unreduced:
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

    out_spec = PartitionSpec(*[None] * jnp.ndim(operand), unreduced={red.axis})
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
    """``fn(*args)`` with its reductions over ``reduction.axis`` left unreduced.

    Call it while tracing a program on an Explicit mesh (``fn`` is traced to a
    jaxpr and re-evaluated equation by equation). Results that are sums over
    the axis come back unreduced (their type says ``{U:axis}``); other results
    are what ``fn`` returns.

    Args:
      fn: a function of arrays, e.g. the function ``jax.vjp`` returns.
      *args: its arguments (pytrees of arrays or tracers).
      reduction: the axis.

    Returns:
      ``fn``'s result, with the same tree structure.
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    outs = _eval_jaxpr(closed.jaxpr, closed.consts, jax.tree.leaves(args), reduction)
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def reduce_gradients_once(program: Sequence[Instruction], ctx: Any) -> list[Instruction]:
    """Inserts each stage's ``reduce`` call right after its last backward.

    The pass after `schedule_lowering.fuse_forward_backward`: only for a
    training region with an unreduced or stacked axis (`RegionInfo.reduces_once`). The
    ``reduce`` program reads and donates the stage's gradient accumulators and
    writes them back reduced (see `stage_programs.StageFunctions.reduce`).

    Args:
      program: the region's instructions.
      ctx: the region's `RegionContext`.

    Returns:
      A new list; the input is not changed.
    """
    if not ctx.with_grad or not getattr(ctx.plan.info, "reduces_once", False):
        return list(program)
    last: dict[int, int] = {}
    for n, ins in enumerate(program):
        if isinstance(ins, Call) and ins.program.kind in ("B", "BW", "FB"):
            last[ins.program.stage] = n
    after: dict[int, Call] = {}
    for k, n in last.items():
        if ctx.fns[k].param_inputs:
            key, fn = ctx.program("reduce", k)
            gacc = ctx.grad_accumulators(k)
            after[n] = Call(ctx.stage_mesh[k], key, fn, (gacc,), gacc, f"reduce{k}")
    result: list[Instruction] = []
    for n, ins in enumerate(program):
        result.append(ins)
        if n in after:
            result.append(after[n])
    return result


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_DTYPE_BYTES.update({"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8})
_ALL_REDUCE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+all-reduce(?:-start)?\(")


def all_reduce_bytes(hlo_text: str) -> int:
    """Bytes all-reduced by one run of a compiled XLA program (its result shapes' sizes).

    Args:
      hlo_text: the compiled module's text (``compiled.as_text()``).

    Returns:
      The summed byte size of every ``all-reduce`` (or ``all-reduce-start``) result.

    Example:
      >>> all_reduce_bytes("  %ar = f32[4,3]{1,0} all-reduce(f32[4,3]{1,0} %x), to_apply=%add")
      48
    """
    total = 0
    for line in hlo_text.splitlines():
        match = _ALL_REDUCE.match(line)
        if match is None:
            continue
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", match.group(1)):
            size = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
            total += size * _DTYPE_BYTES.get(dtype, 4)
    return total


def program_calls(instructions: Sequence[Instruction]) -> dict[str, int]:
    """How many times the instruction list calls each program, by program name."""
    counts: dict[str, int] = {}
    for ins in instructions:
        if isinstance(ins, Call):
            counts[str(ins.program)] = counts.get(str(ins.program), 0) + 1
    return counts


def step_all_reduce_bytes(instructions: Sequence[Instruction], executables: Any) -> int:
    """Bytes all-reduced by one step: each program's all-reduce bytes times its calls.

    Args:
      instructions: the step's instruction list (``lowered.compiled.instructions``).
      executables: ``compiled.executables()`` (program name -> compiled variants).

    Returns:
      The total; a program compiled in several variants counts its first.
    """
    total = 0
    for name, calls in program_calls(instructions).items():
        found = executables.get(name)
        if found:
            total += calls * all_reduce_bytes(found[0].as_text())
    return total
