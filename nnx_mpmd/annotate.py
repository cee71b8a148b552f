"""Stage annotations: `Stage`, `PipelinedModel`, and stage metadata on Variables.

Every Variable under a `Stage(module, stage=k)` carries the metadata
``mpmd_stage`` (its owner: the lowest stage that reaches it) and ``mpmd_stages``
(every stage that reaches it, sorted). Optimizer state created after annotation
inherits the metadata of the parameter it belongs to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx

from nnx_mpmd import markers
from nnx_mpmd.errors import PartitionError

__all__ = [
    "STAGE_KEY",
    "STAGES_KEY",
    "PipelinedModel",
    "Stage",
    "auto_stage",
    "balanced_partition",
    "logical_paths",
    "tag_stage",
    "variable_stage",
]

STAGE_KEY = "mpmd_stage"
STAGES_KEY = "mpmd_stages"


def variable_stage(variable: nnx.Variable) -> int | None:
    """The owning stage recorded on ``variable``, or None if it has none."""
    return variable.get_metadata().get(STAGE_KEY)


def tag_stage(module: Any, stage: int) -> None:
    """Records ``stage`` on every Variable under ``module``.

    A Variable already tagged with another stage becomes shared: its owner is
    the lowest stage and ``mpmd_stages`` lists all of them.
    """
    for _, node in nnx.iter_graph(module):
        if not isinstance(node, nnx.Variable):
            continue
        metadata = node.get_metadata()
        stages = set(metadata.get(STAGES_KEY, ()))
        if STAGE_KEY in metadata:
            stages.add(metadata[STAGE_KEY])
        stages.add(stage)
        node.set_metadata(**{STAGE_KEY: min(stages), STAGES_KEY: tuple(sorted(stages))})


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
        return markers.call_stage(
            self.stage,
            self.module,
            args,
            kwargs,
            remat=self.remat,
            policy=self.policy,
            where=f" ({type(self.module).__name__})",
        )

    def __repr__(self) -> str:
        return f"Stage({type(self.module).__name__}, stage={self.stage}, remat={self.remat})"


class PipelinedModel(nnx.Module):
    """Base class for models whose layers are wrapped in `Stage`.

    Example:
      >>> from flax import nnx
      >>> import nnx_mpmd as mp
      >>> class Two(mp.PipelinedModel):
      ...     def __init__(self, rngs):
      ...         self.a = mp.Stage(nnx.Linear(2, 2, rngs=rngs), stage=0)
      ...         self.b = mp.Stage(nnx.Linear(2, 2, rngs=rngs), stage=1)
      ...     def __call__(self, x):
      ...         return self.b(self.a(x))
      >>> Two(nnx.Rngs(0)).num_stages
      2
    """

    @property
    def num_stages(self) -> int:
        """Number of stages: one more than the highest stage number used."""
        stages = [
            variable_stage(node)
            for _, node in nnx.iter_graph(self)
            if isinstance(node, nnx.Variable)
        ]
        stages = [s for s in stages if s is not None]
        return max(stages) + 1 if stages else 0


def balanced_partition(weights: list[float] | tuple[float, ...], num_stages: int) -> list[int]:
    """Splits a sequence of weights into contiguous stages minimizing the heaviest stage.

    Every stage gets at least one item (so ``len(weights) >= num_stages``). Among
    optimal splits the earliest boundaries win, which makes the result stable.

    Args:
      weights: the cost of each item (e.g. parameter bytes of each layer).
      num_stages: how many contiguous stages to form.

    Returns:
      The stage number of each item: non-decreasing, from 0 to ``num_stages - 1``.

    Example:
      >>> balanced_partition([1, 1, 1, 3], 2)
      [0, 0, 0, 1]
    """
    n = len(weights)
    if num_stages < 1 or n < num_stages:
        raise PartitionError(
            f"cannot split {n} layers into {num_stages} non-empty stages; use at most "
            f"{n} stages or add layers."
        )
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[k][i]: minimal heaviest stage when the first i items form k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    stages = [0] * n
    i = n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        stages[j:i] = [k - 1] * (i - j)
        i = j
    return stages


def _parameter_bytes(module: Any) -> int:
    total = 0
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Param):
            value = node.get_value()
            total += int(getattr(value, "size", 0)) * getattr(value.dtype, "itemsize", 4)
    return total


def auto_stage(layers: Any, num_stages: int, *, weights: list[float] | None = None) -> list[int]:
    """Assigns contiguous stages to a sequence of layers, balancing parameter bytes.

    The split is optimal: no contiguous split has a lighter heaviest stage.

    Args:
      layers: a sequence of NNX modules (or anything, when ``weights`` is given).
      num_stages: how many stages to form; every stage gets at least one layer.
      weights: optional per-layer costs to balance instead of parameter bytes.

    Returns:
      The stage number of each layer, non-decreasing from 0 to ``num_stages - 1``.

    Example:
      >>> from flax import nnx
      >>> layers = [nnx.Linear(8, 8, rngs=nnx.Rngs(0)) for _ in range(4)]
      >>> auto_stage(layers, 2)
      [0, 0, 1, 1]
    """
    layers = list(layers)
    if weights is None:
        weights = [_parameter_bytes(layer) for layer in layers]
    elif len(weights) != len(layers):
        raise PartitionError(
            f"auto_stage got {len(layers)} layers but {len(weights)} weights; pass one "
            "weight per layer."
        )
    return balanced_partition(list(weights), num_stages)


def logical_paths(node: Any) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    """Maps each Variable's graph path under ``node`` to its logical path.

    The logical path drops the ``module`` attribute that a `Stage` wrapper adds,
    so ``blocks.3.module.kernel`` becomes ``blocks.3.kernel``: a staged model and
    the same model without `Stage` have the same logical paths. A Variable
    reachable by several paths is listed once, under its first path.

    Args:
      node: an NNX graph node (model, optimizer, or a tuple/dict of them).

    Returns:
      ``{physical_path: logical_path}`` for every Variable.

    Example:
      >>> from flax import nnx
      >>> m = nnx.Dict(a=Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=0))
      >>> logical_paths(m)[("a", "module", "kernel")]
      ('a', 'kernel')
    """
    nodes = [(tuple(path), child) for path, child in nnx.iter_graph(node)]
    # iter_graph yields children before their parents: find the wrappers first.
    stage_prefixes = {path for path, child in nodes if isinstance(child, Stage)}
    result: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    for path, child in nodes:
        if isinstance(child, nnx.Variable):
            logical = [
                key
                for i, key in enumerate(path)
                if not (key == "module" and tuple(path[:i]) in stage_prefixes)
            ]
            result[path] = tuple(logical)
    return result
