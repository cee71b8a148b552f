"""A step's arguments read once per call: bound, flattened, typed and keyed.

`StepArguments` belongs to one ``mp.jit`` step. ``read(args, kwargs)`` binds
the arguments to the step's positional parameters (wrapping static ones),
flattens them into NNX state leaves and other leaves, gives each leaf its
`PlacedAval` and hashes the cache key, once, into a `StepCall` that every
stage then shares. ``placed(call)`` moves state that is not where the
schedule wants it and reads the moved leaves back without walking the graph.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax

from nnx_mpmd.compiler.trace.stage_programs import check_mesh_context
from nnx_mpmd.compiler.trace.trace_step import (
    FlatArgs,
    flatten_step_args,
    refreshed_flat_args,
    reusable_flat_args,
)
from nnx_mpmd.errors import CompileError, ScheduleError
from nnx_mpmd.jit import graph_key
from nnx_mpmd.jit.donation import donated_positions, donated_state_leaves
from nnx_mpmd.jit.options import JitOptions
from nnx_mpmd.jit.static_args import argument_positions, check_disjoint, wrap_static
from nnx_mpmd.placement.abstract import PlacedAval, placed_aval, planned_avals
from nnx_mpmd.placement.place import place

__all__ = ["StepArguments", "StepCall", "StepSignature"]


class StepSignature:
    """A step's cache key, hashed once, its graphdef's hash given.

    A dict look-up and its LRU move would hash a tuple key twice, and a Flax
    graphdef recomputes its hash over every node each time.
    """

    __slots__ = ("_hash", "graphdef", "rest")

    graphdef: Any
    rest: tuple[Any, ...]
    _hash: int

    def __init__(self, graphdef: Any, graphdef_hash: int, rest: tuple[Any, ...]) -> None:
        self.graphdef, self.rest = graphdef, rest
        self._hash = hash((graphdef_hash, rest))

    def __hash__(self) -> int:
        return self._hash

    def frozen(self) -> StepSignature:
        """This key as the cache stores it: unhashable static values copied (`frozen_graphdef`)."""
        stored = object.__new__(StepSignature)
        stored.graphdef = graph_key.frozen_graphdef(self.graphdef)
        stored.rest, stored._hash = self.rest, self._hash
        return stored

    def __getitem__(self, index: Any) -> Any:
        """Reads like the tuple ``(graphdef, state_tree, args_tree, state keys, other keys)``."""
        return (self.graphdef, *self.rest)[index]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepSignature):
            return NotImplemented
        return (
            self._hash == other._hash
            and (self.graphdef is other.graphdef or self.graphdef == other.graphdef)
            and self.rest == other.rest
        )


@dataclasses.dataclass(frozen=True)
class StepCall:
    """One call's arguments, read once: flattened leaves, their avals and the cache key."""

    flat: FlatArgs
    state_avals: list[PlacedAval]
    other_avals: list[PlacedAval]
    signature: StepSignature

    def inputs(self, consts: list[Any]) -> list[Any]:
        """The step's inputs in order: ``consts``, then state leaves, then other leaves."""
        return [*consts, *self.flat.state_leaves, *self.flat.other_leaves]

    def abstract_inputs(self, consts: list[PlacedAval]) -> list[PlacedAval]:
        """The same as avals: what ahead-of-time compilation sees."""
        return [*consts, *self.state_avals, *self.other_avals]


