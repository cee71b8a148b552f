"""`assign_stages`: annotating a model you did not write, by path pattern.

Each pattern is matched against the model's graph paths; matched modules are
wrapped in `Stage` in place (containers element by element) and matched
Variables are tagged. Every match is checked before anything changes, so an
error leaves the model as it was.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Mapping
from typing import Any

from flax import nnx
from flax.nnx import bridge

from nnx_mpmd.annotate.scan_stack import split_scan_stacks
from nnx_mpmd.annotate.stage import Stage, _tag_variable, path_text
from nnx_mpmd.errors import PartitionError

__all__ = ["assign_stages"]


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
    """Whether ``node`` holds layers (list, tuple, dict, non-callable ``nnx.List``/``nnx.Dict``)."""
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
        path_text(tuple(path)): (tuple(path), node)
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
        ancestor = path_text(path[:i])
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
        path_text(tuple(path)) or type(node).__name__
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
      >>> m["b"], m["b"].module.kernel.get_metadata()["mpmd_stage"]
      (Stage(Linear, stage=1, remat=False), 1)
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
        ancestors = [path_text(path[:i]) for i in range(1, len(path))]
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
