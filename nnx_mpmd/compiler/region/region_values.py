"""Typed names for the values of the pipelined region, and what its passes read.

The region's lowering passes (`schedule_lowering`, `region_transfers`,
`region_outputs`) build instructions whose slots are not numbers yet but
`RegionValue` keys: *which* value (an activation of microbatch 2, the gradient
accumulator of stage 1's third parameter...) on *which* mesh. The same value on
another mesh is ``value.on(mesh)``, which is how `insert_transfers` finds what
to move. The last pass, `region_plan.assign_slots`, numbers the keys.

`RegionContext` bundles the read-only inputs of those passes (the stage plan,
the stage functions, the stage -> mesh map, the compiled stage programs) and
spells each task's arguments and results as keys, so every pass builds them
the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nnx_mpmd.compiler.ir import ProgramKey
from nnx_mpmd.compiler.trace.stage_programs import StageFunctions
from nnx_mpmd.compiler.trace.stages import StagePlan
from nnx_mpmd.errors import CompileError

__all__ = ["VALUE_KINDS", "RegionContext", "RegionValue", "region_values_in"]

# What each kind of value is; ``ident`` says which one (see `RegionValue`).
VALUE_KINDS = {
    "input": "a region input (ident: its index r); the outer step gives its slot",
    "idx": "the microbatch index, a constant on each mesh",
    "act": "a stage boundary value (ident: its number in the plan)",
    "ct": "the cotangent of a boundary value from one consumer (ident: number, consumer stage)",
    "res": "a forward's residuals (ident: stage)",
    "extras": "what a BI task leaves for its BW task (ident: stage)",
    "grad": "a gradient accumulator (ident: stage, parameter position)",
    "acc": "a loss/aux accumulator (ident: stage, output position)",
    "unused_acc": "a result accumulator an init makes for an alike stage's sake (ident: stage, "
    "position); never read (`region_plan.init_donors`)",
    "out": "a forward-only output of one microbatch (ident: stage, output position)",
    "carry": "mutable state before a microbatch's forward (ident: region input r)",
    "stacked": "a forward-only output stacked over microbatches (ident: output index)",
    "zero_grad": "the zero gradient of an unused parameter (ident: parameter index)",
    "grad_sum": "a shared parameter's summed gradient (ident: parameter index)",
}


@dataclasses.dataclass(frozen=True, repr=False)
class RegionValue:
    """One value of the pipelined region on one mesh: a slot before it has a number.

    Args:
      kind: what the value is, one of `VALUE_KINDS`.
      ident: which value of that kind (a stage, a parameter position...).
      microbatch: the microbatch, for per-microbatch values.
      mesh: the mesh that holds this copy.

    The text form leaves the mesh out: an instruction already says where it runs.

    Example:
      >>> act = RegionValue("act", (3,), microbatch=0, mesh=0)
      >>> act.on(1)
      act3.mb0
      >>> act.on(1).mesh, act.on(1) == RegionValue("act", (3,), 0, 1)
      (1, True)
    """

    kind: str
    ident: tuple[int, ...] = ()
    microbatch: int | None = None
    mesh: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in VALUE_KINDS:
            raise CompileError(
                f"RegionValue kind {self.kind!r} is unknown: use one of {sorted(VALUE_KINDS)}."
            )

    def on(self, mesh: int | None) -> RegionValue:
        """The same value on ``mesh``."""
        return dataclasses.replace(self, mesh=mesh)

    def __repr__(self) -> str:
        text = self.kind + ".".join(str(n) for n in self.ident)
        return text + ("" if self.microbatch is None else f".mb{self.microbatch}")


def region_values_in(tree: Any) -> list[RegionValue]:
    """The `RegionValue` leaves of nested tuples/lists of slots, in order (int slots skipped).

    Example:
      >>> act = RegionValue("act", (0,), microbatch=1, mesh=0)
      >>> region_values_in(((act, 3), (), act.on(1)))
      [act0.mb1, act0.mb1]
    """
    if isinstance(tree, RegionValue):
        return [tree]
    if isinstance(tree, tuple | list):
        return [v for t in tree for v in region_values_in(t)]
    return []


@dataclasses.dataclass(frozen=True)
class RegionContext:
    """What the region's passes read: the plan, stage functions, placement, programs.

    The methods spell a stage task's arguments and results as `RegionValue`
    keys on the stage's own mesh, in the order its program takes them.
    """

    plan: StagePlan
    fns: Sequence[StageFunctions]
    stage_mesh: Sequence[int]
    programs: dict[ProgramKey, Callable[..., Any]]  # overlap_tasks adds programs
    boundary_vars: Sequence[Any]  # boundary value number -> its jaxpr var
    boundary_numbers: Mapping[Any, int]  # jaxpr var -> boundary value number

    @classmethod
    def build(
        cls,
        plan: StagePlan,
        fns: Sequence[StageFunctions],
        stage_mesh: Sequence[int],
        programs: dict[ProgramKey, Callable[..., Any]],
    ) -> RegionContext:
        """The context; boundary values are numbered in the plan's order."""
        numbers = {v: n for n, v in enumerate(plan.consumers)}
        return cls(plan, fns, stage_mesh, programs, tuple(plan.consumers), numbers)

    @property
    def with_grad(self) -> bool:
        return bool(self.plan.info.with_grad)

    @property
    def num_microbatches(self) -> int:
        return int(self.plan.info.num_microbatches)

    def program(self, kind: str, stage: int) -> tuple[ProgramKey, Callable[..., Any]]:
        """The key and callable of stage ``stage``'s ``kind`` program."""
        key = ProgramKey(kind, stage)
        if key not in self.programs:
            raise CompileError(
                f"no program {key} among the region's programs ({len(self.programs)} given); "
                "compile_stage_programs makes F, B, FB, BI, BW, Fwd and init for every stage "
                "(and reduce for a stage with an unreduced data axis)."
            )
        return key, self.programs[key]

    def boundary_number(self, var: Any) -> int:
        return self.boundary_numbers[var]

    # -- values on the stage's mesh --------------------------------------------
    def act(self, var: Any, i: int, q: int) -> RegionValue:
        return RegionValue("act", (self.boundary_number(var),), i, q)

    def input(self, r: int, q: int) -> RegionValue:
        return RegionValue("input", (r,), None, q)

    def state_before(self, r: int, i: int, q: int) -> RegionValue:
        """Mutable state ``r`` as microbatch ``i`` reads it: what microbatch i-1 left."""
        return self.input(r, q) if i == 0 else RegionValue("carry", (r,), i, q)

    def forward_args(self, k: int, i: int) -> tuple[Any, ...]:
        """``(params, rest, batch, idx, xd, xn)`` of stage ``k``, microbatch ``i``."""
        f, q = self.fns[k], self.stage_mesh[k]
        rest = tuple(
            self.state_before(r, i, q) if r in f.carries else self.input(r, q)
            for r in f.rest_inputs
        )
        return (
            tuple(self.input(r, q) for r in f.param_inputs),
            rest,
            tuple(self.input(r, q) for r in f.batch_inputs),
            RegionValue("idx", (), i, q),
            tuple(self.act(v, i, q) for v in f.xd),
            tuple(self.act(v, i, q) for v in f.xn),
        )

    def sends(self, k: int, i: int) -> tuple[RegionValue, ...]:
        return tuple(self.act(v, i, self.stage_mesh[k]) for v in self.fns[k].sends)

    def carried_out(self, k: int, i: int) -> tuple[RegionValue, ...]:
        """The state stage ``k`` leaves for microbatch ``i + 1``."""
        q = self.stage_mesh[k]
        return tuple(RegionValue("carry", (r,), i + 1, q) for r in self.fns[k].carries)

    def received_cotangents(self, k: int, i: int) -> tuple[tuple[RegionValue, ...], ...]:
        """Per differentiable send, one cotangent from each consumer stage."""
        q, consumers = self.stage_mesh[k], self.plan.consumers
        return tuple(
            tuple(RegionValue("ct", (self.boundary_number(v), c), i, q) for c in consumers[v])
            for v in self.fns[k].diff_sends
        )

    def sent_cotangents(self, k: int, i: int) -> tuple[RegionValue, ...]:
        """The cotangents of stage ``k``'s differentiable inputs, sent back."""
        q = self.stage_mesh[k]
        return tuple(RegionValue("ct", (self.boundary_number(v), k), i, q) for v in self.fns[k].xd)

    def grad_accumulators(self, k: int) -> tuple[RegionValue, ...]:
        q = self.stage_mesh[k]
        return tuple(
            RegionValue("grad", (k, j), None, q) for j in range(len(self.fns[k].param_inputs))
        )

    def result_accumulators(self, k: int) -> tuple[RegionValue, ...]:
        q = self.stage_mesh[k]
        return tuple(
            RegionValue("acc", (k, j), None, q) for j in range(len(self.fns[k].accumulated))
        )

    def residuals(self, k: int, i: int) -> RegionValue:
        return RegionValue("res", (k,), i, self.stage_mesh[k])

    def extras(self, k: int, i: int) -> RegionValue:
        return RegionValue("extras", (k,), i, self.stage_mesh[k])

    def outputs(self, k: int, i: int) -> tuple[RegionValue, ...]:
        """A forward-only task's results (the stage's loss/aux-position outputs)."""
        q = self.stage_mesh[k]
        return tuple(RegionValue("out", (k, j), i, q) for j in range(len(self.fns[k].accumulated)))
