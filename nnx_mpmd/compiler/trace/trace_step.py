"""Tracing a step: its arguments as flat leaves, and the step as one jaxpr.

`flatten_step_args` splits a step's arguments into NNX state leaves and other
leaves, and finds the ``nnx.Rngs`` the step reaches by name without receiving
them (they become implicit arguments). `trace_step` traces the step into one
jaxpr whose pipelined regions are recorded equations. What the trace records
decides the step's mode: a step that calls `mp.value_and_grad` trains; a step
that calls stages but no region is a forward-only pipeline and is traced again
as one region applied per microbatch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import errors as flax_errors
from flax import nnx
from flax.nnx import graph as nnx_graph
from jax.extend import core as jcore
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_mpmd._jax_compat import (
    convert_constvars_jaxpr,
    dce_jaxpr,
    explicit_sharding_rejection,
    variables_bound_to_current_trace,
)
from nnx_mpmd.annotate import markers
from nnx_mpmd.compiler.trace.captured import implicit_rng_nodes, rng_variables
from nnx_mpmd.compiler.trace.region import RegionInfo, region_tracing, trace_region
from nnx_mpmd.compiler.trace.stage_programs import submesh_tracing
from nnx_mpmd.errors import CompileError
from nnx_mpmd.placement.mesh import MpmdMesh
from nnx_mpmd.placement.mpmd_array import MpmdArray

__all__ = [
    "FlatArgs",
    "ReplicatedBatchWarning",
    "TracedStep",
    "flatten_args",
    "flatten_step_args",
    "implicit_rngs_bound",
    "refreshed_flat_args",
    "reusable_flat_args",
    "is_graph_node",
    "trace_step",
]


def is_graph_node(x: Any) -> bool:
    return nnx_graph.is_graph_node(x)


@dataclasses.dataclass
class FlatArgs:
    """The arguments of a step, split into NNX state leaves and other leaves."""

    args_tree: Any
    node_positions: list[int]
    nodes: tuple[Any, ...]
    graphdef: Any
    state_tree: Any
    state_leaves: list[Any]
    other_positions: list[int]
    other_leaves: list[Any]
    args_leaves: list[Any]
    # The Variable objects behind ``state_leaves`` (one leaf each, same order), so a
    # step can write its new state back with one assignment per Variable instead of
    # ``nnx.update``'s walk over the graph; None when some Variable does not hold
    # exactly one plain array (then ``nnx.update`` is used).
    variables: list[Any] | None = None
    # How many of ``nodes`` (the last ones) are not arguments but ``nnx.Rngs`` the
    # step reaches by name (see `captured.implicit_rng_nodes`).
    num_implicit: int = 0


def _one_leaf_variables(state: Any, state_leaves: list[Any]) -> list[Any] | None:
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if len(variables) != len(state_leaves):
        return None
    for variable, leaf in zip(variables, state_leaves):
        if not isinstance(variable, nnx.Variable) or variable.get_raw_value() is not leaf:
            return None
        if getattr(variable, "ref", False) or getattr(variable, "hijax", False):
            return None  # the raw value is a mutable reference: let nnx.update write into it
    return variables


def flatten_args(args: tuple[Any, ...], implicit: Sequence[Any] = ()) -> FlatArgs:
    """Splits a step's arguments (and ``implicit`` NNX nodes) into state and other leaves."""
    leaves, tree = jax.tree.flatten(args, is_leaf=is_graph_node)
    node_positions = [i for i, x in enumerate(leaves) if is_graph_node(x)]
    other_positions = [i for i, x in enumerate(leaves) if not is_graph_node(x)]
    nodes = (*(leaves[i] for i in node_positions), *implicit)
    graphdef, state = nnx.split(nodes)
    state_leaves, state_tree = jax.tree.flatten(state)
    return FlatArgs(
        tree,
        node_positions,
        nodes,
        graphdef,
        state_tree,
        state_leaves,
        other_positions,
        [leaves[i] for i in other_positions],
        leaves,
        _one_leaf_variables(state, state_leaves),
        len(implicit),
    )


def flatten_step_args(fn: Callable[..., Any], args: tuple[Any, ...]) -> FlatArgs:
    """`flatten_args`, plus the ``nnx.Rngs`` that ``fn`` reaches without receiving them."""
    flat = flatten_args(args)
    implicit = implicit_rng_nodes(fn, lambda: _variable_ids(flat))
    return flatten_args(args, implicit) if implicit else flat


# A state leaf the refresh may read as it is: an array, or a value placed on
# several meshes (`place` turns replicated leaves into MpmdArrays).
_ARRAY_TYPES = (jax.Array, MpmdArray)


