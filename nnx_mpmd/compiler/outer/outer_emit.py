"""Mesh inference, last passes: the outer code's programs, transfers and report.

After `outer_assign.assign_meshes` decided where every equation runs:

1. `level_equations` groups each mesh's equations into *levels*: a level ends
   where a value must arrive from another mesh, so one program per (segment,
   level, mesh) (`OuterGroup`, named ``pre.L0.mesh1``) and the transfers
   between levels.
2. `emit_outer_program` makes the instructions: per segment and level, the
   transfers then the `Call` of each mesh's program; the region's instructions
   between the ``pre`` and the ``post`` segment.
3. `report_transfers` lists the transfers between meshes outside the region
   (`CrossMeshTransfer`, ``lower(...).transfers``) and warns about large ones.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from nnx_mpmd.compiler.ir import Call, Instruction, ProgramKey, SlotTable, Transfer
from nnx_mpmd.compiler.jaxpr_utils import (
    is_literal,
    make_subprogram,
    named_jit,
    structure_key,
    var_bytes,
)
from nnx_mpmd.compiler.outer.outer_assign import (
    HOST,
    BatchOnMesh,
    MeshAssignment,
    Move,
    OuterProblem,
    Segment,
    ValueOnMesh,
    aval_text,
    mesh_order,
)
from nnx_mpmd.compiler.outer.outer_packing import PackedTransfer, packed_function, transfer_text
from nnx_mpmd.placement.mesh import mesh_shape_key

__all__ = [
    "CrossMeshTransfer",
    "MpmdTransferWarning",
    "OuterGroup",
    "OuterLevels",
    "OuterProgram",
    "OuterTransfer",
    "Part",
    "constrain_to",
    "emit_outer_program",
    "defer_equations",
    "kept_values",
    "level_equations",
    "report_transfers",
]


class MpmdTransferWarning(UserWarning):
    """A large value crosses meshes outside the pipelined region every step."""


@dataclasses.dataclass(frozen=True)
class CrossMeshTransfer:
    """A transfer outside the region, as reported by ``lower(...).transfers``."""

    what: str
    src: int
    dst: int
    nbytes: int


class Part(enum.IntEnum):
    """Which part of a split outer program (`outer_parts.split_common_parts`) a group is.

    A program that is not split is ``WHOLE``. A split one runs as the rest
    (``WHOLE``, or ``PROLOGUE`` when only the small values the common part reads
    are left), then the ``COMMON`` part it shares with other meshes.
    """

    PROLOGUE = -1
    WHOLE = 0
    COMMON = 1


@dataclasses.dataclass(frozen=True, order=True)
class OuterGroup:
    """One program of the outer code: a segment's equations of one level on one mesh.

    ``part`` tells which part of a split program it is (`Part`).
    """

    segment: Segment
    level: int
    mesh: int
    part: Part = Part.WHOLE

    @property
    def program_key(self) -> ProgramKey:
        """The program's name: ``pre.L0.mesh1`` (a part: ``post_common.L1.mesh0``)."""
        kind = self.segment.name.lower()
        if self.part is not Part.WHOLE:
            kind += f"_{self.part.name.lower()}"
        return ProgramKey(kind, index=self.level, mesh=self.mesh)


@dataclasses.dataclass(frozen=True)
class OuterTransfer:
    """A `Move` with its source mesh (or `HOST`) and the level it runs before."""

    var: Any
    src: int
    dst: int
    segment: Segment
    level: int
    as_batch: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class OuterLevels:
    """Result of `level_equations`: equations per program, transfers per level.

    Attributes:
      groups: each program's equation indices, in emission order (segment,
        level, mesh).
      transfers: the transfers, in the order they were needed (after
        `outer_packing.pack_transfers`, some are `PackedTransfer`s).
      assignment: the `MeshAssignment` leveled.
    """

    groups: Mapping[OuterGroup, tuple[int, ...]]
    transfers: tuple[OuterTransfer | PackedTransfer, ...]
    assignment: MeshAssignment

    def __str__(self) -> str:
        eqns, names = self.assignment.jaxpr.eqns, self.assignment.names
        lines = [
            f"{group.program_key}: " + " ".join(f"{i}:{eqns[i].primitive.name}" for i in members)
            for group, members in self.groups.items()
        ]
        for t in self.transfers:
            if isinstance(t, PackedTransfer):
                lines.append(transfer_text(t, names))
                continue
            src = "host" if t.src == HOST else f"mesh{t.src}"
            kind = "batch " if t.as_batch else ""
            lines.append(
                f"transfer {kind}{names.get(t.var, '?')!r} {aval_text(t.var)} {src}->mesh{t.dst} "
                f"before {t.segment.name.lower()}.L{t.level}"
            )
        return "\n".join(lines)


