"""NNX state a function reaches without receiving it as an argument.

A loss function often closes over an ``nnx.Rngs`` (``lambda m, b: loss(m, b,
rngs)``), or reads one from a module-level global. Under a JAX transform such a
Flax Variable belongs to an outer trace and cannot be updated, so the pipelined
region (and the step) must take its state in explicitly: find the graph nodes a
function reaches through closures, ``functools.partial`` arguments, bound
methods and the globals its code names, then thread their Variables through the
trace with `bound_variables`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from flax import nnx
from flax.nnx import graph as nnx_graph

from nnx_mpmd._jax_compat import (
    variable_belongs_to_current_trace,
    variables_bound_to_current_trace,
)
from nnx_mpmd.errors import CompileError

__all__ = [
    "CapturedVariable",
    "bound_variables",
    "captured_graph_nodes",
    "captured_variables",
    "implicit_rng_nodes",
    "outer_trace_error",
    "rng_variables",
]

_MAX_DEPTH = 4


@dataclasses.dataclass(frozen=True)
class CapturedVariable:
    """One Variable reached from a function, with a readable name for messages."""

    variable: nnx.Variable
    path: str  # e.g. "rngs.dropout.count" (the closure or global name first)


def _code_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def captured_graph_nodes(fn: Callable[..., Any]) -> list[tuple[str, Any]]:
    """``[(name, node)]`` of the NNX graph nodes ``fn`` reaches without arguments, each once.

    Follows closures, ``functools.partial``, bound methods and named globals, to a small depth.
    """
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def visit(name: str, obj: Any, depth: int) -> None:
        if id(obj) in seen or depth < 0:
            return
        seen.add(id(obj))
        if nnx_graph.is_graph_node(obj):
            found.append((name, obj))
        elif isinstance(obj, functools.partial):
            visit(name, obj.func, depth)
            for i, arg in enumerate(obj.args):
                visit(f"{name}.args[{i}]", arg, depth - 1)
            for key, arg in obj.keywords.items():
                visit(key, arg, depth - 1)
        elif inspect.ismethod(obj):
            visit(f"{name}.__self__", obj.__self__, depth - 1)
            visit(name, obj.__func__, depth)
        elif inspect.isfunction(obj):
            cells = obj.__closure__ or ()
            for var, cell in zip(obj.__code__.co_freevars, cells):
                try:
                    contents = cell.cell_contents
                except ValueError:  # an empty cell (a name assigned later)
                    continue
                visit(var, contents, depth - 1)
            module_globals = obj.__globals__
            for global_name in dict.fromkeys(_code_names(obj.__code__)):
                if global_name in module_globals:
                    visit(global_name, module_globals[global_name], depth - 1)

    visit(getattr(fn, "__name__", "fn"), fn, _MAX_DEPTH)
    return found


def captured_variables(
    fn: Callable[..., Any], exclude: Iterable[Any] = (), kind: Any = nnx.RngState
) -> list[CapturedVariable]:
    """The ``kind`` Variables that ``fn``'s closures and globals reach, minus ``exclude``'s."""
    known = {id(v) for node in exclude for v in _variables(node, nnx.Variable)}
    out: list[CapturedVariable] = []
    for name, node in captured_graph_nodes(fn):
        for path, variable in nnx.to_flat_state(nnx.state(node, kind)):
            if id(variable) in known:
                continue
            known.add(id(variable))
            out.append(CapturedVariable(variable, ".".join([name, *map(str, path)])))
    return out


def implicit_rng_nodes(fn: Callable[..., Any], known: Callable[[], set[int]]) -> list[Any]:
    """The ``nnx.Rngs`` / ``nnx.RngStream`` objects ``fn`` reaches by name only.

    `mp.jit` threads them through the step; ``known()`` gives the ids of Variables passed in.
    """
    candidates = [
        node for _, node in captured_graph_nodes(fn) if isinstance(node, (nnx.Rngs, nnx.RngStream))
    ]
    if not candidates:
        return []
    nodes, seen = [], set(known())
    for node in candidates:
        fresh = [v for v in rng_variables(node) if id(v) not in seen]
        if fresh:
            nodes.append(node)
            seen.update(id(v) for v in fresh)
    return nodes


def rng_variables(node: Any) -> list[nnx.Variable]:
    """The RNG keys and counters of ``node``, in NNX's (path) order."""
    return _variables(node, nnx.RngState)


def _variables(node: Any, kind: Any) -> list[Any]:
    return [v for _, v in nnx.to_flat_state(nnx.state(node, kind))]


def outer_trace_error(captured: Sequence[CapturedVariable]) -> CompileError | None:
    """An error if a captured Variable cannot be written back where we are.

    The new value of a captured RNG counter is stored in its Variable after the
    region; that needs the Variable to belong to the trace running now (the
    step's), which is not so for, e.g., a global ``nnx.Rngs`` under ``nnx.jit``.
    """
    stale = [c.path for c in captured if not variable_belongs_to_current_trace(c.variable)]
    if not stale:
        return None
    return CompileError(
        f"{', '.join(stale)} (RNG state) is captured by the loss function from outside the "
        "jitted step, so its new RNG count cannot be stored back. Pass the nnx.Rngs to the step "
        "as an argument (step(model, optimizer, rngs, batch)) or keep it in the model."
    )


def bound_variables(captured: Sequence[CapturedVariable], values: Sequence[Any]) -> Any:
    """A context in which the captured Variables hold ``values`` of the current trace."""
    return variables_bound_to_current_trace([c.variable for c in captured], values)
