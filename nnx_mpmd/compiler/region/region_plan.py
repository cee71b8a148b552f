"""Turning a schedule into the region's instruction list: the region's passes, composed.

`build_region_program` runs, in order (each pass a function IR -> IR with
its own tests, its result kept in `RegionProgram.passes`):

1. `schedule_lowering.lower_schedule`: accumulator ``init`` calls, then one
   `Call` per task in `schedule_lowering.dispatch_order`, every argument a
   `RegionValue` on the task's own mesh;
2. `overlap.overlap_tasks`: each group of overlapped tasks (joined by ``+``
   in the schedule) -> one call of one program;
   `schedule_lowering.fuse_forward_backward`: ``F`` + ``B`` -> ``FB`` where
   the backward directly follows;
   `grad_reduction.reduce_gradients_once` (data-parallel stages only, on
   Explicit or Auto data axes): one ``reduce`` call per stage after its last backward;
3. `region_transfers.insert_transfers`: activations and cotangents copied to
   the meshes that read them, right after they are made;
4. `region_outputs.region_outputs`: loss/aux, gradients summed on their home
   mesh, state carried home;
5. `assign_slots`: every `RegionValue` gets a slot number from the step's
   `SlotTable` (region inputs get the outer step's slots).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import numpy as np

from nnx_mpmd.compiler.ir import (
    Call,
    Donatable,
    Instruction,
    ProgramKey,
    SlotTable,
    Transfer,
)
from nnx_mpmd.compiler.jaxpr_utils import named_jit, put_scalar, var_bytes
from nnx_mpmd.compiler.region.overlap import overlap_tasks
from nnx_mpmd.compiler.region.region_outputs import OutputLocations, region_outputs
from nnx_mpmd.compiler.region.region_transfers import insert_transfers
from nnx_mpmd.compiler.region.region_values import RegionContext, RegionValue, region_values_in
from nnx_mpmd.compiler.region.schedule_lowering import (
    dispatch_order,
    fuse_forward_backward,
    lower_schedule,
)
from nnx_mpmd.compiler.trace.grad_reduction import GradientReduction, reduce_gradients_once
from nnx_mpmd.compiler.trace.grad_reduction_auto import StackedReduction
from nnx_mpmd.compiler.trace.stage_programs import STAGE_PROGRAMS, StageFunctions
from nnx_mpmd.compiler.trace.stages import StagePlan

__all__ = [
    "NumberedRegion",
    "RegionProgram",
    "assign_slots",
    "build_region_program",
    "compile_stage_programs",
    "donatable_cotangents",
    "init_donors",
    "dispatch_order",
]


@dataclasses.dataclass
class RegionProgram:
    """The region's instructions, where its outputs lie, and how they were made."""

    instructions: list[Instruction]
    output_slots: list[list[tuple[Any, Any]]]  # per region output: [(mesh, slot)]
    constants: dict[int, Any]
    compiled: dict[str, Any]  # label -> jitted program, for inspection
    # (pass name, the region's instructions after it), in order; before
    # assign_slots, slots are RegionValue keys.
    passes: list[tuple[str, list[Instruction]]] = dataclasses.field(default_factory=list)
    # Programs that could donate their received cotangents (`donatable_cotangents`).
    donatable: dict[ProgramKey, Donatable] = dataclasses.field(default_factory=dict)


