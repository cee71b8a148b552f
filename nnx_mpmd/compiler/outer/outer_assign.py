"""Mesh inference, first passes: where each equation outside the region runs.

The step's jaxpr holds the code outside the pipelined region (the optimizer
update, gradient clipping, metrics) and the region as one equation. These passes
decide, for every equation, the meshes it runs on:

1. `locate_region`: the region equation's index (one region per step at most).
2. `needed_meshes` (backward): the meshes that use each value: a step output's
   target meshes, the meshes whose stages read a region input, and, through
   every equation, the meshes that need its results.
3. `assign_meshes` (forward): every equation runs on the meshes that need its
   result, or once where most of its input bytes already are (shipping its
   result) when that moves fewer bytes; every input missing on a mesh that runs
   the equation becomes a `Move`. The region's own passes run at its place
   (`build_region`), which says where the region's outputs live.

The IR these passes produce is a `MeshAssignment`; `outer_emit` turns it into
instructions. Slots of the outer code are named by `ValueOnMesh` /
`BatchOnMesh` keys in the step's `SlotTable`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from nnx_mpmd.compiler.ir import Instruction, SlotTable
from nnx_mpmd.compiler.jaxpr_utils import is_literal, var_bytes
from nnx_mpmd.compiler.trace.region import region_p
from nnx_mpmd.errors import CompileError

__all__ = [
    "HOST",
    "BatchOnMesh",
    "MeshAssignment",
    "Move",
    "OuterProblem",
    "RegionPlacement",
    "Segment",
    "ValueOnMesh",
    "assign_meshes",
    "build_region",
    "locate_region",
    "needed_meshes",
]

HOST = -1  # a value that is not on any submesh yet (a NumPy array, or on the default device)

# ``region_builder(input_slot, home) -> (instructions, output locations)``: the
# region's passes. ``input_slot(r, mesh)`` is the slot of region input r on a
# mesh, ``home(r)`` the mesh that owns it; each output's locations are
# ``(mesh, slot)`` pairs, or ``("input", r)`` for an output that is input r.
RegionBuilder = Callable[
    [Callable[[int, int], int], Callable[[int], int]],
    tuple[Sequence[Instruction], Sequence[Sequence[tuple[Any, Any]]]],
]
RegionNeeds = Callable[[int], frozenset[int]]


class Segment(enum.IntEnum):
    """Which part of the step an outer program belongs to.

    ``PRE`` is the code before the region (all of it when the step has no
    region), ``POST`` the code after it; their programs are named ``pre.L*``
    and ``post.L*`` and run before and after the region's instructions.
    """

    PRE = 0
    POST = 1


@dataclasses.dataclass(frozen=True)
class ValueOnMesh:
    """Slot key: the copy of jaxpr value ``var`` on mesh ``mesh`` (or `HOST`)."""

    var: Any
    mesh: int


@dataclasses.dataclass(frozen=True)
class BatchOnMesh:
    """Slot key: batch ``var`` on ``mesh``, reshaped into microbatches for the region."""

    var: Any
    mesh: int


@dataclasses.dataclass(frozen=True, eq=False)
class OuterProblem:
    """What mesh inference works on: the step's jaxpr and where its values live.

    Attributes:
      jaxpr: the step's jaxpr, constvars already turned into invars; the region
        (if any) is one `region_p` equation.
      invar_meshes: per input, the meshes holding it (``{HOST}`` for a value on
        no submesh).
      outvar_targets: per output, the meshes it must end up on (state outputs go
        where their input lives), or None for "wherever it is computed".
      names: a readable name per input (transfer labels and reports).
      submeshes: the jax Mesh of each mesh id.
      out_sharding: ``(output index, mesh) -> Sharding`` of a state output.
      batch_inputs: region input indices that are batches (reshaped into
        microbatches on their way to the region).
      num_microbatches: microbatches per step.
      batch_spec: ``aval -> PartitionSpec`` of a microbatched batch on a submesh.
      transfer_warning_bytes: warn about transfers outside the region above this.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> closed = jax.make_jaxpr(lambda a, b: a + b)(jnp.ones(2), jnp.ones(2))
      >>> problem = OuterProblem(closed.jaxpr, [{0}, {1}], [None], ["a", "b"],
      ...                        jax.devices()[:2], lambda j, q: None)
      >>> problem.invar_meshes
      (frozenset({0}), frozenset({1}))
    """

    jaxpr: Any
    invar_meshes: Sequence[frozenset[int]]
    outvar_targets: Sequence[frozenset[int] | None]
    names: Sequence[str]
    submeshes: Sequence[Any]
    out_sharding: Callable[[int, int], Any]
    batch_inputs: frozenset[int] = frozenset()
    num_microbatches: int = 1
    batch_spec: Callable[[Any], Any] | None = None
    transfer_warning_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        frozen = object.__setattr__
        frozen(self, "invar_meshes", tuple(frozenset(m) for m in self.invar_meshes))
        targets = tuple(None if t is None else frozenset(t) for t in self.outvar_targets)
        frozen(self, "outvar_targets", targets)
        frozen(self, "names", tuple(self.names))
        frozen(self, "submeshes", tuple(self.submeshes))
        frozen(self, "batch_inputs", frozenset(self.batch_inputs))
        self._check()

    def _check(self) -> None:
        jaxpr, n_in = self.jaxpr, len(self.jaxpr.invars)
        if jaxpr.constvars:
            raise CompileError(
                f"mesh inference got a jaxpr with {len(jaxpr.constvars)} constvars; turn them "
                "into inputs first (convert_constvars_jaxpr) and give each a mesh."
            )
        for what, given in (("input meshes", self.invar_meshes), ("input names", self.names)):
            if len(given) != n_in:
                raise CompileError(
                    f"mesh inference got {len(given)} {what} for a step with {n_in} inputs; "
                    "give one per input, in order."
                )
        if len(self.outvar_targets) != len(jaxpr.outvars):
            raise CompileError(
                f"mesh inference got {len(self.outvar_targets)} output targets for a step with "
                f"{len(jaxpr.outvars)} outputs; give one per output (None: anywhere)."
            )
        valid = {HOST, *range(len(self.submeshes))}
        for i, (name, meshes) in enumerate(zip(self.names, self.invar_meshes)):
            if not meshes or not meshes <= valid:
                raise CompileError(
                    f"step input {i} ({name}) is said to live on meshes {sorted(meshes)}; "
                    f"give a non-empty set of mesh ids below {len(self.submeshes)}, "
                    f"or {{HOST}} ({HOST}) for a value on no submesh."
                )


@dataclasses.dataclass(frozen=True)
class Move:
    """Value ``var`` is needed on mesh ``dst`` and is not there yet.

    ``sources`` are the meshes holding it at that point (`HOST` included);
    `outer_emit.level_equations` picks the one to copy from. ``before`` is the
    index of the equation that reads it: the region's index for region inputs,
    ``len(eqns)`` for the step's outputs. ``as_batch`` moves a batch into the
    region's microbatched layout (a separate copy, `BatchOnMesh`).
    """

    var: Any
    dst: int
    sources: frozenset[int]
    segment: Segment
    before: int
    as_batch: bool = False


@dataclasses.dataclass(frozen=True)
class RegionPlacement:
    """The region's instructions and, per region output, the meshes holding it."""

    instructions: tuple[Instruction, ...]
    output_meshes: tuple[frozenset[int], ...]


