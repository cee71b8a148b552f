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
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax.extend import core as jcore

from nnx_mpmd.annotate.markers import stage_marker_p
from nnx_mpmd.compiler.jaxpr_utils import SubProgram, is_literal, make_subprogram
from nnx_mpmd.compiler.trace.region import RegionInfo
from nnx_mpmd.errors import PartitionError

__all__ = ["OutputSource", "StagePlan", "StageSlice", "cut_stages", "input_stages"]


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


@dataclasses.dataclass(frozen=True)
class _Markers:
    """What the stage markers of a body say.

    ``stage_of[i]``: the stage of equation i if it sits between an ``enter`` and
    an ``exit`` marker (else None); ``substitute``: marker outputs -> inputs
    (markers are identities, dropped from the stages' programs); ``remat``:
    stage -> (remat flag, policy) from its markers.
    """

    stage_of: tuple[int | None, ...]
    is_marker: tuple[bool, ...]
    substitute: dict[Any, Any]
    remat: dict[int, tuple[bool, Any]]

    def resolve(self, v: Any) -> Any:
        """``v`` with marker outputs replaced by the values they mark."""
        while not is_literal(v) and v in self.substitute:
            v = self.substitute[v]
        return v


def _read_markers(eqns: Sequence[Any]) -> _Markers:
    """Equations between a stage's ``enter`` and ``exit`` markers belong to that stage."""
    substitute: dict[Any, Any] = {}
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
    return _Markers(tuple(stage_of), tuple(is_marker), substitute, remat)


def _count_stages(eqns: Sequence[Any], markers: _Markers) -> int:
    """The number of stages; raises if none is called or some are skipped."""
    marked = sorted(
        {eqn.params["info"].stage for eqn, m in zip(eqns, markers.is_marker, strict=True) if m}
    )
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
            f"must be 0..{num_stages - 1} without gaps. Renumber the Stage wrappers. (A Stage "
            "runs as its stage only when it is called itself, stage(x); another method, "
            "stage.encode(x), runs where its inputs are: call the Stage, or wrap the module "
            "whose __call__ does that work.)"
        )
    return num_stages


def _glue_to_producers(
    eqns: Sequence[Any], markers: _Markers
) -> tuple[list[int | None], dict[Any, int]]:
    """``(stage_of, producer)``: glue reading a stage's value goes to the latest stage it reads."""
    stage_of = list(markers.stage_of)
    producer: dict[Any, int] = {}
    for i, eqn in enumerate(eqns):
        if markers.is_marker[i]:
            continue
        if stage_of[i] is None:
            inputs = [markers.resolve(v) for v in eqn.invars if not is_literal(v)]
            known = [producer[v] for v in inputs if not is_literal(v) and v in producer]
            if known:
                stage_of[i] = max(known)
        if stage_of[i] is not None:
            for out in eqn.outvars:
                producer[out] = stage_of[i]  # type: ignore[assignment]
    return stage_of, producer


def _glue_to_first_users(
    jaxpr: Any,
    markers: _Markers,
    stage_of: list[int | None],
    producer: dict[Any, int],
    num_stages: int,
) -> tuple[list[int | None], dict[Any, int]]:
    """``(stage_of, producer)``: glue reading only inputs goes to the earliest stage using it.

    Equations whose results nothing uses stay without a stage (dead code).
    """
    stage_of, producer = list(stage_of), dict(producer)
    first_use: dict[Any, int] = {}
    for out in jaxpr.outvars:
        if not is_literal(out):
            first_use[markers.resolve(out)] = num_stages - 1
    for i in reversed(range(len(jaxpr.eqns))):
        if markers.is_marker[i]:
            continue
        eqn = jaxpr.eqns[i]
        if stage_of[i] is None:
            uses = [first_use[o] for o in eqn.outvars if o in first_use]
            if not uses:
                continue  # dead code
            stage_of[i] = min(uses)
            for out in eqn.outvars:
                producer[out] = stage_of[i]  # type: ignore[assignment]
        for v in eqn.invars:
            v = markers.resolve(v)
            if not is_literal(v):
                first_use[v] = min(first_use.get(v, stage_of[i]), stage_of[i])  # type: ignore[type-var]
    return stage_of, producer


def _append_once(items: list[Any], item: Any) -> None:
    if item not in items:
        items.append(item)


@dataclasses.dataclass(frozen=True)
class _Dataflow:
    """Which stage runs which equations, and who reads what."""

    per_stage: list[list[Any]]  # stage -> its equations, in order
    consumers: dict[Any, list[int]]  # boundary value -> later stages that read it
    input_stages: dict[int, list[int]]  # body invar index -> stages that read it


def _dataflow(
    jaxpr: Any,
    markers: _Markers,
    stage_of: Sequence[int | None],
    producer: dict[Any, int],
    num_stages: int,
) -> _Dataflow:
    """Groups equations by stage and records the values that cross stages.

    Raises:
      PartitionError: a stage reads a value a later stage computes.
    """
    invar_index = {v: i for i, v in enumerate(jaxpr.invars)}
    flow = _Dataflow([[] for _ in range(num_stages)], {}, {})
    for i, eqn in enumerate(jaxpr.eqns):
        stage = stage_of[i]
        if markers.is_marker[i] or stage is None:
            continue
        flow.per_stage[stage].append(eqn)
        for v in map(markers.resolve, eqn.invars):
            if is_literal(v):
                continue
            if v in invar_index:
                _append_once(flow.input_stages.setdefault(invar_index[v], []), stage)
            elif producer[v] > stage:
                raise PartitionError(
                    f"stage {stage} uses a value computed by stage {producer[v]} "
                    f"({eqn.primitive.name} reads it): data must flow from lower to higher "
                    "stage numbers. Call the stages in increasing order or renumber them. "
                    "(To run one module at several pipeline positions, with shared weights, "
                    "give each position a Stage of its own around that module, "
                    "[mp.Stage(block, stage=s) for s in ...]: its parameters are then "
                    "shared by those stages, like a tied embedding.)"
                )
            elif producer[v] != stage:
                _append_once(flow.consumers.setdefault(v, []), stage)
    return flow


