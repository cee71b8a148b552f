"""Splitting a stage's backward pass into BI and BW without recomputation.

Zero-bubble schedules run a stage's backward in two tasks: BI computes the
cotangent of the stage input (which the previous stage is waiting for) and BW
computes the weight gradient later, filling what would be a bubble. Both are
cut from one backward jaxpr (the transpose recorded by ``jax.vjp``):

- BI holds every equation the input cotangent needs;
- BW holds the equations only the weight gradient needs;
- the values BW reads that BI computed (intermediate cotangents, the output
  cotangent itself) are BI's extra outputs, so BW recomputes nothing. Forward
  residuals stay in the forward task's residual pytree until BW.

The cut is recomputed from the traced jaxpr in each program's trace; tracing is
deterministic, so BI and BW agree on it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import jax
from jax.core import ShapedArray
from jax.extend import core as jcore

from nnx_mpmd._jax_compat import convert_constvars_jaxpr
from nnx_mpmd.compiler.jaxpr_utils import is_literal, make_subprogram

__all__ = ["BackwardSplit", "split_backward"]


@dataclasses.dataclass
class BackwardSplit:
    """The backward jaxpr of one stage cut into its BI and BW parts."""

    consts: list[Any]
    num_residual_leaves: int
    bi_program: Any  # inputs: bi_inputs; outputs: ct_x..., extras...
    bi_inputs: list[int]  # positions among [consts, residual leaves, seeds]
    bw_program: Any  # inputs: bw_inputs (direct) + extras; outputs: weight gradients
    bw_direct_inputs: list[int]  # positions among [consts, residual leaves] read by BW
    num_extras: int


def _live_eqns(jaxpr: Any, outvars: list[Any]) -> set[int]:
    live = {v for v in outvars if not is_literal(v)}
    needed: set[int] = set()
    for index in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[index]
        if any(o in live for o in eqn.outvars) or eqn.effects:
            needed.add(index)
            live.update(v for v in eqn.invars if not is_literal(v))
    return needed


def abstract_like(x: Any) -> jax.ShapeDtypeStruct:
    """``x``'s type as a ShapeDtypeStruct, its sharding included.

    On Explicit mesh axes the sharding is part of an array's type: a cotangent
    traced without it would not match the forward's output in the backward.
    """
    if isinstance(x, jax.ShapeDtypeStruct):
        aval = x
    else:
        aval = cast(ShapedArray, x.aval if isinstance(x, jcore.Var) else jax.typeof(x))
    sharding = getattr(aval, "sharding", None)
    if sharding is not None and not any(sharding.spec):
        sharding = None  # fully replicated: the plain type says the same
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding)


def split_backward(vjp_fn: Any, seed_avals: list[Any], num_params: int) -> BackwardSplit:
    """Traces ``vjp_fn`` (over ``(params, xd)``) and cuts its backward into BI and BW."""
    residual_leaves, vjp_tree = jax.tree.flatten(vjp_fn)
    num_res = len(residual_leaves)

    def run(*leaves: Any) -> list[Any]:
        fn = jax.tree.unflatten(vjp_tree, leaves[:num_res])
        grads, ct_x = fn(tuple(leaves[num_res:]))
        return [*grads, *ct_x]

    avals = [abstract_like(x) for x in residual_leaves] + list(seed_avals)
    closed = jax.make_jaxpr(run)(*avals)
    jaxpr = convert_constvars_jaxpr(closed.jaxpr)
    consts = list(closed.consts)
    num_direct = len(consts) + num_res  # consts and residual leaves
    grads_out = jaxpr.outvars[:num_params]
    ct_out = jaxpr.outvars[num_params:]
    bi_eqns = _live_eqns(jaxpr, ct_out)
    bw_eqns = _live_eqns(jaxpr, grads_out) - bi_eqns
    bw_list = [jaxpr.eqns[i] for i in sorted(bw_eqns)]
    bi_list = [jaxpr.eqns[i] for i in sorted(bi_eqns)]
    # What BW reads from outside its own equations.
    defined_in_bw = {o for e in bw_list for o in e.outvars}
    invar_pos = {v: i for i, v in enumerate(jaxpr.invars)}
    needs: list[Any] = []
    for v in [v for e in bw_list for v in e.invars] + list(grads_out):
        if is_literal(v) or v in defined_in_bw or v in needs:
            continue
        needs.append(v)
    direct = [v for v in needs if v in invar_pos and invar_pos[v] < num_direct]
    extras = [v for v in needs if v not in direct]  # seeds or values computed by BI
    bi_program, bi_free = make_subprogram(bi_list, list(ct_out) + extras)
    bw_program, _ = make_subprogram(bw_list, list(grads_out), fixed_invars=direct + extras)
    return BackwardSplit(
        consts=consts,
        num_residual_leaves=num_res,
        bi_program=bi_program,
        bi_inputs=[invar_pos[v] for v in bi_free],
        bw_program=bw_program,
        bw_direct_inputs=[invar_pos[v] for v in direct],
        num_extras=len(extras),
    )


def run_bi(vjp_fn: Any, seeds: list[Any], num_params: int) -> tuple[tuple[Any, ...], tuple]:
    """The BI task: ``(ct_x, extras)`` for the given output cotangents."""
    split = split_backward(vjp_fn, [abstract_like(s) for s in seeds], num_params)
    values = [*split.consts, *jax.tree.leaves(vjp_fn), *seeds]
    outs = split.bi_program(*[values[i] for i in split.bi_inputs])
    num_ct = len(outs) - split.num_extras
    return tuple(outs[:num_ct]), tuple(outs[num_ct:])


def run_bw(vjp_fn: Any, extras: tuple[Any, ...], seed_avals: list[Any], num_params: int) -> list:
    """The BW task: the weight gradients, from the residuals and BI's extras."""
    split = split_backward(vjp_fn, seed_avals, num_params)
    values = [*split.consts, *jax.tree.leaves(vjp_fn)]
    return split.bw_program(*[values[i] for i in split.bw_direct_inputs], *extras)