class _LazyInit:
    """Zero accumulators, compiled on first use with the parameters' shardings.

    A gradient accumulator has its parameter's sharding, made unreduced over
    the data axis where the stage accumulates unreduced (`grad_reduction`), or
    is ``[n, *shape]`` sharded over it where the stage accumulates stacked
    partials (`grad_reduction_auto`; the concrete parameters decide which).
    """

    def __init__(
        self, f: StageFunctions, submesh: Any, label: str, donor: StageFunctions | None = None
    ) -> None:
        self.fn, self.submesh, self.num_acc, self.jitted = f.init, submesh, len(f.accumulated), None
        self.reduction = getattr(f, "reduction", None)
        # Each result accumulator (a mean, a concatenated aux value's buffer) as
        # the stage programs return it (`StageFunctions.result_specs`).
        self.result_specs = list(getattr(f, "result_specs", (None,) * self.num_acc))
        # A stage without result accumulators makes ``donor``'s too (never read), so
        # that its init is the donor's program, compiled once (`init_donors`).
        self.padding: tuple[str, ...] = ()  # the types of the donor's accumulators
        if donor is not None:
            self.padding = tuple(str(v.aval) for v in donor.accumulated)
            self.result_specs = list(donor.result_specs)
            self.fn = lambda params, stacked=(): (f.init(params, stacked)[0], donor.zero_results())
        self.label = self.__name__ = label

    def _gradient_sharding(self, param: Any) -> Any:
        red, sharding = self.reduction, param.sharding
        if isinstance(red, StackedReduction):
            return red.accumulator_sharding(param) if red.defers(param) else sharding
        if red is None or not red.defers(param):
            return sharding
        # Unreduced over the data axis; a parameter sharded over it (FSDP) at full size.
        return red.unreduced_sharding(sharding, len(param.shape))

    def _jitted(self, params: tuple[Any, ...]) -> Any:
        if self.jitted is None:
            grads = tuple(self._gradient_sharding(p) for p in params)
            results = tuple(
                jax.sharding.NamedSharding(self.submesh, spec or jax.sharding.PartitionSpec())
                for spec in self.result_specs
            )
            out = (grads, results)
            fn = self.fn
            if isinstance(self.reduction, StackedReduction):  # decided by the concrete params
                fn = functools.partial(fn, stacked=tuple(map(self.reduction.defers, params)))
            self.jitted = named_jit(fn, self.label, out_shardings=out)
        return self.jitted

    def __call__(self, params: tuple[Any, ...]) -> Any:
        return self._jitted(params)(params)

    def trace(self, params: tuple[Any, ...]) -> Any:
        """``jax.jit``'s trace, for ahead-of-time compilation (abstract ``params``)."""
        return self._jitted(params).trace(params)


class _LazyReduce:
    """The ``reduce`` program, jitted on first use: it donates the accumulators
    unless it reduce-scatters one (an FSDP parameter's gradient, whose result is
    smaller than its full-size accumulator: XLA could not reuse that buffer) or
    sums stacked partials (`grad_reduction_auto`)."""

    def __init__(self, f: StageFunctions, label: str) -> None:
        self.fn, self.reduction, self.jitted = f.reduce, f.reduction, None
        self.label = self.__name__ = label

    def _jitted(self, params: tuple[Any, ...]) -> Any:
        if self.jitted is None:
            # Stacked partials ([n, *shape]) and reduce-scattered gradients are
            # larger than their results: XLA could not reuse those buffers.
            red = self.reduction  # a stage with a reduce program has a reduction
            shrinks = isinstance(red, StackedReduction) or any(
                map(cast(GradientReduction, red).sharded_over, params)
            )
            donate = {} if shrinks else {"donate_argnums": (0,)}
            self.jitted = named_jit(self.fn, self.label, **donate)
        return self.jitted

    def __call__(self, gacc: tuple[Any, ...], params: tuple[Any, ...]) -> Any:
        return self._jitted(params)(gacc, params)

    def trace(self, gacc: tuple[Any, ...], params: tuple[Any, ...]) -> Any:
        """``jax.jit``'s trace, for ahead-of-time compilation (abstract arguments)."""
        return self._jitted(params).trace(gacc, params)


def compile_stage_programs(
    fns: Sequence[StageFunctions], stage_mesh: Sequence[int], submeshes: Sequence[Any]
) -> dict[ProgramKey, Callable[..., Any]]:
    """Every stage's programs, jitted lazily: F, B, FB, BI, Fwd, BW, init (and reduce).

    Per-step accumulators are donated (the gradient one only where nothing is reduce-scattered
    or stacked, `_LazyReduce`); ``reduce`` exists for unreduced or stacked gradients.
    """
    programs: dict[ProgramKey, Callable[..., Any]] = {}
    for k, f in enumerate(fns):
        for kind, (method, donated) in STAGE_PROGRAMS.items():
            fn = getattr(f, method)
            programs[ProgramKey(kind, k)] = named_jit(fn, f"{kind}{k}", donate_argnums=donated)
        if getattr(f, "reduction", None) is not None:  # data-parallel on an Explicit axis
            programs[ProgramKey("reduce", k)] = _LazyReduce(f, f"reduce{k}")
    donors = init_donors(fns, stage_mesh, submeshes)
    for k, f in enumerate(fns):
        submesh = submeshes[stage_mesh[k]]
        donor = fns[donors[k]] if k in donors else None
        programs[ProgramKey("init", k)] = _LazyInit(f, submesh, f"init{k}", donor)
    return programs


# A stage makes at most this many bytes of another stage's result accumulators.
_DONATED_RESULT_BYTES = 16 * 1024


