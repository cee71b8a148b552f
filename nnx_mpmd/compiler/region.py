"""The pipelined region: what `value_and_grad` records while `mp.jit` traces a step.

Inside `mp.jit`'s trace, ``mp.value_and_grad(loss_fn)(model, batch)`` does not
differentiate anything. It traces ``loss_fn`` on one microbatch (with stage
markers on) into a closed *body* jaxpr and emits a single ``mpmd_region``
equation into the step's jaxpr. Its outputs are the mean loss, the mean aux
values, the mean gradients and the updated non-differentiated state. The
compiler later cuts the body into stages; the rest of the step (the optimizer)
sees the region as one equation.

Outside `mp.jit`, `reference_value_and_grad` computes the same numbers
unpipelined: a scan over microbatches, averaging losses and gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax._src.interpreters import partial_eval as pe  # convert_constvars_jaxpr, dce_jaxpr
from jax.extend import core as jcore
from jax.extend.core import Primitive

from nnx_mpmd import markers
from nnx_mpmd.errors import CompileError

__all__ = [
    "RegionInfo",
    "active_microbatches",
    "reference_value_and_grad",
    "region_p",
    "region_tracing",
    "split_microbatches",
    "trace_region",
]

region_p = Primitive("mpmd_region")
region_p.multiple_results = True


@dataclasses.dataclass(eq=False)
class RegionInfo:
    """Everything the compiler needs to know about one pipelined region.

    Inputs of the region equation, in order: closure values, differentiated
    state leaves, other state leaves, batch leaves. Outputs: loss, aux leaves,
    gradients (one per differentiated leaf), updated other state leaves.
    """

    body: jcore.Jaxpr  # invars: closure, diff, other, microbatch; outvars: loss, aux, other
    num_microbatches: int
    n_closure: int
    n_diff: int
    n_other: int
    n_batch: int
    n_aux: int
    has_aux: bool
    with_grad: bool
    diff_paths: tuple[str, ...]
    other_paths: tuple[str, ...]
    out_avals: tuple[Any, ...]

    def __hash__(self) -> int:
        return id(self)


def _region_abstract_eval(*avals: Any, info: RegionInfo) -> tuple[Any, ...]:
    del avals
    return info.out_avals


region_p.def_abstract_eval(_region_abstract_eval)


class _RegionState(threading.local):
    def __init__(self) -> None:
        self.num_microbatches: int | None = None
        self.regions: list[RegionInfo] | None = None


_region_state = _RegionState()


@contextlib.contextmanager
def region_tracing(num_microbatches: int) -> Iterator[list[RegionInfo]]:
    """While active, `value_and_grad` records regions instead of computing."""
    previous = (_region_state.num_microbatches, _region_state.regions)
    regions: list[RegionInfo] = []
    _region_state.num_microbatches, _region_state.regions = num_microbatches, regions
    try:
        yield regions
    finally:
        _region_state.num_microbatches, _region_state.regions = previous


def active_microbatches() -> int | None:
    """The number of microbatches of the enclosing `mp.jit` trace, if any."""
    return _region_state.num_microbatches


def _path_str(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


def split_microbatches(batch: Any, num_microbatches: int) -> Any:
    """Reshapes every leaf of ``batch`` from ``[B, ...]`` to ``[m, B/m, ...]``.

    Raises:
      CompileError: if a leaf has no leading axis or it is not divisible by m.
    """
    paths_leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    for path, leaf in paths_leaves:
        shape = jnp.shape(leaf)
        if not shape or shape[0] % num_microbatches:
            where = jax.tree_util.keystr(path) or "batch"
            raise CompileError(
                f"batch leaf {where} has shape {tuple(shape)}: its leading (batch) axis must "
                f"divide into num_microbatches={num_microbatches} equal microbatches. Use a "
                "batch size that is a multiple of num_microbatches."
            )
    return jax.tree.map(
        lambda x: jnp.reshape(x, (num_microbatches, x.shape[0] // num_microbatches, *x.shape[1:])),
        batch,
    )


def _split_model(model: Any, wrt: Any) -> tuple[Any, nnx.State, nnx.State]:
    graphdef, diff_state, other_state = nnx.split(model, wrt, ...)
    return graphdef, diff_state, other_state


def trace_region(
    loss_fn: Callable[..., Any],
    model: Any,
    batch: Any,
    *,
    has_aux: bool,
    wrt: Any,
    with_grad: bool = True,
) -> Any:
    """Records ``loss_fn(model, batch)`` as a region equation of the current trace.

    Returns what `value_and_grad` returns: ``(loss, grads)`` or
    ``((loss, aux), grads)``; with ``with_grad=False`` the stacked outputs.
    """
    num_microbatches = _region_state.num_microbatches
    assert num_microbatches is not None and _region_state.regions is not None
    graphdef, diff_state, other_state = _split_model(model, wrt)
    diff_flat = list(nnx.to_flat_state(diff_state))
    other_flat = list(nnx.to_flat_state(other_state))
    diff_leaves, diff_tree = jax.tree.flatten(diff_state)
    other_leaves, other_tree = jax.tree.flatten(other_state)
    batch_leaves, batch_tree = jax.tree.flatten(batch)
    split_microbatches(batch, num_microbatches)  # validates divisibility
    mb_avals = [
        jax.ShapeDtypeStruct((x.shape[0] // num_microbatches, *x.shape[1:]), x.dtype)
        for x in batch_leaves
    ]
    aux_tree_box: list[Any] = []

    def body(diff: list[Any], other: list[Any], mb: list[Any]) -> Any:
        local = nnx.merge(
            graphdef, jax.tree.unflatten(diff_tree, diff), jax.tree.unflatten(other_tree, other)
        )
        out = loss_fn(local, jax.tree.unflatten(batch_tree, mb))
        if with_grad:
            loss, aux = out if has_aux else (out, None)
            aux_leaves, aux_tree = jax.tree.flatten(aux)
            head = [loss, *aux_leaves]
        else:  # forward only: every output leaf is collected per microbatch
            head, aux_tree = jax.tree.flatten(out)
            if not head:
                raise CompileError("a forward-only pipelined step must return arrays.")
        aux_tree_box.append(aux_tree)
        _, _, new_other = _split_model(local, wrt)
        return [*head, *jax.tree.leaves(new_other)]

    def aval(x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))

    with markers.pipeline_tracing():
        closed = jax.make_jaxpr(body)(
            [aval(x) for x in diff_leaves], [aval(x) for x in other_leaves], mb_avals
        )
    loss_aval = closed.out_avals[0]
    if with_grad and (loss_aval.shape != () or not jnp.issubdtype(loss_aval.dtype, jnp.floating)):
        raise CompileError(
            f"the loss function must return a float scalar (got {loss_aval.str_short()}); "
            "return the mean loss of the microbatch, and pass extra outputs with has_aux=True."
        )
    n_aux = len(closed.out_avals) - 1 - len(other_leaves)
    jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)
    consts = list(closed.consts)
    if with_grad:
        mean_avals = [
            a if jnp.issubdtype(a.dtype, jnp.inexact) else a.update(dtype=jnp.float32)
            for a in closed.out_avals[: 1 + n_aux]
        ]
        out_avals = (
            *mean_avals,
            *[jax.core.ShapedArray(jnp.shape(x), jnp.result_type(x)) for x in diff_leaves],
            *closed.out_avals[1 + n_aux :],
        )
    else:  # forward only: stacked per-microbatch outputs
        out_avals = tuple(
            jax.core.ShapedArray((num_microbatches, *a.shape), a.dtype)
            for a in closed.out_avals[: 1 + n_aux]
        ) + tuple(closed.out_avals[1 + n_aux :])
    info = RegionInfo(
        body=jaxpr,
        num_microbatches=num_microbatches,
        n_closure=len(consts),
        n_diff=len(diff_leaves),
        n_other=len(other_leaves),
        n_batch=len(batch_leaves),
        n_aux=n_aux,
        has_aux=has_aux,
        with_grad=with_grad,
        diff_paths=tuple(_path_str(p) for p, _ in diff_flat),
        other_paths=tuple(_path_str(p) for p, _ in other_flat),
        out_avals=out_avals,
    )
    _region_state.regions.append(info)
    outs = region_p.bind(*consts, *diff_leaves, *other_leaves, *batch_leaves, info=info)
    if not with_grad:
        nnx.update(model, jax.tree.unflatten(other_tree, outs[1 + n_aux :]))
        return jax.tree.unflatten(aux_tree_box[-1], outs[: 1 + n_aux])
    loss, rest = outs[0], outs[1:]
    aux = jax.tree.unflatten(aux_tree_box[-1], rest[:n_aux])
    rest = rest[n_aux:]
    if with_grad:
        grads = jax.tree.unflatten(diff_tree, rest[: len(diff_leaves)])
        rest = rest[len(diff_leaves) :]
    nnx.update(model, jax.tree.unflatten(other_tree, rest))
    return ((loss, aux), grads) if has_aux else (loss, grads)


def reference_value_and_grad(
    loss_fn: Callable[..., Any],
    model: Any,
    batch: Any,
    *,
    num_microbatches: int,
    has_aux: bool,
    wrt: Any,
) -> Any:
    """Unpipelined value-and-grad with the pipeline's microbatch semantics.

    Splits the batch into ``num_microbatches`` along axis 0, runs the
    microbatches in order (threading non-differentiated state such as RNG
    counters and batch statistics), and returns the mean loss, mean aux and mean
    gradients.
    """
    graphdef, diff_state, other_state = _split_model(model, wrt)
    diff_leaves, diff_tree = jax.tree.flatten(diff_state)
    other_leaves, other_tree = jax.tree.flatten(other_state)
    stacked = split_microbatches(batch, num_microbatches)

    # Raw leaves cross the transforms; Variables are rebuilt inside the trace so
    # that state updates (RNG counters, batch statistics) happen at its level.
    def one(diff: list[Any], other: list[Any], mb: Any) -> Any:
        local = nnx.merge(
            graphdef, jax.tree.unflatten(diff_tree, diff), jax.tree.unflatten(other_tree, other)
        )
        out = loss_fn(local, mb)
        loss, aux = out if has_aux else (out, None)
        _, _, new_other = _split_model(local, wrt)
        return loss, (aux, jax.tree.leaves(new_other))

    grad_fn = jax.value_and_grad(one, has_aux=True)

    def step(carry: Any, mb: Any) -> Any:
        other, loss_sum, aux_sum, grad_sum = carry
        (loss, (aux, other)), grads = grad_fn(diff_leaves, other, mb)
        add = lambda a, b: a + b  # noqa: E731
        aux_sum = jax.tree.map(add, aux_sum, aux) if aux_sum is not None else aux
        return (other, loss_sum + loss, aux_sum, jax.tree.map(add, grad_sum, grads)), None

    zeros = [jnp.zeros_like(x) for x in diff_leaves]
    first_mb = jax.tree.map(lambda x: x[0], stacked)
    (loss0, (aux0, _)), _ = jax.eval_shape(grad_fn, diff_leaves, other_leaves, first_mb)
    aux_zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux0)
    init = (other_leaves, jnp.zeros(loss0.shape, loss0.dtype), aux_zeros, zeros)
    (other_leaves, loss_sum, aux_sum, grad_sum), _ = jax.lax.scan(step, init, stacked)
    other_state = jax.tree.unflatten(other_tree, other_leaves)
    grad_sum = jax.tree.unflatten(diff_tree, grad_sum)
    nnx.update(model, other_state)
    scale = 1.0 / num_microbatches
    loss = loss_sum * scale
    grads = jax.tree.map(lambda g: g * scale, grad_sum)
    if has_aux:
        aux = jax.tree.map(lambda a: a * scale, aux_sum)
        return (loss, aux), grads
    return loss, grads
