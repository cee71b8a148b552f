"""The region's outputs: where each result of the pipelined region ends up.

The region returns, in order: the loss and aux values, one gradient per
differentiated parameter, then the updated mutable state (RNG streams, batch
statistics). Three passes append what that takes to the instruction list and
say where each output lies (a list of ``(mesh, RegionValue)`` per output, or
``("input", r)`` / ``("literal", value)``):

* `collect_results`: the loss/aux accumulators (training), or each output's
  microbatches stacked to ``[m, ...]`` (forward-only).
* `reduce_shared_gradients`: each parameter's gradient on its home mesh; a
  parameter used by stages on several meshes has its contributions moved home
  and summed, an unused one gets zeros.
* `carry_state_home`: the state the last microbatch left, moved to the mesh the
  state lives on.

`region_outputs` runs the three.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from nnx_mpmd.compiler.ir import Call, Instruction, ProgramKey, Transfer
from nnx_mpmd.compiler.jaxpr_utils import named_jit
from nnx_mpmd.compiler.region.region_values import RegionContext, RegionValue
from nnx_mpmd.errors import CompileError

__all__ = [
    "OutputLocations",
    "carry_state_home",
    "collect_results",
    "reduce_shared_gradients",
    "region_outputs",
]

# Per region output: [(mesh, value)], or [("input", r)] / [("literal", value)].
OutputLocations = list[list[tuple[Any, Any]]]


def _sum(*xs: Any) -> Any:
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total


def _stack(*xs: Any) -> Any:
    return jnp.stack(xs)


def _program(fn: Any, key: ProgramKey, **jit_kwargs: Any) -> Any:
    """``fn`` jitted as program ``key`` (its XLA module named ``jit_<key>``)."""
    return named_jit(fn, str(key), **jit_kwargs)


def _stacked_outputs(ctx: RegionContext) -> tuple[list[Instruction], OutputLocations]:
    """Forward-only: each output's microbatches stacked to ``[m, ...]`` on its stage's mesh."""
    info, program, locations = ctx.plan.info, [], []
    for o_index, source in enumerate(ctx.plan.outputs[: 1 + info.n_aux]):
        if source.kind != "stage":
            raise CompileError(
                f"output {o_index} of the forward-only step does not come from a stage; "
                "return values computed by the model."
            )
        k, q = source.stage, ctx.stage_mesh[source.stage]
        j = ctx.fns[k].accumulated_outputs.index(o_index)
        parts = tuple(ctx.outputs(k, i)[j] for i in range(ctx.num_microbatches))
        out = RegionValue("stacked", (o_index,), None, q)
        key = ProgramKey("stack", index=o_index, mesh=q)
        stack = _program(_stack, key)
        program.append(Call(q, key, stack, parts, out, f"stack output {o_index}"))
        locations.append([(q, out)])
    return program, locations


def collect_results(ctx: RegionContext) -> tuple[list[Instruction], OutputLocations]:
    """The loss and aux outputs: their accumulators, or stacked forward-only results.

    Raises:
      CompileError: an output does not come from a stage.
    """
    if not ctx.with_grad:
        return _stacked_outputs(ctx)
    locations: OutputLocations = []
    for o_index, source in enumerate(ctx.plan.outputs[: 1 + ctx.plan.info.n_aux]):
        if source.kind != "stage":
            what = "does not come from a stage"
            if source.kind == "literal":
                what = f"is the constant {np.asarray(source.value).tolist()!r}"
            raise CompileError(
                f"region output {o_index} (loss/aux) {what}; compute it from the model's "
                "outputs, or return a value that does not depend on the model from the step "
                "itself, outside mp.value_and_grad."
            )
        k = source.stage
        j = ctx.fns[k].accumulated_outputs.index(o_index)
        locations.append([(ctx.stage_mesh[k], ctx.result_accumulators(k)[j])])
    return [], locations


def _gradient_home(
    ctx: RegionContext, r: int, home: int
) -> tuple[list[Instruction], list[RegionValue]]:
    """Moves each stage's gradient of region input ``r`` to ``home``: (transfers, parts)."""
    program: list[Instruction] = []
    parts = []
    for k in ctx.plan.input_stages.get(r, []):
        value = ctx.grad_accumulators(k)[ctx.fns[k].param_inputs.index(r)]
        if value.mesh != home:
            moved = value.on(home)
            label = f"shared grad s{k}"
            program.append(Transfer(value, moved, home, label, src_mesh=value.mesh))  # type: ignore[arg-type]
            value = moved
        parts.append(value)
    return program, parts