def level_equations(assignment: MeshAssignment) -> OuterLevels:
    """Pass: groups each mesh's equations into levels; places the transfers between them.

    An equation's level is its inputs' highest; a copy arrives one level later; 0 after the region.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from nnx_mpmd.compiler.outer.outer_assign import OuterProblem, assign_meshes
      >>> closed = jax.make_jaxpr(lambda a, b: a + b)(jnp.ones(2), jnp.ones(2))
      >>> problem = OuterProblem(closed.jaxpr, [{0}, {1}], [None], ["a", "b"],
      ...                        jax.devices()[:2], lambda j, q: None)
      >>> print(level_equations(assign_meshes(problem, {}, region_at=1)))
      pre.L1.mesh0: 0:add
      transfer 'b' float32[2] mesh1->mesh0 before pre.L1
    """
    eqns = assignment.jaxpr.eqns
    moves_at: dict[int, list[Move]] = {}
    for move in assignment.moves:
        moves_at.setdefault(move.before, []).append(move)
    level: dict[Any, int] = {}  # ValueOnMesh / BatchOnMesh -> level; absent: 0
    groups: dict[OuterGroup, list[int]] = {}
    transfers: list[OuterTransfer] = []
    for i in range(len(eqns) + 1):
        transfers += [_level_move(move, level) for move in moves_at.get(i, ())]
        if i == len(eqns):
            break
        if i == assignment.region_at:
            level = {}  # the post-region code starts when everything before is done
            continue
        segment = Segment.PRE if i < assignment.region_at else Segment.POST
        inputs = [v for v in eqns[i].invars if not is_literal(v)]
        for q in mesh_order(assignment.run_on[i]):
            lvl = max((level.get(ValueOnMesh(v, q), 0) for v in inputs), default=0)
            groups.setdefault(OuterGroup(segment, lvl, q), []).append(i)
            level.update((ValueOnMesh(out, q), lvl) for out in eqns[i].outvars)
    ordered = {group: tuple(sorted(groups[group])) for group in sorted(groups)}
    return OuterLevels(ordered, tuple(transfers), assignment)


def defer_equations(levels: OuterLevels) -> OuterLevels:
    """Pass: moves each equation to the latest level its readers on its mesh allow.

    Early work costs a program output, a buffer and an unfused kernel per value; transfers,
    level counts and equations with effects stay put.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from nnx_mpmd.compiler.outer.outer_assign import OuterProblem, assign_meshes
      >>> def f(a, b):
      ...     return (a * 2) + jnp.sum(b)  # a * 2 can wait for b's sum
      >>> closed = jax.make_jaxpr(f)(jnp.ones(2), jnp.ones(2))
      >>> problem = OuterProblem(closed.jaxpr, [{0}, {1}], [None], ["a", "b"],
      ...                        jax.devices()[:2], lambda j, q: None)
      >>> levels = level_equations(assign_meshes(problem, {}, region_at=3))
      >>> print(levels)
      pre.L0.mesh0: 0:mul
      pre.L0.mesh1: 1:reduce_sum
      pre.L1.mesh0: 2:add
      transfer 'b' float32[] mesh1->mesh0 before pre.L1
      >>> print(defer_equations(levels))
      pre.L0.mesh1: 1:reduce_sum
      pre.L1.mesh0: 0:mul 2:add
      transfer 'b' float32[] mesh1->mesh0 before pre.L1
    """
    eqns = levels.assignment.jaxpr.eqns
    group_of = {(i, g.mesh): g for g, members in levels.groups.items() for i in members}
    last_level: dict[tuple[Segment, int], int] = {}
    for g in levels.groups:
        key = (g.segment, g.mesh)
        last_level[key] = max(last_level.get(key, 0), g.level)
    readers: dict[ValueOnMesh, list[int]] = {}
    for g, members in levels.groups.items():
        for i in members:
            for v in eqns[i].invars:
                if not is_literal(v):
                    readers.setdefault(ValueOnMesh(v, g.mesh), []).append(i)
    copied_before: dict[ValueOnMesh, int] = {}
    for t in levels.transfers:
        for var in t.vars if isinstance(t, PackedTransfer) else (t.var,):
            if t.src != HOST:
                key = ValueOnMesh(var, t.src)
                copied_before[key] = min(copied_before.get(key, t.level), t.level)
    level: dict[tuple[int, int], int] = {}
    for i, q in sorted(group_of, reverse=True):
        group = group_of[(i, q)]
        latest = last_level[(group.segment, q)]
        if eqns[i].effects:
            latest = group.level
        for out in eqns[i].outvars:
            value = ValueOnMesh(out, q)
            if value in copied_before:
                latest = min(latest, copied_before[value] - 1)
            for j in readers.get(value, ()):
                if group_of[(j, q)].segment == group.segment:
                    latest = min(latest, level[(j, q)])
        level[(i, q)] = max(latest, group.level)
    groups: dict[OuterGroup, list[int]] = {}
    for (i, q), group in group_of.items():
        groups.setdefault(OuterGroup(group.segment, level[(i, q)], q), []).append(i)
    ordered = {g: tuple(sorted(groups[g])) for g in sorted(groups)}
    return OuterLevels(ordered, levels.transfers, levels.assignment)


