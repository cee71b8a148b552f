"""Stage annotations: `Stage`, `PipelinedModel`, and stage metadata on Variables.

Every Variable under a `Stage(module, stage=k)` carries the metadata
``mpmd_stage`` (its owner: the lowest stage that reaches it) and ``mpmd_stages``
(every stage that reaches it, sorted). Optimizer state created after annotation
inherits the metadata of the parameter it belongs to.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flax import nnx

from nnx_mpmd.errors import PartitionError

__all__ = [
    "STAGE_KEY",
    "STAGES_KEY",
    "ArrayAttribute",
    "PipelinedModel",
    "ScanStack",
    "Stage",
    "array_attributes",
    "assign_stages",
    "auto_stage",
    "balanced_partition",
    "logical_paths",
    "num_stages",
    "shared_variables",
    "stage_summary",
    "tag_stage",
    "tag_variables_created_later",
    "validate_stages",
    "variable_stage",
]

from nnx_mpmd.annotate.assign import assign_stages
from nnx_mpmd.annotate.scan_stack import ScanStack
from nnx_mpmd.annotate.stage import (
    STAGE_KEY,
    STAGES_KEY,
    ArrayAttribute,
    Stage,
    _variable_stages,
    array_attributes,
    logical_path,
    path_text,
    tag_stage,
    tag_variables_created_later,
    variable_stage,
)


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
        return num_stages(self)

    def stage_summary(self) -> str:
        """A text table of parameters and bytes per stage; see `stage_summary`."""
        return stage_summary(self)

    def validate(self) -> int:
        """Checks the stage annotations; see `validate_stages`."""
        return validate_stages(self)


def balanced_partition(weights: list[float] | tuple[float, ...], num_stages: int) -> list[int]:
    """Splits a sequence of weights into contiguous stages minimizing the heaviest stage.

    Every stage gets at least one item (so ``len(weights) >= num_stages``). Among
    optimal splits the earliest boundaries win, which makes the result stable.
    It takes O(stages * items * log(items)) time in numpy: 100,000 layers into 32
    stages split in a fraction of a second.

    Args:
      weights: the cost of each item (e.g. parameter bytes of each layer); not negative.
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
    values = [float(w) for w in weights]
    for index, w in enumerate(values):
        if not w >= 0.0:
            raise PartitionError(
                f"layer {index} has weight {weights[index]}; stage balancing needs weights >= 0 "
                "(costs such as bytes or FLOPs)."
            )
    # Sequential sums (np.add.accumulate adds in order), as the scalar programme had.
    prefix = np.concatenate(([0.0], np.add.accumulate(np.asarray(values, dtype=np.float64))))
    # best[i]: minimal heaviest stage when the first i items form k stages (k grows per pass).
    best = prefix - prefix[0]
    cuts = [np.zeros(n + 1, dtype=np.int64)]
    for k in range(2, num_stages + 1):
        best, cut = _next_stage(prefix, best, k, n - (num_stages - k))
        cuts.append(cut)
    stages = [0] * n
    i = n
    for k in range(num_stages, 0, -1):
        j = int(cuts[k - 1][i])
        stages[j:i] = [k - 1] * (i - j)
        i = j
    return stages


