"""The pipelined region: what `value_and_grad` records while `mp.jit` traces a step.

Inside `mp.jit`'s trace, ``mp.value_and_grad(loss_fn)(model, batch)`` does not
differentiate anything. It traces ``loss_fn`` on one microbatch (with stage
markers on) into a closed *body* jaxpr and emits a single ``mpmd_region``
equation into the step's jaxpr. Its outputs are the mean loss, the mean aux
values, the mean gradients and the updated non-differentiated state. The
compiler later cuts the body into stages; the rest of the step (the optimizer)
sees the region as one equation.

Outside `mp.jit`, `reference_value_and_grad` computes the same numbers
unpipelined: a scan over microbatches, averaging losses and gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any, cast

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend import core as jcore
from jax.extend.core import Primitive
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from nnx_mpmd._jax_compat import convert_constvars_jaxpr
from nnx_mpmd.annotate import markers
from nnx_mpmd.compiler.trace.captured import (
    CapturedVariable,
    bound_variables,
    captured_variables,
    outer_trace_error,
)
from nnx_mpmd.compiler.trace.region_aux import aux_modes, join_stacked, stacked_aval
from nnx_mpmd.compiler.trace.region_rng import (
    advance_counts,
    rng_count_inputs,
    rng_counts_from_index,
)
from nnx_mpmd.errors import CompileError

__all__ = [
    "RegionInfo",
    "active_microbatches",
    "check_microbatches",
    "reference_value_and_grad",
    "region_p",
    "microbatch_spec",
    "region_tracing",
    "split_microbatches",
    "trace_region",
]

region_p = Primitive("mpmd_region")
region_p.multiple_results = True


@dataclasses.dataclass(eq=False)
class RegionInfo:
    """Everything the compiler needs to know about one pipelined region.

    Inputs of the region equation, in order: closure values, differentiated
    state leaves, other state leaves, batch leaves. Outputs: loss, aux leaves,
    gradients (one per differentiated leaf), updated other state leaves.
    """

    body: jcore.Jaxpr  # invars: closure, diff, other, microbatch; outvars: loss, aux, other
    num_microbatches: int
    n_closure: int
    n_diff: int
    n_other: int
    n_batch: int
    n_aux: int
    has_aux: bool
    with_grad: bool
    diff_paths: tuple[str, ...]
    other_paths: tuple[str, ...]
    out_avals: tuple[Any, ...]
    # The Explicit submesh axis (of size > 1) the microbatches are sharded over:
    # gradients accumulate unreduced over it and are reduced once per step
    # (`grad_reduction`). None: reduced in every backward, as JAX places it.
    unreduced_axis: str | None = None
    # The same on an Auto axis: (axis, its size). Gradients accumulate as stacked
    # per-device partial sums and are reduced once per step (`grad_reduction_auto`).
    stacked_axis: tuple[str, int] | None = None
    # Per aux leaf, "mean" or "concat" (`region_aux`); empty: every leaf averaged.
    aux_modes: tuple[str, ...] = ()

    @property
    def reduces_once(self) -> bool:
        """Whether gradients are reduced once per step (`reduce` programs)."""
        return self.with_grad and (self.unreduced_axis or self.stacked_axis) is not None

    def __hash__(self) -> int:
        return id(self)


def _region_abstract_eval(*avals: Any, info: RegionInfo) -> tuple[Any, ...]:
    del avals
    return info.out_avals


region_p.def_abstract_eval(_region_abstract_eval)


class _RegionState(threading.local):
    def __init__(self) -> None:
        self.num_microbatches: int | None = None
        self.regions: list[RegionInfo] | None = None
        self.submesh: Mesh | None = None
        self.batch_axis: str | None = None


_region_state = _RegionState()


@contextlib.contextmanager
def region_tracing(
    num_microbatches: int, submesh: Mesh | None = None, batch_axis: str | None = None
) -> Iterator[list[RegionInfo]]:
    """While active, `value_and_grad` records regions (yielded list) instead of computing.

    ``submesh`` evaluates the RNG counters and, by its axis types, decides whether microbatches
    are traced with a typed sharding over ``batch_axis``.
    """
    state = _region_state
    previous = (state.num_microbatches, state.regions, state.submesh, state.batch_axis)
    regions: list[RegionInfo] = []
    state.num_microbatches, state.regions = num_microbatches, regions
    state.submesh, state.batch_axis = submesh, batch_axis
    try:
        yield regions
    finally:
        (state.num_microbatches, state.regions, state.submesh, state.batch_axis) = previous


def microbatch_spec(
    shape: tuple[int, ...], submesh: Mesh, batch_axis: str | None
) -> PartitionSpec | None:
    """``P(batch_axis)`` for a microbatch leaf of ``shape`` if that axis splits its rows, else None.

    On an Explicit axis this spec is part of the traced type.

    Example:
      >>> import jax
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> microbatch_spec((4, 3), mesh, "data"), microbatch_spec((3,), mesh, "data")
      (P('data',), None)
    """
    size = dict(submesh.shape).get(batch_axis, 1) if batch_axis else 1
    if size > 1 and shape and shape[0] % size == 0:
        return PartitionSpec(batch_axis)
    return None


def _microbatch_aval(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
    """A microbatch's abstract value, typed on the submeshes' abstract mesh (`microbatch_spec`).

    An untyped input would not combine with stage values on Explicit axes.
    """
    submesh, axis = _region_state.submesh, _region_state.batch_axis
    if submesh is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    spec = microbatch_spec(shape, submesh, axis) or PartitionSpec()
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(submesh.abstract_mesh, spec))


def _reduction_axis(with_grad: bool, axis_type: AxisType) -> str | None:
    """The batch axis, if of ``axis_type`` and size > 1, in a gradient region."""
    submesh, axis = _region_state.submesh, _region_state.batch_axis
    if not with_grad or submesh is None or axis not in submesh.axis_names:
        return None
    types = dict(zip(submesh.axis_names, submesh.axis_types))
    if types[axis] != axis_type or dict(submesh.shape)[axis] < 2:
        return None
    return axis


def _unreduced_axis(with_grad: bool) -> str | None:
    """The batch axis, when gradients can accumulate unreduced over it (see `RegionInfo`)."""
    return _reduction_axis(with_grad, AxisType.Explicit)


def _stacked_axis(with_grad: bool) -> tuple[str, int] | None:
    """The Auto batch axis and its size, when gradients accumulate stacked over it."""
    axis = _reduction_axis(with_grad, AxisType.Auto)
    submesh = cast(Mesh, _region_state.submesh)  # set whenever there is a reduction axis
    return None if axis is None else (axis, dict(submesh.shape)[axis])


def active_microbatches() -> int | None:
    """The number of microbatches of the enclosing `mp.jit` trace, if any."""
    return _region_state.num_microbatches


def _path_str(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


def check_microbatches(batch: Any, num_microbatches: int) -> None:
    """Checks that ``batch`` splits into ``num_microbatches`` equal microbatches.

    Raises:
      CompileError: a leaf has no leading axis, the leaves' leading sizes
        disagree (all are listed), or the size is not divisible by m.
    """
    paths_leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    sizes: dict[str, int] = {}
    for path, leaf in paths_leaves:
        shape = jnp.shape(leaf)
        where = jax.tree_util.keystr(path) or "batch"
        if not shape:
            raise CompileError(
                f"batch leaf {where} is a scalar: every leaf of the batch needs a leading "
                f"(batch) axis to split into num_microbatches={num_microbatches} microbatches. "
                "Pass per-example arrays, or close over the scalar in the loss function."
            )
        sizes[where] = shape[0]
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise CompileError(
            f"the batch leaves have different leading (batch) sizes ({listed}): every leaf "
            "is split along axis 0 into the same microbatches, so they must agree. Give every "
            "leaf of the batch the same number of rows."
        )
    for where, size in sizes.items():
        if size % num_microbatches:
            raise CompileError(
                f"batch leaf {where} has {size} rows: its leading (batch) axis must divide "
                f"into num_microbatches={num_microbatches} equal microbatches. Use a batch "
                "size that is a multiple of num_microbatches."
            )


def split_microbatches(batch: Any, num_microbatches: int) -> Any:
    """Reshapes every leaf of ``batch`` from ``[B, ...]`` to ``[m, B/m, ...]``.

    Raises:
      CompileError: see `check_microbatches`.
    """
    check_microbatches(batch, num_microbatches)
    return jax.tree.map(
        lambda x: jnp.reshape(x, (num_microbatches, x.shape[0] // num_microbatches, *x.shape[1:])),
        batch,
    )


def _split_model(model: Any, wrt: Any) -> tuple[Any, nnx.State, nnx.State]:
    graphdef, diff_state, other_state = nnx.split(model, wrt, ...)
    return graphdef, diff_state, other_state


def _new_state_leaves(local: Any, wrt: Any, other_tree: Any) -> list[Any]:
    """The loss function's updated non-differentiated state, checked for new Variables.

    Raises:
      CompileError: the loss function added or removed Variables (``sow`` of an
        ``nnx.Intermediate``, say); microbatched steps can only update state.
    """
    _, _, new_other = _split_model(local, wrt)
    leaves, tree = jax.tree.flatten(new_other)
    if tree != other_tree:
        before = {
            p
            for p, _ in nnx.to_flat_state(
                jax.tree.unflatten(other_tree, [0] * other_tree.num_leaves)
            )
        }
        after = {p for p, _ in nnx.to_flat_state(new_other)}
        changed = sorted(_path_str(p) for p in before ^ after) or ["(structure)"]
        raise CompileError(
            f"the loss function added or removed state at {', '.join(changed)} (e.g. sow of an "
            "nnx.Intermediate): a microbatched value_and_grad can only update existing "
            "Variables. Collect sown values inside the loss function, with "
            "`out, sown = nnx.capture(model, nnx.Intermediate)(x)` (or nnx.pop(model, "
            "nnx.Intermediate) before it returns), and return what you need as aux "
            "(mp.value_and_grad(loss_fn, has_aux=True), averaged over microbatches)."
        )
    return leaves


def _held_used(jaxpr: jcore.Jaxpr, first_in: int, first_out: int, n_held: int) -> list[bool]:
    """Which captured leaves the traced body reads or changes.

    Captured candidates are found by name (closures, globals), so some are not
    used at all (a global model the loss function does not call); only those the
    body reads, or returns changed, become region state.
    """
    read = {v for eqn in jaxpr.eqns for v in eqn.invars if isinstance(v, jcore.Var)}
    used = []
    for i in range(n_held):
        invar, outvar = jaxpr.invars[first_in + i], jaxpr.outvars[first_out + i]
        used.append(invar in read or outvar is not invar)
    return used


def _check_writable(captured: list[CapturedVariable]) -> None:
    error = outer_trace_error(captured)
    if error is not None:
        raise error


def _head_leaves(out: Any, *, has_aux: bool, with_grad: bool) -> tuple[list[Any], Any]:
    """The loss function's result as leaves ``[loss, *aux]`` (or every output leaf).

    Raises:
      CompileError: a forward-only step returns no arrays, or an output (an
        aux value) is not an array or a number.
    """
    if with_grad:
        loss, aux = out if has_aux else (out, None)
        _check_array_leaves(aux, "aux value")
        aux_leaves, aux_tree = jax.tree.flatten(aux)
        return [loss, *aux_leaves], aux_tree
    _check_array_leaves(out, "output")
    head, tree = jax.tree.flatten(out)  # forward only: every output leaf, per microbatch
    if not head:
        raise CompileError("a forward-only pipelined step must return arrays.")
    return head, tree


def _check_array_leaves(tree: Any, what: str) -> None:
    """Raises a `CompileError` naming the first leaf of ``tree`` that no array can hold."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not isinstance(leaf, jax.Array | np.ndarray | np.generic | bool | int | float | complex):
            raise CompileError(
                f"the loss function's {what} at {jax.tree_util.keystr(path) or '(root)'} is a "
                f"{type(leaf).__name__}, not an array or a number: the pipelined region "
                "returns arrays only. Compute it outside mp.value_and_grad (or outside the "
                "step), or return it as an array."
            )