@dataclasses.dataclass(frozen=True, eq=False)
class MeshAssignment:
    """Result of `assign_meshes`: the meshes every equation outside the region runs on.

    Attributes:
      jaxpr: the step's jaxpr.
      region_at: the region equation's index (``len(eqns)`` when there is none).
      run_on: equation index -> the meshes that run it (the region excluded).
      moves: every value copied to a mesh that lacks it, in the order needed.
      placement: value -> the meshes holding it at the end (moves included).
      output_meshes: per step output, the meshes it is read from.
      region: the region's instructions and output meshes (None: no region).
      names: value -> readable name (the input it derives from, by bytes).
    """

    jaxpr: Any
    region_at: int
    run_on: Mapping[int, frozenset[int]]
    moves: tuple[Move, ...]
    placement: Mapping[Any, frozenset[int]]
    output_meshes: tuple[tuple[int, ...], ...]
    region: RegionPlacement | None
    names: Mapping[Any, str]

    def __str__(self) -> str:
        moves_at: dict[int, list[Move]] = {}
        for move in self.moves:
            moves_at.setdefault(move.before, []).append(move)
        lines = []
        for i, eqn in enumerate(self.jaxpr.eqns):
            lines += [_move_text(m, self.names) for m in moves_at.get(i, ())]
            if i == self.region_at and self.region is not None:
                outs = " | ".join(_meshes_text(m) for m in self.region.output_meshes)
                lines.append(f"{i} region: outputs on {outs}")
            else:
                lines.append(f"{i} {eqn.primitive.name}: {_meshes_text(self.run_on[i])}")
        lines += [_move_text(m, self.names) for m in moves_at.get(len(self.jaxpr.eqns), ())]
        lines.append("outputs on " + " | ".join(_meshes_text(m) for m in self.output_meshes))
        return "\n".join(lines)