class StepArguments:
    """How one step reads its arguments: positions of static and donated ones, and caches.

    Args:
      fn: the step.
      options: its `JitOptions`.
    """

    def __init__(self, fn: Callable[..., Any], options: JitOptions) -> None:
        self.fn = fn
        self.options = options
        self.name: str = getattr(fn, "__name__", "step")
        self.donated: frozenset[int] = donated_positions(
            fn, options.donate_argnums, options.donate_argnames
        )
        self.static: frozenset[int] = argument_positions(
            fn, options.static_argnums, options.static_argnames, "static"
        )
        check_disjoint(self.static, self.donated)
        self._last_graphdef: tuple[Any, int] = (None, 0)  # (graphdef, its hash)
        # Under `nnx.cached_partial`: the structure of its private node copies'
        # flattened arguments (no arrays), by id of its node cache; an entry goes
        # when that cache does (with the partial), so no dropped model stays alive.
        self._cached_partial_args: dict[int, tuple[weakref.ref, FlatArgs]] = {}

    def read(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], partial_nodes: Any = None
    ) -> StepCall:
        """The call's arguments as they are now (state where it is)."""
        check_mesh_context(self.options.mesh)  # before placing: no jax.set_mesh around it
        flat = self._flatten(self.positional(args, kwargs), partial_nodes)
        mesh = self.options.mesh
        state_avals = [placed_aval(x, mesh) for x in flat.state_leaves]
        other_avals = [placed_aval(x, mesh) for x in flat.other_leaves]
        return self._call(flat, state_avals, other_avals)

    def read_planned(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> StepCall:
        """The call's arguments with state typed where `placed` would put it (nothing moves)."""
        check_mesh_context(self.options.mesh)
        flat = flatten_step_args(self.fn, self.positional(args, kwargs))
        other_avals = [placed_aval(x, self.options.mesh) for x in flat.other_leaves]
        return self._call(flat, self._planned(flat), other_avals)

    def placed(self, call: StepCall) -> StepCall:
        """``call`` with its state moved where the schedule wants it (placed leaves stay)."""
        options = self.options
        variables = call.flat.variables
        metadata = None if variables is None else [dict(v.get_metadata()) for v in variables]
        try:
            place(call.flat.nodes, options.mesh, options.schedule)
        except ScheduleError as e:
            raise self._placement_error(e) from None
        if (
            metadata is not None
            and variables is not None
            and _metadata_changed(variables, metadata)
        ):
            # Placement tagged Variables (a bridged Linen module's, made after its Stage):
            # the graphdef changed with them, so the call is read again.
            flat = flatten_step_args(self.fn, self._args_of(call.flat))
        else:
            flat = self._refreshed(call.flat)
        before, after = call.flat.state_leaves, flat.state_leaves
        if len(before) == len(after) and all(a is b for a, b in zip(before, after)):
            return call  # nothing moved: the call's avals and key stand
        state_avals = [placed_aval(x, options.mesh) for x in flat.state_leaves]
        return self._call(flat, state_avals, call.other_avals)

    def donated_state(self, flat: FlatArgs) -> frozenset[int]:
        """Indices of the state leaves the step may reuse (``donate_argnums``)."""
        return donated_state_leaves(flat, self.donated)

    def positional(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """``args`` and ``kwargs`` as the step's positional arguments, static ones wrapped.

        A parameter left out before one given by keyword takes its default.
        """
        return wrap_static(self._bound(args, kwargs), self.static, self.name)

    def _bound(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        if not kwargs:
            return args
        try:
            bound = inspect.signature(self.fn).bind(*args, **kwargs)
        except TypeError as e:
            raise CompileError(f"cannot call {self.name} with these arguments: {e}.") from None
        positional = [
            p
            for p in bound.signature.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        given = [i for i, p in enumerate(positional) if p.name in bound.arguments]
        for p in positional[: max(given, default=-1) + 1]:  # a default before a given one
            bound.arguments.setdefault(p.name, p.default)
        if bound.kwargs:
            raise CompileError(
                f"{self.name} takes {', '.join(sorted(bound.kwargs))} by keyword only; mp.jit "
                "passes a step's arguments by position: make them ordinary parameters "
                "(before any *args) or pass them positionally."
            )
        return bound.args

    def _call(
        self, flat: FlatArgs, state_avals: list[PlacedAval], other_avals: list[PlacedAval]
    ) -> StepCall:
        return StepCall(
            flat, state_avals, other_avals, self._signature(flat, state_avals, other_avals)
        )

    def _signature(
        self, flat: FlatArgs, state_avals: list[PlacedAval], other_avals: list[PlacedAval]
    ) -> StepSignature:
        """The cache key: structure, shapes, dtypes and placements of the arguments.

        A graphdef equal to the last one seen is replaced by that object, so
        comparing keys finds it by identity.
        """
        graphdef = flat.graphdef
        last, last_hash = self._last_graphdef
        if last is not None and (last is graphdef or last == graphdef):
            graphdef, graphdef_hash = last, last_hash
        else:
            graphdef_hash = graph_key.graphdef_hash(graphdef)
            self._last_graphdef = (graphdef, graphdef_hash)
        rest = (
            flat.state_tree,
            flat.args_tree,
            tuple(a.key() for a in state_avals),
            tuple(a.key() for a in other_avals),
        )
        return StepSignature(graphdef, graphdef_hash, rest)

    def _planned(self, flat: FlatArgs) -> list[PlacedAval]:
        """Where the state leaves will live once placed (no data moves)."""
        options = self.options
        try:
            return planned_avals(flat.nodes, flat.state_leaves, options.mesh, options.schedule)
        except ScheduleError as e:
            raise self._placement_error(e) from None

    def _placement_error(self, e: ScheduleError) -> ScheduleError:
        options = self.options
        return ScheduleError(
            f"{type(options.schedule).__name__} cannot place this step's state on "
            f"{options.mesh.num_meshes} meshes: {e}"
        )

    def _refreshed(self, flat: FlatArgs) -> FlatArgs:
        """``flat`` with the arrays its Variables hold now; flattened again only if it must."""
        if flat.variables is None:
            return flatten_step_args(self.fn, self._args_of(flat))
        state_leaves = [variable.get_raw_value() for variable in flat.variables]
        return dataclasses.replace(flat, state_leaves=state_leaves)

    @staticmethod
    def _args_of(flat: FlatArgs) -> tuple[Any, ...]:
        return jax.tree.unflatten(flat.args_tree, flat.args_leaves)

    def _flatten(self, args: tuple[Any, ...], partial_nodes: Any) -> FlatArgs:
        """The step's arguments flattened; under `nnx.cached_partial`, without walking the graph.

        ``nnx.cached_partial(step, model, optimizer)`` passes private copies of
        the nodes whose structure cannot change (``partial_nodes`` is its node
        cache), so after the first call their flattening is kept and only the
        Variables' arrays are read again.
        """
        if partial_nodes is None:
            return flatten_step_args(self.fn, args)
        known = self._cached_partial_args.get(id(partial_nodes))
        if known is not None and known[0]() is partial_nodes:
            flat = refreshed_flat_args(known[1], self.fn, args)
            if flat is not None:
                return flat
        flat = flatten_step_args(self.fn, args)
        if reusable_flat_args(flat, partial_nodes):
            key, entries = id(partial_nodes), self._cached_partial_args
            ref = weakref.ref(partial_nodes, lambda _: entries.pop(key, None))
            structure = dataclasses.replace(flat, state_leaves=[], other_leaves=[], args_leaves=[])
            self._cached_partial_args[key] = (ref, structure)
        return flat


def _metadata_changed(variables: Sequence[Any], before: Sequence[dict[str, Any]]) -> bool:
    """Whether any Variable's metadata differs from ``before`` (part of the graphdef)."""
    return any(dict(v.get_metadata()) != m for v, m in zip(variables, before, strict=True))