def init_donors(
    fns: Sequence[StageFunctions], stage_mesh: Sequence[int], submeshes: Sequence[Any]
) -> dict[int, int]:
    """For stages without loss/aux accumulators, an alike stage whose accumulators they make too.

    Alike: the same parameter types, no gradient reduction and equal-shaped submeshes. Then
    the two ``init`` programs are one module, compiled once (`nnx_mpmd.aot.program_sharing`):
    a 4-stage MLP whose last stage holds the loss compiles one init, not two. Only small
    accumulators (a loss, scalar aux values) are made for nothing.

    Returns:
      ``{stage: donor stage}``.

    Example:
      >>> init_donors([], [], [])
      {}
    """

    def alike(k: int) -> Any:
        f, submesh = fns[k], submeshes[stage_mesh[k]]
        plan = getattr(f, "plan", None)  # (hand-made stage functions have none)
        if plan is None or getattr(f, "reduction", None) is not None:
            return None
        body = plan.info.body
        params = tuple(str(body.invars[r].aval) for r in f.param_inputs)
        return params, tuple(dict(submesh.shape).items()), str(submesh.devices.flat[0].platform)

    donors: dict[int, int] = {}
    with_results: dict[Any, int] = {}
    for k, f in enumerate(fns):
        small = sum(var_bytes(v) for v in f.accumulated) <= _DONATED_RESULT_BYTES
        if f.accumulated and small and not any(getattr(f, "stacked_results", ())):
            key = alike(k)
            if key is not None:
                with_results.setdefault(key, k)
    for k, f in enumerate(fns):
        key = None if f.accumulated else alike(k)
        if key is not None and key in with_results:
            donors[k] = with_results[key]
    return donors


# The backward kinds' cotangent argument, the ct_xd result it can alias, and the
# arguments each always donates (as in compile_stage_programs).
_COTANGENTS: dict[str, tuple[int, int, tuple[int, ...]]] = {
    "B": (2, 0, (3,)),
    "BI": (2, 0, ()),
    "FB": (6, 1, (7, 8)),
}


class _Donating:
    """``donating(argnums)`` of a `Donatable`: the program jitted to donate those too."""

    def __init__(self, fn: Callable[..., Any], label: str, always: tuple[int, ...]) -> None:
        self.fn, self.label, self.always = fn, label, always
        self.made: dict[tuple[int, ...], Any] = {}

    def __call__(self, argnums: tuple[int, ...]) -> Any:
        donate = tuple(sorted({*self.always, *argnums}))
        if donate not in self.made:
            self.made[donate] = named_jit(self.fn, self.label, donate_argnums=donate)
        return self.made[donate]


def donatable_cotangents(fns: Sequence[StageFunctions]) -> dict[ProgramKey, Donatable]:
    """The backward programs (B, BI, FB) that could donate the cotangents they receive.

    Then XLA writes ``ct_xd`` into the received buffers; `donate_dead_arguments` decides per call.
    """
    donatable: dict[ProgramKey, Donatable] = {}
    for k, f in enumerate(fns):
        if not f.cotangents_fit_inputs():
            continue
        for kind, fn in (("B", f.backward), ("BI", f.backward_input), ("FB", f.fused)):
            argnum, out_index, always = _COTANGENTS[kind]
            donating = _Donating(fn, f"{kind}{k}", always)
            donatable[ProgramKey(kind, k)] = Donatable(argnum, out_index, donating)
    return donatable


@dataclasses.dataclass
class NumberedRegion:
    """The result of `assign_slots`: instructions and outputs over slot numbers."""

    instructions: list[Instruction]
    output_slots: list[list[tuple[Any, Any]]]
    constants: dict[int, Any]  # slot -> microbatch index constant


# Results numbered before a call's arguments, by program kind: sent activations
# (and a forward-only task's outputs), a zero gradient. That is the order slots
# have always been numbered in, so the instruction text stays the same.
_RESULTS_FIRST: dict[str, Callable[[Any], Any]] = {
    "F": lambda outs: outs[0],
    "FB": lambda outs: outs[0],
    "Fwd": lambda outs: outs[:2],
    "zeros": lambda outs: outs,
}


def _numbering_order(ins: Instruction) -> list[RegionValue]:
    """The values of ``ins`` in the order their slots are numbered."""
    if isinstance(ins, Call):
        first = _RESULTS_FIRST.get(ins.program.kind, lambda outs: ())(ins.outs)
        return region_values_in((first, ins.args, ins.outs))
    if isinstance(ins, Transfer):
        return region_values_in((ins.src, ins.dst))
    return []