def _level_move(move: Move, level: dict[Any, int]) -> OuterTransfer:
    if HOST in move.sources:
        src, lvl = HOST, 0
    else:
        src = min(move.sources, key=lambda s: (level.get(ValueOnMesh(move.var, s), 0), s))
        lvl = level.get(ValueOnMesh(move.var, src), 0) + 1
    key = BatchOnMesh if move.as_batch else ValueOnMesh
    level[key(move.var, move.dst)] = lvl
    return OuterTransfer(move.var, src, move.dst, move.segment, lvl, move.as_batch)


@dataclasses.dataclass(frozen=True)
class OuterProgram:
    """Result of `emit_outer_program`.

    Attributes:
      instructions: the step's instructions (the region's spliced in), no frees.
      programs: the outer programs by name (``pre.L0.mesh1``).
      output_slots: per step output, its ``(mesh, slot)`` pairs.
      input_slots: per step input, ``{mesh or HOST: slot}``.
    """

    instructions: tuple[Instruction, ...]
    programs: dict[str, Any]
    output_slots: list[list[tuple[int, int]]]
    input_slots: list[dict[int, int]]


def emit_outer_program(
    problem: OuterProblem, levels: OuterLevels, slots: SlotTable
) -> OuterProgram:
    """Pass: one `Call` per `OuterGroup`, the `Transfer`s, the region in between.

    Per segment and level: transfers, then each mesh's program; state outputs take
    ``problem.out_sharding``; slots go outputs, programs, transfers, inputs.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from nnx_mpmd.compiler.ir import format_instructions
      >>> from nnx_mpmd.compiler.outer.outer_assign import OuterProblem, assign_meshes
      >>> closed = jax.make_jaxpr(lambda a, b: a + b)(jnp.ones(2), jnp.ones(2))
      >>> problem = OuterProblem(closed.jaxpr, [{0}, {1}], [None], ["a", "b"],
      ...                        jax.devices()[:2], lambda j, q: None)
      >>> levels = level_equations(assign_meshes(problem, {}, region_at=1))
      >>> program = emit_outer_program(problem, levels, SlotTable())
      >>> print(format_instructions(program.instructions))
      transfer 3@1 -> 2@0 label='b 1->0' bytes=8
      call 0 pre.L1.mesh0 args=(1,2) outs=(0,) label=pre.L1.mesh0
    """
    assignment = levels.assignment
    outvars = problem.jaxpr.outvars
    output_slots = [
        [(q, slots(ValueOnMesh(v, q))) for q in meshes]
        for v, meshes in zip(outvars, assignment.output_meshes)
    ]
    calls, programs = _emit_calls(problem, levels, slots)
    by_level: dict[tuple[Segment, int], list[OuterTransfer | PackedTransfer]] = {}
    for t in levels.transfers:
        by_level.setdefault((t.segment, t.level), []).append(t)
    calls_at: dict[tuple[Segment, int], list[Call]] = {}  # each level's calls, mesh by mesh
    for g in sorted(calls):
        calls_at.setdefault((g.segment, g.level), []).append(calls[g])
    max_level = max([g.level for g in levels.groups] + [t.level for t in levels.transfers] + [0])
    instructions: list[Instruction] = []
    for segment in Segment:
        for lvl in range(max_level + 1):
            for t in by_level.get((segment, lvl), ()):
                if isinstance(t, PackedTransfer):
                    instructions.append(_packed_transfer(problem, t, slots))
                else:
                    instructions.append(_transfer(problem, t, assignment.names, slots))
            instructions.extend(calls_at.get((segment, lvl), ()))
        if segment is Segment.PRE and assignment.region is not None:
            instructions.extend(assignment.region.instructions)
    input_slots = [
        {q: slots(ValueOnMesh(v, q)) for q in meshes}
        for v, meshes in zip(problem.jaxpr.invars, problem.invar_meshes)
    ]
    return OuterProgram(tuple(instructions), programs, output_slots, input_slots)


