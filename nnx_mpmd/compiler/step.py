"""Compiling a whole train step: trace, cut, infer meshes, emit one instruction list."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import errors as flax_errors
from flax import nnx
from flax.nnx import graph as nnx_graph
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from nnx_mpmd._jax_compat import (
    convert_constvars_jaxpr,
    dce_jaxpr,
    variables_bound_to_current_trace,
)
from nnx_mpmd.compiler.captured import implicit_rng_nodes, rng_variables
from nnx_mpmd.compiler.instructions import Instruction, SlotTable, insert_frees
from nnx_mpmd.compiler.mesh_inference import HOST, CrossMeshTransfer, plan_outer
from nnx_mpmd.compiler.region import microbatch_spec, region_tracing, trace_region
from nnx_mpmd.compiler.region_plan import build_region_program
from nnx_mpmd.compiler.stage_programs import StageFunctions, submesh_tracing
from nnx_mpmd.compiler.stages import StagePlan, cut_stages
from nnx_mpmd.errors import CompileError, ScheduleError
from nnx_mpmd.frontend import markers
from nnx_mpmd.placement.mesh import MpmdMesh
from nnx_mpmd.placement.partition import MpmdArray, leaf_mesh_ids

__all__ = [
    "CompiledStep",
    "FlatArgs",
    "ReplicatedBatchWarning",
    "compile_step",
    "flatten_args",
    "flatten_step_args",
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


def _variable_ids(flat: FlatArgs) -> set[int]:
    if flat.variables is not None:
        return {id(v) for v in flat.variables}
    return {id(v) for _, v in nnx.to_flat_state(nnx.state(flat.nodes))}


@contextlib.contextmanager
def _implicit_rngs_bound(flat: FlatArgs, copies: tuple[Any, ...]) -> Iterator[None]:
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


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    if isinstance(x, MpmdArray):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))


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


def _is_sharding_type_error(error: BaseException) -> bool:
    """Whether ``error`` is JAX's error for an op its Explicit sharding rules reject."""
    return any(cls.__name__ == "ShardingTypeError" for cls in type(error).__mro__)


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


def _warn_replicated_batch(error: BaseException, mesh: MpmdMesh, batch_axis: str) -> None:
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
        stacklevel=5,
    )


@dataclasses.dataclass
class CompiledStep:
    """A step compiled into one instruction list over slots."""

    instructions: list[Instruction]
    num_slots: int
    constants: dict[int, Any]
    input_slots: list[dict[int, int]]  # consts, state leaves, other leaves
    consts: list[Any]
    output_slots: list[list[tuple[int, int]]]
    num_user_outputs: int
    out_tree: Any
    transfers: list[CrossMeshTransfer]
    programs: dict[str, Any]
    plan: StagePlan | None
    tasks: Any
    stage_mesh: list[int]
    # The submesh axis microbatches are sharded over (None: replicated), which is
    # mp.jit's batch_axis unless the step's code rejects a sharded batch.
    batch_axis: str | None = None


def _leaf_meshes(x: Any, mesh: MpmdMesh) -> frozenset[int]:
    ids = leaf_mesh_ids(x, mesh)
    return frozenset(ids) if ids else frozenset({HOST})


def _leaf_sharding(x: Any, q: int) -> Any:
    if isinstance(x, MpmdArray):
        return x.array(q).sharding
    return x.sharding


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


