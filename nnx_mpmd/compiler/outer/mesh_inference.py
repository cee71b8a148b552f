"""Mesh inference: placing the code outside the pipelined region.

Every equation of the step outside the region (the optimizer update, gradient
clipping, learning-rate schedules, metrics) runs on the meshes that need its
result. When an equation's inputs are not all on those meshes, it either runs
on each of them (fetching the missing inputs) or runs once where most of its
input bytes already are and ships its result, whichever moves fewer bytes. So a
global gradient norm is computed as per-mesh partial sums whose scalars are
exchanged, not by copying gradients around.

Equations on one mesh are grouped into programs by *level*: a level ends where
a value must arrive from another mesh. Transfers run between levels.

`plan_outer_problem` runs the passes in order, each recorded in
`OuterPlan.passes`:

1. ``needed_meshes`` (`outer_assign.needed_meshes`): the meshes using each value.
2. ``assign_meshes`` (`outer_assign.assign_meshes`): the meshes each equation
   runs on and the values moved to them; the region's passes run at its place.
3. ``level_equations`` (`outer_emit.level_equations`): programs per (segment,
   level, mesh), transfers between levels; each equation as early as it can run.
4. ``defer_equations`` (`outer_emit.defer_equations`): each equation moved to
   the latest level its readers allow, so work that waits anyway fuses with its
   readers instead of being passed between programs.
5. ``pack_transfers`` (`outer_packing.pack_transfers`): the small values one
   program sends to one mesh (a global norm's partial sums) move as one array.
6. ``drop_unread_equations`` (`outer_parts.drop_unread_equations`): equations
   removed from the meshes where nothing reads their results.
7. ``split_common_parts`` (`outer_parts.split_common_parts`): a program that
   holds an equal-shaped mesh's whole program and more is split into the rest
   and the part they share, which is then compiled once (the block updates of
   the first and last meshes, besides the embedding's and the final norm's).
8. ``emit_outer_program`` (`outer_emit.emit_outer_program`): the instructions.
9. ``report_transfers`` (`outer_emit.report_transfers`): the cross-mesh
   transfers outside the region, with a warning for large ones.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from nnx_mpmd.compiler.ir import Instruction, SlotTable
from nnx_mpmd.compiler.outer.outer_assign import (
    HOST,
    OuterProblem,
    RegionBuilder,
    RegionNeeds,
    assign_meshes,
    build_region,
    locate_region,
    needed_meshes,
)
from nnx_mpmd.compiler.outer.outer_emit import (
    CrossMeshTransfer,
    MpmdTransferWarning,
    constrain_to,
    defer_equations,
    emit_outer_program,
    kept_values,
    level_equations,
    report_transfers,
)
from nnx_mpmd.compiler.outer.outer_packing import pack_transfers
from nnx_mpmd.compiler.outer.outer_parts import drop_unread_equations, split_common_parts

__all__ = [
    "HOST",
    "CrossMeshTransfer",
    "MpmdTransferWarning",
    "OuterPlan",
    "OuterProblem",
    "constrain_to",
    "plan_outer_problem",
]


@dataclasses.dataclass
class OuterPlan:
    """The outer code's instructions (the region's spliced in), before frees.

    Attributes:
      instructions: in dispatch order.
      output_slots: per step output, its ``(mesh, slot)`` pairs.
      input_slots: per step input, ``{mesh or HOST: slot}``.
      transfers: cross-mesh transfers outside the region.
      programs: the outer programs by name (``pre.L0.mesh1``).
      passes: ``(pass name, its result)`` in order; a result prints readably
        (``str``), or is an instruction list.
    """

    instructions: list[Instruction]
    output_slots: list[list[tuple[int, int]]]
    input_slots: list[dict[int, int]]
    transfers: list[CrossMeshTransfer]
    programs: dict[str, Any]
    passes: list[tuple[str, Any]] = dataclasses.field(default_factory=list)


def plan_outer_problem(
    problem: OuterProblem,
    slots: SlotTable,
    region_builder: RegionBuilder | None = None,
    region_needs: RegionNeeds | None = None,
    *,
    warning_stacklevel: int = 4,
) -> OuterPlan:
    """Assigns the step's equations to meshes and emits their instructions (an `OuterPlan`).

    ``region_builder`` runs the region's passes at its place; ``warning_stacklevel`` counts
    from this function, like ``warnings.warn``'s.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from nnx_mpmd.compiler.ir import format_instructions
      >>> closed = jax.make_jaxpr(lambda a, b: a + b)(jnp.ones(2), jnp.ones(2))
      >>> problem = OuterProblem(closed.jaxpr, [{0}, {1}], [None], ["a", "b"],
      ...                        jax.devices()[:2], lambda j, q: None)
      >>> plan = plan_outer_problem(problem, SlotTable())
      >>> print(format_instructions(plan.instructions))
      transfer 3@1 -> 2@0 label='b 1->0' bytes=8
      call 0 pre.L1.mesh0 args=(1,2) outs=(0,) label=pre.L1.mesh0
      >>> [name for name, _ in plan.passes][:2]
      ['needed_meshes', 'assign_meshes']
    """
    region_at = locate_region(problem.jaxpr)
    need = needed_meshes(problem, region_at, region_needs)
    place_region = None
    if region_builder is not None and region_at < len(problem.jaxpr.eqns):
        place_region = functools.partial(build_region, problem, slots, region_builder, region_at)
    assignment = assign_meshes(problem, need, region_at, region_needs, place_region)
    levels = level_equations(assignment)
    deferred = defer_equations(levels)
    packed = pack_transfers(deferred, kept_values(problem, deferred))
    trimmed = drop_unread_equations(packed, kept_values(problem, packed))
    split = split_common_parts(trimmed)
    program = emit_outer_program(problem, split, slots)
    transfers = report_transfers(problem, split, stacklevel=warning_stacklevel)
    passes: list[tuple[str, Any]] = [
        ("needed_meshes", _need_text(problem, need)),
        ("assign_meshes", assignment),
        ("level_equations", levels),
        ("defer_equations", deferred),
        ("pack_transfers", packed),
        ("drop_unread_equations", trimmed),
        ("split_common_parts", split),
        ("emit_outer_program", list(program.instructions)),
        ("report_transfers", "\n".join(map(str, transfers)) or "no transfers between meshes"),
    ]
    return OuterPlan(
        list(program.instructions),
        program.output_slots,
        program.input_slots,
        transfers,
        program.programs,
        passes,
    )


def _need_text(problem: OuterProblem, need: dict[Any, frozenset[int]]) -> str:
    lines = []
    for i, eqn in enumerate(problem.jaxpr.eqns):
        meshes = frozenset().union(*(need.get(out, ()) for out in eqn.outvars))
        lines.append(f"{i} {eqn.primitive.name}: needed on {sorted(meshes) or 'no mesh'}")
    return "\n".join(lines)
