"""Transfer insertion: move each value a stage task reads to the task's mesh.

After `schedule_lowering`, every `Call` reads `RegionValue` keys on its own
mesh. A value produced on another mesh (``value.on(p)`` written by a call on
mesh p) must be copied: `insert_transfers` adds one `Transfer` per value and
destination mesh, right after the instruction that produces it, so the copy
overlaps with whatever the producing mesh runs next.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from nnx_mpmd.compiler.ir import Call, Instruction, Transfer
from nnx_mpmd.compiler.jaxpr_utils import var_bytes
from nnx_mpmd.compiler.region.region_values import RegionContext, RegionValue, region_values_in
from nnx_mpmd.errors import CompileError

__all__ = ["insert_transfers"]

# Values that are never produced by an instruction of the region: the outer step
# provides region inputs, and microbatch indices are constants on every mesh.
_GIVEN = frozenset({"input", "idx"})

# Values that move between stages, and the label of their transfers.
_MOVED = {"act": "act", "ct": "grad"}


def _writes(ins: Instruction) -> list[RegionValue]:
    if isinstance(ins, Call):
        return region_values_in(ins.outs)
    if isinstance(ins, Transfer):
        return region_values_in(ins.dst)
    return []


def _producers(program: Sequence[Instruction]) -> dict[RegionValue, tuple[int, RegionValue]]:
    """Each value (without its mesh) -> (position, key) of its first producer."""
    producers: dict[RegionValue, tuple[int, RegionValue]] = {}
    for n, ins in enumerate(program):
        for value in _writes(ins):
            producers.setdefault(value.on(None), (n, value))
    return producers


def _stage_of(call: Instruction, value: RegionValue, ctx: RegionContext, making: bool) -> int:
    """The stage of ``call`` that makes (or reads) ``value``."""
    task = getattr(call, "task", None)
    if task is None:
        raise CompileError(
            f"{value!r} moves between meshes for {getattr(call, 'label', call)!r}, which is not "
            "a stage task: only stage tasks exchange activations and cotangents."
        )
    if not isinstance(task, tuple):
        return task.stage
    # Overlapped tasks: an activation is made by its producer stage and read by
    # a consumer among the members; a cotangent ("ct", (value, sender)) is made
    # by its sender and read by the value's producer.
    var = ctx.boundary_vars[value.ident[0]]
    if value.kind == "ct":
        return value.ident[1] if making else ctx.plan.producer[var]
    if making:
        return ctx.plan.producer[var]
    return min({t.stage for t in task} & set(ctx.plan.consumers[var]))


def _transfer(
    src: RegionValue, dst: RegionValue, producer: Call, reader: Call, ctx: RegionContext
) -> Transfer:
    if src.kind not in _MOVED:
        raise CompileError(
            f"{reader.label} on mesh {reader.mesh} reads {src!r}, which {producer.label} makes "
            f"on mesh {src.mesh}: only activations and cotangents move between meshes inside "
            "the schedule. This is a bug in the region's lowering; please report it."
        )
    k, c = _stage_of(producer, src, ctx, True), _stage_of(reader, dst, ctx, False)
    label = f"{_MOVED[src.kind]} s{k}->s{c} mb{src.microbatch}"
    nbytes = var_bytes(ctx.boundary_vars[src.ident[0]])
    # The region's slots are RegionValues until region_plan numbers them.
    return Transfer(
        src,  # pyright: ignore[reportArgumentType]
        dst,  # pyright: ignore[reportArgumentType]
        cast(int, dst.mesh),
        label,
        src_mesh=cast(int, src.mesh),
        nbytes=nbytes,
        per_microbatch=True,
    )


def _missing_reads(
    program: Sequence[Instruction],
) -> dict[RegionValue, dict[RegionValue, Call]]:
    """Values read on a mesh where nothing writes them: source -> {destination: first reader}.

    Sources are in order of their first read, destinations per source too.
    """
    written = {value for ins in program for value in _writes(ins)}
    producers = _producers(program)
    missing: dict[RegionValue, dict[RegionValue, Call]] = {}
    for n, ins in enumerate(program):
        if not isinstance(ins, Call):
            continue
        for value in region_values_in(ins.args):
            if value in written or value.kind in _GIVEN:
                continue
            position, source = producers.get(value.on(None), (None, None))
            if source is None or position is None or position >= n:
                raise CompileError(
                    f"{ins.label} on mesh {ins.mesh} reads {value!r}, which no earlier "
                    "instruction produces on any mesh: the task order is broken (check the "
                    "schedule with mp.schedules.validate)."
                )
            missing.setdefault(source, {}).setdefault(value, ins)
    return missing


def insert_transfers(program: Sequence[Instruction], ctx: RegionContext) -> list[Instruction]:
    """Adds a `Transfer` after the producer of every value a call reads on another mesh.

    Labels: ``act sK->sC mbI``, ``grad sK->sP mbI``; a value already copied is not copied again.

    Raises:
      CompileError: a value is read before it is produced, or a value other than an
        activation or cotangent would cross meshes.
    """
    missing = _missing_reads(program)
    result: list[Instruction] = []
    for ins in program:
        result.append(ins)
        for source in _writes(ins):
            for dst, reader in missing.pop(source, {}).items():
                result.append(_transfer(source, dst, ins, reader, ctx))  # type: ignore[arg-type]
    return result
