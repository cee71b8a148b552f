"""Lowering a whole train step: a sequence of named passes, IR to IR.

The passes, in order (each recorded in `CompiledStep.passes` with the IR's text
after it, which ``Lowered.passes`` shows):

1. ``trace`` (`trace_step.trace_step`): the step as one jaxpr with the pipelined
   region recorded as one equation; its mode (training or forward-only) is read
   from what the trace recorded.
2. ``cut_stages`` (`stages.cut_stages`): the region's body cut at the `Stage`
   markers into stage slices, glue placed by dataflow.
3. ``stage_vjp`` (`stage_programs.StageFunctions`): per stage, the forward
   with its vjp residuals, the backward, the fused and forward-only variants.
4. ``split_backward`` (zero-bubble schedules only): each backward split into BI
   (input cotangents) and BW (weight gradients).
5. ``schedule``: the schedule's per-mesh task lists for this model.
6. the region's lowering passes (`region_plan`): schedule lowering,
   overlapped tasks as one program, fusion, transfer insertion, region
   outputs; spliced by
7. the mesh-inference passes (`mesh_inference`): the code outside the region
   placed on the meshes that use its results, with its transfers.
8. ``insert_frees``: every slot freed after its last read; then
   ``donate_dead_arguments``: backwards that are the last readers of the
   cotangents they receive donate them (XLA writes their input cotangents
   there); with ``mp.jit(donate_argnums=...)``, ``donate_step_inputs``
   (`donate_inputs`): the update programs donate the donated arguments' old
   state (XLA writes the new state there).
9. ``schedule_ticks``, ``batch_transfers`` and ``merge_frees``
   (`transfer_batching`): the list reordered tick by tick, each tick's
   transfers made as one batched move and its frees as one.
10. ``dedupe_programs``: the programs the instruction list calls, one per name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from nnx_mpmd.compiler.final.donate_inputs import donate_step_inputs, transfer_sources
from nnx_mpmd.compiler.final.transfer_batching import batch_transfers, merge_frees, schedule_ticks
from nnx_mpmd.compiler.ir import (
    Call,
    Instruction,
    SlotTable,
    donate_dead_arguments,
    format_instructions,
    insert_frees,
)
from nnx_mpmd.compiler.outer.mesh_inference import (
    HOST,
    CrossMeshTransfer,
    OuterPlan,
    OuterProblem,
    plan_outer_problem,
)
from nnx_mpmd.compiler.region.region_plan import RegionProgram, build_region_program
from nnx_mpmd.compiler.trace.region import microbatch_spec
from nnx_mpmd.compiler.trace.stage_programs import StageFunctions
from nnx_mpmd.compiler.trace.stages import StagePlan, cut_stages
from nnx_mpmd.compiler.trace.trace_step import (
    FlatArgs,
    ReplicatedBatchWarning,
    TracedStep,
    flatten_args,
    flatten_step_args,
    trace_step,
)
from nnx_mpmd.errors import ScheduleError
from nnx_mpmd.placement.abstract import PlacedAval, placed_aval
from nnx_mpmd.placement.mesh import MpmdMesh

__all__ = [
    "CompiledStep",
    "FlatArgs",
    "PassRecord",
    "ReplicatedBatchWarning",
    "compile_step",
    "dedupe_programs",
    "flatten_args",
    "flatten_step_args",
    "trace_for_step",
]


@dataclasses.dataclass(frozen=True)
class PassRecord:
    """One lowering pass and the IR after it, as text (rendered when first read).

    Example:
      >>> PassRecord("insert_frees", lambda: "free 0").text
      'free 0'
    """

    name: str
    render: Callable[[], str] = dataclasses.field(repr=False, compare=False)

    @property
    def text(self) -> str:
        return self.render()


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """A step compiled into one instruction list over slots.

    Frozen: runners keep their caches elsewhere, so the IR never changes after lowering.
    """

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
    passes: list[PassRecord] = dataclasses.field(default_factory=list)
    # The traced step (`trace_step`): what `nnx_mpmd.aot.step_store` keys it by.
    jaxpr: Any = None


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The traced step's inputs: readable names and where each one lives."""

    names: list[str]  # per used input
    meshes: list[frozenset[int]]  # per used input ({HOST}: not on a submesh)
    used_index: list[int]  # index of each used input among all inputs
    num_inputs: int
    state_avals: list[PlacedAval]


