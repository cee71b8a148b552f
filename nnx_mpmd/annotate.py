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