def kept_values(problem: OuterProblem, levels: OuterLevels) -> set[ValueOnMesh]:
    """Values read outside their program, by mesh: by a transfer, the region or the outputs.

    A `PackedTransfer`'s values are not (their program returns them packed).
    """
    assignment = levels.assignment
    kept = {ValueOnMesh(t.var, t.src) for t in levels.transfers if isinstance(t, OuterTransfer)}
    if assignment.region is not None:
        region_eqn = problem.jaxpr.eqns[assignment.region_at]
        kept |= {
            ValueOnMesh(v, q) for v in region_eqn.invars for q in assignment.placement.get(v, ())
        }
    for v, meshes in zip(problem.jaxpr.outvars, assignment.output_meshes):
        kept |= {ValueOnMesh(v, q) for q in meshes}
    return kept


def _emit_calls(
    problem: OuterProblem, levels: OuterLevels, slots: SlotTable
) -> tuple[dict[OuterGroup, Call], dict[str, Any]]:
    eqns = problem.jaxpr.eqns
    readers: dict[ValueOnMesh, set[OuterGroup]] = {}
    for group, members in levels.groups.items():
        for i in members:
            for v in eqns[i].invars:
                if not is_literal(v):
                    readers.setdefault(ValueOnMesh(v, group.mesh), set()).add(group)
    kept = kept_values(problem, levels)
    packs = [t for t in levels.transfers if isinstance(t, PackedTransfer)]
    # A packed value, on its destination mesh and on its own: (its pack, offset and
    # shape). Programs on the sending mesh read their own values from the array too,
    # so the update programs of meshes holding equal layers stay twins.
    in_pack: dict[ValueOnMesh, tuple[PackedTransfer, Any]] = {}
    for p in packs:
        for v, at in zip(p.vars, p.layout()):
            in_pack[ValueOnMesh(v, p.dst)] = (p, at)
            in_pack.setdefault(ValueOnMesh(v, p.src), (p, at))
    state_out = {
        ValueOnMesh(v, q): j
        for j, (v, targets) in enumerate(zip(problem.jaxpr.outvars, problem.outvar_targets))
        if targets
        for q in targets
    }
    calls: dict[OuterGroup, Call] = {}
    programs: dict[str, Any] = {}
    for group, members in levels.groups.items():
        q = group.mesh
        group_eqns = [eqns[i] for i in members]
        outs = [
            o
            for e in group_eqns
            for o in e.outvars
            if ValueOnMesh(o, q) in kept
            or (
                ValueOnMesh(o, q) not in in_pack
                and (readers.get(ValueOnMesh(o, q), set()) - {group})
            )
        ]
        # One array per set of values, however many meshes it is sent to.
        sent = list({p.on(q): p for p in packs if p.source == group}.values())
        extra = list(dict.fromkeys(v for p in sent for v in p.vars if v not in outs))
        sub, free = make_subprogram(group_eqns, outs + extra)
        shardings = [
            problem.out_sharding(state_out[ValueOnMesh(o, q)], q)
            if ValueOnMesh(o, q) in state_out
            else None
            for o in outs
        ]
        own, read_packs, unpack = _packed_arguments(free, q, in_pack)
        position = {v: j for j, v in enumerate(outs + extra)}
        pack_out = [tuple(position[v] for v in p.vars) for p in sent]
        key = group.program_key
        label = str(key)
        pinned = problem.submeshes[q] if not free else None
        run = sub
        if read_packs or sent:
            run = packed_function(sub, unpack, pack_out, len(outs))
        fn = _group_function(run, shardings + [None] * len(sent), pinned, label)
        programs[label] = fn
        args = tuple(slots(ValueOnMesh(v, q)) for v in own)
        args += tuple(slots(key) for key in read_packs)
        results = tuple(slots(ValueOnMesh(o, q)) for o in outs)
        results += tuple(slots(p.on(q)) for p in sent)
        structure = _structure(sub, shardings, pinned)
        if structure is not None and (read_packs or sent):
            structure = (*structure, tuple(unpack), tuple(pack_out), len(outs))
        aliases = input_aliases(own, outs, problem.jaxpr.invars)
        calls[group] = Call(q, key, fn, args, results, label, structure=structure, aliases=aliases)
    return calls, programs