def _bind_region(info: RegionInfo, inputs: list[Any], diff_tree: Any) -> tuple[Any, Any, list]:
    """Emits the region equation: ``(loss and aux leaves, grads or None, new state)``."""
    outs = region_p.bind(*inputs, info=info)
    head, rest = outs[: 1 + info.n_aux], list(outs[1 + info.n_aux :])
    if not info.with_grad:
        return head, None, rest
    return head, jax.tree.unflatten(diff_tree, rest[: info.n_diff]), rest[info.n_diff :]


def _paths(state: Any) -> list[str]:
    return [_path_str(p) for p, _ in nnx.to_flat_state(state)]


def _microbatch_shape(x: Any, num_microbatches: int) -> tuple[int, ...]:
    return (x.shape[0] // num_microbatches, *x.shape[1:])


def _store_state(
    model: Any, other_tree: Any, captured: list[CapturedVariable], new_state: list[Any]
) -> None:
    """Writes the region's new state into the model and the captured Variables."""
    n = other_tree.num_leaves
    nnx.update(model, jax.tree.unflatten(other_tree, new_state[:n]))
    for c, value in zip(captured, new_state[n:], strict=True):
        c.variable.set_raw_value(value)


def _aval(x: Any) -> jax.ShapeDtypeStruct:
    """``x``'s abstract value for the region body: its type on the submeshes' mesh.

    A value of the step's trace keeps its sharding (the step's inputs are typed
    by their placement); any other value (a captured array, a constant) is
    typed replicated there, as ``nnx.jit`` inside ``jax.set_mesh`` types it.
    """
    shape, dtype = jnp.shape(x), jnp.result_type(x)
    submesh = _region_state.submesh
    if submesh is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    abstract = submesh.abstract_mesh
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = PartitionSpec()
    if isinstance(sharding, NamedSharding) and sharding.mesh.axis_names == abstract.axis_names:
        spec = sharding.spec
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(abstract, spec))


