"""One gradient reduction per step on an *Auto* data axis: stacked per-device partials.

On an Explicit data axis `grad_reduction` types per-device partial sums as
JAX ``unreduced`` values. JAX refuses those on an Auto axis ("Unreduced axes
can only refer to mesh axes that is of type `Explicit`"), and an Auto trace
does not say which dimensions are sharded over the axis. This module keeps
the partial sums as *stacked* arrays instead: ``[n, *shape]`` for an axis of
``n`` devices, sharded ``P(axis)`` over the leading dimension, so device ``i``
holds its own partial sum and ``sum(stacked, 0)`` (one all-reduce) is the
gradient.

`run_stacking` evaluates a backward jaxpr equation by equation, exactly as
traced, except for the *last* reduction on each path into a parameter
gradient: a ``dot_general``, ``reduce_sum`` or scatter-add (an embedding's
gradient) whose result reaches the gradient only through linear operations
that sum nothing the axis can split (`_tail_vars`). That
reduction runs in a ``shard_map`` over the axis, each device reducing its own
block of the first reduced dimension (the batch, for a weight gradient), and
gives a stacked result; the linear operations after it run per partial
(``jax.vmap``). The split does not depend on how XLA lays the operands out:
any block split of a summed dimension sums to the same value, so a layout
guess that is wrong costs a reshard, never correctness. Everything else
(batch-coupled code such as a BatchNorm, activation cotangents) is bound as
traced, on Auto axes as before. A gradient with no such sum (its last sum
over a dimension the axis does not divide, or inside a ``scan``) is reduced
where it was and placed on the first device (`StackedReduction.stack`).

Tracing the stage programs with the data axis made Explicit instead would
re-type the user's Auto-traced equations under Explicit rules (a gather
without ``out_sharding``, a ``with_sharding_constraint`` with Auto meaning);
this module changes no equation's typing.

Only float reassociation changes numerics: per device, microbatch gradients
are summed before the sum over devices instead of after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.sharding import NamedSharding, PartitionSpec

from nnx_mpmd.compiler.trace.grad_reduction import _ADDITIVE, _INLINED, _bind, _names
from nnx_mpmd.compiler.trace.grad_reduction import _LINEAR as _DEFERRED_LINEAR
from nnx_mpmd.errors import MeshError

__all__ = ["StackedReduction", "run_stacking", "split_dims"]

# Sums: the last one on a path into a gradient runs per device; reduce_sum and
# dot_general are linear in each input (one stacked input is carried per partial).
_BILINEAR = frozenset({"reduce_sum", "dot_general"})
_SUMS = _BILINEAR | {"scatter-add"}
# Non-reducing operations linear in their (one) stacked float input.
_LINEAR = _DEFERRED_LINEAR - _BILINEAR
# _ADDITIVE (sums: every float input is stacked, a plain one placed on the first
# device) and _INLINED (programs inlined) are grad_reduction's.


def _float(x: Any) -> bool:
    return bool(jnp.issubdtype(jnp.result_type(x), jnp.inexact))


@dataclasses.dataclass(frozen=True)
class StackedReduction:
    """Gradients kept as per-device partial sums over one Auto mesh axis.

    Args:
      axis: the submesh axis the microbatch is sharded over.
      size: its number of devices (at least 2).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,),
      ...                      devices=jax.devices()[:2])
      >>> w = jax.device_put(jnp.ones((4, 3)), NamedSharding(mesh, P()))
      >>> x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))
      >>> red = StackedReduction("data", 2)
      >>> @jax.jit
      ... def grad(w, x):
      ...     _, vjp = jax.vjp(lambda w: jnp.sum(x @ w), w)
      ...     (g,) = run_stacking(vjp, jnp.ones(()), reduction=red, stacked=[0])
      ...     return g
      >>> with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      ...     g = grad(w, x)
      >>> g.shape, float(jnp.sum(g, 0)[0, 0])
      ((2, 4, 3), 8.0)
    """

    axis: str
    size: int

    def defers(self, param: Any) -> bool:
        """Whether float ``param`` accumulates stacked: not sharded over the axis (FSDP is not)."""
        spec = getattr(getattr(param, "sharding", None), "spec", None)
        if spec is None or not _float(param.dtype):
            return False
        return not any(self.axis in _names(p) for p in spec.partitions)

    def accumulator_sharding(self, param: Any) -> NamedSharding:
        """The sharding of ``param``'s stacked accumulator: ``P(axis, *param's spec)``."""
        spec = list(param.sharding.spec) + [None] * (len(param.shape) - len(param.sharding.spec))
        return NamedSharding(param.sharding.mesh, PartitionSpec(self.axis, *spec))

    def zeros(self, param: Any) -> Any:
        """A stacked zero accumulator for ``param``: shape ``[size, *param.shape]``."""
        return jnp.zeros((self.size, *jnp.shape(param)), jnp.result_type(param))

    def reduce(self, stacked: Any) -> Any:
        """The sum of the partials (an all-reduce over the axis)."""
        return jnp.sum(stacked, axis=0)

    def stack(self, x: Any) -> Any:
        """A plain (replicated) value as partials: ``x`` on the first device, zeros elsewhere."""

        def first(y: Any) -> Any:
            here = jax.lax.axis_index(self.axis) == 0
            return jnp.where(here, y, jnp.zeros_like(y))[None]

        return self._shard_map(first, (PartitionSpec(),), PartitionSpec(self.axis), x)

    def rows_spec(self, shape: Sequence[int]) -> PartitionSpec:
        """A layout for a per-microbatch value of ``shape``: rows over the axis if it divides them.

        Example:
          >>> StackedReduction("data", 2).rows_spec((4, 3)), StackedReduction("data", 2).rows_spec(())
          (P('data',), P())
        """
        if shape and shape[0] % self.size == 0:
            return PartitionSpec(self.axis)
        return PartitionSpec()

    def constrain(self, x: Any, spec: PartitionSpec) -> Any:
        """``x`` laid out as ``spec`` on the axis's mesh (a constraint with Auto meaning)."""
        return jax.lax.with_sharding_constraint(x, NamedSharding(self._mesh([x]), spec))

    def _mesh(self, values: Sequence[Any]) -> Any:
        """The context's abstract mesh, else the one ``values`` are typed on."""
        meshes = [jax.sharding.get_abstract_mesh()]
        meshes += [getattr(jax.typeof(x).sharding, "mesh", None) for x in values]
        for mesh in meshes:
            if mesh is not None and self.axis in mesh.axis_names:
                return mesh
        raise MeshError(
            f"no mesh with the axis {self.axis!r} to reduce gradients over: trace the "
            "program on the stage's submesh (its arrays, or jax.sharding.use_abstract_mesh)."
        )

    def _shard_map(self, fn: Callable[..., Any], in_specs: Any, out_specs: Any, *xs: Any) -> Any:
        mesh = self._mesh(xs)
        return jax.shard_map(
            fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={self.axis}
        )(*xs)

    def reduce_per_device(self, eqn: Any, invals: Sequence[Any], dims: Sequence[int | None]) -> Any:
        """``eqn`` on each device's blocks of ``invals`` (split along ``dims``): stacked.

        An input with no split dimension is whole on every device; a
        scatter-add's operand (added, not scattered) counts on the first only.
        """

        def spec(x: Any, d: int | None) -> PartitionSpec:
            return PartitionSpec(*[self.axis if k == d else None for k in range(jnp.ndim(x))])

        def local(*xs: Any) -> Any:
            if eqn.primitive.name == "scatter-add":
                here = jax.lax.axis_index(self.axis) == 0
                xs = (jnp.where(here, xs[0], jnp.zeros_like(xs[0])), *xs[1:])
            return eqn.primitive.bind(*xs, **eqn.params)[None]

        specs = tuple(spec(x, d) for x, d in zip(invals, dims))
        return self._shard_map(local, specs, PartitionSpec(self.axis), *invals)


