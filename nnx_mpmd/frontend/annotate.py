"""Stage annotations: `Stage`, `PipelinedModel`, and stage metadata on Variables.

Every Variable under a `Stage(module, stage=k)` carries the metadata
``mpmd_stage`` (its owner: the lowest stage that reaches it) and ``mpmd_stages``
(every stage that reaches it, sorted). Optimizer state created after annotation
inherits the metadata of the parameter it belongs to.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Mapping
from typing import Any

from flax import nnx
from flax.nnx import bridge

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

from nnx_mpmd.frontend.scan_stack import ScanStack, split_scan_stacks
from nnx_mpmd.frontend.stage import (
    STAGE_KEY,
    STAGES_KEY,
    ArrayAttribute,
    Stage,
    _tag_variable,
    _variable_stages,
    array_attributes,
    logical_path,
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
            result[path] = logical_path(path, stage_prefixes)
    return result


def _path_text(path: tuple[Any, ...]) -> str:
    return ".".join(str(key) for key in path)


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

    Stage numbers come from the Variables' stage metadata and from `Stage`
    wrappers (so a stage without parameters still counts).

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
        _path_text(path)
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
        stack = by_path.get(path[:-2]) if len(path) >= 2 and path[-2] == "chunks" else None
        if isinstance(stack, ScanStack):
            start, stop = stack.chunk_ranges()[int(path[-1])]
            return f"{_path_text(path[:-2])}[{start}:{stop}]"
        return _path_text(path)

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
        label = owner_paths.get(id(node), _path_text(path[:1]))
        stages = _variable_stages(node)
        if len(stages) > 1:
            label += "*"
            shared_notes.append(
                f"* {_path_text(path)} is shared by stages {tuple(sorted(stages))}; "
                f"counted at stage {stage}"
            )
        if label not in row[2]:
            row[2].append(label)
    for wrapper_path, wrapper in wrappers:
        rows.setdefault(wrapper.stage, [0, 0, []])
        label = label_of(wrapper_path)
        if not any(p.rstrip("*") == label for p in rows[wrapper.stage][2]):
            rows[wrapper.stage][2].append(label)
    order = sorted((s for s in rows if s is not None), key=int)
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


def _matches(pattern: str, names: Mapping[str, Any]) -> list[str]:
    if pattern in names:
        return [pattern]
    found = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
    if found:
        return found
    try:
        regex = re.compile(pattern)
    except re.error:
        return []
    return [name for name in names if regex.fullmatch(name)]


def _is_container(node: Any) -> bool:
    """Whether ``node`` holds layers rather than being one: its elements get the stage.

    Plain lists, tuples and dicts, and ``nnx.List`` / ``nnx.Dict`` (unless a
    subclass makes them callable, in which case the whole module is a layer).
    """
    if isinstance(node, nnx.List | nnx.Dict):
        return not callable(node)
    return isinstance(node, list | tuple | dict)


def _container_items(node: Any) -> list[tuple[Any, Any]]:
    if isinstance(node, nnx.Dict | dict):
        return list(node.items())
    return list(enumerate(node))


def _assignable_nodes(model: Any) -> dict[str, tuple[tuple[Any, ...], Any]]:
    """``{"a.b.0": (path, node)}`` for every module, Variable and container below ``model``."""
    return {
        _path_text(tuple(path)): (tuple(path), node)
        for path, node in nnx.iter_graph(model)
        if path
        and isinstance(node, nnx.Module | nnx.Variable | list | tuple | dict)
        and not any(str(key).startswith("_pytree__") for key in path)
    }


def _child(node: Any, key: Any) -> Any:
    if isinstance(node, nnx.List | nnx.Dict | list | tuple | dict):
        return node[key]
    return getattr(node, key)


def _node_at(root: Any, path: tuple[Any, ...]) -> Any:
    node = root
    for key in path:
        node = _child(node, key)
    return node


def _replace_at(root: Any, path: tuple[Any, ...], value: Any) -> None:
    """Puts ``value`` at ``path``; an element of a tuple is replaced by rebuilding the tuple."""
    parent_path, key = path[:-1], path[-1]
    parent = _node_at(root, parent_path)
    if isinstance(parent, tuple):
        items = list(parent)
        items[key] = value
        rebuilt = type(parent)(*items) if hasattr(parent, "_fields") else type(parent)(items)
        _replace_at(root, parent_path, rebuilt)
    elif isinstance(parent, nnx.List | nnx.Dict | list | dict):
        parent[key] = value
    else:
        setattr(parent, key, value)


def _nearby_paths(pattern: str, nodes: Mapping[str, tuple[tuple[Any, ...], Any]]) -> str:
    """The paths next to where ``pattern`` points: the children of its longest existing
    prefix, then similarly spelled paths."""
    parts = pattern.split(".")
    prefix = ""
    for i in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in nodes:
            prefix = candidate
            break
    depth = len(nodes[prefix][0]) + 1 if prefix else 1
    children = [
        name
        for name, (path, _) in nodes.items()
        if len(path) == depth and (not prefix or name.startswith(prefix + "."))
    ]
    similar = [
        name
        for name in difflib.get_close_matches(pattern, list(nodes), n=5, cutoff=0.6)
        if name not in children and name != prefix
    ]
    text = ", ".join(children[:20]) + (
        f" and {len(children) - 20} more" if len(children) > 20 else ""
    )
    where = f"under {prefix!r}" if prefix else "at the top level"
    if similar:
        text += f"{'; ' if text else ''}similar paths: {', '.join(similar)}"
    return f"Paths {where}: {text}" if text else f"Nothing is {where}"


def _check_not_inside_linen(
    name: str,
    pattern: str,
    path: tuple[Any, ...],
    model: Any,
    nodes: Mapping[str, tuple[tuple[Any, ...], Any]],
) -> None:
    """Refuses a match inside a Linen module: Linen calls its submodules itself."""
    for i in range(len(path)):
        ancestor = _path_text(path[:i])
        node = nodes[ancestor][1] if i else model
        if isinstance(node, bridge.ToNNX):
            where = repr(ancestor) if ancestor else "the model itself"
            raise PartitionError(
                f"assign_stages: {name!r} (from {pattern!r}) is inside the Linen module at "
                f"{where} (nnx.bridge.ToNNX). Linen calls its submodules itself, not "
                "through NNX, so they cannot become stages of their own: assign the whole "
                "ToNNX to one stage, or wrap each Linen submodule in its own ToNNX inside an "
                "NNX model and give those stages."
            )


def _lazy_init_hint(model: Any) -> str:
    """A hint when a Linen module wrapped by ``nnx.bridge.ToNNX`` has no variables yet."""
    empty = [
        _path_text(tuple(path)) or type(node).__name__
        for path, node in nnx.iter_graph(model)
        if isinstance(node, bridge.ToNNX)
        and not any(isinstance(v, nnx.Param) for _, v in nnx.iter_graph(node))
    ]
    if not empty:
        return ""
    return (
        f" {', '.join(empty)} wraps a Linen module whose variables do not exist until its "
        "first call: run nnx.bridge.lazy_init(module, *sample_inputs) before assign_stages."
    )


def _module_paths(pattern: str, nodes: Mapping[str, tuple[tuple[Any, ...], Any]]) -> str:
    """Every module path, for a pattern none of whose prefixes exists (else empty)."""
    parts = pattern.split(".")
    if any(".".join(parts[:i]) in nodes for i in range(1, len(parts))):
        return ""  # the paths under that prefix were listed already
    modules = sorted(
        (n for n, (_, node) in nodes.items() if n and isinstance(node, nnx.Module)),
        key=lambda n: len(nodes[n][0]),
    )
    if not modules:
        return ""
    more = f" and {len(modules) - 15} more" if len(modules) > 15 else ""
    return f" Module paths: {', '.join(modules[:15])}{more}."


def _plan_assignment(
    name: str, path: tuple[Any, ...], node: Any, stage: int, pattern: str
) -> list[tuple[tuple[Any, ...], Any, int]]:
    """``(path, node, stage)`` to tag or wrap for one match; containers give their elements."""
    if isinstance(node, Stage) and node.stage != stage:
        raise PartitionError(
            f"assign_stages: {name!r} is already Stage(stage={node.stage}) but "
            f"{pattern!r} gives it stage {stage}; remove that pattern or change the Stage."
        )
    if not _is_container(node):
        return [(path, node, stage)]
    plan = []
    for key, element in _container_items(node):
        if isinstance(element, nnx.Module | nnx.Variable) or _is_container(element):
            plan += _plan_assignment(f"{name}.{key}", (*path, key), element, stage, pattern)
    return plan


def assign_stages(model: Any, mapping: Mapping[str, int]) -> Any:
    """Annotates a model you did not write, by path pattern.

    Paths are NNX graph paths joined with ``"."`` (``"blocks.3"``,
    ``"head.kernel"``). Each pattern is tried as an exact path, then as an
    ``fnmatch`` glob (``"blocks.*"``), then as a regular expression
    (``re.fullmatch``). Every matching submodule is wrapped in `Stage` in place
    (on its parent attribute, ``nnx.List`` index, ``nnx.Dict`` key, list or
    dict entry, or tuple position, by rebuilding the tuple); a matching Variable
    is only tagged with the stage. A matching *container* (``nnx.List``,
    ``nnx.Dict``, or a list, tuple or dict of modules) is not wrapped itself:
    each of its elements is, so the model can still iterate it, index it, take
    its ``len()`` and call ``.items()``.

    Args:
      model: the NNX module to annotate (changed in place).
      mapping: ``{path_pattern: stage}``.

    Returns:
      ``model``.

    Raises:
      PartitionError: a pattern matches nothing (the error lists the paths
        near it), a stage is not an int >= 0, a module is matched by two
        patterns with different stages, nested matches disagree, or a match is
        already a `Stage` with another stage number.

    Example:
      >>> from flax import nnx
      >>> m = nnx.Dict(a=nnx.Linear(2, 2, rngs=nnx.Rngs(0)), b=nnx.Linear(2, 2, rngs=nnx.Rngs(1)))
      >>> m = assign_stages(m, {"a": 0, "b": 1})
      >>> m["b"], num_stages(m)
      (Stage(Linear, stage=1, remat=False), 2)
      >>> layers = nnx.List([nnx.Linear(2, 2, rngs=nnx.Rngs(i)) for i in range(3)])
      >>> tower = assign_stages(nnx.Dict(layers=layers), {"layers": 0})
      >>> len(tower["layers"]), [layer.stage for layer in tower["layers"]]
      (3, [0, 0, 0])
    """
    mapping = split_scan_stacks(model, mapping)
    nodes = _assignable_nodes(model)
    chosen: dict[str, tuple[int, str]] = {}
    for pattern, stage in mapping.items():
        if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
            raise PartitionError(
                f"assign_stages: pattern {pattern!r} maps to stage {stage!r}; stages must "
                "be ints >= 0."
            )
        names = _matches(str(pattern), nodes)
        if not names:
            raise PartitionError(
                f"assign_stages: pattern {pattern!r} matches no path of "
                f"{type(model).__name__}. {_nearby_paths(str(pattern), nodes)}."
                f"{_module_paths(str(pattern), nodes)} Use an exact path, a glob such as "
                f"'blocks.*', or a regular expression.{_lazy_init_hint(model)}"
            )
        for name in names:
            if name in chosen and chosen[name][0] != stage:
                raise PartitionError(
                    f"assign_stages: {name!r} is matched by {chosen[name][1]!r} (stage "
                    f"{chosen[name][0]}) and by {pattern!r} (stage {stage}); make the "
                    "patterns disjoint or give them the same stage."
                )
            chosen[name] = (stage, str(pattern))
    outermost = []
    for name, (stage, pattern) in chosen.items():
        path = nodes[name][0]
        _check_not_inside_linen(name, pattern, path, model, nodes)
        ancestors = [_path_text(path[:i]) for i in range(1, len(path))]
        enclosing = [a for a in ancestors if a in chosen]
        for ancestor in enclosing:
            if chosen[ancestor][0] != stage:
                raise PartitionError(
                    f"assign_stages: {name!r} gets stage {stage} from {pattern!r} but it is "
                    f"inside {ancestor!r}, which gets stage {chosen[ancestor][0]} from "
                    f"{chosen[ancestor][1]!r}; nested matches must agree. Narrow the "
                    "patterns so each module is matched once."
                )
        if not enclosing:
            outermost.append(name)
    # Check every match before changing anything, so an error leaves the model as it was.
    plan = []
    for name in outermost:
        path, node = nodes[name]
        stage, pattern = chosen[name]
        plan += _plan_assignment(name, path, node, stage, pattern)
    for path, node, stage in plan:
        if isinstance(node, nnx.Variable):
            _tag_variable(node, stage)
        elif not isinstance(node, Stage):
            _replace_at(model, path, Stage(node, stage))
    return model