def _trace_body(
    body: Callable[..., Any], diff_leaves: list[Any], state_leaves: list[Any], mb_avals: list[Any]
) -> Any:
    """The closed jaxpr of the region body, with stage markers on."""
    with markers.pipeline_tracing():
        return jax.make_jaxpr(body)(
            [_aval(x) for x in diff_leaves], [_aval(x) for x in state_leaves], mb_avals
        )


def _trace_keeping_used_captured(
    body: Callable[..., Any],
    captured: list[CapturedVariable],
    diff_leaves: list[Any],
    other_leaves: list[Any],
    mb_avals: list[Any],
) -> Any:
    """Traces ``body``; drops (in place) the captured Variables it ignores.

    Captured candidates are found by name, so some are unused (a global model the
    loss function does not call). Those are removed from ``captured``, which
    ``body`` reads, and the body is traced again without them (rare).
    """
    held = [c.variable.get_raw_value() for c in captured]
    closed = _trace_body(body, diff_leaves, [*other_leaves, *held], mb_avals)
    n_aux = len(closed.out_avals) - 1 - len(other_leaves) - len(held)
    first_in = len(diff_leaves) + len(other_leaves)
    used = _held_used(closed.jaxpr, first_in, 1 + n_aux + len(other_leaves), len(held))
    if all(used):
        return closed
    captured[:] = [c for c, u in zip(captured, used) if u]
    held = [c.variable.get_raw_value() for c in captured]
    return _trace_body(body, diff_leaves, [*other_leaves, *held], mb_avals)


