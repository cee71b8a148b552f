"""Cutting a region's body jaxpr into per-stage sub-programs.

Equations between a stage's ``enter`` and ``exit`` markers belong to that
stage. Glue code outside any `Stage` goes by dataflow: to the latest stage that
produces one of its inputs, or, if it depends only on region inputs (the batch,
parameters, closed-over values), to the earliest stage that consumes its result.
Values that cross from one stage to a later one are the stage *boundary*
values; the compiler transfers them between meshes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax.extend import core as jcore

from nnx_mpmd.compiler.jaxpr_utils import SubProgram, is_literal, make_subprogram
from nnx_mpmd.compiler.region import RegionInfo
from nnx_mpmd.errors import PartitionError
from nnx_mpmd.frontend.markers import stage_marker_p

__all__ = ["OutputSource", "StagePlan", "StageSlice", "cut_stages"]


@dataclasses.dataclass
class StageSlice:
    """One stage of the region: its equations as a program and its interface.

    ``program`` takes ``[*region inputs used, *boundary_in]`` (in the orders of
    ``region_inputs`` and ``boundary_in``) and returns ``boundary_out``.
    """

    stage: int
    program: SubProgram
    region_inputs: list[int]  # indices into the body's invars
    boundary_in: list[Any]  # vars produced by earlier stages
    boundary_out: list[Any]  # vars produced here and used later or returned
    remat: bool
    policy: Any

    def is_differentiable(self, var: Any) -> bool:
        return bool(jnp.issubdtype(var.aval.dtype, jnp.inexact))


@dataclasses.dataclass(frozen=True)
class OutputSource:
    """Where a region output comes from: a stage, a region input, or a literal."""

    kind: str  # "stage" | "input" | "literal"
    stage: int = -1
    var: Any = None
    input_index: int = -1
    value: Any = None


@dataclasses.dataclass
class StagePlan:
    """The region cut into stages."""

    info: RegionInfo
    stages: list[StageSlice]
    producer: dict[Any, int]  # boundary var -> producing stage
    consumers: dict[Any, list[int]]  # boundary var -> consuming later stages
    outputs: list[OutputSource]  # one per body outvar
    input_stages: dict[int, list[int]]  # body invar index -> stages that read it

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def loss_stage(self) -> int:
        return self.outputs[0].stage


def _input_kind(info: RegionInfo, index: int) -> tuple[str, int]:
    bounds = [
        ("closure", info.n_closure),
        ("diff", info.n_diff),
        ("other", info.n_other),
        ("batch", info.n_batch),
    ]
    for kind, n in bounds:
        if index < n:
            return kind, index
        index -= n
    raise IndexError(index)


# Higher-order primitives that can hide Stage calls from the cut, with the user-level
# transforms that emit them (for error messages).
_TRANSFORM_NAMES = {
    "checkpoint": "jax.checkpoint / nnx.remat",
    "remat": "jax.checkpoint / nnx.remat",
    "remat2": "jax.checkpoint / nnx.remat",
    "jit": "jax.jit / nnx.jit",
    "pjit": "jax.jit / nnx.jit",
    "closed_call": "a closed call",
    "scan": "jax.lax.scan / nnx.scan",
    "while": "jax.lax.while_loop / jax.lax.fori_loop",
    "cond": "jax.lax.cond / jax.lax.switch / nnx.cond",
    "custom_jvp_call": "jax.custom_jvp",
    "custom_vjp_call": "jax.custom_vjp",
    "custom_vjp_call_jaxpr": "jax.custom_vjp",
    "shard_map": "jax.shard_map",
}


def _nested_stages(jaxpr: Any) -> list[int]:
    """Stage numbers of the markers anywhere inside ``jaxpr`` (any depth)."""
    found: list[int] = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is stage_marker_p:
            found.append(eqn.params["info"].stage)
        for sub in jcore.jaxprs_in_params(eqn.params):
            found.extend(_nested_stages(sub))
    return found


def _check_no_hidden_stages(jaxpr: Any) -> None:
    """Raises if a Stage call sits inside a higher-order primitive of the region body.

    The cut only sees markers at the top level of the body: a Stage called under
    ``jax.checkpoint``, ``jax.jit``, ``scan`` and the like would be invisible to it
    (the whole call would land on one stage, or the region would seem to call no
    Stage at all).
    """
    for eqn in jaxpr.eqns:
        hidden = sorted(
            {s for sub in jcore.jaxprs_in_params(eqn.params) for s in _nested_stages(sub)}
        )
        if not hidden:
            continue
        name = eqn.primitive.name
        transform = _TRANSFORM_NAMES.get(name, f"a transform that emits {name!r}")
        raise PartitionError(
            f"Stage call(s) {hidden} run inside {transform} (primitive {name!r}) in the loss "
            "function given to mp.value_and_grad (or in a forward-only step): mp.jit cuts the "
            "pipeline only at Stage calls made directly, so it cannot split that call into "
            "stages. Call the Stage modules outside that transform; to recompute activations "
            "use mp.Stage(module, stage=k, remat=True), and put other transforms (jit, scan, "
            "cond, custom_vjp) inside a Stage's body, around the layers of one stage."
        )


def cut_stages(info: RegionInfo) -> StagePlan:
    """Cuts ``info.body`` at its stage markers.

    Args:
      info: the traced region.

    Returns:
      The `StagePlan`.

    Raises:
      PartitionError: no stage was called, stages are missing (gaps), stages
        nest or run out of order, a Stage call is hidden inside a higher-order
        primitive (jax.checkpoint, jax.jit, scan...), or the loss is not computed
        by the last stage.
    """
    jaxpr = info.body
    _check_no_hidden_stages(jaxpr)
    eqns = jaxpr.eqns
    substitute: dict[Any, Any] = {}

    def resolve(v: Any) -> Any:
        while not is_literal(v) and v in substitute:
            v = substitute[v]
        return v

    stage_of: list[int | None] = [None] * len(eqns)
    is_marker = [False] * len(eqns)
    remat: dict[int, tuple[bool, Any]] = {}
    current: int | None = None
    for i, eqn in enumerate(eqns):
        if eqn.primitive is stage_marker_p:
            is_marker[i] = True
            marker = eqn.params["info"]
            for out, inp in zip(eqn.outvars, eqn.invars, strict=True):
                substitute[out] = inp
            if marker.remat:
                remat[marker.stage] = (True, marker.policy)
            current = marker.stage if marker.boundary == "enter" else None
        elif current is not None:
            stage_of[i] = current
    marked = sorted({eqns[i].params["info"].stage for i in range(len(eqns)) if is_marker[i]})
    if not marked:
        raise PartitionError(
            "the loss function called no Stage: nothing to pipeline. Wrap the model's layers "
            "in mp.Stage(...) or annotate it with mp.assign_stages(model, {...})."
        )
    num_stages = marked[-1] + 1
    missing = sorted(set(range(num_stages)) - set(marked))
    if missing:
        raise PartitionError(
            f"stages {missing} are never called, but stage {num_stages - 1} is: stage numbers "
            f"must be 0..{num_stages - 1} without gaps. Renumber the Stage wrappers."
        )

    producer: dict[Any, int] = {}
    for i, eqn in enumerate(eqns):
        if is_marker[i]:
            continue
        if stage_of[i] is None:
            inputs = [resolve(v) for v in eqn.invars if not is_literal(v)]
            known = [producer[v] for v in inputs if not is_literal(v) and v in producer]
            if known:
                stage_of[i] = max(known)
        if stage_of[i] is not None:
            for out in eqn.outvars:
                producer[out] = stage_of[i]

    first_use: dict[Any, int] = {}
    for out in jaxpr.outvars:
        if not is_literal(out):
            first_use[resolve(out)] = num_stages - 1
    for i in reversed(range(len(eqns))):
        if is_marker[i]:
            continue
        eqn = eqns[i]
        if stage_of[i] is None:
            uses = [first_use[o] for o in eqn.outvars if o in first_use]
            if not uses:
                continue  # dead code
            stage_of[i] = min(uses)
            for out in eqn.outvars:
                producer[out] = stage_of[i]
        for v in eqn.invars:
            v = resolve(v)
            if not is_literal(v):
                first_use[v] = min(first_use.get(v, stage_of[i]), stage_of[i])

    invar_index = {v: i for i, v in enumerate(jaxpr.invars)}
    consumers: dict[Any, list[int]] = {}
    input_stages: dict[int, list[int]] = {}
    per_stage: list[list[Any]] = [[] for _ in range(num_stages)]
    for i, eqn in enumerate(eqns):
        stage = stage_of[i]
        if is_marker[i] or stage is None:
            continue
        per_stage[stage].append(eqn)
        for v in eqn.invars:
            v = resolve(v)
            if is_literal(v):
                continue
            if v in invar_index:
                users = input_stages.setdefault(invar_index[v], [])
                if stage not in users:
                    users.append(stage)
            elif producer[v] != stage:
                if producer[v] > stage:
                    raise PartitionError(
                        f"stage {stage} uses a value computed by stage {producer[v]} "
                        f"({eqn.primitive.name} reads it): data must flow from lower to higher "
                        "stage numbers. Call the stages in increasing order or renumber them."
                    )
                users = consumers.setdefault(v, [])
                if stage not in users:
                    users.append(stage)

    outputs: list[OutputSource] = []
    returned: dict[int, list[Any]] = {s: [] for s in range(num_stages)}
    for out in jaxpr.outvars:
        out = resolve(out)
        if is_literal(out):
            outputs.append(OutputSource("literal", value=out.val))
        elif out in invar_index:
            outputs.append(OutputSource("input", input_index=invar_index[out]))
        else:
            stage = producer[out]
            outputs.append(OutputSource("stage", stage=stage, var=out))
            if out not in returned[stage]:
                returned[stage].append(out)
    if info.with_grad and outputs[0].kind == "stage" and outputs[0].stage != num_stages - 1:
        raise PartitionError(
            f"the loss is computed by stage {outputs[0].stage}, but the last stage is "
            f"{num_stages - 1}: every stage must feed the loss. Compute the loss after the "
            "last Stage call."
        )
    if info.with_grad and outputs[0].kind != "stage":
        raise PartitionError("the loss does not depend on any Stage; call the model's stages.")

    stages: list[StageSlice] = []
    for stage in range(num_stages):
        defined = [o for eqn in per_stage[stage] for o in eqn.outvars]
        boundary_out = [v for v in defined if v in consumers] + [
            v for v in returned[stage] if v not in consumers
        ]
        program, free = make_subprogram(per_stage[stage], boundary_out, substitute=substitute)
        region_inputs = [invar_index[v] for v in free if v in invar_index]
        boundary_in = [v for v in free if v not in invar_index]
        # Reorder inputs: region inputs first, then boundary values.
        program, _ = make_subprogram(
            per_stage[stage],
            boundary_out,
            fixed_invars=[jaxpr.invars[i] for i in region_inputs] + boundary_in,
            substitute=substitute,
        )
        flag, policy = remat.get(stage, (False, None))
        stages.append(
            StageSlice(stage, program, region_inputs, boundary_in, boundary_out, flag, policy)
        )
    return StagePlan(info, stages, producer, consumers, outputs, input_stages)