def split_dims(eqn: Any, invals: Sequence[Any], size: int) -> tuple[int | None, ...] | None:
    """Per input of a sum, the dimension to split into ``size`` device blocks, or None.

    The first summed dimension ``size`` divides (a ``dot_general``'s left operand, a scatter-add's).
    """
    name, shapes = eqn.primitive.name, [np.shape(x) for x in invals]
    if name == "reduce_sum":
        axes = sorted(eqn.params["axes"])
        return (axes[0],) if axes and shapes[0][axes[0]] % size == 0 else None
    if name == "dot_general":
        (lhs, rhs), _ = eqn.params["dimension_numbers"]
        if not lhs:
            return None
        i, j = min(zip(lhs, rhs))
        return None if shapes[0][i] % size else (i, j)
    if name != "scatter-add" or len(invals) != 3:
        return None
    dnums = eqn.params["dimension_numbers"]
    scatter = [d for d in range(len(shapes[2])) if d not in dnums.update_window_dims]
    index = list(range(len(shapes[1]) - 1))  # JAX's index vector is the last dimension
    if dnums.operand_batching_dims or not scatter or len(index) != len(scatter):
        return None
    return None if shapes[2][scatter[0]] % size else (None, index[0], scatter[0])


def _inline(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """Evaluates ``jaxpr`` with nested programs inlined (traced: gives a flat jaxpr)."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if eqn.primitive.name in _INLINED and "jaxpr" in eqn.params:
            inner = eqn.params["jaxpr"]
            closed = inner if isinstance(inner, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(inner, [])
            outs = _inline(closed.jaxpr, closed.consts, invals)
        else:
            outs = _bind(eqn, invals, eqn.params)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _tail_vars(jaxpr: Any, stacked_outputs: set[int], size: int) -> set[Any]:
    """Float variables that reach only stacked outputs, through linear ops that carry partials.

    A splittable sum (`split_dims`) whose result is one of them is the last
    sum on its way into a gradient: `run_stacking` splits it per device.
    """
    uses: dict[Any, list[Any]] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal):
                uses.setdefault(v, []).append(eqn)
    returned: dict[Any, bool] = {}
    for i, v in enumerate(jaxpr.outvars):
        if not isinstance(v, jcore.Literal):
            returned[v] = returned.get(v, True) and i in stacked_outputs
    tail: set[Any] = set()
    for eqn in reversed(jaxpr.eqns):
        for v in eqn.outvars:
            if not jnp.issubdtype(v.aval.dtype, jnp.inexact) or not returned.get(v, True):
                continue
            consumers = uses.get(v, [])
            if not consumers and v not in returned:
                continue
            if all(_carries(c, size) and all(o in tail for o in c.outvars) for c in consumers):
                tail.add(v)
    return tail


def _carries(eqn: Any, size: int) -> bool:
    """Whether ``eqn`` carries partials: linear, and not a sum `split_dims` can split."""
    name = eqn.primitive.name
    if name in _SUMS:
        return split_dims(eqn, [v.aval for v in eqn.invars], size) is None
    return name in _LINEAR | _ADDITIVE


class _Stacked:
    """A stacked value in the evaluation environment (``value``: ``[n, *shape]``)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _carry(eqn: Any, invals: list[Any], red: StackedReduction) -> list[Any] | None:
    """``eqn`` per partial when it is linear in its stacked inputs; else None."""
    name, stacked = eqn.primitive.name, [isinstance(x, _Stacked) for x in invals]
    if name in _ADDITIVE:
        if not all(s or _float(x) for s, x in zip(stacked, invals)):
            return None
        values = [x.value if s else red.stack(x) for s, x in zip(stacked, invals)]
        return [_Stacked(v) for v in _bind(eqn, values, eqn.params)]
    if name == "scatter-add" and len(invals) == 3 and not stacked[1]:
        # linear in (operand, updates) together: both as partials, the indices shared
        operand, indices, updates = (x.value if s else x for s, x in zip(stacked, invals))
        operand = operand if stacked[0] else red.stack(operand)
        updates = updates if stacked[2] else red.stack(updates)
        outs = jax.vmap(lambda o, u: _bind(eqn, (o, indices, u), eqn.params))(operand, updates)
        return [_Stacked(v) for v in outs]
    if name not in _LINEAR | _BILINEAR or sum(stacked) != 1:
        return None
    axes = [0 if s else None for s in stacked]
    values = [x.value if s else x for s, x in zip(stacked, invals)]
    outs = jax.vmap(lambda *xs: _bind(eqn, xs, eqn.params), in_axes=tuple(axes))(*values)
    return [_Stacked(v) for v in outs]


def _eval_eqn(eqn: Any, invals: list[Any], tail: set[Any], red: StackedReduction) -> list[Any]:
    if any(isinstance(x, _Stacked) for x in invals):
        outs = _carry(eqn, invals, red) if eqn.outvars[0] in tail else None
        if outs is not None:
            return outs
        invals = [red.reduce(x.value) if isinstance(x, _Stacked) else x for x in invals]
    elif eqn.primitive.name in _SUMS and eqn.outvars[0] in tail:
        dims = split_dims(eqn, invals, red.size)
        if dims is not None:
            return [_Stacked(red.reduce_per_device(eqn, invals, dims))]
    return _bind(eqn, invals, eqn.params)


def _output(x: Any, stacked: bool, red: StackedReduction) -> Any:
    if isinstance(x, _Stacked):
        return x.value if stacked else red.reduce(x.value)
    return red.stack(x) if stacked else x


def run_stacking(
    fn: Callable[..., Any],
    *args: Any,
    reduction: StackedReduction,
    stacked: Sequence[int],
) -> Any:
    """``fn(*args)`` with the gradients it sums over ``reduction.axis`` left as partials.

    Outputs at positions ``stacked`` come back as ``[n, *shape]`` partials summing to the result.
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    flat = jax.make_jaxpr(lambda *a: _inline(closed.jaxpr, closed.consts, a))(
        *jax.tree.leaves(args)
    )
    jaxpr, wanted = flat.jaxpr, set(stacked)
    tail = _tail_vars(jaxpr, wanted, reduction.size)
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, flat.consts, strict=True))
    env.update(zip(jaxpr.invars, jax.tree.leaves(args), strict=True))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for eqn in jaxpr.eqns:
        outs = _eval_eqn(eqn, [read(v) for v in eqn.invars], tail, reduction)
        env.update(zip(eqn.outvars, outs, strict=True))
    outs = [_output(read(v), i in wanted, reduction) for i, v in enumerate(jaxpr.outvars)]
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
