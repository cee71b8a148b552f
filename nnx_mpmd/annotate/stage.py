"""`Stage`: the wrapper that marks a module as one pipeline stage, and stage metadata.

Every Variable under a `Stage(module, stage=k)` carries the metadata
``mpmd_stage`` (its owner: the lowest stage that reaches it) and ``mpmd_stages``
(every stage that reaches it, sorted). Optimizer state created after annotation
inherits the metadata of the parameter it belongs to.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from flax import nnx

from nnx_mpmd.annotate import markers
from nnx_mpmd.errors import PartitionError

__all__ = [
    "STAGES_KEY",
    "STAGE_KEY",
    "ArrayAttribute",
    "Stage",
    "array_attributes",
    "logical_path",
    "path_text",
    "recording_stage_calls",
    "tag_stage",
    "tag_variables_created_later",
    "variable_stage",
]

STAGE_KEY = "mpmd_stage"
STAGES_KEY = "mpmd_stages"


# Lists that `recording_stage_calls` blocks append every called Stage to (innermost last).
_RECORDERS: list[list[Any]] = []


@contextlib.contextmanager
def recording_stage_calls() -> Iterator[list[Any]]:
    """Records every `Stage` called inside the block, in call order, in the list it yields.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> layer = Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=0)
      >>> with recording_stage_calls() as calls:
      ...     _ = layer(jnp.ones((1, 2)))
      >>> calls == [layer]
      True
    """
    calls: list[Any] = []
    _RECORDERS.append(calls)
    try:
        yield calls
    finally:
        _RECORDERS.remove(calls)


def variable_stage(variable: nnx.Variable) -> int | None:
    """The owning stage recorded on ``variable``.

    Args:
      variable: any NNX Variable.

    Returns:
      Its ``mpmd_stage`` metadata (the lowest stage that reaches it), or None.

    Example:
      >>> from flax import nnx
      >>> variable_stage(nnx.Param(1.0, mpmd_stage=2)), variable_stage(nnx.Param(1.0))
      (2, None)
    """
    return variable.get_metadata().get(STAGE_KEY)


def tag_stage(module: Any, stage: int) -> None:
    """Records ``stage`` on every Variable under ``module``.

    A Variable already tagged with another stage becomes shared (owner: the lowest).

    Args:
      module: an NNX graph node (module, Variable container).
      stage: the stage number to record.

    Example:
      >>> from flax import nnx
      >>> layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
      >>> tag_stage(layer, 3); tag_stage(layer, 1)
      >>> layer.kernel.get_metadata()["mpmd_stages"]
      (1, 3)
    """
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Variable):
            _tag_variable(node, stage)


def tag_variables_created_later(node: Any) -> None:
    """Tags the Variables a `Stage` under ``node`` holds but did not see when it was made.

    For Variables created later (``nnx.bridge.lazy_init``, assigning ``stage.module``).

    Args:
      node: an NNX graph node (the model); anything else is left alone.

    Example:
      >>> from flax import nnx
      >>> layer = Stage(nnx.Module(), stage=1)
      >>> layer.module.w = nnx.Param(1.0)
      >>> tag_variables_created_later(layer)
      >>> variable_stage(layer.module.w)
      1
    """
    if not isinstance(node, nnx.Pytree):
        return
    for _, child in nnx.iter_graph(node):
        if isinstance(child, Stage):
            for _, leaf in nnx.iter_graph(child.module):
                if isinstance(leaf, nnx.Variable) and child.stage not in _variable_stages(leaf):
                    _tag_variable(leaf, child.stage)


def _variable_stages(variable: nnx.Variable) -> set[int]:
    metadata = variable.get_metadata()
    stages = set(metadata.get(STAGES_KEY, ()))
    if metadata.get(STAGE_KEY) is not None:
        stages.add(metadata[STAGE_KEY])
    return stages


def _tag_variable(variable: nnx.Variable, stage: int) -> None:
    stages = _variable_stages(variable) | {stage}
    variable.set_metadata(**{STAGE_KEY: min(stages), STAGES_KEY: tuple(sorted(stages))})


class Stage(nnx.Module):
    """Wraps a module so that it runs as (part of) pipeline stage ``stage``.

    Calling the `Stage` calls the wrapped module. Several `Stage` wrappers may
    carry the same stage number; consecutive calls of one stage form one stage
    task. The wrapped module stays reachable as ``stage.module`` so its other
    methods (for example ``nnx.Embed.attend``) can be used.

    Args:
      module: the module to wrap.
      stage: the logical stage number (>= 0).
      remat: recompute the stage's forward during its backward pass instead of
        keeping its residuals (the forward task keeps only the stage input).
      policy: an optional ``jax.checkpoint`` policy used when ``remat`` is True.

    Example:
      >>> from flax import nnx
      >>> import nnx_mpmd as mp
      >>> layer = mp.Stage(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), stage=1)
      >>> layer.module.kernel.get_metadata()["mpmd_stage"]
      1
    """

    def __init__(
        self,
        module: Any,
        stage: int,
        *,
        remat: bool = False,
        policy: Callable[..., Any] | None = None,
    ) -> None:
        if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
            raise PartitionError(
                f"Stage(stage={stage!r}) for {type(module).__name__}: the stage number "
                "must be an int >= 0."
            )
        self.module = module
        self.stage = stage
        self.remat = remat
        self.policy = policy
        tag_stage(module, stage)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _RECORDERS:
            _RECORDERS[-1].append(self)
        return markers.call_stage(
            self.stage,
            self.module,
            args,
            kwargs,
            remat=self.remat,
            policy=self.policy,
            where=f" ({type(self.module).__name__})",
        )

    def __getattr__(self, name: str) -> Any:
        # Runs only when normal lookup fails: forward to the wrapped module so that
        # e.g. ``stage.attend(x)`` works. While NNX rebuilds a graph, ``module`` may
        # not be set yet; internal names are never forwarded.
        if name.startswith("__") or name.startswith("_pytree__"):
            raise AttributeError(name)
        module = object.__getattribute__(self, "__dict__").get("module")
        if module is None:
            raise AttributeError(f"'Stage' object has no attribute {name!r}")
        return getattr(module, name)

    def __repr__(self) -> str:
        return f"Stage({type(self.module).__name__}, stage={self.stage}, remat={self.remat})"


class ArrayAttribute(NamedTuple):
    """An array a module holds as a plain attribute (Flax data, not a Variable).

    Attributes:
      path: its graph path.
      logical: the path without `Stage`'s ``module`` component (as `logical_paths`).
      stage: the stage of the innermost `Stage` that holds it, or None.
      value: the array.
    """

    path: tuple[Any, ...]
    logical: tuple[Any, ...]
    stage: int | None
    value: Any


def array_attributes(node: Any) -> list[ArrayAttribute]:
    """The arrays held as plain attributes under ``node`` (``self.table = jnp...``).

    Flax keeps them as state leaves without metadata; their stage is their `Stage`'s.

    Args:
      node: an NNX graph node.

    Returns:
      One `ArrayAttribute` per array, under its first path.

    Example:
      >>> import jax.numpy as jnp
      >>> block = nnx.Module()
      >>> block.table = jnp.zeros(3)
      >>> m = nnx.Dict(a=Stage(block, stage=2))
      >>> [(a.path, a.logical, a.stage) for a in array_attributes(m)]
      [(('a', 'module', 'table'), ('a', 'table'), 2)]
    """
    leaves = [
        (tuple(path), leaf)
        for path, leaf in nnx.to_flat_state(nnx.state(node))
        if not isinstance(leaf, nnx.Variable | bool | int | float | complex | str)
        and hasattr(leaf, "shape")
    ]
    if not leaves:
        return []
    stages = {
        tuple(path): child.stage for path, child in nnx.iter_graph(node) if isinstance(child, Stage)
    }
    found = []
    for path, leaf in leaves:
        owner = next(
            (stages[path[:k]] for k in range(len(path) - 1, -1, -1) if path[:k] in stages), None
        )
        found.append(ArrayAttribute(path, logical_path(path, stages), owner, leaf))
    return found


def logical_path(path: tuple[Any, ...], stage_paths: Any) -> tuple[Any, ...]:
    """``path`` without the ``module`` component of each `Stage` at ``stage_paths``.

    Example:
      >>> logical_path(("blocks", 3, "module", "kernel"), {("blocks", 3)})
      ('blocks', 3, 'kernel')
    """
    return tuple(
        key for i, key in enumerate(path) if not (key == "module" and path[:i] in stage_paths)
    )


def path_text(path: tuple[Any, ...]) -> str:
    """A graph path as text, its keys joined with dots.

    Example:
      >>> path_text(("blocks", 3, "kernel"))
      'blocks.3.kernel'
    """
    return ".".join(str(key) for key in path)