def reusable_flat_args(flat: FlatArgs, cached_nodes: Any) -> bool:
    """Whether ``flat`` may be refreshed instead of walking the graph again.

    Only for ``nnx.cached_partial``'s private node copies (their structure cannot
    change), each state leaf one array of one Variable, and no ``nnx.Rngs`` by name.
    """
    return (
        flat.variables is not None
        and not flat.num_implicit
        and all(node in cached_nodes for node in flat.nodes)
        and all(isinstance(x, _ARRAY_TYPES) for x in flat.state_leaves)
    )


def refreshed_flat_args(flat: FlatArgs, fn: Callable[..., Any], args: Any) -> FlatArgs | None:
    """``flat`` with the Variables' current arrays and ``args``' other leaves, or None.

    One read per Variable instead of ``nnx.split`` (10-20 ms); None means flatten again.
    """
    leaves, tree = jax.tree.flatten(args, is_leaf=is_graph_node)
    if tree != flat.args_tree:
        return None
    if any(leaves[i] is not node for i, node in zip(flat.node_positions, flat.nodes)):
        return None
    state_leaves = [variable.get_raw_value() for variable in flat.variables or ()]
    if not all(isinstance(x, _ARRAY_TYPES) for x in state_leaves):
        return None
    if implicit_rng_nodes(fn, lambda: {id(v) for v in flat.variables or ()}):
        return None
    return dataclasses.replace(
        flat,
        state_leaves=state_leaves,
        other_leaves=[leaves[i] for i in flat.other_positions],
        args_leaves=leaves,
    )


def _variable_ids(flat: FlatArgs) -> set[int]:
    if flat.variables is not None:
        return {id(v) for v in flat.variables}
    return {id(v) for _, v in nnx.to_flat_state(nnx.state(flat.nodes))}


@contextlib.contextmanager
def implicit_rngs_bound(flat: FlatArgs, copies: tuple[Any, ...]) -> Iterator[None]:
    """Lets ``fn`` draw from the implicit ``nnx.Rngs`` (the user's own objects).

    The step's code reaches those objects by name, not through the merged copies
    the trace made, so the originals hold the copies' traced values for the
    duration of the trace; their new values then go into the copies, from which
    the step's new state is read.
    """
    if not flat.num_implicit:
        yield
        return
    originals = [v for n in flat.nodes[-flat.num_implicit :] for v in rng_variables(n)]
    traced = [v for n in copies[-flat.num_implicit :] for v in rng_variables(n)]
    with variables_bound_to_current_trace(originals, [v.get_raw_value() for v in traced]):
        yield
        new_values = [v.get_raw_value() for v in originals]
    for variable, value in zip(traced, new_values, strict=True):
        variable.set_raw_value(value)


def _merge_microbatches(x: Any) -> Any:
    """``[m, B/m, ...] -> [B, ...]`` (forward-only outputs), on Explicit axes too.

    On Explicit axes each microbatch is sharded over the batch axis, and rows of
    different microbatches would interleave on a device: JAX asks for the
    output's sharding, which is replicated.
    """
    if x.ndim < 2:
        return x
    shape = (-1, *x.shape[2:])
    sharding = getattr(jax.typeof(x), "sharding", None)
    if sharding is None or all(entry is None for entry in sharding.spec):
        return x.reshape(shape)
    return jnp.reshape(x, shape, out_sharding=P())


@contextlib.contextmanager
def _outer_state_explained() -> Iterator[None]:
    """Turns Flax's error for state updated from another trace into one naming the fix."""
    try:
        yield
    except flax_errors.TraceContextError as e:
        raise CompileError(
            f"the step updates NNX state that it does not receive as an argument ({e}). "
            "mp.jit, like nnx.jit, can only update the NNX objects passed to the step: pass "
            "the nnx.Rngs (or module) as an argument, step(model, optimizer, rngs, batch), or "
            "keep it inside the model."
        ) from None


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """The step as one jaxpr over ``[*consts, *state leaves, *other leaves]``.

    ``used`` marks the inputs the jaxpr reads (the others were dead code);
    ``regions`` holds the pipelined region recorded in it (empty: no region);
    its outputs are the user's outputs, then the new state leaves.
    """

    jaxpr: Any
    used: tuple[bool, ...]
    consts: tuple[Any, ...]
    regions: tuple[RegionInfo, ...]
    out_tree: Any
    num_user_outputs: int
    batch_axis: str | None
    forward_only: bool