def reduce_shared_gradients(
    ctx: RegionContext, home_mesh: Callable[[int], int]
) -> tuple[list[Instruction], OutputLocations]:
    """One gradient per differentiated parameter on its home mesh: moved, summed or zeros."""
    program: list[Instruction] = []
    locations: OutputLocations = []
    info = ctx.plan.info
    for d in range(info.n_diff if ctx.with_grad else 0):
        r = info.n_closure + d
        home = home_mesh(r)
        moves, parts = _gradient_home(ctx, r, home)
        program += moves
        if not parts:
            out = RegionValue("zero_grad", (d,), None, home)
            key = ProgramKey("zeros", index=d, mesh=home)
            # keep_unused: a jit whose only input is unused takes its devices from
            # none and fails on a parameter of an Explicit mesh of several devices.
            zeros = _program(jnp.zeros_like, key, keep_unused=True)
            program.append(Call(home, key, zeros, (ctx.input(r, home),), out, f"zero grad {d}"))
        elif len(parts) == 1:
            out = parts[0]
        else:
            out = RegionValue("grad_sum", (d,), None, home)
            key = ProgramKey("sum", index=d, mesh=home)
            total = _program(_sum, key)
            program.append(Call(home, key, total, tuple(parts), out, f"sum shared grad {d}"))
        locations.append([(home, out)])
    return program, locations


def carry_state_home(
    ctx: RegionContext, home_mesh: Callable[[int], int]
) -> tuple[list[Instruction], OutputLocations]:
    """The region's other outputs (mutable state, passed-through inputs, literals), moved home.

    Raises:
      CompileError: state other than RNG streams is used by several stages.
    """
    info, plan = ctx.plan.info, ctx.plan
    program: list[Instruction] = []
    locations: OutputLocations = []
    first_other = info.n_closure + info.n_diff
    for j, source in enumerate(plan.outputs[1 + info.n_aux :]):
        r = first_other + j
        if source.kind == "input":
            locations.append([("input", source.input_index)])
            continue
        if source.kind == "literal":
            locations.append([("literal", source.value)])
            continue
        readers = sorted(set(plan.input_stages.get(r, [])) | {source.stage})
        if len(readers) > 1:
            raise CompileError(
                f"{info.other_paths[j]} is updated by stage {source.stage} and used by "
                f"stages {readers}: mutable state other than RNG streams (batch "
                "statistics, running counters) must belong to one stage. Give each stage "
                "its own state (e.g. one BatchNorm per Stage), or update it in one stage."
            )
        q, home = ctx.stage_mesh[source.stage], home_mesh(r)
        final = RegionValue("carry", (r,), ctx.num_microbatches, q)
        if q != home:
            program.append(Transfer(final, final.on(home), home, f"state {j}", src_mesh=q))  # type: ignore[arg-type]
            final = final.on(home)
        locations.append([(home, final)])
    return program, locations


def region_outputs(
    program: Sequence[Instruction], ctx: RegionContext, home_mesh: Callable[[int], int]
) -> tuple[list[Instruction], OutputLocations]:
    """Appends what the region's outputs take; returns ``(new list, locations per output)``.

    Outputs are loss, aux, gradients, state, in order; ``home_mesh`` maps an input to its home.
    """
    result, locations = list(program), []
    for added, where in (
        collect_results(ctx),
        reduce_shared_gradients(ctx, home_mesh),
        carry_state_home(ctx, home_mesh),
    ):
        result += added
        locations += where
    return result, locations