def _check_loss(loss_aval: Any, with_grad: bool) -> None:
    if with_grad and (loss_aval.shape != () or not jnp.issubdtype(loss_aval.dtype, jnp.floating)):
        raise CompileError(
            f"the loss function must return a float scalar (got {loss_aval.str_short()}); "
            "return the mean loss of the microbatch, and pass extra outputs with has_aux=True."
        )


def _rng_counts_from_index(closed: Any, *args: Any) -> tuple[Any, list[Any], dict[int, int]]:
    """`region_rng.rng_counts_from_index` on the traced step's submesh, its index a batch leaf."""
    index_aval = _microbatch_aval((1,), jnp.uint32)  # placed like a batch leaf
    submesh = _region_state.submesh
    return rng_counts_from_index(closed, *args, index_aval=index_aval, submesh=submesh)


def trace_region(
    loss_fn: Callable[..., Any],
    model: Any,
    batch: Any,
    *,
    has_aux: bool,
    wrt: Any,
    with_grad: bool = True,
    aux_reduction: Any = None,
) -> Any:
    """Records ``loss_fn(model, batch)`` as a region equation of the current trace.

    Returns what `value_and_grad` returns (aux combined per ``aux_reduction``); RNG counters
    are derived from the microbatch index (`region_rng`).
    """
    num_microbatches = _region_state.num_microbatches
    assert num_microbatches is not None and _region_state.regions is not None
    graphdef, diff_state, other_state = _split_model(model, wrt)
    captured = captured_variables(loss_fn, exclude=[model])
    diff_leaves, diff_tree = jax.tree.flatten(diff_state)
    other_leaves, other_tree = jax.tree.flatten(other_state)
    batch_leaves, batch_tree = jax.tree.flatten(batch)
    check_microbatches(batch, num_microbatches)
    mb_avals = [
        _microbatch_aval(_microbatch_shape(x, num_microbatches), x.dtype) for x in batch_leaves
    ]
    aux_tree_box: list[Any] = []

    def body(diff: list[Any], other: list[Any], mb: list[Any]) -> Any:
        local = nnx.merge(
            graphdef,
            jax.tree.unflatten(diff_tree, diff),
            jax.tree.unflatten(other_tree, other[: len(other_leaves)]),
        )
        with bound_variables(captured, other[len(other_leaves) :]):
            out = loss_fn(local, jax.tree.unflatten(batch_tree, mb))
            new_held = [c.variable.get_raw_value() for c in captured]
        head, aux_tree = _head_leaves(out, has_aux=has_aux, with_grad=with_grad)
        aux_tree_box.append(aux_tree)
        return [*head, *_new_state_leaves(local, wrt, other_tree), *new_held]

    closed = _trace_keeping_used_captured(body, captured, diff_leaves, other_leaves, mb_avals)
    state_leaves = [*other_leaves, *(c.variable.get_raw_value() for c in captured)]
    n_aux = len(closed.out_avals) - 1 - len(state_leaves)
    _check_writable(captured)
    _check_loss(closed.out_avals[0], with_grad)
    aux_avals = closed.out_avals[1 : 1 + n_aux] if with_grad else None  # forward: outputs
    modes = _aux_modes(aux_reduction, aux_tree_box[-1], aux_avals, batch, num_microbatches)
    other_paths = [*_paths(other_state), *(c.path for c in captured)]
    counts = rng_count_inputs(other_state, len(other_leaves), captured)
    in_avals = [*map(_aval, diff_leaves), *map(_aval, state_leaves), *mb_avals]
    closed, consts, increments = _rng_counts_from_index(
        closed, counts, len(diff_leaves), 1 + n_aux, in_avals, other_paths
    )
    index_leaves = [jnp.arange(num_microbatches, dtype=jnp.uint32)] if increments else []
    info = RegionInfo(
        body=convert_constvars_jaxpr(closed.jaxpr),
        num_microbatches=num_microbatches,
        n_closure=len(consts),
        n_diff=len(diff_leaves),
        n_other=len(state_leaves),
        n_batch=len(batch_leaves) + len(index_leaves),
        n_aux=n_aux,
        has_aux=has_aux,
        with_grad=with_grad,
        diff_paths=tuple(_paths(diff_state)),
        other_paths=tuple(other_paths),
        out_avals=_region_out_avals(closed, modes, diff_leaves, num_microbatches, with_grad),
        unreduced_axis=_unreduced_axis(with_grad),
        stacked_axis=_stacked_axis(with_grad),
        aux_modes=modes if with_grad else (),
    )
    _region_state.regions.append(info)
    inputs = [*consts, *diff_leaves, *state_leaves, *batch_leaves, *index_leaves]
    head, grads, new_state = _bind_region(info, inputs, diff_tree)
    new_state = advance_counts(new_state, increments, num_microbatches)
    _store_state(model, other_tree, captured, new_state)
    return _user_result(head, grads, aux_tree_box[-1], modes if with_grad else None, has_aux)


