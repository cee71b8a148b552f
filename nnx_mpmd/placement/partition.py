"""Split NNX state per mesh, and where each Variable goes: its mesh and its sharding.

Where a Variable lives follows from its metadata: ``mpmd_stage`` picks the stage
and therefore the mesh (``stage % num_meshes``, or a schedule's ``mesh_of``), and
``out_sharding`` (a tuple of axis names / None, or a PartitionSpec) picks the
sharding inside that submesh. A leaf on one mesh is a plain ``jax.Array`` on that
submesh; a leaf every mesh needs (the optimizer step count) is an `MpmdArray`.

Example:
    >>> import jax
    >>> from flax import nnx
    >>> from nnx_mpmd.annotate.annotate import Stage
    >>> from nnx_mpmd.placement.mesh import MpmdMesh
    >>> mesh = MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
    >>> model = nnx.Dict(a=Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=3))
    >>> placement_of(model["a"].module.kernel, "a.module.kernel", mesh)
    ((3,), P())
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.nnx.training.optimizer import OptState
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from nnx_mpmd.annotate.annotate import STAGE_KEY, variable_stage
from nnx_mpmd.errors import PartitionError, PlacementError
from nnx_mpmd.placement.mesh import MpmdMesh
from nnx_mpmd.placement.mpmd_array import MpmdArray

__all__ = [
    "MpmdArray",
    "leaf_mesh_ids",
    "leaf_sharding",
    "merge_partitions",
    "partition",
    "placement_of",
]

Path = tuple[Any, ...]


def _path_text(path: Any) -> str:
    if isinstance(path, tuple):
        return ".".join(str(key) for key in path) or "<root>"
    return str(path) or "<root>"


# ------------------------------------------------------------------ partition


def _sort_key(path: Path) -> tuple[Any, ...]:
    return tuple((0, key, "") if isinstance(key, int) else (1, 0, str(key)) for key in path)


def _looped_mesh(stage: int, num_meshes: int) -> int:
    return stage % num_meshes


def partition(
    state: Any, num_meshes: int, mesh_of: Callable[[int], int] | None = None
) -> list[nnx.State]:
    """Splits NNX state into one `nnx.State` per mesh, keeping every path.

    A leaf goes to the mesh of its stage (``mpmd_stage`` metadata); a leaf with
    no stage (e.g. an optimizer step count) goes to every mesh.

    Args:
      state: an ``nnx.State``, or an NNX object (model, optimizer) to take it from.
      num_meshes: how many meshes.
      mesh_of: ``stage -> mesh index``; default ``stage % num_meshes`` (looped).

    Returns:
      ``num_meshes`` States; `merge_partitions` of them gives ``state`` back.

    Raises:
      PartitionError: ``state`` is not NNX state, ``num_meshes < 1``, or
        ``mesh_of`` returns an index outside ``[0, num_meshes)``.

    Example:
      >>> from flax import nnx
      >>> from nnx_mpmd.annotate.annotate import Stage
      >>> model = nnx.Dict(a=Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=1))
      >>> parts = partition(nnx.state(model), 2)
      >>> [len(nnx.to_flat_state(p)) for p in parts]
      [0, 2]
    """
    if isinstance(state, nnx.Pytree):
        state = nnx.state(state)
    if not isinstance(state, nnx.State):
        raise PartitionError(
            f"partition expects an nnx.State (or an NNX module/optimizer), got "
            f"{type(state).__name__}; pass nnx.state(model)."
        )
    if isinstance(num_meshes, bool) or not isinstance(num_meshes, int) or num_meshes < 1:
        raise PartitionError(f"partition needs num_meshes >= 1, got {num_meshes!r}.")
    if mesh_of is None:
        mesh_of = partial(_looped_mesh, num_meshes=num_meshes)
    parts: list[list[tuple[Path, Any]]] = [[] for _ in range(num_meshes)]
    for path, leaf in nnx.to_flat_state(state):
        stage = variable_stage(leaf) if isinstance(leaf, nnx.Variable) else None
        if stage is None:
            for part in parts:
                part.append((path, leaf))
            continue
        index = mesh_of(stage)
        if isinstance(index, bool) or not isinstance(index, int | np.integer):
            index = -1
        if not 0 <= index < num_meshes:
            raise PartitionError(
                f"{_path_text(path)} has stage {stage}, which mesh_of maps to mesh "
                f"{index!r}, outside [0, {num_meshes}); fix mesh_of or use more meshes."
            )
        parts[int(index)].append((path, leaf))
    return [nnx.from_flat_state(part) for part in parts]


def _same_leaf(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, nnx.Variable):
        a, b = a.get_value(), b.get_value()
    try:
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    except Exception:  # values without a numpy form (typed keys): compare identity
        return a is b


def merge_partitions(states: Sequence[nnx.State]) -> nnx.State:
    """Merges per-mesh States (from `partition`) back into one State, every path once.

    Raises:
      PartitionError: a path appears in two States with different values, or an
        item is not an ``nnx.State``.

    Example:
      >>> from flax import nnx
      >>> from nnx_mpmd.annotate.annotate import Stage
      >>> model = nnx.Dict(a=Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=1))
      >>> merged = merge_partitions(partition(nnx.state(model), 2))
      >>> merged["a"]["module"]["kernel"] is model["a"].module.kernel
      True
    """
    merged: dict[Path, Any] = {}
    where: dict[Path, int] = {}
    for index, state in enumerate(states):
        if not isinstance(state, nnx.State):
            raise PartitionError(
                f"merge_partitions: item {index} is a {type(state).__name__}, not an "
                "nnx.State; pass the list that partition returned."
            )
        for path, leaf in nnx.to_flat_state(state):
            if path in merged:
                if not _same_leaf(merged[path], leaf):
                    raise PartitionError(
                        f"merge_partitions: {_path_text(path)} differs between state "
                        f"{where[path]} and state {index}; leaves without a stage must be "
                        "identical on every mesh (sync them before merging)."
                    )
                continue
            merged[path] = leaf
            where[path] = index
    ordered = sorted(merged.items(), key=lambda item: _sort_key(item[0]))
    return nnx.from_flat_state(ordered)


# ------------------------------------------------------------------ shardings


def _spec_from_metadata(metadata: Mapping[str, Any], path: str) -> PartitionSpec:
    out = metadata.get("out_sharding")
    if out is None:
        return PartitionSpec()
    if isinstance(out, NamedSharding):
        out = out.spec
    if isinstance(out, str):
        out = (out,)
    if not isinstance(out, PartitionSpec | tuple | list):
        raise PlacementError(
            f"{path}: out_sharding={out!r} is not a tuple of axis names / None or a "
            "PartitionSpec; write e.g. out_sharding=(None, 'data')."
        )
    from flax.core import spmd

    rules = metadata.get("sharding_rules")
    if rules or spmd.get_logical_axis_rules():
        # Logical axis names -> mesh axis names, as flax does: the Variable's own
        # rules, then those set with flax.core.spmd.set_logical_axis_rules / logical_axis_rules.
        out = spmd.apply_rules(out, rules)
    return PartitionSpec(*out)


def _axis_names(entry: Any, path: str) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple) and all(isinstance(name, str) for name in entry):
        return entry
    raise PlacementError(
        f"{path}: out_sharding entry {entry!r} is not an axis name, a tuple of axis names, or None."
    )


def _check_spec(
    spec: PartitionSpec,
    submesh: Mesh,
    shape: tuple[int, ...] | None,
    path: str,
    mpmd_axis: str | None,
) -> None:
    if shape is not None and len(spec) > len(shape):
        raise PlacementError(
            f"{path}: out_sharding {spec} has {len(spec)} entries but the value has shape "
            f"{tuple(shape)}; give at most one entry per dimension."
        )
    for dim, entry in enumerate(spec):
        names = _axis_names(entry, path)
        for name in names:
            if mpmd_axis is not None and name == mpmd_axis:
                raise PlacementError(
                    f"{path}: out_sharding {spec} names the mpmd axis {name!r}, which "
                    "enumerates the pipeline meshes and does not exist inside a stage; "
                    f"use one of the submesh axes {tuple(submesh.axis_names)}."
                )
        size = math.prod(submesh.shape[name] for name in names)
        if shape is not None and names and shape[dim] % size:
            raise PlacementError(
                f"{path}: dimension {dim} of shape {tuple(shape)} is not divisible by "
                f"{size} (axes {names} of the submesh {dict(submesh.shape)}); change "
                "out_sharding for that dimension or the layer size."
            )


_WARNED_ABSENT: set[tuple[str, tuple[str, ...]]] = set()


def _without_absent_axes(
    spec: PartitionSpec, submesh: Mesh, path: str, mpmd_axis: str | None
) -> PartitionSpec:
    """``spec`` without the axis names the submesh lacks, each warned about once.

    Published models annotate parameters for the meshes they were written for
    (``'fsdp'``, ``'tp'``, logical names such as ``'embed'``); ``nnx.jit`` ignores
    metadata a mesh cannot honour, so such a model runs unchanged here too, with
    those dimensions replicated. The pipeline axis stays an error (`_check_spec`).
    """
    absent = {
        name
        for entry in spec
        if isinstance(entry, str | tuple)
        for name in ((entry,) if isinstance(entry, str) else entry)
        if isinstance(name, str) and name not in submesh.axis_names and name != mpmd_axis
    }
    if not absent:
        return spec
    key = (",".join(sorted(absent)), tuple(submesh.axis_names))
    if key not in _WARNED_ABSENT:
        _WARNED_ABSENT.add(key)
        warnings.warn(
            f"{path}: out_sharding {spec} names {sorted(absent)}, which the submesh "
            f"{dict(submesh.shape)} does not have; those dimensions are replicated (as "
            "nnx.jit ignores them). Map the names onto the mesh with sharding_rules metadata "
            "or flax.core.spmd.set_logical_axis_rules to shard them. (Warned once per name.)",
            UserWarning,
            stacklevel=2,
        )
    entries = []
    for entry in spec:
        if isinstance(entry, str | tuple):
            names = (entry,) if isinstance(entry, str) else entry
            kept = tuple(n for n in names if n not in absent)
            entry = kept[0] if len(kept) == 1 else (kept or None)
        entries.append(entry)
    while entries and entries[-1] is None:  # as `_round_trip_spec`: P(None, None) is P()
        entries.pop()
    return PartitionSpec(*entries)


def _round_trip_spec(spec: PartitionSpec, submesh: Mesh) -> PartitionSpec:
    """``spec`` without its Auto axes of size 1: the spec a step's update gives back.

    XLA drops a size-1 Auto axis from the shardings it chooses, so a value placed
    ``P('data', None)`` on ``data`` of size 1 would come back ``P()`` and the next
    call would see another signature (and compile again). Explicit axes stay: the
    value's type carries them through the step.
    """
    kinds = dict(zip(submesh.axis_names, submesh.axis_types, strict=True))
    dropped = {
        name
        for name in submesh.axis_names
        if submesh.shape[name] == 1 and kinds[name] != AxisType.Explicit
    }
    if not dropped or not any(set(_axis_names(e, "")) & dropped for e in spec):
        return spec
    entries = []
    for entry in spec:
        names = _axis_names(entry, "")
        if not set(names) & dropped:
            entries.append(entry)
            continue
        kept = tuple(name for name in names if name not in dropped)
        entries.append(kept[0] if len(kept) == 1 else (kept or None))
    while entries and entries[-1] is None:  # P('data', None) on data of size 1: P()
        entries.pop()
    return PartitionSpec(*entries)


def leaf_sharding(
    variable_or_metadata: nnx.Variable | Mapping[str, Any],
    submesh: Mesh,
    path: str = "",
    *,
    shape: tuple[int, ...] | None = None,
    mpmd_axis: str | None = None,
) -> NamedSharding:
    """The sharding of a Variable inside its submesh, from its ``out_sharding``.

    Auto axes of size 1 are left out of the spec, as XLA leaves them out.

    Args:
      path: the Variable's path, for error messages.
      shape: for the divisibility check (default: the Variable's value shape).
      mpmd_axis: the whole mesh's mpmd axis, to report it if named.

    Raises:
      PlacementError: the mpmd axis is named, a dimension is not divisible by its
        axes' size, or the spec is malformed.

    Example:
      >>> import jax
      >>> from flax import nnx
      >>> submesh = jax.make_mesh((4, 2), ("stage", "data"))
      >>> submesh = MpmdMesh(submesh, "stage").submesh(0)
      >>> leaf_sharding({"out_sharding": (None, "data")}, submesh).spec
      P(None, 'data')
    """
    if isinstance(variable_or_metadata, nnx.Variable):
        metadata = variable_or_metadata.get_metadata()
        if shape is None:
            shape = getattr(variable_or_metadata.get_value(), "shape", None)
    else:
        metadata = variable_or_metadata
    where = path or "<variable>"
    spec = _without_absent_axes(_spec_from_metadata(metadata, where), submesh, where, mpmd_axis)
    _check_spec(spec, submesh, shape, where, mpmd_axis)
    return NamedSharding(submesh, _round_trip_spec(spec, submesh))


# ------------------------------------------------------------------ placement


def _stage_to_mesh(
    stage: int, path: str, mesh: MpmdMesh, schedule: Any, num_stages: int | None
) -> int:
    if schedule is None:
        return stage % mesh.num_meshes
    if num_stages is None:
        raise PlacementError(
            f"{path}: placing with schedule {type(schedule).__name__} needs num_stages; "
            "pass num_stages=model.num_stages."
        )
    index = schedule.mesh_of(stage, num_stages, mesh.num_meshes)
    if isinstance(index, bool) or not isinstance(index, int | np.integer):
        index = -1
    if not 0 <= index < mesh.num_meshes:
        raise PlacementError(
            f"{path}: stage {stage} of {num_stages} maps to mesh {index!r} under "
            f"{type(schedule).__name__}, but {mesh!r} has {mesh.num_meshes} meshes; use a "
            "schedule whose mesh_of fits, or a mesh with more submeshes."
        )
    return int(index)


def _owner(
    variable: nnx.Variable, path: Path, params: Mapping[Path, nnx.Variable] | None
) -> nnx.Variable | None:
    """The Variable whose stage and out_sharding decide where ``variable`` goes."""
    if variable_stage(variable) is not None:
        return variable
    if params is None or isinstance(variable, nnx.Param):
        return None
    best: tuple[int, nnx.Variable] | None = None
    for param_path, param in params.items():
        n = len(param_path)
        matches = 0 < n <= len(path) and tuple(path[-n:]) == tuple(param_path)
        if matches and (best is None or n > best[0]):
            best = (n, param)
    return best[1] if best else None


def placement_of(
    variable: nnx.Variable,
    path: Any,
    mesh: MpmdMesh,
    schedule: Any = None,
    num_stages: int | None = None,
    *,
    params: Mapping[Path, nnx.Variable] | None = None,
) -> tuple[tuple[int, ...], PartitionSpec]:
    """``(mesh_ids, spec)``: where `place` puts one Variable.

    Without ``mpmd_stage``, a leaf follows the ``params`` entry whose path is the longest
    suffix of ``path``; a leaf of no parameter goes to every mesh.

    Raises:
      PlacementError: a Param has no stage, the schedule maps the stage outside
        the mesh, or ``out_sharding`` does not fit the submesh.

    Example:
      >>> import jax
      >>> from flax import nnx
      >>> mesh = MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
      >>> p = nnx.Param(jax.numpy.zeros((4, 4)), mpmd_stage=5, out_sharding=(None, "data"),
      ...               eager_sharding=False)
      >>> placement_of(p, "w", mesh)
      ((1,), P(None, 'data'))
    """
    where = _path_text(path)
    key = tuple(path) if isinstance(path, tuple) else tuple(str(path).split("."))
    owner = _owner(variable, key, params)
    shape = getattr(variable.get_value(), "shape", None)
    if owner is None:
        if isinstance(variable, nnx.Param):
            raise PlacementError(
                f"parameter {where} has no stage; wrap the module that owns it in "
                "Stage(module, stage=k) or call assign_stages(model, {pattern: k})."
            )
        mesh_ids = tuple(range(mesh.num_meshes))
        metadata = variable.get_metadata()
    else:
        stage = owner.get_metadata()[STAGE_KEY]
        mesh_ids = (_stage_to_mesh(stage, where, mesh, schedule, num_stages),)
        metadata = owner.get_metadata()
    submesh = mesh.submesh(mesh_ids[0])
    spec = _without_absent_axes(
        _spec_from_metadata(metadata, where), submesh, where, mesh.mpmd_axis
    )
    try:
        _check_spec(spec, submesh, shape, where, mesh.mpmd_axis)
    except PlacementError:
        # Optimizer state whose shape differs from its parameter's (e.g. factored
        # second moments) cannot take the parameter's spec: replicate it instead.
        if not isinstance(variable, OptState) or not _fits_axes(spec, submesh, mesh.mpmd_axis):
            raise
        spec = PartitionSpec()
    return mesh_ids, _round_trip_spec(spec, submesh)


def _fits_axes(spec: PartitionSpec, submesh: Mesh, mpmd_axis: str) -> bool:
    try:
        _check_spec(spec, submesh, None, "", mpmd_axis)
    except PlacementError:
        return False
    return True


def leaf_mesh_ids(x: Any, mesh: MpmdMesh) -> tuple[int, ...] | None:
    """Where a leaf lives: ``(i,)`` for an array on submesh ``i``, an `MpmdArray`'s ids, or None.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> mesh = MpmdMesh(jax.make_mesh((8,), ("stage",)), "stage")
      >>> leaf_mesh_ids(jax.device_put(jnp.ones(2), jax.devices()[6]), mesh)
      (6,)
    """
    if isinstance(x, MpmdArray):
        return x.mesh_ids
    if isinstance(x, jax.Array):
        index = mesh.mesh_id_of(x)
        return None if index is None else (index,)
    return None