def _leaf_meshes(aval: PlacedAval) -> frozenset[int]:
    return frozenset(aval.mesh_ids) or frozenset({HOST})


def _path_text(path: Sequence[Any]) -> str:
    """``0.layers.1.module.kernel`` for a state leaf's key path (node index first)."""
    parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    return ".".join(parts[:-1] if parts and parts[-1] == "value" else parts)


def describe_inputs(
    traced: TracedStep,
    flat: FlatArgs,
    mesh: MpmdMesh,
    state_avals: list[PlacedAval],
    other: list[PlacedAval],
) -> StepInputs:
    """Names and meshes of the inputs the traced step reads."""
    n_consts, n_state = len(traced.consts), len(state_avals)
    tree = jax.tree.unflatten(flat.state_tree, list(range(n_state)))
    state_paths = [_path_text(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    names = [f"constant {i}" for i in range(n_consts)] + state_paths
    names += [f"argument leaf {i}" for i in range(len(other))]
    avals = [placed_aval(c, mesh) for c in traced.consts] + list(state_avals) + list(other)
    used_index = [i for i, u in enumerate(traced.used) if u]
    return StepInputs(
        names=[names[i] for i in used_index],
        meshes=[_leaf_meshes(avals[i]) for i in used_index],
        used_index=used_index,
        num_inputs=len(avals),
        state_avals=list(state_avals),
    )


def schedule_tasks(
    plan: StagePlan, schedule: Any, mesh: MpmdMesh, num_microbatches: int
) -> tuple[Any, list[int]]:
    """The schedule's per-mesh task lists and each stage's mesh, for this model."""
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
    return tasks, stage_mesh


def dedupe_programs(instructions: Sequence[Instruction]) -> dict[str, Any]:
    """``{name: program}`` of the programs some `Call` uses, in name order (unused ones dropped).

    Two callables under one name raise AssertionError (a compiler bug).

    Example:
      >>> from nnx_mpmd.compiler.ir import ProgramKey
      >>> calls = [Call(0, ProgramKey("F", 0), abs, (0,), 1, "F0.0")]
      >>> dedupe_programs(calls)
      {'F0': <built-in function abs>}
    """
    called: dict[str, Any] = {}
    for ins in instructions:
        if isinstance(ins, Call):
            name = str(ins.program)
            if called.setdefault(name, ins.fn) is not ins.fn:
                raise AssertionError(f"two programs are named {name}")
    return {name: called[name] for name in sorted(called)}


class _RegionLowering:
    """The region's passes, run when mesh inference reaches the region."""

    def __init__(
        self, plan: StagePlan, fns: list[StageFunctions], tasks: Any, stage_mesh: list[int]
    ) -> None:
        self.plan, self.fns, self.tasks, self.stage_mesh = plan, fns, tasks, stage_mesh
        self.program: RegionProgram | None = None
        info = plan.info
        first_batch = info.n_closure + info.n_diff + info.n_other
        self.batch_inputs = frozenset(range(first_batch, first_batch + info.n_batch))

    def needs(self, r: int) -> frozenset[int]:
        return frozenset(self.stage_mesh[k] for k in self.plan.input_stages.get(r, []))

    def build(self, submeshes: list[Any], slots: SlotTable) -> Callable[..., Any]:
        def builder(input_slot: Any, home: Any) -> Any:
            self.program = build_region_program(
                self.plan, self.fns, self.tasks, self.stage_mesh, submeshes, slots, input_slot, home
            )
            return self.program.instructions, self.program.output_slots

        return builder


def _plan_text(plan: StagePlan) -> str:
    lines = []
    for sl in plan.stages:
        lines.append(
            f"stage {sl.stage}: {len(sl.program.jaxpr.eqns)} equations, "
            f"{len(sl.region_inputs)} region inputs, {len(sl.boundary_in)} in, "
            f"{len(sl.boundary_out)} out{', remat' if sl.remat else ''}"
        )
    return "\n".join(lines)


def _vjp_text(fns: list[StageFunctions]) -> str:
    return "\n".join(
        f"stage {f.stage}: {len(f.param_inputs)} params, {len(f.batch_inputs)} batch leaves, "
        f"{len(f.sends)} sends ({len(f.diff_sends)} differentiable), {len(f.carries)} carries"
        for f in fns
    )


def _tasks_text(tasks: Any, stage_mesh: list[int]) -> str:
    lines = [f"stage -> mesh: {stage_mesh}"]
    lines += [f"mesh {q}: {' '.join(str(t) for t in ts)}" for q, ts in enumerate(tasks)]
    return "\n".join(lines)


def _batch_spec(mesh: MpmdMesh, num_microbatches: int, batch_axis: str | None) -> Any:
    def batch_spec(aval: Any) -> Any:
        # The stacked [m, B/m, ...] batch: each microbatch as the stages were traced.
        shape = (aval.shape[0] // num_microbatches, *aval.shape[1:]) if aval.shape else ()
        spec = microbatch_spec(shape, mesh.submesh(0), batch_axis)
        return P() if spec is None else P(None, *spec)

    return batch_spec


def _region_passes(
    traced: TracedStep, schedule: Any, mesh: MpmdMesh, num_microbatches: int, record: Any
) -> _RegionLowering | None:
    """cut_stages, stage_vjp, split_backward and schedule, recorded."""
    if not traced.regions:
        return None
    plan = cut_stages(traced.regions[0])
    record("cut_stages", lambda: _plan_text(plan))
    layouts: dict[Any, Any] = {}  # shared: equal stages have one residual layout
    fns = [StageFunctions(plan, k, residual_layouts=layouts) for k in range(plan.num_stages)]
    record("stage_vjp", lambda: _vjp_text(fns))
    tasks, stage_mesh = schedule_tasks(plan, schedule, mesh, num_microbatches)
    if any(t.kind == "BW" for ts in tasks for t in ts):
        record("split_backward", lambda: "backward split into BI and BW for every stage")
    record("schedule", lambda: _tasks_text(tasks, stage_mesh))
    return _RegionLowering(plan, fns, tasks, stage_mesh)


def _outer_pass(
    traced: TracedStep,
    inputs: StepInputs,
    mesh: MpmdMesh,
    region: _RegionLowering | None,
    slots: SlotTable,
    num_microbatches: int,
    transfer_warning_bytes: int,
) -> OuterPlan:
    """Mesh inference over the step's jaxpr, calling the region's passes in place."""
    n_user = traced.num_user_outputs
    targets: list[frozenset[int] | None] = [None] * n_user + [
        frozenset(a.mesh_ids) or None for a in inputs.state_avals
    ]

    def out_sharding(j: int, q: int) -> Any:
        return inputs.state_avals[j - n_user].sharding(q)

    submeshes = list(mesh.submeshes)
    problem = OuterProblem(
        traced.jaxpr,
        inputs.meshes,
        targets,
        inputs.names,
        submeshes,
        out_sharding,
        batch_inputs=region.batch_inputs if region else frozenset(),
        num_microbatches=num_microbatches,
        batch_spec=_batch_spec(mesh, num_microbatches, traced.batch_axis),
        transfer_warning_bytes=transfer_warning_bytes,
    )
    return plan_outer_problem(
        problem,
        slots,
        region.build(submeshes, slots) if region else None,
        region.needs if region else None,
        warning_stacklevel=_USER_FRAME,
    )


# Warnings name the user's line: the step's call (or lower()) is this many frames
# above the pass that warns (the pass, _outer_pass, compile_step,
# PipelinedFunction._lowered, its _prepare or _lower_abstract, then __call__ or lower).
_USER_FRAME = 7


def _traced_avals(
    mesh: MpmdMesh, state_avals: list[PlacedAval], other_avals: list[PlacedAval]
) -> tuple[list[Any], list[Any]]:
    """The avals the step is traced with: each with its run-time sharding on the submesh
    (as under ``nnx.jit`` inside ``jax.set_mesh``), so Explicit axes type as they will run."""
    typed_on = mesh.submesh(0).abstract_mesh
    return (
        [a.traced_on(typed_on) for a in state_avals],
        [a.traced_on(typed_on) for a in other_avals],
    )


def compile_step(
    fn: Callable[..., Any],
    flat: FlatArgs,
    mesh: MpmdMesh,
    schedule: Any,
    num_microbatches: int,
    *,
    state_avals: list[PlacedAval] | None = None,
    other_avals: list[PlacedAval] | None = None,
    batch_axis: str | None = "data",
    transfer_warning_bytes: int = 1 << 20,
    donated_state: frozenset[int] = frozenset(),
    traced: TracedStep | None = None,
) -> CompiledStep:
    """Lowers ``fn`` for ``mesh`` and ``schedule``: the passes in this module's order.

    ``state_avals``/``other_avals`` say where leaves will be (default: where they are), to
    lower without placing; ``donated_state`` are the state leaves whose buffers may be reused;
    ``traced`` is the first pass's result when `trace_for_step` made it already.
    """
    with collector_paused():
        return _compile_step(
            fn, flat, mesh, schedule, num_microbatches, state_avals, other_avals,
            batch_axis, transfer_warning_bytes, donated_state, traced,
        )  # fmt: skip


def trace_for_step(
    fn: Callable[..., Any],
    flat: FlatArgs,
    mesh: MpmdMesh,
    num_microbatches: int,
    *,
    state_avals: list[PlacedAval] | None = None,
    other_avals: list[PlacedAval] | None = None,
    batch_axis: str | None = "data",
) -> TracedStep:
    """`compile_step`'s first pass alone: ``fn`` traced to one jaxpr, for its ``traced``.

    So that `nnx_mpmd.jit.stages.Traced` owns the jaxpr and lowering does not trace again.
    """
    with collector_paused():
        state_avals = state_avals or [placed_aval(x, mesh) for x in flat.state_leaves]
        other_avals = other_avals or [placed_aval(x, mesh) for x in flat.other_leaves]
        avals = _traced_avals(mesh, state_avals, other_avals)
        return trace_step(fn, flat, avals, mesh, num_microbatches, batch_axis)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector is off for the block (unless it was off already).

    Lowering allocates objects that mostly live until it ends (instructions,
    slot keys, IR text), so the collector's full collections walk ever more
    of them: at 8,192 tasks they were 40% of ``lower()``, which made the
    passes that happened to trigger them look worse than O(n log n). Garbage
    cycles made in the block are collected after it.

    Example:
      >>> import gc
      >>> with collector_paused():
      ...     inside = gc.isenabled()
      >>> inside, gc.isenabled()
      (False, True)
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _compile_step(
    fn: Callable[..., Any],
    flat: FlatArgs,
    mesh: MpmdMesh,
    schedule: Any,
    num_microbatches: int,
    state_avals: list[PlacedAval] | None,
    other_avals: list[PlacedAval] | None,
    batch_axis: str | None,
    transfer_warning_bytes: int,
    donated_state: frozenset[int],
    traced: TracedStep | None,
) -> CompiledStep:
    """`compile_step`'s passes, with the collector paused."""
    state_avals = state_avals or [placed_aval(x, mesh) for x in flat.state_leaves]
    other_avals = other_avals or [placed_aval(x, mesh) for x in flat.other_leaves]
    passes: list[PassRecord] = []

    def record(name: str, render: Callable[[], str]) -> None:
        passes.append(PassRecord(name, render))

    if traced is None:
        avals = _traced_avals(mesh, state_avals, other_avals)
        traced = trace_step(fn, flat, avals, mesh, num_microbatches, batch_axis)
    record("trace", lambda: str(traced.jaxpr))
    region = _region_passes(traced, schedule, mesh, num_microbatches, record)
    inputs = describe_inputs(traced, flat, mesh, state_avals, other_avals)
    slots = SlotTable()
    outer = _outer_pass(
        traced, inputs, mesh, region, slots, num_microbatches, transfer_warning_bytes
    )
    region_program = region.program if region else None
    for name, ir in getattr(region_program, "passes", []):
        record(name, lambda ir=ir: _ir_text(ir))
    for name, ir in getattr(outer, "passes", []):
        record(name, lambda ir=ir: _ir_text(ir))
    keep = {slot for locs in outer.output_slots for _, slot in locs}
    donatable = getattr(region_program, "donatable", {})
    input_slots: list[dict[int, int]] = [{} for _ in range(inputs.num_inputs)]
    for i, slots_of in zip(inputs.used_index, outer.input_slots):
        input_slots[i] = slots_of
    donated = _donated_slots(donated_state, input_slots[len(traced.consts) :], state_avals)
    instructions = _final_passes(outer.instructions, keep, donatable, donated, record)
    programs = dedupe_programs(instructions)
    record("dedupe_programs", lambda: "\n".join(programs))
    return CompiledStep(
        instructions=instructions,
        num_slots=len(slots),
        constants=dict(region_program.constants) if region_program else {},
        input_slots=input_slots,
        consts=list(traced.consts),
        output_slots=outer.output_slots,
        num_user_outputs=traced.num_user_outputs,
        out_tree=traced.out_tree,
        transfers=outer.transfers,
        programs=programs,
        plan=region.plan if region else None,
        tasks=region.tasks if region else (),
        stage_mesh=region.stage_mesh if region else [],
        batch_axis=traced.batch_axis,
        passes=passes,
        jaxpr=traced.jaxpr,
    )


def _donated_slots(
    donated_state: frozenset[int], state_slots: list[dict[int, int]], state_avals: list[PlacedAval]
) -> set[int]:
    """The slots of the donated state leaves that hold an array of their own.

    A leaf on one mesh has one slot; one on several meshes (an `MpmdArray`) one
    copy per mesh. A leaf whose slots would share one array (a host value, or
    more slots than copies) is not donated: its other readers would find it gone.
    """
    slots = set()
    for j in donated_state:
        slots_of = state_slots[j]
        if HOST not in slots_of and len(slots_of) <= max(1, len(state_avals[j].mesh_ids)):
            slots.update(slots_of.values())
    return slots


def _final_passes(
    instructions: list[Instruction],
    keep: set[int],
    donatable: dict[Any, Any],
    donated_slots: set[int],
    record: Callable[[str, Callable[[], str]], None],
) -> list[Instruction]:
    """``insert_frees``, the two donation passes, then the transfer-batching passes."""
    freed = insert_frees(instructions, keep)
    record("insert_frees", lambda: format_instructions(freed))
    donating = donate_dead_arguments(freed, keep, donatable)
    record("donate_dead_arguments", lambda: format_instructions(donating))
    donated = donating  # a name of its own: each record renders its own list, lazily
    if donated_slots and jax.process_count() > 1:
        donated_slots = donated_slots - transfer_sources(freed)
    if donated_slots:
        donated = donate_step_inputs(donating, keep, donated_slots)
        record("donate_step_inputs", lambda: format_instructions(donated))
    in_ticks = schedule_ticks(donated)
    record("schedule_ticks", lambda: format_instructions(in_ticks))
    batched = batch_transfers(in_ticks)
    record("batch_transfers", lambda: format_instructions(batched))
    final = merge_frees(batched)
    record("merge_frees", lambda: format_instructions(final))
    return final


def _ir_text(ir: Any) -> str:
    if isinstance(ir, list | tuple) and all(
        isinstance(i, Instruction.__args__)
        for i in ir  # type: ignore[attr-defined]
    ):
        return format_instructions(ir)
    return str(ir)