def _meshes_text(meshes: Iterable[int]) -> str:
    return ",".join("host" if q == HOST else f"mesh{q}" for q in sorted(meshes)) or "nowhere"


def _move_text(move: Move, names: Mapping[Any, str]) -> str:
    kind = "batch " if move.as_batch else ""
    return (
        f"  move {kind}{names.get(move.var, '?')!r} {aval_text(move.var)} to mesh{move.dst} "
        f"(held on {_meshes_text(move.sources)})"
    )


def aval_text(var: Any) -> str:
    """A value's type in short form (``f32[8,16]``)."""
    aval = var.aval
    return aval.str_short() if hasattr(aval, "str_short") else str(aval)


def mesh_order(meshes: Iterable[int]) -> list[int]:
    """Mesh ids ascending, `HOST` last (the order the planner visits meshes in)."""
    return sorted(meshes, key=lambda q: (q == HOST, q))


def locate_region(jaxpr: Any) -> int:
    """The index of the region equation, or ``len(jaxpr.eqns)`` when there is none.

    Raises:
      CompileError: the step has more than one region.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> locate_region(jax.make_jaxpr(jnp.sin)(1.0).jaxpr)  # no region: len(eqns)
      1
    """
    positions = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is region_p]
    if len(positions) > 1:
        raise CompileError(
            "the step calls mp.value_and_grad (or runs the pipelined model) "
            f"{len(positions)} times; one pipelined region per step is supported. "
            "Compute everything from a single call."
        )
    return positions[0] if positions else len(jaxpr.eqns)


def _require_region_callbacks(jaxpr: Any, region_at: int, *callbacks: Any) -> None:
    if region_at < len(jaxpr.eqns) and any(c is None for c in callbacks):
        raise CompileError(
            f"equation {region_at} of the step is a pipelined region, but mesh inference got "
            "no region_needs/region_builder to lower it; pass the region's callbacks."
        )


def needed_meshes(
    problem: OuterProblem, region_at: int, region_needs: RegionNeeds | None
) -> dict[Any, frozenset[int]]:
    """Pass (backward): value -> the meshes that use it (values needed nowhere are absent).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> closed = jax.make_jaxpr(lambda a: a * 2)(jnp.ones(2))
      >>> problem = OuterProblem(closed.jaxpr, [{0}], [{1}], ["a"], jax.devices()[:2],
      ...                        lambda j, q: None)
      >>> sorted(needed_meshes(problem, 1, None)[closed.jaxpr.invars[0]])
      [1]
    """
    jaxpr = problem.jaxpr
    _require_region_callbacks(jaxpr, region_at, region_needs)
    need: dict[Any, set[int]] = {}
    for v, targets in zip(jaxpr.outvars, problem.outvar_targets):
        if not is_literal(v) and targets:
            need.setdefault(v, set()).update(targets)
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        if i == region_at:
            for r, v in enumerate(eqn.invars):
                if not is_literal(v):
                    need.setdefault(v, set()).update(region_needs(r))  # type: ignore[misc]
            continue
        wanted = set().union(*(need.get(out, ()) for out in eqn.outvars))
        for v in eqn.invars:
            if not is_literal(v):
                need.setdefault(v, set()).update(wanted)
    return {v: frozenset(meshes) for v, meshes in need.items()}


def name_values(problem: OuterProblem, region_at: int) -> dict[Any, str]:
    """A readable name per value: its input's name, or its biggest input's name."""
    names: dict[Any, str] = dict(zip(problem.jaxpr.invars, problem.names))
    for i, eqn in enumerate(problem.jaxpr.eqns):
        if i == region_at:
            names.update((out, "region output") for out in eqn.outvars)
            continue
        inputs = [v for v in eqn.invars if not is_literal(v)]
        for v in inputs:
            names.setdefault(v, "?")
        biggest = max(inputs, key=var_bytes, default=None)
        name = names.get(biggest, "?") if biggest is not None else eqn.primitive.name
        names.update((out, name) for out in eqn.outvars)
    return names