def _user_result(head: list[Any], grads: Any, tree: Any, modes: Any, has_aux: bool) -> Any:
    """What `value_and_grad` returns from the region's results (``modes`` None: forward only)."""
    if modes is None:
        return jax.tree.unflatten(tree, head)
    aux = jax.tree.unflatten(tree, _aux_leaves(modes, *_split_by_mode(head[1:], modes)))
    return ((head[0], aux), grads) if has_aux else (head[0], grads)


def _aux_modes(
    aux_reduction: Any, aux_tree: Any, aux_avals: Any, batch: Any, num_microbatches: int
) -> tuple:
    """`region_aux.aux_modes` for a microbatch of ``batch`` (no leaves: no row count).

    ``aux_avals`` None: a forward-only step, whose outputs are all stacked.
    """
    if aux_avals is None:
        return ("mean",) * (aux_tree.num_leaves - 1)
    leaves = jax.tree.leaves(batch)
    rows = jnp.shape(leaves[0])[0] // num_microbatches if leaves else -1
    return aux_modes(aux_reduction, aux_tree, aux_avals, rows)


def _region_out_avals(
    closed: Any, modes: tuple, diff_leaves: list[Any], num_microbatches: int, with_grad: bool
) -> tuple[Any, ...]:
    """The region equation's outputs: means (or stacked outputs), grads, new state."""
    n_aux = len(modes)
    head, state = closed.out_avals[: 1 + n_aux], tuple(closed.out_avals[1 + n_aux :])
    if not with_grad:  # forward only: stacked per-microbatch outputs
        return tuple(stacked_aval(a, num_microbatches) for a in head) + state
    means = [
        stacked_aval(a, num_microbatches)
        if mode == "concat"
        else a
        if jnp.issubdtype(a.dtype, jnp.inexact)
        else a.update(dtype=jnp.float32)
        for a, mode in zip(head, ("mean", *modes), strict=True)
    ]
    grads = [jax.core.ShapedArray(jnp.shape(x), jnp.result_type(x)) for x in diff_leaves]
    return (*means, *grads, *state)