def _renamed(tree: Any, numbers: dict[RegionValue, int]) -> Any:
    if isinstance(tree, RegionValue):
        return numbers[tree]
    if isinstance(tree, tuple | list):
        return type(tree)(_renamed(t, numbers) for t in tree)
    return tree


def _renumbered(ins: Instruction, numbers: dict[RegionValue, int]) -> Instruction:
    if isinstance(ins, Call):
        args, outs = _renamed(ins.args, numbers), _renamed(ins.outs, numbers)
        return dataclasses.replace(ins, args=args, outs=outs)
    if isinstance(ins, Transfer):
        return dataclasses.replace(
            ins, src=_renamed(ins.src, numbers), dst=_renamed(ins.dst, numbers)
        )
    return ins


def assign_slots(
    program: Sequence[Instruction],
    locations: OutputLocations,
    slots: SlotTable,
    input_slot: Callable[[int, int], int],
    submeshes: Sequence[Any],
) -> NumberedRegion:
    """Numbers every `RegionValue` of the region in order of first appearance (the last pass).

    A region input takes the outer step's slot (``input_slot``); a microbatch index is a constant.
    """
    numbers: dict[RegionValue, int] = {}
    constants: dict[int, Any] = {}
    values = [v for ins in program for v in _numbering_order(ins)]
    values += [v for locs in locations for _, v in locs if isinstance(v, RegionValue)]
    for value in values:
        if value in numbers:
            continue
        if value.kind == "input":
            numbers[value] = input_slot(value.ident[0], value.mesh)  # type: ignore[arg-type]
            continue
        numbers[value] = slots(value)
        if value.kind == "idx":  # a microbatch index: it has a mesh and a microbatch
            mesh, microbatch = cast(int, value.mesh), cast(int, value.microbatch)
            sharding = jax.sharding.NamedSharding(submeshes[mesh], jax.sharding.PartitionSpec())
            constants[numbers[value]] = put_scalar(np.int32(microbatch), sharding)
    output_slots = [[(place, _renamed(v, numbers)) for place, v in locs] for locs in locations]
    instructions = [_renumbered(ins, numbers) for ins in program]
    return NumberedRegion(instructions, output_slots, constants)


def _compiled(
    programs: dict[ProgramKey, Callable[..., Any]], program: Sequence[Instruction]
) -> dict[str, Any]:
    """Name -> callable: the stage programs, then the region-output programs called."""
    compiled = {str(key): fn for key, fn in programs.items()}
    for ins in program:
        if isinstance(ins, Call):
            compiled.setdefault(str(ins.program), ins.fn)
    return compiled


def build_region_program(
    plan: StagePlan,
    fns: list[StageFunctions],
    tasks: Any,
    stage_mesh: list[int],
    submeshes: list[Any],
    slots: SlotTable,
    input_slot: Callable[[int, int], int],
    home_mesh: Callable[[int], int],
) -> RegionProgram:
    """Emits the region's instructions for one schedule: the region's passes in order.

    ``input_slot(r, mesh)`` is where the outer step makes input ``r`` available (batches
    reshaped); ``home_mesh(r)`` is a parameter's home.
    """
    programs = compile_stage_programs(fns, stage_mesh, submeshes)
    ctx = RegionContext.build(plan, fns, stage_mesh, programs)
    passes: list[tuple[str, list[Instruction]]] = []
    ir = lower_schedule(ctx, tasks)
    passes.append(("lower_schedule", ir))
    ir = overlap_tasks(ir, ctx)
    passes.append(("overlap_tasks", ir))
    ir = fuse_forward_backward(ir, ctx)
    passes.append(("fuse_forward_backward", ir))
    if getattr(plan.info, "reduces_once", False):
        ir = reduce_gradients_once(ir, ctx)
        passes.append(("reduce_gradients_once", ir))
    ir = insert_transfers(ir, ctx)
    passes.append(("insert_transfers", ir))
    ir, locations = region_outputs(ir, ctx, home_mesh)
    passes.append(("region_outputs", ir))
    numbered = assign_slots(ir, locations, slots, input_slot, submeshes)
    passes.append(("assign_slots", numbered.instructions))
    return RegionProgram(
        numbered.instructions,
        numbered.output_slots,
        numbered.constants,
        _compiled(programs, ir),
        passes,
        donatable_cotangents(fns),
    )