class _Sweep:
    """The forward walk's working state: where each value is, and the moves so far."""

    def __init__(self, problem: OuterProblem) -> None:
        self.avail: dict[Any, set[int]] = {
            v: set(meshes) for v, meshes in zip(problem.jaxpr.invars, problem.invar_meshes)
        }
        self.batch_avail: dict[Any, set[int]] = {}
        self.moves: list[Move] = []

    def ensure(self, var: Any, mesh: int, segment: Segment, before: int, as_batch: bool) -> None:
        have = self.batch_avail.setdefault(var, set()) if as_batch else self.avail[var]
        if mesh in have:
            return
        if not self.avail[var]:
            raise CompileError(
                f"a value read by equation {before} of the step ({aval_text(var)}) "
                f"is needed on mesh {mesh} but lives on no mesh; this is a bug in nnx_mpmd, "
                "please report it with the step's code."
            )
        self.moves.append(Move(var, mesh, frozenset(self.avail[var]), segment, before, as_batch))
        have.add(mesh)


# Results up to this size move in one hop when computing them everywhere costs the
# same bytes as computing them once (see `choose_meshes`).
SMALL_RESULT_BYTES = 64


def choose_meshes(eqn: Any, wanted: frozenset[int], avail: Mapping[Any, Any]) -> frozenset[int]:
    """The meshes that run ``eqn``: everywhere it is wanted, or once and shipped.

    Fewer bytes wins; a tie runs once for results over `SMALL_RESULT_BYTES`, else everywhere.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> jaxpr = jax.make_jaxpr(jnp.sum)(jnp.ones(1000)).jaxpr  # 4000 bytes in, 4 out
      >>> sorted(choose_meshes(jaxpr.eqns[0], frozenset({1, 2}), {jaxpr.invars[0]: {0}}))
      [0]
    """
    inputs = [v for v in eqn.invars if not is_literal(v)]
    if not inputs:
        return frozenset(wanted or {0})
    candidates = set().union(*(avail[v] for v in inputs)) | wanted
    candidates.discard(HOST)
    candidates = candidates or {0}

    def missing(q: int) -> int:
        return sum(var_bytes(v) for v in inputs if q not in avail[v] and HOST not in avail[v])

    out_bytes = sum(var_bytes(o) for o in eqn.outvars)
    home = min(candidates, key=lambda q: (missing(q), q not in wanted, q))
    cost_home = missing(home) + out_bytes * len(wanted - {home})
    cost_everywhere = sum(missing(q) for q in wanted)
    if cost_everywhere == cost_home and out_bytes > SMALL_RESULT_BYTES:
        return frozenset({home})
    return wanted if wanted and cost_everywhere <= cost_home else frozenset({home})


def assign_meshes(
    problem: OuterProblem,
    need: Mapping[Any, frozenset[int]],
    region_at: int,
    region_needs: RegionNeeds | None = None,
    place_region: Callable[[Mapping[Any, frozenset[int]]], RegionPlacement] | None = None,
) -> MeshAssignment:
    """Pass (forward): the meshes each equation runs on, and the moves that feed them.

    ``place_region`` builds the region where every value is then (`build_region`).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> closed = jax.make_jaxpr(lambda a, b: a + b)(jnp.ones(2), jnp.ones(2))
      >>> problem = OuterProblem(closed.jaxpr, [{0}, {1}], [None], ["a", "b"],
      ...                        jax.devices()[:2], lambda j, q: None)
      >>> print(assign_meshes(problem, {}, region_at=1))
        move 'b' float32[2] to mesh0 (held on mesh1)
      0 add: mesh0
      outputs on mesh0
    """
    eqns = problem.jaxpr.eqns
    _require_region_callbacks(problem.jaxpr, region_at, region_needs, place_region)
    sweep, run_on, region = _Sweep(problem), {}, None
    for i, eqn in enumerate(eqns):
        if i == region_at:
            region = _place_region(problem, eqn, i, sweep, region_needs, place_region)
            continue
        segment = Segment.PRE if i < region_at else Segment.POST
        wanted = frozenset().union(*(need.get(out, ()) for out in eqn.outvars))
        run_on[i] = choose_meshes(eqn, wanted, sweep.avail)
        for q in mesh_order(run_on[i]):
            for v in eqn.invars:
                if not is_literal(v):
                    sweep.ensure(v, q, segment, i, as_batch=False)
        for out in eqn.outvars:
            sweep.avail[out] = set(run_on[i])
    output_meshes = _route_outputs(problem, sweep)
    return MeshAssignment(
        jaxpr=problem.jaxpr,
        region_at=region_at,
        run_on=run_on,
        moves=tuple(sweep.moves),
        placement={v: frozenset(m) for v, m in sweep.avail.items()},
        output_meshes=output_meshes,
        region=region,
        names=name_values(problem, region_at),
    )