def _first_true(predicate: Any, guess: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per entry, the first index in ``[lo, hi)`` where a monotone predicate holds (else hi).

    Starts from ``guess`` (a searchsorted estimate, off by rounding at most) and steps
    until the predicate itself agrees, so the result is exact.
    """
    at = np.clip(guess, lo, hi)
    while True:
        back = at > lo
        back[back] = predicate(at[back] - 1, back)
        ahead = at < hi
        ahead[ahead] = ~predicate(at[ahead], ahead)
        if not (back.any() or ahead.any()):
            return at
        at = at - back + ahead


def _next_stage(
    prefix: np.ndarray, previous: np.ndarray, k: int, last: int
) -> tuple[np.ndarray, np.ndarray]:
    """One step of the split's dynamic programme, from k - 1 stages to k, for every i at once.

    The best cut is found by bisection for all i together (numpy, no per-item loop),
    with the scalar programme's comparisons: same split, ties to the earliest cut.
    """
    best = np.full(len(prefix), np.inf)
    cut = np.zeros(len(prefix), dtype=np.int64)
    if last < k:
        return best, cut
    i = np.arange(k, last + 1)
    total = prefix[i]
    first = np.full(i.shape, k - 1)
    # cross: the first j >= k - 1 with previous[j] >= prefix[i] - prefix[j], or i when none.
    key = previous[k - 1 :] + prefix[k - 1 :]
    guess = np.searchsorted(key, total, side="left") + (k - 1)
    cross = _first_true(lambda j, rows: previous[j] >= total[rows] - prefix[j], guess, first, i)
    # At and right of the crossing previous dominates; left of it the last stage.
    value = np.where(cross < i, previous[np.minimum(cross, len(prefix) - 1)], np.inf)
    j = np.where(cross < i, cross, i)
    left = total - prefix[np.maximum(cross - 1, 0)]
    take = (cross > k - 1) & (left <= value)
    value = np.where(take, left, value)
    # Ties: the earliest cut m with prefix[i] - prefix[m] equal to that value (these
    # differences shrink with m, so the equal ones are the m just before cross).
    before = np.maximum(cross - 1, first)
    guess = np.searchsorted(prefix, prefix[before], side="left")
    tied = _first_true(lambda m, rows: total[rows] - prefix[m] <= value[rows], guess, first, before)
    j = np.where(take, tied, j)
    best[i], cut[i] = value, j
    return best, cut


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

    Drops the ``module`` a `Stage` adds (``blocks.3.module.kernel`` -> ``blocks.3.kernel``).

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
            result[path] = logical_path(path, stage_prefixes)
    return result


def _graph_nodes(node: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """Modules and Variables under ``node`` with their first path (root included)."""
    return [
        (tuple(path), child)
        for path, child in nnx.iter_graph(node)
        if isinstance(child, nnx.Module | nnx.Variable)
        and not any(str(key).startswith("_pytree__") for key in path)
    ]


def _stage_numbers(module: Any) -> set[int]:
    used: set[int] = set()
    for _, node in _graph_nodes(module):
        if isinstance(node, nnx.Variable):
            used |= _variable_stages(node)
        elif isinstance(node, Stage):
            used.add(node.stage)
    return used


def num_stages(module: Any) -> int:
    """Number of stages of ``module``: one more than the highest stage number used.

    Stages come from Variables' metadata and `Stage` wrappers (a stage without parameters counts).

    Args:
      module: any NNX module (or graph node).

    Returns:
      The number of stages, or 0 when nothing is annotated.

    Example:
      >>> from flax import nnx
      >>> m = nnx.Dict(a=Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=2))
      >>> num_stages(m)
      3
    """
    used = _stage_numbers(module)
    return max(used) + 1 if used else 0


def _params_without_stage(module: Any) -> list[str]:
    return [
        path_text(path)
        for path, node in _graph_nodes(module)
        if isinstance(node, nnx.Param) and variable_stage(node) is None
    ]


def validate_stages(module: Any) -> int:
    """Checks that every parameter has a stage and that stage numbers have no gaps.

    Args:
      module: any NNX module.

    Returns:
      The number of stages.

    Raises:
      PartitionError: some ``nnx.Param`` has no stage (every such path is
        listed), the stage numbers skip a value (e.g. 0, 1, 3), or nothing is
        annotated at all.

    Example:
      >>> from flax import nnx
      >>> m = nnx.Dict(a=Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=0))
      >>> validate_stages(m)
      1
    """
    tag_variables_created_later(module)
    problems = []
    missing = _params_without_stage(module)
    if missing:
        problems.append(
            f"{len(missing)} parameter(s) of {type(module).__name__} have no stage: "
            f"{', '.join(missing)}. Wrap the modules that own them in Stage(module, "
            "stage=k), or call assign_stages(model, {path_pattern: k, ...})."
        )
    used = _stage_numbers(module)
    if used:
        gaps = sorted(set(range(max(used) + 1)) - used)
        if gaps:
            problems.append(
                f"{type(module).__name__} uses stages {tuple(sorted(used))} but not "
                f"{tuple(gaps)}; stage numbers must be 0..{max(used)} without gaps. "
                "Renumber the Stage wrappers consecutively."
            )
    elif not missing:
        problems.append(
            f"{type(module).__name__} has no stage annotations; wrap its layers in "
            "Stage(module, stage=k) or call assign_stages(model, {path_pattern: k})."
        )
    if problems:
        raise PartitionError(" ".join(problems))
    return max(used) + 1


def shared_variables(module: Any) -> dict[tuple[Any, ...], tuple[int, ...]]:
    """The Variables reachable from more than one stage (e.g. tied embeddings).

    A shared Variable lives on the mesh of its owner, the lowest of its stages.

    Args:
      module: any NNX module.

    Returns:
      ``{path: stages}`` with the Variable's first graph path and all its stages
      (sorted; the first is the owner).

    Example:
      >>> from flax import nnx
      >>> embed = nnx.Embed(8, 4, rngs=nnx.Rngs(0))
      >>> m = nnx.Dict(a=Stage(embed, stage=0), b=Stage(embed, stage=3))
      >>> shared_variables(m)
      {('a', 'module', 'embedding'): (0, 3)}
    """
    result = {}
    for path, node in _graph_nodes(module):
        if isinstance(node, nnx.Variable):
            stages = _variable_stages(node)
            if len(stages) > 1:
                result[path] = tuple(sorted(stages))
    return result


def _nbytes(value: Any) -> tuple[int, int]:
    size = int(getattr(value, "size", 0) or 0)
    dtype = getattr(value, "dtype", None)
    return size, size * int(getattr(dtype, "itemsize", 0) or 0)


def _compress(paths: list[str]) -> str:
    """``blocks.0, blocks.1, blocks.2`` -> ``blocks.0-2`` (consecutive indices only)."""
    out: list[str] = []
    run: tuple[str, int, int] | None = None  # (prefix, first, last)
    for path in paths:
        prefix, _, last = path.rpartition(".")
        if prefix and last.isdigit():
            index = int(last)
            if run and run[0] == prefix and run[2] + 1 == index:
                run = (prefix, run[1], index)
                continue
            if run:
                out.append(_run_text(run))
            run = (prefix, index, index)
            continue
        if run:
            out.append(_run_text(run))
            run = None
        out.append(path)
    if run:
        out.append(_run_text(run))
    return ", ".join(out)


def _run_text(run: tuple[str, int, int]) -> str:
    prefix, first, last = run
    return f"{prefix}.{first}" if first == last else f"{prefix}.{first}-{last}"


def stage_summary(module: Any) -> str:
    """A text table of the parameters of each stage.

    One row per stage with its parameter count, parameter bytes and the paths of
    the `Stage` wrappers (or tagged Variables) that belong to it. A shared
    parameter is counted once, at its owner (lowest) stage, and marked ``*``.

    Args:
      module: any NNX module.

    Returns:
      The table as a string.

    Example:
      >>> from flax import nnx
      >>> m = nnx.Dict(a=Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=0))
      >>> print(stage_summary(m))
      stage  params  bytes  paths
      0           6     24  a
      total       6     24
    """
    tag_variables_created_later(module)
    nodes = _graph_nodes(module)
    by_path = dict(nodes)

    def label_of(path: tuple[Any, ...]) -> str:
        """A path's text; a `ScanStack` chunk reads as its layer range, ``blocks[0:4]``."""
        stack = by_path.get(path[:-2]) if path[-2:-1] == ("chunks",) else None
        if isinstance(stack, ScanStack):
            start, stop = stack.chunk_ranges()[int(path[-1])]
            return f"{path_text(path[:-2])}[{start}:{stop}]"
        return path_text(path)

    wrappers = [(path, node) for path, node in nodes if isinstance(node, Stage)]
    # The outermost wrapper that reaches a Variable at its owner stage names it.
    owner_paths: dict[int, str] = {}
    for path, wrapper in sorted(wrappers, key=lambda item: len(item[0])):
        for _, child in nnx.iter_graph(wrapper):
            if (
                isinstance(child, nnx.Variable)
                and variable_stage(child) == wrapper.stage
                and id(child) not in owner_paths
            ):
                owner_paths[id(child)] = label_of(path)
    rows: dict[int | None, list[Any]] = {}
    shared_notes = []
    for path, node in nodes:
        if not isinstance(node, nnx.Param):
            continue
        stage = variable_stage(node)
        row = rows.setdefault(stage, [0, 0, []])
        size, nbytes = _nbytes(node.get_value())
        row[0] += size
        row[1] += nbytes
        label = owner_paths.get(id(node), path_text(path[:1]))
        stages = _variable_stages(node)
        if len(stages) > 1:
            label += "*"
            shared_notes.append(
                f"* {path_text(path)} is shared by stages {tuple(sorted(stages))}; "
                f"counted at stage {stage}"
            )
        if label not in row[2]:
            row[2].append(label)
    for wrapper_path, wrapper in wrappers:
        rows.setdefault(wrapper.stage, [0, 0, []])
        label = label_of(wrapper_path)
        if not any(p.rstrip("*") == label for p in rows[wrapper.stage][2]):
            rows[wrapper.stage][2].append(label)
    order: list[int | None] = [*sorted((s for s in rows if s is not None), key=int)]
    if None in rows:
        order.append(None)
    table = [("stage", "params", "bytes", "paths")]
    for stage in order:
        count, nbytes, labels = rows[stage]
        name = "none" if stage is None else str(stage)
        table.append((name, str(count), str(nbytes), _compress(labels)))
    total_count = sum(row[0] for row in rows.values())
    total_bytes = sum(row[1] for row in rows.values())
    table.append(("total", str(total_count), str(total_bytes), ""))
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    lines = []
    for row in table:
        cells = [row[0].ljust(widths[0]), row[1].rjust(widths[1]), row[2].rjust(widths[2])]
        lines.append("  ".join([*cells, row[3]]).rstrip())
    return "\n".join(lines + shared_notes)