def _mean_seeded_value_and_grad(one: Callable[..., Any], scale: float) -> Callable[..., Any]:
    """``jax.value_and_grad(one, has_aux=True)`` with the backward started at ``scale``.

    Each microbatch's backward starts from ``1/m`` as the pipeline's does, so a
    custom_vjp that is not linear in its cotangent sees what ``jax.grad`` of the mean gives.
    """

    def grad_fn(diff: list[Any], state: Any, mb: Any) -> Any:
        loss, vjp_fn, rest = jax.vjp(lambda d: one(d, state, mb), diff, has_aux=True)
        (grads,) = vjp_fn(jnp.full(jnp.shape(loss), scale, jnp.result_type(loss)))
        return (loss, rest), grads

    return grad_fn


def reference_value_and_grad(
    loss_fn: Callable[..., Any],
    model: Any,
    batch: Any,
    *,
    num_microbatches: int,
    has_aux: bool,
    wrt: Any,
    aux_reduction: Any = None,
) -> Any:
    """Unpipelined value-and-grad with the pipeline's microbatch semantics.

    Microbatches run in order, threading non-differentiated and closed-over RNG state; mean
    loss and gradients, aux combined per ``aux_reduction``.
    """
    graphdef, diff_state, other_state = _split_model(model, wrt)
    captured = captured_variables(loss_fn, exclude=[model])
    diff_leaves, diff_tree = jax.tree.flatten(diff_state)
    other_leaves, other_tree = jax.tree.flatten(other_state)
    stacked = split_microbatches(batch, num_microbatches)
    first_mb = jax.tree.map(lambda x: x[0], stacked)

    # Raw leaves cross the transforms; Variables are rebuilt inside the trace so
    # that state updates (RNG counters, batch statistics) happen at its level.
    def one(diff: list[Any], state: tuple[list[Any], list[Any]], mb: Any) -> Any:
        other, held = state
        local = nnx.merge(
            graphdef, jax.tree.unflatten(diff_tree, diff), jax.tree.unflatten(other_tree, other)
        )
        with bound_variables(captured, held):
            out = loss_fn(local, mb)
            held = [c.variable.get_raw_value() for c in captured]
        loss, aux = out if has_aux else (out, None)
        return loss, (aux, (_new_state_leaves(local, wrt, other_tree), held))

    forward_shapes = None  # (loss, (aux, state)) of one microbatch, shapes only
    if captured:  # keep only what the loss function really uses (`one` reads the new list)
        captured, forward_shapes = _captured_in_use(
            one, captured, diff_leaves, other_leaves, first_mb
        )
    held_leaves = [c.variable.get_raw_value() for c in captured]
    scale = 1.0 / num_microbatches
    grad_fn = _mean_seeded_value_and_grad(one, scale)

    state0 = (other_leaves, held_leaves)
    # The loss and aux types need the forward only: the scan below traces the backward.
    if forward_shapes is None:
        forward_shapes = jax.eval_shape(one, diff_leaves, state0, first_mb)
    loss0, (aux0, _) = forward_shapes
    aux_tree = jax.tree.structure(aux0)
    modes = _aux_modes(aux_reduction, aux_tree, jax.tree.leaves(aux0), batch, num_microbatches)

    def step(carry: Any, mb: Any) -> Any:
        state, loss_sum, aux_sum, grad_sum = carry
        (loss, (aux, state)), grads = grad_fn(diff_leaves, state, mb)
        means, stacked = _split_by_mode(jax.tree.leaves(aux), modes)
        add = lambda a, b: a + b  # noqa: E731
        aux_sum = jax.tree.map(add, aux_sum, means)
        return (state, loss_sum + loss, aux_sum, jax.tree.map(add, grad_sum, grads)), stacked

    zeros = [jnp.zeros_like(x) for x in diff_leaves]
    aux_zeros = [
        jnp.zeros(a.shape, a.dtype) for a in _split_by_mode(jax.tree.leaves(aux0), modes)[0]
    ]
    init = (state0, jnp.zeros(loss0.shape, loss0.dtype), aux_zeros, zeros)
    ((other_leaves, held_leaves), loss_sum, aux_sum, grad_sum), aux_stacked = jax.lax.scan(
        step, init, stacked
    )
    _store_state(model, other_tree, captured, [*other_leaves, *held_leaves])
    grads = jax.tree.unflatten(diff_tree, grad_sum)
    aux = _aux_leaves(modes, [a * scale for a in aux_sum], aux_stacked)
    loss = loss_sum * scale
    return ((loss, jax.tree.unflatten(aux_tree, aux)), grads) if has_aux else (loss, grads)


