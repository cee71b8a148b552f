"""Stage markers: how a `Stage` call shows up in a traced program.

While the compiler traces the pipelined region (and only then), every call of a
`Stage` is bracketed by two identity primitives, ``enter`` on the call's array
arguments and ``exit`` on its array results. The compiler cuts the traced jaxpr
at these brackets. Outside that trace a `Stage` call is an ordinary call, so the
same model runs unchanged under ``nnx.jit``, ``jax.grad`` or eagerly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from nnx_mpmd.errors import PartitionError

__all__ = [
    "StageMarkerInfo",
    "StageOutsideRegionError",
    "call_stage",
    "current_stage",
    "outer_tracing",
    "pipeline_tracing",
    "stage_marker_p",
]


class StageOutsideRegionError(PartitionError):
    """A `Stage` ran while `mp.jit` traced the step outside its pipelined region."""


stage_marker_p = Primitive("mpmd_stage_marker")
stage_marker_p.multiple_results = True


@dataclasses.dataclass(frozen=True)
class StageMarkerInfo:
    """Static facts a marker carries into the jaxpr (hashable)."""

    stage: int
    boundary: str  # "enter" or "exit"
    remat: bool = False
    policy: Callable[..., Any] | None = None


def _marker_impl(*args: Any, info: StageMarkerInfo) -> tuple[Any, ...]:
    del info
    return tuple(args)


def _marker_abstract_eval(*avals: Any, info: StageMarkerInfo) -> tuple[Any, ...]:
    del info
    return tuple(avals)


def _marker_jvp(primals, tangents, *, info):
    return stage_marker_p.bind(*primals, info=info), tuple(tangents)


def _marker_batch(args, dims, *, info):
    return stage_marker_p.bind(*args, info=info), dims


stage_marker_p.def_impl(_marker_impl)
stage_marker_p.def_abstract_eval(_marker_abstract_eval)
ad.primitive_jvps[stage_marker_p] = _marker_jvp
batching.primitive_batchers[stage_marker_p] = _marker_batch
mlir.register_lowering(
    stage_marker_p, mlir.lower_fun(_marker_impl, multiple_results=True), platform=None
)


class _TraceState(threading.local):
    def __init__(self) -> None:
        self.active = False
        self.outer = False
        self.stage_stack: list[int] = []


_state = _TraceState()


@contextlib.contextmanager
def pipeline_tracing() -> Iterator[None]:
    """Within this context, `Stage` calls emit markers (used by the compiler)."""
    previous = (_state.active, _state.outer, _state.stage_stack)
    _state.active, _state.outer, _state.stage_stack = True, False, []
    try:
        yield
    finally:
        _state.active, _state.outer, _state.stage_stack = previous


@contextlib.contextmanager
def outer_tracing() -> Iterator[None]:
    """While `mp.jit` traces a step outside its pipelined region, a `Stage` call is an error."""
    previous = _state.outer
    _state.outer = True
    try:
        yield
    finally:
        _state.outer = previous


def current_stage() -> int | None:
    """The stage whose body is being traced, or None outside any stage."""
    return _state.stage_stack[-1] if _state.stage_stack else None


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | jax.core.Tracer)


def _mark(tree: Any, info: StageMarkerInfo) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    positions = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
    if not positions:
        # Keep the bracket even for a call without array arguments (e.g. a stage
        # that only reads its parameters) so the compiler still sees the span.
        stage_marker_p.bind(info=info)
        return tree
    marked = stage_marker_p.bind(*[leaves[i] for i in positions], info=info)
    for i, value in zip(positions, marked, strict=True):
        leaves[i] = value
    return jax.tree.unflatten(treedef, leaves)


def call_stage(
    stage: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    remat: bool = False,
    policy: Callable[..., Any] | None = None,
    where: str = "",
) -> Any:
    """Calls ``fn(*args, **kwargs)`` as the body of ``stage``.

    Outside the compiler's trace this is exactly ``fn(*args, **kwargs)``.

    Args:
      stage: the logical stage number.
      fn: the wrapped module (or function) to call.
      args: positional arguments.
      kwargs: keyword arguments.
      remat: whether the stage recomputes its forward in the backward pass.
      policy: optional ``jax.checkpoint`` policy used with ``remat``.
      where: a description of the call site for error messages.

    Returns:
      Whatever ``fn`` returns.
    """
    if not _state.active:
        if _state.outer:
            raise StageOutsideRegionError(
                f"Stage {stage}{where} was called by the step outside mp.value_and_grad: "
                "mp.jit can only place stage code inside the pipelined region. Call the model "
                "inside the loss function given to mp.value_and_grad."
            )
        return fn(*args, **kwargs)
    outer = current_stage()
    if outer is not None:
        if outer != stage:
            raise PartitionError(
                f"Stage {stage}{where} is called inside the body of stage {outer}; "
                "stages cannot nest. Give the inner module the outer stage number "
                "or move the call out of the outer Stage."
            )
        return fn(*args, **kwargs)
    enter = StageMarkerInfo(stage, "enter", remat, policy)
    args, kwargs = _mark((args, kwargs), enter)
    _state.stage_stack.append(stage)
    try:
        out = fn(*args, **kwargs)
    finally:
        _state.stage_stack.pop()
    return _mark(out, StageMarkerInfo(stage, "exit", remat, policy))