def input_aliases(
    own: Sequence[Any], outs: Sequence[Any], inputs: Sequence[Any]
) -> tuple[int, ...]:
    """The positions of ``own`` that are step inputs with a result of their shape and dtype.

    Each result is matched once, in order, as XLA pairs donated buffers.

    Example:
      >>> from types import SimpleNamespace as V
      >>> import numpy as np
      >>> a = lambda shape: V(aval=V(shape=shape, dtype=np.float32))
      >>> p, g, step, new_p = a((4,)), a((4,)), a(()), a((4,))
      >>> input_aliases([p, g, step], [new_p], inputs=[p, step])
      (0,)
    """
    step_inputs = {id(v) for v in inputs}
    free = collections.Counter((tuple(o.aval.shape), o.aval.dtype) for o in outs)
    found = []
    for n, v in enumerate(own):
        key = (tuple(v.aval.shape), v.aval.dtype)
        if id(v) in step_inputs and free[key] > 0:
            free[key] -= 1
            found.append(n)
    return tuple(found)


def _packed_arguments(
    free: Sequence[Any], q: int, in_pack: Mapping[ValueOnMesh, tuple[PackedTransfer, Any]]
) -> tuple[list[Any], list[Any], list[tuple[int, Any]]]:
    """A program's arguments: its free values' own slots, then each packed array read.

    Returns the free values with their own argument, the packed arrays' slot
    keys, and per free value ``(argument, None)`` or ``(argument, (offset,
    shape))`` (`outer_packing.packed_function`'s ``unpack``).
    """
    own = [v for v in free if ValueOnMesh(v, q) not in in_pack]
    read_packs = list({in_pack[ValueOnMesh(v, q)][0].on(q): None for v in free if v not in own})
    unpack = [
        (own.index(v), None)
        if v in own
        else (
            len(own) + read_packs.index(in_pack[ValueOnMesh(v, q)][0].on(q)),
            in_pack[ValueOnMesh(v, q)][1],
        )
        for v in free
    ]
    return own, read_packs, unpack


def _structure(sub: Any, shardings: list[Any], pinned: Any) -> Any:
    """`Call.structure` of a group's program: its equations' key, output shardings, pin."""
    key = structure_key(sub.eqns, sub.invars, sub.outvars)
    if key is None:
        return None
    placed = []
    for s in shardings:
        if s is None:
            placed.append(None)
        elif isinstance(s, jax.sharding.NamedSharding):
            placed.append((s.spec, s.memory_kind, mesh_shape_key(s.mesh)))
        else:
            return None  # a sharding tied to its devices: no equal-shaped twin
    return (key, tuple(placed), None if pinned is None else mesh_shape_key(pinned))


def _transfer(
    problem: OuterProblem, t: OuterTransfer, names: Mapping[Any, str], slots: SlotTable
) -> Transfer:
    dst_key = BatchOnMesh(t.var, t.dst) if t.as_batch else ValueOnMesh(t.var, t.dst)
    batch_spec = problem.batch_spec
    return Transfer(
        slots(ValueOnMesh(t.var, t.src)),
        slots(dst_key),
        t.dst,
        f"{names.get(t.var, '?')} {'host' if t.src == HOST else t.src}->{t.dst}",
        src_mesh=t.src,
        nbytes=var_bytes(t.var),
        reshape_microbatches=problem.num_microbatches if t.as_batch else None,
        spec=batch_spec(t.var.aval) if t.as_batch and batch_spec else None,
    )


def _packed_transfer(problem: OuterProblem, pack: PackedTransfer, slots: SlotTable) -> Transfer:
    # The array's type is known here, so ahead-of-time compilation need not wait
    # for the sender's program. The spec is the one the sender's replicated output
    # has (typed ``P(None)`` on Explicit axes, ``P()`` on Auto ones), so the move
    # keeps its layout and takes the batched copy.
    axis_types = getattr(problem.submeshes[pack.src], "axis_types", ())
    explicit = any(t == jax.sharding.AxisType.Explicit for t in axis_types)
    aval = pack.vars[0].aval
    return Transfer(
        slots(pack.on(pack.src)),
        slots(pack.on(pack.dst)),
        pack.dst,
        f"{len(pack.vars)} packed values {pack.src}->{pack.dst}",
        src_mesh=pack.src,
        nbytes=pack.nbytes,
        spec=jax.sharding.PartitionSpec(None) if explicit else jax.sharding.PartitionSpec(),
        value_type=((pack.size,), str(aval.dtype), bool(aval.weak_type)),
    )