def _captured_in_use(
    one: Callable[..., Any],
    captured: list[Any],
    diff_leaves: list[Any],
    other_leaves: list[Any],
    first_mb: Any,
) -> tuple[list[Any], Any]:
    """The captured Variables that ``one`` (the microbatch loss) really uses, and its output
    shapes: one trace serves both, so the forward is not traced again for its types."""
    held = [c.variable.get_raw_value() for c in captured]
    probe, forward_shapes = jax.make_jaxpr(one, return_shape=True)(
        diff_leaves, (other_leaves, held), first_mb
    )
    n_aux = len(probe.out_avals) - 1 - len(other_leaves) - len(held)
    used = _held_used(
        probe.jaxpr,
        len(diff_leaves) + len(other_leaves),
        1 + n_aux + len(other_leaves),
        len(captured),
    )
    in_use = [c for c, u in zip(captured, used) if u]
    _check_writable(in_use)
    return in_use, forward_shapes


def _aux_leaves(modes: tuple, means: list[Any], stacked: list[Any]) -> list[Any]:
    """The aux leaves in order: the means, and the stacked values joined along their rows."""
    means_iter, stacked_iter = iter(means), iter(stacked)
    return [
        join_stacked(next(stacked_iter)) if mode == "concat" else next(means_iter) for mode in modes
    ]


def _split_by_mode(leaves: list[Any], modes: tuple) -> tuple[list[Any], list[Any]]:
    """The aux leaves averaged over the microbatches, and those concatenated."""
    means = [x for x, mode in zip(leaves, modes, strict=True) if mode != "concat"]
    return means, [x for x, mode in zip(leaves, modes, strict=True) if mode == "concat"]