def _place_region(
    problem: OuterProblem,
    eqn: Any,
    at: int,
    sweep: _Sweep,
    region_needs: Any,
    place_region: Any,
) -> RegionPlacement:
    """Moves the region's inputs to the meshes that read them, then builds the region."""
    for r, v in enumerate(eqn.invars):
        if is_literal(v):
            raise CompileError(
                f"region input {r} is a literal; this is a bug in nnx_mpmd, please report it."
            )
        for q in sorted(region_needs(r)):
            sweep.ensure(v, q, Segment.PRE, at, as_batch=r in problem.batch_inputs)
    region = place_region({v: frozenset(m) for v, m in sweep.avail.items()})
    if len(region.output_meshes) != len(eqn.outvars):
        raise CompileError(
            f"the region's passes placed {len(region.output_meshes)} outputs, but the region "
            f"has {len(eqn.outvars)}; this is a bug in nnx_mpmd, please report it."
        )
    for out, meshes in zip(eqn.outvars, region.output_meshes):
        sweep.avail[out] = set(meshes)
    return region


def _route_outputs(problem: OuterProblem, sweep: _Sweep) -> tuple[tuple[int, ...], ...]:
    """Moves every state output to its target meshes; the meshes each output is read from."""
    before = len(problem.jaxpr.eqns)
    result = []
    for j, (v, targets) in enumerate(zip(problem.jaxpr.outvars, problem.outvar_targets)):
        if is_literal(v):
            raise CompileError(
                f"step output {j} is a constant; return arrays computed by the step."
            )
        if targets:
            for q in mesh_order(targets):
                sweep.ensure(v, q, Segment.POST, before, as_batch=False)
            result.append(tuple(sorted(targets)))
        else:
            result.append(tuple(sorted(sweep.avail[v])))
    return tuple(result)


def build_region(
    problem: OuterProblem,
    slots: SlotTable,
    region_builder: RegionBuilder,
    region_at: int,
    placement: Mapping[Any, frozenset[int]],
) -> RegionPlacement:
    """Runs the region's passes at the region's place (``place_region`` of `assign_meshes`).

    Gives the builder each input's slot and home mesh, then names the output slots
    ``ValueOnMesh(output, mesh)`` in ``slots`` (an output that is an input shares its slots).
    """
    eqn = problem.jaxpr.eqns[region_at]

    def input_slot(r: int, q: int) -> int:
        v = eqn.invars[r]
        return slots(BatchOnMesh(v, q) if r in problem.batch_inputs else ValueOnMesh(v, q))

    def home(r: int) -> int:
        meshes = placement[eqn.invars[r]] - {HOST}
        if not meshes:
            raise CompileError(
                f"region input {r} is not on any mesh; place the model with mp.place."
            )
        return min(meshes)

    instructions, outputs = region_builder(input_slot, home)
    output_meshes = []
    for out, locations in zip(eqn.outvars, outputs):
        meshes: set[int] = set()
        for q, slot in locations:
            if q == "literal":
                raise CompileError("literal region outputs are not supported yet.")
            if q == "input":
                source = eqn.invars[slot]
                for qq in mesh_order(placement[source]):
                    slots.index[ValueOnMesh(out, qq)] = slots(ValueOnMesh(source, qq))
                    meshes.add(qq)
            else:
                slots.index[ValueOnMesh(out, q)] = slot
                meshes.add(q)
        output_meshes.append(frozenset(meshes))
    return RegionPlacement(tuple(instructions), tuple(output_meshes))
