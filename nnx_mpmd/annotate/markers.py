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
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.core
from flax import nnx
from flax.nnx import graph as nnx_graph
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from nnx_mpmd._jax_compat import DIFFERENTIATION_FRAMES
from nnx_mpmd.errors import CompileError, PartitionError, PlacementError

__all__ = [
    "StageMarkerInfo",
    "StageOutsideRegionError",
    "call_stage",
    "current_stage",
    "outer_tracing",
    "stage_outside_region_error",
    "pipeline_tracing",
    "stage_marker_p",
]


class StageOutsideRegionError(PartitionError):
    """A `Stage` ran while `mp.jit` traced the step outside its pipelined region."""


stage_marker_p: Primitive = Primitive("mpmd_stage_marker")
stage_marker_p.multiple_results = True


@dataclasses.dataclass(frozen=True)
class StageMarkerInfo:
    """Static facts a marker carries into the jaxpr (hashable)."""

    stage: int
    boundary: str  # "enter" or "exit" ("probe": a check outside the region, never kept)
    remat: bool = False
    policy: Callable[..., Any] | None = None


def _marker_impl(*args: Any, info: StageMarkerInfo) -> tuple[Any, ...]:
    del info
    return tuple(args)


def _marker_abstract_eval(*avals: Any, info: StageMarkerInfo) -> tuple[Any, ...]:
    del info
    return tuple(avals)


_LIBRARY_PREFIXES = ("jax.", "jaxlib.", "flax.", "optax.", "nnx_mpmd.", "contextlib")


def _differentiation_site() -> tuple[str, str]:
    """``(transform, where)`` of the outermost differentiation transform on the Python stack."""
    transform, caller = "", None
    try:
        frame = inspect.currentframe()
        while frame is not None:
            module = str(frame.f_globals.get("__name__", ""))
            name = frame.f_code.co_name
            found = DIFFERENTIATION_FRAMES.get((module, name))
            if module == "flax.nnx.transforms.autodiff" and name in (
                "grad_wrapper",
                "tree_grad_wrapper",
            ):
                value: Any = frame.f_locals.get("return_value")
                found = {True: "nnx.value_and_grad", False: "nnx.grad"}.get(value, "nnx.grad")
            elif module == "flax.nnx.transforms.autodiff" and name.startswith(("vjp", "jvp")):
                found = f"nnx.{name[:3]}"
            if found:
                transform, caller = found, None
            elif transform and caller is None and not module.startswith(_LIBRARY_PREFIXES):
                caller = frame
            frame = frame.f_back
    except Exception:  # naming the transform is best effort
        transform, caller = "", None
    if not transform:
        return "a differentiation transform (jax.grad, nnx.value_and_grad, ...)", ""
    where = ""
    if caller is not None:
        where = f" at {caller.f_code.co_filename}:{caller.f_lineno}"
    return transform, where


def _differentiated_stage_error(info: StageMarkerInfo) -> CompileError:
    transform, where = _differentiation_site()
    return CompileError(
        f"{transform}{where} differentiates through Stage {info.stage} while mp.jit traces "
        "the step: mp.jit pipelines only the gradient taken by mp.value_and_grad. Use "
        "`loss, grads = mp.value_and_grad(loss_fn)(model, batch)` for the pipelined region "
        "(it differentiates per stage, over microbatches); nnx.value_and_grad, nnx.grad and "
        "jax.grad are fine outside mp.jit (e.g. under nnx.jit) or inside one Stage's body."
    )


def _marker_jvp(primals, tangents, *, info):
    if _state.active or _state.outer is not None:
        # A grad transform around Stage calls inside mp.jit's trace: the compiler
        # would see one forward-only program with the backward pass as glue code.
        raise _differentiated_stage_error(info)
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
        # While mp.jit traces a step outside its region: the stage calls seen there.
        self.outer: list[str] | None = None
        self.stage_stack: list[int] = []


_state = _TraceState()


@contextlib.contextmanager
def pipeline_tracing() -> Iterator[None]:
    """Within this context, `Stage` calls emit markers (used by the compiler)."""
    previous = (_state.active, _state.outer, _state.stage_stack)
    _state.active, _state.outer, _state.stage_stack = True, None, []
    try:
        yield
    finally:
        _state.active, _state.outer, _state.stage_stack = previous


@contextlib.contextmanager
def outer_tracing() -> Iterator[list[str]]:
    """Records the `Stage` calls a step makes outside its pipelined region.

    The compiler reads the yielded list to tell a forward-only step from a training
    step that calls stages outside ``mp.value_and_grad`` (an error).
    """
    previous = _state.outer
    _state.outer = calls = []
    try:
        yield calls
    finally:
        _state.outer = previous


def stage_outside_region_error(calls: list[str]) -> StageOutsideRegionError:
    """The error for a step that calls stages both inside and outside its region."""
    return StageOutsideRegionError(
        f"{calls[0]} was called by the step outside mp.value_and_grad: mp.jit can only "
        "place stage code inside the pipelined region. Call the model inside the loss "
        "function given to mp.value_and_grad."
    )


def current_stage() -> int | None:
    """The stage whose body is being traced, or None outside any stage."""
    return _state.stage_stack[-1] if _state.stage_stack else None


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | jax.core.Tracer)


def _mark(tree: Any, info: StageMarkerInfo) -> Any:
    # NNX objects passed to or returned by a stage (an nnx.Rngs given at call time)
    # stay the caller's objects: flattening would hand the body a copy, and keys it
    # draws would not advance the caller's counters.
    leaves, treedef = jax.tree.flatten(tree, is_leaf=nnx_graph.is_graph_node)
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


def _probe_differentiation(stage: int, fn: Any, call_args: Any) -> None:
    """Raises the grad-transform error if a Stage call outside the region is differentiated.

    Binding a marker on the call's arrays and the module's state runs the marker's
    JVP rule exactly when a grad transform (of any flavour: jax or nnx) traces them.
    """
    leaves = [x for x in jax.tree.leaves(call_args) if _is_array(x)]
    with contextlib.suppress(Exception):  # fn may be a plain function, not an NNX node
        leaves += [x for x in jax.tree.leaves(nnx.state(fn)) if _is_array(x)]
    if leaves:
        stage_marker_p.bind(*leaves, info=StageMarkerInfo(stage, "probe"))


def _call_outside_steps(
    stage: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], where: str
) -> Any:
    """``fn(*args, **kwargs)``; JAX's error for arrays of different submeshes names the fix."""
    try:
        return fn(*args, **kwargs)
    except ValueError as e:
        if "incompatible devices" not in str(e):
            raise
        raise PlacementError(
            f"Stage {stage}{where} was called outside mp.jit on arrays that live on different "
            "devices, as a model's state does after mp.jit steps (each stage's on its own "
            "submesh). To evaluate, export or nnx.jit the model, first bring it onto one "
            "device with mp.gather(model) (mp.distributed.gather on several processes; the "
            "next mp.jit step places it again), or run the call inside an mp.jit step. "
            f"JAX said: {str(e).splitlines()[0]}"
        ) from e


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
    """Calls ``fn(*args, **kwargs)`` as the body of ``stage`` (just the call outside a trace).

    ``policy`` is the ``jax.checkpoint`` policy of ``remat``; ``where`` names the call site.
    """
    if not _state.active:
        if _state.outer is not None:
            _probe_differentiation(stage, fn, (args, kwargs))
            _state.outer.append(f"Stage {stage}{where}")
            return fn(*args, **kwargs)
        return _call_outside_steps(stage, fn, args, kwargs, where)
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
