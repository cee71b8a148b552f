"""The units a planner moves between stages: a model's `Stage` wrappers, in call order.

A planned model is the user's model with its `Stage` wrappers renumbered: the
planner never rewrites the model's code, it only chooses which stage each
wrapper (a *unit*) belongs to and whether that stage recomputes its forward
(remat). `stage_units` finds the units in the order the loss calls them;
`restage` renumbers them, re-tagging every Variable so that tied parameters
stay shared correctly.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from nnx_mpmd.annotate.stage import (
    STAGE_KEY,
    STAGES_KEY,
    Stage,
    path_text,
    recording_stage_calls,
    tag_stage,
)
from nnx_mpmd.errors import PartitionError

__all__ = ["restage", "stage_units"]


def stage_units(
    model: Any, loss_fn: Callable[[Any, Any], Any], batch: Any
) -> list[tuple[str, Stage]]:
    """The model's `Stage` wrappers, in the order ``loss_fn(model, batch)`` calls them.

    Only shapes are evaluated (``jax.eval_shape``): nothing runs on a device.

    Args:
      model: a model whose layers are wrapped in `Stage` (by the model or by
        `nnx_mpmd.assign_stages`).
      loss_fn: ``loss_fn(model, batch) -> loss``.
      batch: a batch (a microbatch is enough).

    Returns:
      ``(path, stage wrapper)`` per unit, in call order.

    Raises:
      PartitionError: the loss calls no `Stage`, or calls one twice.

    Example:
      >>> import jax.numpy as jnp
      >>> import nnx_mpmd as mp
      >>> model = nnx.Dict(a=mp.Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=0),
      ...                  b=mp.Stage(nnx.Linear(2, 1, rngs=nnx.Rngs(1)), stage=1))
      >>> loss = lambda m, x: jnp.mean(m["b"](m["a"](x)))
      >>> [path for path, _ in stage_units(model, loss, jnp.ones((2, 2)))]
      ['a', 'b']
    """
    by_path: dict[Any, Stage] = {
        path: node for path, node in nnx.iter_graph(model) if isinstance(node, Stage)
    }
    graphdef, state = nnx.split(model)
    called: list[Any] = []

    # The model goes in as traced state (a ScanStack's nnx.scan refuses Variables of
    # an outer trace level); its copy's Stage calls are mapped back by path.
    def trace(state: Any) -> Any:
        local = nnx.merge(graphdef, state)
        local_paths = {id(n): p for p, n in nnx.iter_graph(local) if isinstance(n, Stage)}
        with recording_stage_calls() as calls:
            out = loss_fn(local, batch)
        called.extend(by_path.get(local_paths.get(id(c)), c) for c in calls)
        return out

    jax.eval_shape(trace, state)
    paths = {id(node): path for path, node in by_path.items()}
    if not called:
        raise PartitionError(
            f"the loss calls no Stage of {type(model).__name__}; wrap its layers in mp.Stage "
            "or annotate them with mp.assign_stages before planning."
        )
    units, seen = [], set()
    for stage in called:
        if id(stage) in seen:
            raise PartitionError(
                f"the loss calls the Stage at {path_text(paths.get(id(stage), ()))!r} twice; "
                "the planner moves each Stage wrapper as one unit, so each must run once "
                "per forward. Wrap the repeated layer's callers instead."
            )
        seen.add(id(stage))
        units.append((path_text(paths.get(id(stage), ())), stage))
    return units


def restage(
    units: Sequence[tuple[str, Stage]],
    stages: Sequence[int],
    remat: Sequence[bool] | None = None,
) -> None:
    """Renumbers the units' stages (and remat flags) in place, re-tagging their Variables.

    Args:
      units: from `stage_units`.
      stages: the new stage of each unit: non-decreasing, from 0, no gap.
      remat: per *stage*, whether it recomputes its forward (default: none).

    Raises:
      PartitionError: the stages are not a contiguous non-decreasing split.

    Example:
      >>> import jax.numpy as jnp
      >>> import nnx_mpmd as mp
      >>> model = nnx.Dict(a=mp.Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=0),
      ...                  b=mp.Stage(nnx.Linear(2, 1, rngs=nnx.Rngs(1)), stage=1))
      >>> units = stage_units(model, lambda m, x: jnp.mean(m["b"](m["a"](x))), jnp.ones((2, 2)))
      >>> restage(units, [0, 0], remat=[True])
      >>> model["b"], mp.annotate.num_stages(model)
      (Stage(Linear, stage=0, remat=True), 1)
    """
    stages = [int(s) for s in stages]
    steps = [b - a for a, b in itertools.pairwise(stages)]
    contiguous = bool(stages) and stages[0] == 0 and all(step in (0, 1) for step in steps)
    if len(stages) != len(units) or not contiguous:
        raise PartitionError(
            f"restage: {len(units)} units need a non-decreasing stage per unit starting at 0 "
            f"with no gap, got {stages}."
        )
    remat = list(remat) if remat is not None else [False] * (stages[-1] + 1)
    if len(remat) != stages[-1] + 1:
        raise PartitionError(
            f"restage: {stages[-1] + 1} stages need one remat flag each, got {len(remat)}."
        )
    for _, unit in units:
        for _, node in nnx.iter_graph(unit):
            if isinstance(node, nnx.Variable):
                node.set_metadata(**{STAGE_KEY: None, STAGES_KEY: ()})
    for (_, unit), stage in zip(units, stages, strict=True):
        unit.stage = stage
        unit.remat = bool(remat[stage])
        tag_stage(unit.module, stage)