@jax.tree_util.register_pytree_node_class
class StaticArg:
    """A static argument's value, carried in the argument tree (a node without children).

    Its value is the node's auxiliary data, so it is part of the tree's
    structure (and of a step's cache key); `_assemble` unwraps it.

    Example:
      >>> leaves, tree = jax.tree.flatten((StaticArg(True), 1.0))
      >>> leaves, jax.tree.unflatten(tree, leaves)[0].value
      ([1.0], True)
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def tree_flatten(self) -> tuple[tuple[()], Any]:
        return (), self.value

    @classmethod
    def tree_unflatten(cls, value: Any, children: Any) -> StaticArg:
        return cls(value)

    def __repr__(self) -> str:
        return f"StaticArg({self.value!r})"


def _assemble(flat: FlatArgs, nodes: Sequence[Any], other_leaves: Sequence[Any]) -> tuple:
    """The step's positional arguments from NNX nodes and the other leaves (static
    arguments unwrapped)."""
    leaves = list(flat.args_leaves)
    for pos, node in zip(flat.node_positions, nodes):
        leaves[pos] = node
    for pos, leaf in zip(flat.other_positions, other_leaves):
        leaves[pos] = leaf
    args = jax.tree.unflatten(flat.args_tree, leaves)
    return tuple(a.value if isinstance(a, StaticArg) else a for a in args)


def _raise_if_stale_optimizer(error: ValueError) -> None:
    """A `CompileError` for a pytree mismatch between the gradients and an optimizer's state.

    Two causes are told apart by the keys JAX reports as differing: ``module``
    (a `Stage` wrapper's attribute) means the optimizer was created before the
    model was annotated; other keys mean the parameters changed (a layer added,
    removed or replaced) after the optimizer was created.
    """
    text = str(error)
    if "pytree structure error" not in text:
        return
    differ = _differing_keys(text)
    said = text.strip().splitlines()[0]
    if "module" in differ or (not differ and "module" in text):
        raise CompileError(
            "the optimizer's state and the gradients have different trees: one has a Stage "
            "wrapper ('module' in the path) where the other has none. An nnx.Optimizer keeps "
            "the tree of the parameters it was created for, so this happens when it is created "
            "before mp.assign_stages (or before modules are wrapped in mp.Stage); create the "
            "optimizer after annotating the model. JAX said: " + said
        ) from error
    if differ:
        found = re.search(r"at key path\s*\n\s*(.+)", text)
        where = f" at {found.group(1).strip()}" if found else ""
        raise CompileError(
            f"two trees of the step differ{where}: {sorted(differ)} is in one and not the "
            "other. If these are the gradients and an optimizer's state, the model's "
            "parameters changed (a layer added, removed or replaced) after the nnx.Optimizer "
            "was created, and it keeps the tree of the parameters it was created for: create "
            "a new optimizer for the model as it is now (or keep the model's structure fixed "
            "between steps). JAX said: " + said
        ) from error


def _differing_keys(text: str) -> set[str]:
    """The keys after "symmetric difference on key sets is" in JAX's pytree error, if any."""
    found = re.search(r"symmetric difference on key sets is\s*\n\s*(.+)", text)
    return set(found.group(1).split()) if found else set()


def _training_function(fn: Callable[..., Any], flat: FlatArgs, out_tree: list[Any]) -> Any:
    """``(state leaves, other leaves) -> (outputs, new state leaves)`` of the step."""

    def pure(state_leaves: list[Any], other_leaves: list[Any]) -> Any:
        nodes = nnx.merge(flat.graphdef, jax.tree.unflatten(flat.state_tree, state_leaves))
        with implicit_rngs_bound(flat, nodes):
            try:
                out = fn(*_assemble(flat, nodes, other_leaves))
            except ValueError as e:
                _raise_if_stale_optimizer(e)
                raise
        _, new_state = nnx.split(nodes)
        new_leaves, new_tree = jax.tree.flatten(new_state)
        if new_tree != flat.state_tree:
            raise CompileError(
                "the step changed the structure of its NNX objects (added or removed "
                "Variables); mp.jit steps may only update existing state."
            )
        out_leaves, tree = jax.tree.flatten(out)
        if any(is_graph_node(x) for x in out_leaves):
            raise CompileError("the step returned an NNX object; return arrays instead.")
        out_tree.append(tree)
        return out_leaves, new_leaves

    return pure


def _forward_only_function(fn: Callable[..., Any], flat: FlatArgs, out_tree: list[Any]) -> Any:
    """The step as one region applied per microbatch of its array arguments.

    A step that runs stages without `mp.value_and_grad` is a forward-only
    pipeline; its outputs are concatenated over the microbatches in order.
    """

    def pure(state_leaves: list[Any], other_leaves: list[Any]) -> Any:
        nodes = nnx.merge(flat.graphdef, jax.tree.unflatten(flat.state_tree, state_leaves))

        def forward(local_nodes: Any, batch_leaves: list[Any]) -> Any:
            return fn(*_assemble(flat, local_nodes, batch_leaves))

        with implicit_rngs_bound(flat, nodes):
            stacked = trace_region(
                forward, nodes, list(other_leaves), has_aux=False, wrt=nnx.Nothing, with_grad=False
            )
        out_leaves, tree = jax.tree.flatten(jax.tree.map(_merge_microbatches, stacked))
        out_tree.append(tree)
        _, new_state = nnx.split(nodes)
        return out_leaves, jax.tree.leaves(new_state)

    return pure


def _trace_once(
    pure: Any, avals: Any, mesh: MpmdMesh, num_microbatches: int, batch_axis: str | None
) -> tuple[Any, list[RegionInfo], list[str]]:
    """One trace: the closed jaxpr, the regions and the stage calls outside them.

    A sharding rejection after a stage was called outside any region gives no
    jaxpr (None): the step is forward-only and is traced again per microbatch,
    so code that only this whole-batch trace runs (a KV cache seen as one block)
    must not fail it.
    """
    region_context = region_tracing(num_microbatches, mesh.submesh(0), batch_axis)
    with (
        submesh_tracing(mesh),
        _outer_state_explained(),
        region_context as regions,
        markers.outer_tracing() as outside,
    ):
        closed, rejection = explicit_sharding_rejection(jax.make_jaxpr(pure), *avals)
        if rejection is not None:
            if outside and not regions:
                return None, regions, outside
            raise rejection
    with submesh_tracing(mesh):  # outside the markers' tracing: they differentiate here
        for info in regions:
            _trace_gradient_on_sharded_batch(info, mesh.submesh(0).abstract_mesh)
    return closed, regions, outside


def _trace_gradient_on_sharded_batch(info: RegionInfo, abstract_mesh: Any) -> None:
    """Traces the gradient of a region whose microbatches are sharded over an Explicit axis.

    An op whose derivative JAX then rejects (``sort``) must fail here, while the batch can
    still be replicated, not later as a raw error.
    """
    if not info.with_grad or info.unreduced_axis is None or not _uses(info.body, _SORTING):
        return
    body = jcore.ClosedJaxpr(info.body, [])
    avals = [_typed_like(v.aval, abstract_mesh) for v in info.body.invars]
    first, last = info.n_closure, info.n_closure + info.n_diff

    def loss(diff: list[Any], rest: list[Any]) -> Any:
        return jcore.jaxpr_as_fun(body)(*rest[:first], *diff, *rest[first:])[0]

    trace = jax.make_jaxpr(jax.grad(loss))
    try:
        _, rejection = explicit_sharding_rejection(
            trace, avals[first:last], avals[:first] + avals[last:]
        )
    except Exception:  # other errors surface where the stage programs are built
        return
    if rejection is not None:
        raise rejection


# Primitives whose derivative JAX's Explicit rules reject next to a sharded batch
# (sort's adds replicated iota indices). Tracing the gradient costs about half of a
# step's trace, so it is traced only for bodies that use one of these.
_SORTING = frozenset({"sort"})


def _uses(jaxpr: Any, names: frozenset[str]) -> bool:
    """Whether a primitive named in ``names`` is anywhere in ``jaxpr`` (any depth)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in names:
            return True
        if any(_uses(sub, names) for sub in jcore.jaxprs_in_params(eqn.params)):
            return True
    return False


def _typed_like(aval: Any, abstract_mesh: Any) -> jax.ShapeDtypeStruct:
    """``aval`` with its sharding, replicated on ``abstract_mesh`` when it names no mesh."""
    sharding = getattr(aval, "sharding", None)
    if sharding is None or sharding.mesh.empty:
        sharding = NamedSharding(abstract_mesh, P())
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding)


def _trace_modes(
    fn: Callable[..., Any],
    flat: FlatArgs,
    avals: Any,
    mesh: MpmdMesh,
    num_microbatches: int,
    batch_axis: str | None,
) -> tuple[Any, list[RegionInfo], list[Any], bool]:
    """Traces the step as a training step; again as forward-only if the trace says so."""
    out_tree: list[Any] = []
    pure = _training_function(fn, flat, out_tree)
    closed, regions, outside = _trace_once(pure, avals, mesh, num_microbatches, batch_axis)
    if outside and regions:
        raise markers.stage_outside_region_error(outside)
    if not outside:
        return closed, regions, out_tree, False
    out_tree.clear()
    pure = _forward_only_function(fn, flat, out_tree)
    closed, regions, _ = _trace_once(pure, avals, mesh, num_microbatches, batch_axis)
    return closed, regions, out_tree, True


def trace_step(
    fn: Callable[..., Any],
    flat: FlatArgs,
    avals: tuple[list[Any], list[Any]],
    mesh: MpmdMesh,
    num_microbatches: int,
    batch_axis: str | None,
) -> TracedStep:
    """The first pass: the step ``fn`` on ``flat``'s leaves as one jaxpr (dead code removed).

    Code JAX rejects with sharded microbatches is traced again replicated, with a
    `ReplicatedBatchWarning`; rejected either way it is a `CompileError`.
    """
    trace = functools.partial(_trace_modes, fn, flat, avals, mesh, num_microbatches)
    result, rejection = explicit_sharding_rejection(trace, batch_axis)
    if rejection is not None and _explicit_axis(mesh, batch_axis):
        replicated, second = explicit_sharding_rejection(trace, None)
        if second is None:  # only the sharded batch is rejected: replicate it
            _warn_replicated_batch(rejection, mesh, batch_axis)
            batch_axis, result, rejection = None, replicated, None
    if rejection is not None:
        raise _explicit_rules_error(rejection, mesh) from rejection
    closed, regions, out_tree, forward_only = result
    jaxpr = convert_constvars_jaxpr(closed.jaxpr)
    jaxpr, used = dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    num_user_outputs = len(jaxpr.outvars) - len(flat.state_leaves)
    return TracedStep(
        jaxpr,
        tuple(used),
        tuple(closed.consts),
        tuple(regions),
        out_tree[-1],
        num_user_outputs,
        batch_axis,
        forward_only,
    )


def _explicit_rules_error(error: BaseException, mesh: MpmdMesh) -> CompileError:
    """A `CompileError` for an op that JAX's Explicit sharding rules reject whatever
    the batch's sharding (the same op fails under ``nnx.jit`` inside ``jax.set_mesh``)."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error)
    return CompileError(
        f"JAX's Explicit sharding rules reject an op of the step on the submeshes of {mesh!r} "
        f"({first_line}). Inputs are typed with the sharding they have at run time, as under "
        "nnx.jit inside jax.set_mesh(submesh), so the same code fails there too. Make the "
        "shardings agree (jax.sharding.reshard(x, P(...)) on one operand, or out_sharding=P(...) "
        "on the op), or build the mesh with Auto axes, jax.make_mesh(shape, names, "
        "axis_types=(AxisType.Auto,) * len(names))."
    )


def _explicit_axis(mesh: MpmdMesh, axis: str | None) -> bool:
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    return axis is not None and types.get(axis) == AxisType.Explicit


class ReplicatedBatchWarning(UserWarning):
    """A step's batch is replicated on its submeshes: its code rejects a sharded batch.

    On an Explicit batch axis, JAX rejects some ops on a data-sharded input
    unless they say where their output goes (an embedding lookup with sharded
    ids, say). The step then runs with each microbatch replicated (the same
    numbers, no data parallelism inside the stages). Fix it by giving the op
    ``out_sharding=``, by building the mesh with Auto axes, or silence it with
    ``mp.jit(..., batch_axis=None)``.

    Example:
      >>> import warnings
      >>> import nnx_mpmd as mp
      >>> issubclass(mp.ReplicatedBatchWarning, UserWarning)
      True
    """


def _warn_replicated_batch(error: BaseException, mesh: MpmdMesh, batch_axis: str | None) -> None:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error)
    warnings.warn(
        f"the step's code cannot be traced with each microbatch sharded over the Explicit "
        f"mesh axis {batch_axis!r} of {mesh!r}: JAX rejects an op whose output sharding is "
        f"ambiguous ({first_line}). The batch is replicated on every device of each submesh "
        "instead (same results, no data parallelism inside a stage). To shard it, give that "
        "op its output sharding (out_sharding=P(...), e.g. table.at[ids].get(out_sharding=...) "
        "or nnx.Embed(...)(ids, out_sharding=P(...)) for an embedding), or build the mesh with "
        "Auto axes, jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names)), "
        "so that XLA propagates the batch sharding; pass mp.jit(batch_axis=None) to "
        "replicate the batch without this warning.",
        ReplicatedBatchWarning,
        stacklevel=7,  # the user's call: see compiler.step._USER_FRAME
    )
