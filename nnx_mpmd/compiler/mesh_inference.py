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
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

from nnx_mpmd.compiler.instructions import Call, Instruction, ProgramKey, SlotTable, Transfer
from nnx_mpmd.compiler.jaxpr_utils import is_literal, make_subprogram, named_jit, var_bytes
from nnx_mpmd.compiler.region import region_p
from nnx_mpmd.errors import CompileError

__all__ = ["HOST", "CrossMeshTransfer", "MpmdTransferWarning", "OuterPlan", "plan_outer"]

HOST = -1  # a value that is not on any submesh yet (a NumPy array, or on the default device)


class MpmdTransferWarning(UserWarning):
    """A large value crosses meshes outside the pipelined region every step."""


@dataclasses.dataclass(frozen=True)
class CrossMeshTransfer:
    """A transfer outside the region, as reported by ``lower(...).transfers``."""

    what: str
    src: int
    dst: int
    nbytes: int


@dataclasses.dataclass
class OuterPlan:
    instructions: list[Instruction]
    output_slots: list[list[tuple[int, int]]]  # per outvar: [(mesh, slot)]
    input_slots: list[dict[int, int]]  # per invar: {mesh or HOST: slot}
    transfers: list[CrossMeshTransfer]
    programs: dict[str, Any]


def plan_outer(
    jaxpr: Any,
    invar_meshes: Sequence[frozenset[int]],
    outvar_targets: Sequence[frozenset[int] | None],
    invar_names: Sequence[str],
    slots: SlotTable,
    submeshes: Sequence[Any],
    out_sharding: Callable[[int, int], Any],
    region_builder: Callable[..., tuple[list[Instruction], list[list[tuple[Any, Any]]]]] | None,
    region_needs: Callable[[int], frozenset[int]] | None,
    region_batch_inputs: frozenset[int] = frozenset(),
    num_microbatches: int = 1,
    batch_spec: Callable[[Any], Any] | None = None,
    transfer_warning_bytes: int = 1 << 20,
) -> OuterPlan:
    """Assigns the step's equations to meshes and emits their instructions.

    Args:
      jaxpr: the step's jaxpr (constvars already turned into invars).
      invar_meshes: where each input lives (``{HOST}`` for unplaced values).
      outvar_targets: for each output, the meshes it must end up on (state
        outputs stay where their input lives), or None for "anywhere".
      invar_names: a readable name per input (for transfer reports).
      slots: the step's slot allocator.
      submeshes: the jax Mesh of each mesh id.
      out_sharding: ``(outvar index, mesh) -> Sharding`` for state outputs.
      region_builder: builds the region's instructions given
        ``input_slot(r, mesh)`` and ``home(r)``.
      region_needs: ``region input index -> meshes`` that read it.
      region_batch_inputs: region input indices that are batches.
      num_microbatches: m, to reshape batches on their way to the region.
      batch_spec: ``aval -> PartitionSpec`` of a batch on
        a submesh (its leading microbatch axis excluded).
      transfer_warning_bytes: report transfers outside the region above this.

    Returns:
      The `OuterPlan`.
    """
    eqns = jaxpr.eqns
    region_positions = [i for i, e in enumerate(eqns) if e.primitive is region_p]
    if len(region_positions) > 1:
        raise CompileError(
            "the step calls mp.value_and_grad (or runs the pipelined model) "
            f"{len(region_positions)} times; one pipelined region per step is supported. "
            "Compute everything from a single call."
        )
    region_at = region_positions[0] if region_positions else len(eqns)

    # -- what each value is needed for (backward) ------------------------------
    need: dict[Any, set[int]] = {}
    for v, targets in zip(jaxpr.outvars, outvar_targets):
        if not is_literal(v) and targets:
            need.setdefault(v, set()).update(targets)
    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        if i == region_at:
            for r, v in enumerate(eqn.invars):
                if not is_literal(v):
                    need.setdefault(v, set()).update(region_needs(r))
            continue
        wanted: set[int] = set()
        for out in eqn.outvars:
            wanted |= need.get(out, set())
        for v in eqn.invars:
            if not is_literal(v):
                need.setdefault(v, set()).update(wanted)

    # -- decide where things run (forward) --------------------------------------
    avail: dict[Any, set[int]] = {}
    level: dict[tuple[Any, int], int] = {}
    origin: dict[Any, str] = {}
    for v, meshes, name in zip(jaxpr.invars, invar_meshes, invar_names):
        avail[v] = set(meshes)
        origin[v] = name
        for q in meshes:
            level[(v, q)] = 0
    transfers: list[tuple[int, int, Any, int, int, bool]] = []  # seg, lvl, var, src, dst, batch
    report: list[CrossMeshTransfer] = []
    run_on: dict[int, set[int]] = {}
    eqn_level: dict[tuple[int, int], int] = {}

    def segment_of(i: int) -> int:
        return 0 if i < region_at else 1

    def ensure(v: Any, q: int, segment: int, as_batch: bool = False) -> None:
        key_avail = avail[v] if not as_batch else avail.setdefault(("batch", v), set())
        if q in key_avail:
            return
        sources = avail[v]
        src = HOST if HOST in sources else min(sources, key=lambda s: (level.get((v, s), 0), s))
        src_level = 0 if src == HOST else level[(v, src)]
        lvl = src_level + (0 if src == HOST else 1)
        transfers.append((segment, lvl, v, src, q, as_batch))
        key_avail.add(q)
        level[(("batch", v) if as_batch else v, q)] = lvl
        nbytes = var_bytes(v)
        if src != HOST and not as_batch:
            report.append(CrossMeshTransfer(origin.get(v, str(v)), src, q, nbytes))

    region_instructions: list[Instruction] = []

    def process_region() -> None:
        nonlocal region_instructions
        eqn = eqns[region_at]
        for r, v in enumerate(eqn.invars):
            if is_literal(v):
                raise CompileError("a literal reached the region's inputs; this is a bug.")
            for q in sorted(region_needs(r)):
                ensure(v, q, 0, as_batch=r in region_batch_inputs)

        def input_slot(r: int, q: int) -> int:
            v = eqn.invars[r]
            return slots((("batch", v) if r in region_batch_inputs else v, q))

        def home(r: int) -> int:
            meshes = avail[eqn.invars[r]] - {HOST}
            if not meshes:
                raise CompileError(
                    f"region input {r} is not on any mesh; place the model with mp.place."
                )
            return min(meshes)

        region_instructions, region_outputs = region_builder(input_slot, home)
        for out, locations in zip(eqn.outvars, region_outputs):
            meshes: set[int] = set()
            for q, slot in locations:
                if q == "input":
                    src_var = eqn.invars[slot]
                    for qq in avail[src_var]:
                        slots.index[(out, qq)] = slots((src_var, qq))
                        meshes.add(qq)
                elif q == "literal":
                    raise CompileError("literal region outputs are not supported yet.")
                else:
                    slots.index[(out, q)] = slot
                    meshes.add(q)
            avail[out] = meshes
            origin[out] = "region output"
            for q in meshes:
                level[(out, q)] = 0
        # Post-region levels restart at 0: everything before the region is done.
        for (v, q), _ in list(level.items()):
            if not isinstance(v, tuple) and v not in eqn.outvars:
                level[(v, q)] = 0

    for i, eqn in enumerate(eqns):
        segment = segment_of(i)
        if i == region_at:
            process_region()
            continue
        inputs = [v for v in eqn.invars if not is_literal(v)]
        for v in inputs:
            origin.setdefault(v, "?")
        wanted: set[int] = set()
        for out in eqn.outvars:
            wanted |= need.get(out, set())
        if not inputs:
            run = wanted or {0}
        else:
            candidates = set().union(*(avail[v] for v in inputs)) | wanted
            candidates.discard(HOST)
            if not candidates:
                candidates = {0}

            def missing(q: int, inputs: list[Any] = inputs) -> int:
                return sum(
                    var_bytes(v) for v in inputs if q not in avail[v] and HOST not in avail[v]
                )

            out_bytes = sum(var_bytes(o) for o in eqn.outvars)
            home = min(candidates, key=lambda q: (missing(q), q not in wanted, q))
            cost_home = missing(home) + out_bytes * len(wanted - {home})
            cost_everywhere = sum(missing(q) for q in wanted)
            run = set(wanted) if wanted and cost_everywhere <= cost_home else {home}
        run_on[i] = run
        biggest = max(inputs, key=var_bytes, default=None)
        for q in run:
            for v in inputs:
                ensure(v, q, segment)
            lvl = max((level[(v, q)] for v in inputs), default=0)
            eqn_level[(i, q)] = lvl
            for out in eqn.outvars:
                level[(out, q)] = lvl
        for out in eqn.outvars:
            avail[out] = set(run)
            origin[out] = origin.get(biggest, "?") if biggest is not None else eqn.primitive.name

    # State outputs go home.
    output_slots: list[list[tuple[int, int]]] = []
    for j, (v, targets) in enumerate(zip(jaxpr.outvars, outvar_targets)):
        if is_literal(v):
            raise CompileError(
                f"step output {j} is a constant; return arrays computed by the step."
            )
        if targets:
            for q in targets:
                ensure(v, q, segment_of(len(eqns)))
            output_slots.append([(q, slots((v, q))) for q in sorted(targets)])
        else:
            output_slots.append([(q, slots((v, q))) for q in sorted(avail[v])])

    # -- programs per (segment, level, mesh) ----------------------------------------
    groups: dict[tuple[int, int, int], list[int]] = {}
    for (i, q), lvl in eqn_level.items():
        groups.setdefault((segment_of(i), lvl, q), []).append(i)
    readers: dict[Any, set[tuple[int, int, int]]] = {}
    for key, members in groups.items():
        for i in members:
            for v in eqns[i].invars:
                if not is_literal(v):
                    readers.setdefault((v, key[2]), set()).add(key)
    state_out = {
        (v, q): j for j, (v, t) in enumerate(zip(jaxpr.outvars, outvar_targets)) if t for q in t
    }
    transfer_src = {(v, src) for (_, _, v, src, _, _) in transfers}
    region_reads = set()
    if region_at < len(eqns):
        region_reads = {(v, q) for v in eqns[region_at].invars for q in avail.get(v, ())}
    final_reads = {(v, q) for locs, v in zip(output_slots, jaxpr.outvars) for q, _ in locs}

    programs: dict[str, Any] = {}
    calls: dict[tuple[int, int, int], Call] = {}
    for key in sorted(groups):
        segment, lvl, q = key
        members = sorted(groups[key])
        group_eqns = [eqns[i] for i in members]
        produced = [o for e in group_eqns for o in e.outvars]
        outs = [
            o
            for o in produced
            if (readers.get((o, q), set()) - {key})
            or (o, q) in transfer_src
            or (o, q) in region_reads
            or (o, q) in final_reads
        ]
        sub, free = make_subprogram(group_eqns, outs)
        shardings = [
            out_sharding(state_out[(o, q)], q) if (o, q) in state_out else None for o in outs
        ]
        program_key = ProgramKey("pre" if segment == 0 else "post", index=lvl, mesh=q)
        label = str(program_key)
        fn = _group_function(sub, shardings, submeshes[q] if not free else None, label)
        programs[label] = fn
        args, results = tuple(slots((v, q)) for v in free), tuple(slots((o, q)) for o in outs)
        calls[key] = Call(q, program_key, fn, args, results, label)

    instructions: list[Instruction] = []
    max_level = max([k[1] for k in groups] + [t[1] for t in transfers] + [0])
    for segment in (0, 1):
        for lvl in range(max_level + 1):
            for seg, t_lvl, v, src, dst, as_batch in transfers:
                if seg == segment and t_lvl == lvl:
                    key = ("batch", v) if as_batch else v
                    instructions.append(
                        Transfer(
                            slots((v, src)),
                            slots((key, dst)),
                            dst,
                            f"{origin.get(v, '?')} {'host' if src == HOST else src}->{dst}",
                            src_mesh=src,
                            nbytes=var_bytes(v),
                            reshape_microbatches=num_microbatches if as_batch else None,
                            spec=batch_spec(v.aval) if as_batch and batch_spec else None,
                        )
                    )
            for q in range(len(submeshes)):
                call = calls.get((segment, lvl, q))
                if call is not None:
                    instructions.append(call)
        if segment == 0:
            instructions.extend(region_instructions)

    big = [t for t in report if t.nbytes > transfer_warning_bytes]
    for t in big:
        warnings.warn(
            f"{t.what} ({t.nbytes / 2**20:.1f} MiB) moves from mesh {t.src} to mesh {t.dst} "
            "outside the pipelined region on every step. Keep the computation that uses it on "
            "the mesh of its stage, or raise transfer_warning_bytes if this is intended.",
            MpmdTransferWarning,
            stacklevel=4,
        )
    input_slots = [
        {q: slots((v, q)) for q in meshes} for v, meshes in zip(jaxpr.invars, invar_meshes)
    ]
    return OuterPlan(instructions, output_slots, input_slots, report, programs)


def _spec_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def constrain_to(x: Any, sharding: Any) -> Any:
    """``x`` with ``sharding`` inside a traced program, on Explicit and Auto axes.

    Explicit axes are part of the value's type, so they are set with
    ``jax.sharding.reshard``; Auto axes take a ``with_sharding_constraint``
    (which JAX allows only on Auto axes). A spec over both kinds does both.

    Args:
      x: a traced value.
      sharding: a ``NamedSharding`` on one submesh.

    Returns:
      ``x`` resharded / constrained to ``sharding``.

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


def _group_function(sub: Any, shardings: list[Any], submesh: Any, label: str) -> Any:
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