def compile_step(
    fn: Callable[..., Any],
    flat: FlatArgs,
    mesh: MpmdMesh,
    schedule: Any,
    num_microbatches: int,
    *,
    batch_axis: str | None = "data",
    transfer_warning_bytes: int = 1 << 20,
) -> CompiledStep:
    """Traces ``fn`` on ``flat`` and compiles it for ``mesh`` and ``schedule``."""
    out_tree_box: list[Any] = []

    def pure(state_leaves: list[Any], other_leaves: list[Any]) -> Any:
        state = jax.tree.unflatten(flat.state_tree, state_leaves)
        nodes = nnx.merge(flat.graphdef, state)
        leaves = list(flat.args_leaves)
        for pos, node in zip(flat.node_positions, nodes):
            leaves[pos] = node
        for pos, leaf in zip(flat.other_positions, other_leaves):
            leaves[pos] = leaf
        with _implicit_rngs_bound(flat, nodes):
            out = fn(*jax.tree.unflatten(flat.args_tree, leaves))
        _, new_state = nnx.split(nodes)
        new_leaves, new_tree = jax.tree.flatten(new_state)
        if new_tree != flat.state_tree:
            raise CompileError(
                "the step changed the structure of its NNX objects (added or removed "
                "Variables); mp.jit steps may only update existing state."
            )
        out_leaves, out_tree = jax.tree.flatten(out)
        if any(is_graph_node(x) for x in out_leaves):
            raise CompileError("the step returned an NNX object; return arrays instead.")
        out_tree_box.append(out_tree)
        return out_leaves, new_leaves

    def pure_inference(state_leaves: list[Any], other_leaves: list[Any]) -> Any:
        # A step that runs stages without mp.value_and_grad is a forward-only
        # pipeline: the whole function is the region, applied per microbatch of
        # its array arguments, and its outputs are concatenated in order.
        nodes = nnx.merge(flat.graphdef, jax.tree.unflatten(flat.state_tree, state_leaves))

        def forward(local_nodes: Any, batch_leaves: list[Any]) -> Any:
            leaves = list(flat.args_leaves)
            for pos, node in zip(flat.node_positions, local_nodes):
                leaves[pos] = node
            for pos, leaf in zip(flat.other_positions, batch_leaves):
                leaves[pos] = leaf
            return fn(*jax.tree.unflatten(flat.args_tree, leaves))

        with _implicit_rngs_bound(flat, nodes):
            stacked = trace_region(
                forward, nodes, list(other_leaves), has_aux=False, wrt=nnx.Nothing, with_grad=False
            )
        out = jax.tree.map(_merge_microbatches, stacked)
        out_leaves, out_tree = jax.tree.flatten(out)
        out_tree_box.append(out_tree)
        _, new_state = nnx.split(nodes)
        return out_leaves, jax.tree.leaves(new_state)

    avals = ([_abstract(x) for x in flat.state_leaves], [_abstract(x) for x in flat.other_leaves])

    def trace(traced_batch_axis: str | None) -> tuple[Any, list[Any]]:
        traced: list[list[Any]] = []
        region_context = functools.partial(
            region_tracing, num_microbatches, mesh.submesh(0), traced_batch_axis
        )
        try:
            with (
                submesh_tracing(mesh),
                _outer_state_explained(),
                region_context() as regions,
                markers.outer_tracing(),
            ):
                traced.append(regions)
                return jax.make_jaxpr(pure)(*avals), regions
        except markers.StageOutsideRegionError:
            if traced and traced[0]:
                raise  # stages called both inside and outside the region
        with submesh_tracing(mesh), _outer_state_explained(), region_context() as regions:
            return jax.make_jaxpr(pure_inference)(*avals), regions

    try:
        closed, regions = trace(batch_axis)
    except Exception as e:
        if not (_is_sharding_type_error(e) and _explicit_axis(mesh, batch_axis)):
            raise
        # Ordinary model code that JAX's Explicit sharding rules reject on a
        # sharded batch (a gather with batch-sharded indices): replicate the batch.
        _warn_replicated_batch(e, mesh, batch_axis)
        batch_axis = None
        closed, regions = trace(None)
    jaxpr = convert_constvars_jaxpr(closed.jaxpr)
    jaxpr, used = dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    consts = list(closed.consts)
    all_inputs = consts + list(flat.state_leaves) + list(flat.other_leaves)
    n_consts, n_state = len(consts), len(flat.state_leaves)
    num_user_outputs = len(jaxpr.outvars) - n_state

    names = [f"constant {i}" for i in range(n_consts)]
    state_paths = [
        ".".join(str(k) for k in path)
        for path, _ in jax.tree_util.tree_flatten_with_path(
            jax.tree.unflatten(flat.state_tree, list(range(n_state)))
        )[0]
    ]
    names += state_paths + [f"argument leaf {i}" for i in range(len(flat.other_leaves))]
    used_inputs = [x for x, u in zip(all_inputs, used) if u]
    used_names = [n for n, u in zip(names, used) if u]
    used_index = [i for i, u in enumerate(used) if u]
    invar_meshes = [_leaf_meshes(x, mesh) for x in used_inputs]
    state_meshes = [_leaf_meshes(x, mesh) for x in flat.state_leaves]
    outvar_targets: list[frozenset[int] | None] = [None] * num_user_outputs + [
        m - {HOST} or None for m in state_meshes
    ]

    def out_sharding(j: int, q: int) -> Any:
        leaf = flat.state_leaves[j - num_user_outputs]
        return _leaf_sharding(leaf, q)

    slots = SlotTable()
    plan: StagePlan | None = None
    tasks: Any = ()
    stage_mesh: list[int] = []
    region_builder = region_needs = None
    batch_inputs: frozenset[int] = frozenset()
    constants: dict[int, Any] = {}
    region_programs: dict[str, Any] = {}
    if regions:
        info = regions[0]
        plan = cut_stages(info)
        num_stages, num_meshes = plan.num_stages, mesh.num_meshes
        try:
            schedule.check(num_stages, num_meshes, num_microbatches)
        except ScheduleError as e:
            raise ScheduleError(
                f"{type(schedule).__name__} cannot run this model's {num_stages} stages on "
                f"{num_meshes} meshes with {num_microbatches} microbatches: {e}"
            ) from None
        tasks = schedule.tasks(num_stages, num_meshes, num_microbatches)
        stage_mesh = [schedule.mesh_of(s, num_stages, num_meshes) for s in range(num_stages)]
        fns = [StageFunctions(plan, k) for k in range(num_stages)]
        first_batch = info.n_closure + info.n_diff + info.n_other
        batch_inputs = frozenset(range(first_batch, first_batch + info.n_batch))

        def region_needs(r: int) -> frozenset[int]:
            return frozenset(stage_mesh[k] for k in plan.input_stages.get(r, []))

        def region_builder(input_slot: Any, home: Any) -> Any:
            program = build_region_program(
                plan, fns, tasks, stage_mesh, list(mesh.submeshes), slots, input_slot, home
            )
            constants.update(program.constants)
            region_programs.update(program.compiled)
            return program.instructions, program.output_slots

    def batch_spec(aval: Any) -> Any:
        # The stacked [m, B/m, ...] batch: each microbatch as the stages were traced.
        shape = (aval.shape[0] // num_microbatches, *aval.shape[1:]) if aval.shape else ()
        spec = microbatch_spec(shape, mesh.submesh(0), batch_axis)
        return P() if spec is None else P(None, *spec)

    outer = plan_outer(
        jaxpr,
        invar_meshes,
        outvar_targets,
        used_names,
        slots,
        list(mesh.submeshes),
        out_sharding,
        region_builder,
        region_needs,
        batch_inputs,
        num_microbatches,
        batch_spec,
        transfer_warning_bytes,
    )
    keep = {slot for locs in outer.output_slots for _, slot in locs}
    instructions = insert_frees(outer.instructions, keep)
    input_slots: list[dict[int, int]] = [{} for _ in all_inputs]
    for i, slots_of in zip(used_index, outer.input_slots):
        input_slots[i] = slots_of
    return CompiledStep(
        instructions=instructions,
        num_slots=len(slots),
        constants=constants,
        input_slots=input_slots,
        consts=consts,
        output_slots=outer.output_slots,
        num_user_outputs=num_user_outputs,
        out_tree=out_tree_box[-1],
        transfers=outer.transfers,
        programs={**outer.programs, **region_programs},
        plan=plan,
        tasks=tasks,
        stage_mesh=stage_mesh,
        batch_axis=batch_axis,
    )