def _output_sources(
    jaxpr: Any, markers: _Markers, producer: dict[Any, int], num_stages: int
) -> tuple[list[OutputSource], dict[int, list[Any]]]:
    """Where each body output comes from, and the values each stage returns."""
    invar_index = {v: i for i, v in enumerate(jaxpr.invars)}
    outputs: list[OutputSource] = []
    returned: dict[int, list[Any]] = {s: [] for s in range(num_stages)}
    for out in map(markers.resolve, jaxpr.outvars):
        if is_literal(out):
            outputs.append(OutputSource("literal", value=out.val))
        elif out in invar_index:
            outputs.append(OutputSource("input", input_index=invar_index[out]))
        else:
            stage = producer[out]
            outputs.append(OutputSource("stage", stage=stage, var=out))
            _append_once(returned[stage], out)
    return outputs, returned


def _check_loss_stage(info: RegionInfo, outputs: list[OutputSource], num_stages: int) -> None:
    """Raises unless the loss (training) is computed by the last stage."""
    if info.with_grad and outputs[0].kind == "stage" and outputs[0].stage != num_stages - 1:
        raise PartitionError(
            f"the loss is computed by stage {outputs[0].stage}, but the last stage is "
            f"{num_stages - 1}: every stage must feed the loss. Compute the loss after the "
            "last Stage call."
        )
    if info.with_grad and outputs[0].kind != "stage":
        raise PartitionError("the loss does not depend on any Stage; call the model's stages.")


def _stage_slice(
    jaxpr: Any,
    stage: int,
    eqns: list[Any],
    boundary_out: list[Any],
    markers: _Markers,
) -> StageSlice:
    """Stage ``stage``'s equations as a program of ``[*region inputs, *boundary_in]``."""
    invar_index = {v: i for i, v in enumerate(jaxpr.invars)}
    _, free = make_subprogram(eqns, boundary_out, substitute=markers.substitute)
    region_inputs = [invar_index[v] for v in free if v in invar_index]
    boundary_in = [v for v in free if v not in invar_index]
    # Reorder inputs: region inputs first, then boundary values.
    program, _ = make_subprogram(
        eqns,
        boundary_out,
        fixed_invars=[jaxpr.invars[i] for i in region_inputs] + boundary_in,
        substitute=markers.substitute,
    )
    flag, policy = markers.remat.get(stage, (False, None))
    return StageSlice(stage, program, region_inputs, boundary_in, boundary_out, flag, policy)


def cut_stages(info: RegionInfo) -> StagePlan:
    """The `StagePlan` of ``info.body`` cut at its stage markers.

    Glue goes to the latest stage it reads from, or else the earliest that uses it.

    Raises:
      PartitionError: no stage was called, stages are missing (gaps), stages
        nest or run out of order, a Stage call is hidden inside a higher-order
        primitive (jax.checkpoint, jax.jit, scan...), or the loss is not computed
        by the last stage.
    """
    jaxpr = info.body
    _check_no_hidden_stages(jaxpr)
    markers = _read_markers(jaxpr.eqns)
    num_stages = _count_stages(jaxpr.eqns, markers)
    stage_of, producer = _glue_to_producers(jaxpr.eqns, markers)
    stage_of, producer = _glue_to_first_users(jaxpr, markers, stage_of, producer, num_stages)
    flow = _dataflow(jaxpr, markers, stage_of, producer, num_stages)
    outputs, returned = _output_sources(jaxpr, markers, producer, num_stages)
    _check_loss_stage(info, outputs, num_stages)
    stages = []
    for stage in range(num_stages):
        defined = [o for eqn in flow.per_stage[stage] for o in eqn.outvars]
        boundary_out = [v for v in defined if v in flow.consumers] + [
            v for v in returned[stage] if v not in flow.consumers
        ]
        stages.append(_stage_slice(jaxpr, stage, flow.per_stage[stage], boundary_out, markers))
    return StagePlan(info, stages, producer, flow.consumers, outputs, flow.input_stages)


def input_stages(jaxpr: Any) -> dict[int, list[int]]:
    """``{input index: [stages that read it]}`` of a jaxpr traced with stage markers.

    `cut_stages`'s dataflow for a trace outside a step (e.g. which stage a decoding cache is on).

    Raises:
      PartitionError: as `cut_stages`.

    Example:
      >>> import jax
      >>> from nnx_mpmd.annotate.markers import call_stage, pipeline_tracing
      >>> def f(a, b):
      ...     return call_stage(1, lambda x: x * b, (call_stage(0, jax.numpy.sin, (a,), {}),), {})
      >>> with pipeline_tracing():
      ...     jaxpr = jax.make_jaxpr(f)(1.0, 2.0).jaxpr
      >>> input_stages(jaxpr)
      {0: [0], 1: [1]}
    """
    _check_no_hidden_stages(jaxpr)
    markers = _read_markers(jaxpr.eqns)
    num_stages = _count_stages(jaxpr.eqns, markers)
    stage_of, producer = _glue_to_producers(jaxpr.eqns, markers)
    stage_of, producer = _glue_to_first_users(jaxpr, markers, stage_of, producer, num_stages)
    return _dataflow(jaxpr, markers, stage_of, producer, num_stages).input_stages
