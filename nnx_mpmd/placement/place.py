"""`place` NNX state on its submeshes, and `gather` it back to ordinary arrays.

Where each leaf goes is decided by `placement_decisions` (pure: it moves
nothing) from `nnx_mpmd.placement.partition.placement_of`; `place` then moves
only the leaves that are not already there.

Example:
    >>> import jax
    >>> from flax import nnx
    >>> from nnx_mpmd.annotate.annotate import Stage
    >>> from nnx_mpmd.placement.partition import leaf_mesh_ids
    >>> mesh = MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
    >>> model = nnx.Dict(a=Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=3))
    >>> _ = place(model, mesh)
    >>> leaf_mesh_ids(model["a"].module.kernel.get_value(), mesh)
    (3,)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.core
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnx_mpmd._jax_compat import config_value
from nnx_mpmd.annotate.annotate import (
    STAGE_KEY,
    _variable_stages,
    array_attributes,
    logical_paths,
    tag_variables_created_later,
    variable_stage,
)
from nnx_mpmd.errors import PlacementError
from nnx_mpmd.placement.mesh import MpmdMesh
from nnx_mpmd.placement.mpmd_array import MpmdArray
from nnx_mpmd.placement.partition import Path, _path_text, placement_of
from nnx_mpmd.schedules.registry import get_schedule

__all__ = ["gather", "place", "placement_decisions"]


# ------------------------------------------------------------------ place / gather

_PLACEABLE = (jax.Array, np.ndarray, np.generic, MpmdArray, int, float, complex)


def _roots(tree: Any) -> list[Any]:
    """The NNX objects, States and Variables in a tree of tuples/lists/dicts."""
    if isinstance(tree, nnx.State | nnx.Pytree | nnx.Variable):
        return [tree]
    if isinstance(tree, tuple | list):
        return [root for item in tree for root in _roots(item)]
    if isinstance(tree, dict):
        return [root for item in tree.values() for root in _roots(item)]
    return []


def _map_states(tree: Any, on_state: Callable[[nnx.State], nnx.State]) -> Any:
    """Rebuilds the tuples/lists/dicts of ``tree`` with every State replaced."""
    if isinstance(tree, nnx.State):
        return on_state(tree)
    if isinstance(tree, nnx.Pytree | nnx.Variable):
        return tree
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # namedtuple
        return type(tree)(*(_map_states(item, on_state) for item in tree))
    if isinstance(tree, tuple | list):
        return type(tree)(_map_states(item, on_state) for item in tree)
    if isinstance(tree, dict):
        return type(tree)((key, _map_states(item, on_state)) for key, item in tree.items())
    return tree


def _variables_of(root: Any) -> list[tuple[Path, Any]]:
    if isinstance(root, nnx.State):
        return [(tuple(path), leaf) for path, leaf in nnx.to_flat_state(root)]
    if isinstance(root, nnx.Variable):
        return [((), root)]
    return [
        (tuple(path), node) for path, node in nnx.iter_graph(root) if isinstance(node, nnx.Variable)
    ]


def _set_array_attributes(root: Any, placed: list[tuple[Path, Any]]) -> None:
    if placed:
        nnx.update(root, nnx.from_flat_state(placed))


def _has_sharding(x: Any, target: NamedSharding) -> bool:
    if not isinstance(x, jax.Array):
        return False
    try:
        sharding = x.sharding
        return sharding == target or (
            isinstance(sharding, NamedSharding)
            and sharding.mesh == target.mesh
            and sharding.is_equivalent_to(target, x.ndim)
        )
    except Exception:  # a deleted array
        return False


def _transfer(value: Any, target: NamedSharding, mesh: MpmdMesh) -> jax.Array:
    if mesh.is_multi_process:
        # Each process creates only the shards it owns, from the full host value.
        host = np.asarray(value)
        return jax.make_array_from_callback(
            host.shape, target, lambda index: host[index], dtype=host.dtype
        )
    return jax.device_put(value, target)


def _placed_value(
    value: Any, mesh_ids: tuple[int, ...], spec: PartitionSpec, mesh: MpmdMesh
) -> Any:
    targets = {i: NamedSharding(mesh.submesh(i), spec) for i in mesh_ids}
    existing = value.arrays if isinstance(value, MpmdArray) else {}
    source = value.array(value.mesh_ids[0]) if isinstance(value, MpmdArray) else value
    if len(mesh_ids) == 1:
        (index,) = mesh_ids
        if _has_sharding(value, targets[index]):
            return value
        if _has_sharding(existing.get(index), targets[index]):
            return existing[index]
        return _transfer(existing.get(index, source), targets[index], mesh)
    if (
        isinstance(value, MpmdArray)
        and value.mesh_ids == mesh_ids
        and all(_has_sharding(value.array(i), targets[i]) for i in mesh_ids)
    ):
        return value
    arrays = {}
    for i in mesh_ids:
        current = existing.get(i, source)
        arrays[i] = (
            current if _has_sharding(current, targets[i]) else _transfer(current, targets[i], mesh)
        )
    return MpmdArray(arrays)


def placement_decisions(
    tree: Any, mesh: MpmdMesh, schedule: Any = None
) -> list[tuple[Any, Path, Any, Any, tuple[tuple[int, ...], PartitionSpec]]]:
    """Where `place` would put every placeable leaf of ``tree``, without moving anything.

    One ``(root, path, leaf, value, (mesh_ids, spec))`` per leaf (``leaf``: the Variable or
    bare State leaf); raises `PlacementError` as `place` does.

    Example:
      >>> import jax
      >>> from flax import nnx
      >>> from nnx_mpmd.annotate.annotate import Stage
      >>> mesh = MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
      >>> model = nnx.Dict(a=Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=1))
      >>> sorted({d[-1] for d in placement_decisions(model, mesh)})
      [((1,), P())]
    """
    if not isinstance(mesh, MpmdMesh):
        raise PlacementError(
            f"place expects an MpmdMesh, got {type(mesh).__name__}; wrap your jax mesh: "
            "MpmdMesh(jax_mesh, 'stage')."
        )
    if isinstance(schedule, str):
        schedule = get_schedule(schedule)
    elif isinstance(schedule, type) or (
        schedule is not None and not callable(getattr(schedule, "mesh_of", None))
    ):
        raise PlacementError(
            f"place got schedule={schedule!r} ({type(schedule).__name__}), which has no "
            "mesh_of(stage, num_stages, num_meshes) of its own; pass a schedule instance such "
            "as mp.OneFOneB(), a registered name ('1f1b'), or None (stage k on mesh "
            "k % num_meshes)."
        )
    roots = _roots(tree)
    entries: list[tuple[Any, Path, Any]] = []
    seen: set[int] = set()
    params: dict[Path, nnx.Variable] = {}
    used_stages: set[int] = set()
    attribute_stage: dict[int, int] = {}  # id of a plain array attribute -> its Stage's
    for root in roots:
        tag_variables_created_later(root)  # a Linen module's, made by lazy_init
        # Optimizer state made before assign_stages has paths without Stage's "module".
        logical = logical_paths(root) if isinstance(root, nnx.Pytree) else {}
        for path, leaf in _variables_of(root):
            if not isinstance(root, nnx.State):
                if id(leaf) in seen:
                    continue
                seen.add(id(leaf))
            entries.append((root, path, leaf))
            if isinstance(leaf, nnx.Variable):
                used_stages |= _variable_stages(leaf)
                if isinstance(leaf, nnx.Param) and variable_stage(leaf) is not None:
                    params[path] = leaf
                    params.setdefault(logical.get(path, path), leaf)
        if isinstance(root, nnx.Pytree):
            # Arrays held as plain attributes (Flax treats them as data): a Stage's go
            # with its stage, as a Variable of that module would; others, like a
            # Variable of no parameter, to every mesh.
            for attribute in array_attributes(root):
                leaf = attribute.value
                if id(leaf) in seen:
                    continue
                seen.add(id(leaf))
                if attribute.stage is not None:
                    attribute_stage[id(leaf)] = attribute.stage
                    used_stages.add(attribute.stage)
                entries.append((root, attribute.path, leaf))
    missing = [
        _path_text(path)
        for _, path, leaf in entries
        if isinstance(leaf, nnx.Param) and variable_stage(leaf) is None
    ]
    if missing:
        raise PlacementError(
            f"{len(missing)} parameter(s) have no stage: {', '.join(missing)}. Wrap the "
            "modules that own them in Stage(module, stage=k) or call "
            "assign_stages(model, {pattern: k})."
        )
    num_stages = max(used_stages) + 1 if used_stages else 0
    everywhere = (tuple(range(mesh.num_meshes)), PartitionSpec())
    decisions = []
    for root, path, leaf in entries:
        value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        if not isinstance(value, _PLACEABLE):
            continue
        if isinstance(leaf, nnx.Variable):
            decision = placement_of(leaf, path, mesh, schedule, num_stages, params=params)
        elif id(leaf) in attribute_stage:
            metadata: dict[str, Any] = {STAGE_KEY: attribute_stage[id(leaf)]}
            owner = nnx.Variable(value, **metadata)
            decision = placement_of(owner, path, mesh, schedule, num_stages, params=params)
        else:
            decision = everywhere
        decisions.append((root, path, leaf, value, decision))
    return decisions


def place(tree: Any, mesh: MpmdMesh, schedule: Any = None) -> Any:
    """Puts every Variable in ``tree`` on its mesh's submesh, with its sharding.

    Optimizer state goes with its parameter; NNX objects are updated in place.

    Args:
      tree: NNX objects, ``nnx.State`` objects and Variables, possibly inside
        tuples, lists and dicts.
      mesh: the `MpmdMesh`.
      schedule: optional object with ``mesh_of(stage, num_stages, num_meshes)``, or
        a registered schedule name (``"1f1b"``); default: ``stage % num_meshes``.

    Returns:
      ``tree`` (with any States in it replaced by placed States).

    Raises:
      PlacementError: a Param has no stage (all such paths are listed), an
        ``out_sharding`` does not fit its submesh, or a stage maps to a mesh
        index outside the mesh.

    Example:
      >>> import jax, optax
      >>> from flax import nnx
      >>> from nnx_mpmd.annotate.annotate import Stage
      >>> mesh = MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
      >>> model = nnx.Dict(a=Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=1))
      >>> opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
      >>> _ = place((model, opt), mesh)
      >>> opt.step.get_value()
      MpmdArray(shape=(), dtype=uint32, meshes=(0, 1, 2, 3), spec=P())
    """
    decisions = placement_decisions(tree, mesh, schedule)
    roots = _roots(tree)
    new_states: dict[int, dict[Path, Any]] = {
        id(root): dict(_variables_of(root)) for root in roots if isinstance(root, nnx.State)
    }
    attributes: dict[int, list[tuple[Path, Any]]] = {}
    for root, path, leaf, value, (mesh_ids, spec) in decisions:
        placed = _placed_value(value, mesh_ids, spec, mesh)
        if isinstance(root, nnx.State):
            new_states[id(root)][path] = (
                leaf.replace(placed) if isinstance(leaf, nnx.Variable) else placed
            )
        elif placed is value:
            continue
        elif isinstance(leaf, nnx.Variable):
            leaf.set_value(placed)
        else:
            attributes.setdefault(id(root), []).append((path, placed))
    for root in roots:
        _set_array_attributes(root, attributes.get(id(root), []))
    if not new_states:
        return tree
    return _map_states(tree, lambda state: nnx.from_flat_state(list(new_states[id(state)].items())))


def _default_device() -> Any:
    configured = config_value("jax_default_device")
    return configured if isinstance(configured, jax.Device) else jax.local_devices()[0]


def _gathered(x: Any, device: Any) -> Any:
    if isinstance(x, MpmdArray):
        x = x.array(x.mesh_ids[0])
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return x
    sharding = x.sharding
    aval_spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None) or ()
    if (
        isinstance(sharding, jax.sharding.SingleDeviceSharding)
        and sharding.device_set == {device}
        and all(entry is None for entry in aval_spec)
    ):
        return x
    # An explicit SingleDeviceSharding also drops Explicit-axis sharding from the type.
    return jax.device_put(x, jax.sharding.SingleDeviceSharding(device))


def gather(tree: Any) -> Any:
    """Turns placed state back into ordinary arrays on the default device.

    Variables of NNX objects are updated in place; ``nnx.State`` objects and
    plain pytrees (of ``jax.Array`` / `MpmdArray` leaves) come back converted.
    An `MpmdArray` gives its lowest mesh's copy.

    Args:
      tree: placed models, optimizers, States or pytrees.

    Returns:
      ``tree`` with every array on the default device.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jax.device_put(jnp.ones(2), jax.devices()[3])
      >>> gather({"x": x})["x"].devices() == {jax.devices()[0]}
      True
    """
    device = _default_device()

    def convert(x: Any) -> Any:
        if isinstance(x, nnx.State):
            return nnx.from_flat_state(
                [
                    (path, leaf.replace(_gathered(leaf.get_value(), device)))
                    if isinstance(leaf, nnx.Variable)
                    else (path, _gathered(leaf, device))
                    for path, leaf in nnx.to_flat_state(x)
                ]
            )
        if isinstance(x, nnx.Pytree | nnx.Variable):
            for _, variable in _variables_of(x):
                value = variable.get_value()
                new = _gathered(value, device)
                if new is not value:
                    variable.set_value(new)
            if isinstance(x, nnx.Pytree):
                moved = [(a.path, _gathered(a.value, device)) for a in array_attributes(x)]
                _set_array_attributes(x, moved)
            return x
        return _gathered(x, device)

    return jax.tree.map(
        convert,
        tree,
        is_leaf=lambda x: isinstance(x, nnx.State | nnx.Pytree | nnx.Variable | MpmdArray),
    )