def report_transfers(
    problem: OuterProblem, levels: OuterLevels, *, stacklevel: int = 2
) -> list[CrossMeshTransfer]:
    """Pass: the transfers between meshes outside the region, in order; warns about large ones.

    Host transfers and batches bound for the region are left out; each one above
    ``problem.transfer_warning_bytes`` warns `MpmdTransferWarning` once.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from nnx_mpmd.compiler.outer.outer_assign import OuterProblem, assign_meshes
      >>> closed = jax.make_jaxpr(lambda a, b: a + b)(jnp.ones(2), jnp.ones(2))
      >>> problem = OuterProblem(closed.jaxpr, [{0}, {1}], [None], ["a", "b"],
      ...                        jax.devices()[:2], lambda j, q: None)
      >>> report_transfers(problem, level_equations(assign_meshes(problem, {}, region_at=1)))
      [CrossMeshTransfer(what='b', src=1, dst=0, nbytes=8)]
    """
    names = levels.assignment.names
    report = [
        CrossMeshTransfer(t.text(names), t.src, t.dst, t.nbytes)
        if isinstance(t, PackedTransfer)
        else CrossMeshTransfer(names.get(t.var, str(t.var)), t.src, t.dst, var_bytes(t.var))
        for t in levels.transfers
        if isinstance(t, PackedTransfer) or (t.src != HOST and not t.as_batch)
    ]
    for t in report:
        if t.nbytes > problem.transfer_warning_bytes:
            warnings.warn(
                f"{t.what} ({t.nbytes / 2**20:.1f} MiB) moves from mesh {t.src} to mesh "
                f"{t.dst} outside the pipelined region on every step. Keep the computation that "
                "uses it on the mesh of its stage, or raise transfer_warning_bytes if this is "
                "intended.",
                MpmdTransferWarning,
                stacklevel=stacklevel + 1,
            )
    return report


def _spec_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def constrain_to(x: Any, sharding: Any) -> Any:
    """``x`` with ``sharding`` inside a traced program, on Explicit and Auto axes.

    ``reshard`` for Explicit axes (part of the type), ``with_sharding_constraint`` for Auto ones.

    Example:
      >>> import jax
      >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,),
      ...                      devices=jax.devices()[:2])
      >>> x = jax.device_put(jax.numpy.ones(4), NamedSharding(mesh, P()))
      >>> f = jax.jit(lambda x: constrain_to(x * 2, NamedSharding(mesh, P("data"))))
      >>> f(x).sharding.spec
      P('data',)
    """
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return jax.lax.with_sharding_constraint(x, sharding)
    mesh, spec = sharding.mesh, sharding.spec
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    explicit = {name for name, kind in types.items() if kind == jax.sharding.AxisType.Explicit}
    if not explicit:
        return jax.lax.with_sharding_constraint(x, sharding)

    def keep(names: set[str]) -> Any:
        entries = []
        for entry in spec:
            kept = tuple(a for a in _spec_axes(entry) if a in names)
            entries.append(kept[0] if len(kept) == 1 else (kept or None))
        return jax.sharding.PartitionSpec(*entries)

    x = jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, keep(explicit)))
    auto = set(types) - explicit
    if any(a in auto for entry in spec for a in _spec_axes(entry)):
        x = jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, keep(auto)))
    return x


def _group_function(
    sub: Callable[..., Sequence[Any]], shardings: list[Any], submesh: Any, label: str
) -> Any:
    constrained = [i for i, s in enumerate(shardings) if s is not None]

    def run(*args: Any) -> tuple[Any, ...]:
        outs = list(sub(*args))
        for i in constrained:
            outs[i] = constrain_to(outs[i], shardings[i])
        return tuple(outs)

    if submesh is not None:  # no inputs: pin the outputs to the mesh
        replicated = jax.sharding.NamedSharding(submesh, jax.sharding.PartitionSpec())
        return named_jit(run, label, out_shardings=tuple(s or replicated for s in shardings))
    return named_jit(run, label)
