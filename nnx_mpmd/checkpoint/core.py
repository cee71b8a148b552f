"""`save` and `restore`: one checkpoint directory, written atomically by orbax.

A checkpoint directory holds two orbax items: ``arrays`` (a PyTree checkpoint of
every array under its logical path) and ``manifest`` (JSON, see
`nnx_mpmd.checkpoint.manifest`). Orbax writes into a temporary directory and
renames it when complete, so an interrupted save never looks like a checkpoint.

Once a save has committed, process 0 records the size and CRC-32 of every file
(`nnx_mpmd.checkpoint.file_checksums`); a restore with ``verify=True`` checks
them before reading anything. Restore then reads the manifest, checks the
target against it, reads every array
directly onto the sharding of the target leaf's current placement (the lowest
mesh's copy for an `MpmdArray`, then copied to the other meshes), verifies the
checksums, and only then writes into the target, so a failed restore leaves
the target untouched. Files that cannot be read, or whose contents do not match
the manifest, raise `CheckpointDamagedError` naming the path; a file the process
may not read raises `CheckpointError` saying so (`read_failure`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import jax
import numpy as np
import orbax.checkpoint as ocp

from nnx_mpmd.checkpoint.file_checksums import check_files, record_files
from nnx_mpmd.checkpoint.global_arrays import fingerprints, use_coordination_barriers, worst_of
from nnx_mpmd.checkpoint.layout import (
    ARRAY,
    KEY,
    NUMPY,
    VALUE,
    Entry,
    Layout,
    collect,
    primary_copy,
    rebuild_like,
)
from nnx_mpmd.checkpoint.manifest import (
    build_manifest,
    check_manifest,
    check_target,
    content_key,
    key_impl_name,
)
from nnx_mpmd.checkpoint.recut import recut_stacks
from nnx_mpmd.errors import CheckpointDamagedError, CheckpointError
from nnx_mpmd.placement.mpmd_array import MpmdArray
from nnx_mpmd.runtime.coordination import bounded_by_peers, get_coordination

__all__ = ["ArrayReader", "read_failure", "restore", "restore_layout", "save", "save_args"]

_SAVES = itertools.count()  # the record barriers' names (every process saves alike)

# Reads arrays: (item, restore_args, partial) -> nested dict of restored arrays.
ArrayReader = Callable[[dict[str, Any], dict[str, Any], bool], dict[str, Any]]


def save_args(
    tree: Any, metadata: dict[str, Any] | None = None, step: int | None = None
) -> ocp.args.Composite:
    """The orbax ``Composite`` saving ``tree``: ``arrays`` (if any), ``manifest``, ``metadata``.

    Example:
      >>> args = save_args({"step": 3})
      >>> sorted(args.keys())
      ['manifest']
    """
    manifest, arrays = build_manifest(collect(tree), step=step, metadata=metadata)
    items: dict[str, Any] = {"manifest": ocp.args.JsonSave(manifest)}
    if arrays:
        items["arrays"] = ocp.args.PyTreeSave(arrays)
    if metadata is not None:
        items["metadata"] = ocp.args.JsonSave(metadata)
    return ocp.args.Composite(**items)


def _default_sharding() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _target(entry: Entry, copy: int = 0) -> tuple[jax.sharding.Sharding, Any]:
    """(sharding, abstract stored array) that copy ``copy`` of ``entry`` is read onto.

    Copy 0 is the primary copy (the lowest mesh's for an `MpmdArray`); copy
    ``i`` is the ``i``-th lowest mesh's copy of an `MpmdArray`.
    """
    target = primary_copy(entry.value)
    if copy:
        target = entry.value.array(sorted(entry.value.mesh_ids)[copy])
    sharding = getattr(target, "sharding", None) or _default_sharding()
    abstract = jax.eval_shape(jax.random.key_data, target) if entry.kind == KEY else target
    return sharding, abstract


def _restore_arg(
    entry: Entry, sharding: jax.sharding.Sharding | None = None, copy: int = 0
) -> tuple[Any, Any]:
    """(placeholder, orbax restore args) reading ``entry`` onto its target placement."""
    if entry.kind == NUMPY:
        return 0, ocp.RestoreArgs(restore_type=np.ndarray)
    target_sharding, abstract = _target(entry, copy)
    return 0, ocp.ArrayRestoreArgs(
        sharding=sharding or target_sharding,
        global_shape=tuple(abstract.shape),
        dtype=abstract.dtype,
    )


def _read_here(entry: Entry, copy: int = 0) -> bool:
    """Whether this process holds a shard of ``entry``'s target (numpy: always)."""
    return entry.kind == NUMPY or bool(_target(entry, copy)[0].addressable_devices)


def _without_shards(entry: Entry, copy: int = 0) -> jax.Array:
    """``entry``'s target array on a process that holds none of its shards."""
    sharding, abstract = _target(entry, copy)
    return jax.make_array_from_single_device_arrays(
        tuple(abstract.shape), sharding, [], dtype=abstract.dtype
    )


def _nest(entries: list[Entry], make: Callable[[Entry], Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for entry in entries:
        node = nested
        for key in entry.path[:-1]:
            node = node.setdefault(key, {})
        node[entry.path[-1]] = make(entry)
    return nested


def _lookup(nested: dict[str, Any], path: tuple[str, ...]) -> Any:
    node = nested
    for key in path:
        node = node[key]
    return node


def _read_arrays(
    reader: ArrayReader, entries: list[Entry], partial: bool, where: str, copy: int = 0
) -> dict[str, Any]:
    """Reads ``entries`` onto their targets; the arrays as a nested dict by path.

    Orbax cannot build an array with no shards on this process (0.12.8 omits the dtype), so
    those are made here, empty; every process still calls orbax once (a collective).
    """
    if not entries:
        return {}
    here = [e for e in entries if _read_here(e, copy)]
    elsewhere = [e for e in entries if not _read_here(e, copy)]
    read = here or entries[:1]
    local = None if here else jax.local_devices()[0]
    sharding = None if local is None else jax.sharding.SingleDeviceSharding(local)
    item = _nest(read, lambda e: _restore_arg(e, sharding, copy)[0])
    restore_args = _nest(read, lambda e: _restore_arg(e, sharding, copy)[1])
    error: CheckpointError | None = None
    arrays: dict[str, Any] = {}  # a failed read raises below, on every process
    try:
        arrays = reader(item, restore_args, partial or len(read) < len(entries))
    except Exception as failure:  # orbax/tensorstore raise many types for damaged files
        # Searching reads entries one by one, a collective that processes whose reads
        # succeeded do not join: only on one process.
        first_bad = None if jax.process_count() > 1 else _first_unreadable(reader, entries)
        at = f" at {first_bad!r}" if first_bad else ""
        error = read_failure(
            failure,
            f"{where}/arrays",
            f"cannot be read{at} (truncated or corrupted files: "
            f"{type(failure).__name__}: {str(failure)[:300]}); restore an earlier checkpoint "
            "(CheckpointManager.all_steps() lists them) or re-save.",
        )
        error.__cause__ = failure
    # Every process learns the worst outcome (0 read, 1 damaged, 2 another failure), so
    # all of them go on, fall back to another step, or stop together.
    outcome = 0 if error is None else 1 if isinstance(error, CheckpointDamagedError) else 2
    worst = worst_of(outcome)
    if error is not None and outcome == worst:
        raise error
    if worst:
        kind = CheckpointDamagedError if worst == 1 else CheckpointError
        raise kind(
            f"checkpoint {where}/arrays cannot be read by another process (its message says "
            "why); restore an earlier checkpoint or fix what it names."
        ) from error
    if not here:
        arrays = {}
    for entry in elsewhere:
        node = arrays
        for key in entry.path[:-1]:
            node = node.setdefault(key, {})
        node[entry.path[-1]] = _without_shards(entry, copy)
    return arrays


def _read_other_copies(
    reader: ArrayReader, entries: list[Entry], where: str
) -> dict[str, dict[int, Any]]:
    """``{entry name: {mesh id: array}}``: the other meshes' copies of `MpmdArray` targets.

    Each copy is read onto its own mesh (no transfer); round ``i`` reads every ``i``-th copy.
    """
    copies: dict[str, dict[int, Any]] = {}
    rounds = max(
        (len(e.value.mesh_ids) for e in entries if isinstance(e.value, MpmdArray)), default=1
    )
    for copy in range(1, rounds):
        wanted = [
            e for e in entries if isinstance(e.value, MpmdArray) and len(e.value.mesh_ids) > copy
        ]
        arrays = _read_arrays(reader, wanted, True, where, copy)
        for entry in wanted:
            mesh_id = sorted(entry.value.mesh_ids)[copy]
            copies.setdefault(entry.name, {})[mesh_id] = _lookup(arrays, entry.path)
    return copies


def _first_unreadable(reader: ArrayReader, entries: list[Entry]) -> str | None:
    for entry in entries:
        try:
            item = _nest([entry], lambda e: _restore_arg(e)[0])
            reader(item, _nest([entry], lambda e: _restore_arg(e)[1]), True)
        except Exception:
            return entry.name
    return None


def read_failure(error: BaseException, path: str, damaged: str) -> CheckpointError:
    """The error to raise when reading ``path`` failed with ``error``.

    A permission problem (``EACCES``/``EPERM`` anywhere in the exception chain,
    or tensorstore's "Permission denied") is a `CheckpointError` saying so; any
    other failure means damaged files: `CheckpointDamagedError` with ``damaged``.

    Example:
      >>> type(read_failure(PermissionError(13, "Permission denied", "/c/1"), "/c/1", "x"))
      <class 'nnx_mpmd.errors.CheckpointError'>
    """
    seen: BaseException | None = error
    while seen is not None:
        denied = isinstance(seen, PermissionError) or "permission denied" in str(seen).lower()
        if denied:
            file = getattr(seen, "filename", None) or path
            return CheckpointError(
                f"permission denied reading checkpoint {path} ({file}): this process (user id "
                f"{_user()}) may not read it; fix the owner or mode (chown/chmod -R u+rX) or "
                "run as the user who wrote it. The checkpoint itself may be intact."
            )
        seen = seen.__cause__ or seen.__context__
    return CheckpointDamagedError(f"checkpoint {path} {damaged}")


def _user() -> str:
    return str(os.getuid()) if hasattr(os, "getuid") else "?"


def _verify(
    records: dict[str, Any], entries: list[Entry], arrays: dict, where: str, version: Any
) -> None:
    field, compute = content_key(version)
    rows = fingerprints([compute(_lookup(arrays, entry.path)) for entry in entries])
    for entry, sums in zip(entries, rows):
        expected = records[entry.name].get(field)
        if sums != expected:
            raise CheckpointDamagedError(
                f"checkpoint {where}/arrays is corrupted at {entry.name!r}: its contents do not "
                f"match the {field} recorded in the manifest when it was saved (changed files, "
                "or arrays copied from another step); restore an earlier checkpoint "
                "(CheckpointManager.all_steps() lists them) or re-save."
            )


def _restored_value(
    entry: Entry, record: dict[str, Any], arrays: dict, copies: dict[str, dict[int, Any]]
) -> Any:
    if entry.kind == VALUE:
        return record["value"]
    raw = _lookup(arrays, entry.path)
    if entry.kind == NUMPY:
        return np.asarray(raw)
    if entry.kind == KEY:
        impl = key_impl_name(primary_copy(entry.value))
        return rebuild_like(
            entry.value,
            raw,
            lambda d: jax.random.wrap_key_data(d, impl=impl),
            copies.get(entry.name),
        )
    return rebuild_like(entry.value, raw, lambda a: a, copies.get(entry.name))


def restore_layout(
    layout: Layout,
    manifest: Any,
    reader: ArrayReader,
    where: str,
    *,
    partial: bool = False,
    verify: bool = True,
) -> Any:
    """Restores a collected target from a manifest and an array reader (NNX objects in place).

    Example:
      >>> from nnx_mpmd.checkpoint.layout import collect
      >>> from nnx_mpmd.checkpoint.manifest import build_manifest
      >>> manifest, _ = build_manifest(collect({"step": 7}))
      >>> restore_layout(collect({"step": 0}), manifest, None, "memory")
      {'step': 7}
    """
    records = check_manifest(manifest, where)
    layout, recuts = recut_stacks(layout, records)  # a ScanStack cut into other ranges
    check_target(records, layout, where, partial=partial)
    stored = [e for e in layout.entries if e.kind in (ARRAY, KEY, NUMPY)]
    saved_arrays = [r for r in records.values() if r.get("kind") in (ARRAY, KEY, NUMPY)]
    arrays = _read_arrays(reader, stored, len(stored) < len(saved_arrays), where)
    if verify:
        _verify(records, stored, arrays, where, manifest.get("version"))
    copies = _read_other_copies(reader, stored, where)
    new_leaves: dict[int, Any] = {}
    for recut in recuts:
        recut.assemble(arrays, _lookup)
    proxies = {id(proxy) for recut in recuts for proxy in recut.saved}
    for entry in layout.entries:
        if id(entry) in proxies:
            continue
        value = _restored_value(entry, records[entry.name], arrays, copies)
        if entry.variable is not None:
            entry.variable.set_value(value)
        else:  # an entry without a variable has a leaf index
            new_leaves[cast(int, entry.leaf_index)] = value
    return layout.rebuild(new_leaves)


def _checkpointer() -> ocp.Checkpointer:
    use_coordination_barriers()
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def save(path: str | Path, tree: Any, *, overwrite: bool = False) -> None:
    """Saves ``tree`` to the directory ``path``, synchronously and atomically.

    Use `CheckpointManager` for asynchronous, numbered checkpoints.

    Args:
      path: the checkpoint directory to create (must not exist unless ``overwrite``).
      tree: a pytree (usually a dict) of NNX models, optimizers, ``nnx.State``,
        ``nnx.Rngs``, jax/numpy arrays, `MpmdArray` values and JSON scalars.
      overwrite: replace an existing checkpoint at ``path`` (deleted first).

    Raises:
      CheckpointError: ``path`` exists, or a leaf cannot be saved.
      DistributedError: another process died during the save (multi-process runs).

    Example:
      >>> import tempfile, jax.numpy as jnp
      >>> from flax import nnx
      >>> path = tempfile.mkdtemp() + "/ckpt"
      >>> save(path, {"model": nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "step": 3})
      >>> restore(path, {"model": nnx.Linear(2, 2, rngs=nnx.Rngs(1)), "step": 0})["step"]
      3
    """
    path = Path(path).absolute()
    if path.exists() and not overwrite:
        raise CheckpointError(
            f"cannot save to {path}: it already exists; pass overwrite=True, choose a new "
            "path, or use CheckpointManager for numbered steps."
        )
    bounded_by_peers(f"saving checkpoint {path}", _save_to, path, tree, overwrite)


def _save_to(path: Path, tree: Any, overwrite: bool) -> None:
    args = save_args(tree)
    checkpointer = _checkpointer()
    try:
        checkpointer.save(path, args=args, force=overwrite)
    finally:
        checkpointer.close()
    # The files as stored, once committed (process 0; the others wait, then read them).
    if jax.process_index() == 0:
        record_files(path, step=None, manifest_seal=args["manifest"].item.get("seal"))
    if jax.process_count() > 1:
        get_coordination().barrier(
            f"checkpoint/files/{path}/{next(_SAVES)}", "recording a checkpoint's file checksums"
        )


def _check_restorable(path: Path) -> None:
    if path.is_dir() and (path / "manifest").is_dir():
        return
    unfinished = sorted(p.name for p in path.parent.glob(path.name + ".orbax-checkpoint-tmp*"))
    if unfinished:
        hint = f"only an unfinished save ({unfinished[0]}) exists, it was interrupted; "
    elif path.is_dir() and any(p.name.isdigit() for p in path.iterdir()):
        hint = "it looks like a CheckpointManager directory; use CheckpointManager.restore or "
    elif path.is_dir():
        hint = "it has no 'manifest' item (not an nnx_mpmd checkpoint, or damaged); "
    else:
        hint = "it does not exist; "
    raise CheckpointError(f"no checkpoint at {path}: {hint}check the path.")


def restore(path: str | Path, target: Any, *, partial: bool = False, verify: bool = True) -> Any:
    """Restores the checkpoint at ``path`` into ``target``, whatever its layout.

    Each array is read onto the target leaf's placement; NNX objects are updated in place.

    Args:
      path: a directory written by `save`.
      target: a tree with the same logical structure as the saved one.
      partial: allow checkpoint entries that ``target`` does not have (for example
        restore only the model from a model-and-optimizer checkpoint).
      verify: recompute checksums and fail on corrupted data.

    Returns:
      ``target`` with non-NNX leaves replaced by the restored values.

    Raises:
      CheckpointError: no checkpoint at ``path``, a mismatching structure, shape,
        dtype or key implementation (naming the first such path), or damaged data.
      DistributedError: another process died during the restore (multi-process runs).

    Example:
      >>> import tempfile, jax.numpy as jnp
      >>> path = tempfile.mkdtemp() + "/ckpt"
      >>> save(path, {"w": jnp.ones(3)})
      >>> restore(path, {"w": jnp.zeros(3)})["w"].tolist()
      [1.0, 1.0, 1.0]
    """
    path = Path(path).absolute()
    _check_restorable(path)
    return bounded_by_peers(
        f"restoring checkpoint {path}", _restore_from, path, target, partial, verify
    )


def _restore_from(path: Path, target: Any, partial: bool, verify: bool) -> Any:
    layout = collect(target, where="target")
    checkpointer = _checkpointer()
    try:
        try:
            manifest = checkpointer.restore(
                path, args=ocp.args.Composite(manifest=ocp.args.JsonRestore())
            )["manifest"]
        except Exception as error:
            raise read_failure(
                error,
                str(path),
                f"has an unreadable manifest ({path}/manifest: {type(error).__name__}); it is "
                "truncated or corrupted: restore "
                "an earlier checkpoint or re-save.",
            ) from error

        if verify:
            check_manifest(manifest, str(path))  # its own errors first
            try:
                check_files(path, step=None, manifest_seal=manifest.get("seal"))
            except OSError as error:
                raise read_failure(error, str(path), f"has unreadable files ({error})") from error

        def reader(item: dict, restore_args: dict, partial_read: bool) -> dict:
            args = ocp.args.PyTreeRestore(
                item, restore_args=restore_args, partial_restore=partial_read
            )
            return checkpointer.restore(path, args=ocp.args.Composite(arrays=args))["arrays"]

        return restore_layout(layout, manifest, reader, str(path), partial=partial, verify=verify)
    finally:
        checkpointer.close()
