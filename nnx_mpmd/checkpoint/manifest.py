"""The JSON manifest saved beside the arrays, and checks of a target against it.

The manifest lists every entry of a checkpoint by logical path: its kind, shape,
dtype, PRNG implementation (for keys), the layout it was saved from (meshes and
PartitionSpec, for information only), a checksum of its contents, and the
value itself for JSON scalars. Restore compares the target's layout with the
manifest before reading any array, so a mismatch names the first differing path.

The checksum (`checksum`) is a 64-bit hash of the array's stored bits: every
32-bit word is mixed with its position (the murmur3 finalizer, a bijection) and
the mixed words are summed in two independently seeded lanes. Each device sums
the words of the shard it holds, so it works for sharded and multi-process global
arrays and does not depend on the sharding (a checkpoint restores onto another
layout); restore recomputes it to detect changed files. Any change of the stored
bits changes it except with probability about 2**-64. In a multi-process run the
checksums are brought to every process
(`nnx_mpmd.checkpoint.global_arrays.fingerprints`), so every process builds the
same manifest.

Version 2 manifests also seal the step directory: they record the step, the
SHA-256 of the step's JSON metadata and a SHA-256 ``seal`` over the manifest
itself, so an edited manifest or metadata, or a manifest copied from another
step, is refused (`check_manifest`, `check_commit`). Version 1 manifests (plain
wrapping sums, no seal) are still read.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_mpmd.checkpoint.global_arrays import fingerprints, savable, settle_moves
from nnx_mpmd.checkpoint.layout import (
    ARRAY,
    KEY,
    VALUE,
    Entry,
    Layout,
    primary_copy,
)
from nnx_mpmd.errors import CheckpointDamagedError, CheckpointError

__all__ = [
    "FORMAT",
    "STACKED_LEAF",
    "build_manifest",
    "check_commit",
    "check_manifest",
    "check_target",
    "checksum",
    "content_key",
    "fingerprint",
    "json_digest",
    "key_impl_name",
    "stored_array",
]

FORMAT = "nnx_mpmd.checkpoint"
VERSION = 2
READABLE_VERSIONS = (1, 2)

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _positions(bits: jax.Array) -> jax.Array:
    """Each word's row-major index (mod 2**32): the same whatever the sharding."""
    position = jnp.zeros((), jnp.uint32)
    stride = 1
    for axis in reversed(range(bits.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis)
        position = position + iota * jnp.uint32(stride % 2**32)
        stride *= bits.shape[axis]
    return position


@partial(jax.jit)
def _device_fingerprint(x: jax.Array) -> jax.Array:
    bits = _words(x)
    position = _positions(bits)
    weight = position * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weight, dtype=jnp.uint32)])


def fingerprint(array: Any) -> jax.Array | list[int]:
    """The contents check of version-1 manifests: two wrapping sums of an array's bits.

    Kept to verify old checkpoints; new ones use `checksum`.

    Example:
      >>> import jax.numpy as jnp
      >>> a = [int(v) for v in fingerprint(jnp.arange(4.0))]
      >>> b = [int(v) for v in fingerprint(jnp.arange(4.0).at[3].set(7.0))]
      >>> a == b
      False
    """
    if isinstance(array, np.ndarray | np.generic):
        data = np.ascontiguousarray(array).tobytes()
        return [zlib.crc32(data), zlib.adler32(data)]
    return _device_fingerprint(array)


def _fmix32(h: jax.Array) -> jax.Array:
    """The murmur3 finalizer: a bijection of uint32 that mixes every bit into every other."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


_LANE_SEEDS = (0x9E3779B9, 0x7F4A7C15)


@partial(jax.jit)
def _device_checksum(x: jax.Array) -> jax.Array:
    bits = _words(x)
    position = _positions(bits)
    lanes = []
    for seed in _LANE_SEEDS:
        key = _fmix32(position * jnp.uint32(0x27D4EB2D) + jnp.uint32(seed))
        lanes.append(jnp.sum(_fmix32(bits ^ key) + key, dtype=jnp.uint32))
    return jnp.stack(lanes)


def _words(x: jax.Array) -> jax.Array:
    """The stored bits of ``x`` as uint32 words (one per element, two for 8-byte types)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if x.dtype.itemsize == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # trailing axis of 2 words
    return jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize]).astype(jnp.uint32)


def checksum(array: Any) -> jax.Array | list[int]:
    """A sharding-independent 64-bit checksum of an array's bits: two uint32 (device array or list).

    Unlike `fingerprint`, any bit change changes it (but with probability ~2**-64).

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.arange(1.0, 5.0)
      >>> flipped = x.at[0].set(-1.0).at[2].set(-3.0)  # equal parity: sums would collide
      >>> [int(v) for v in checksum(x)] == [int(v) for v in checksum(flipped)]
      False
    """
    if isinstance(array, np.ndarray | np.generic):
        data = np.ascontiguousarray(array).tobytes()
        return [zlib.crc32(data), zlib.adler32(data)]
    return _device_checksum(array)


def content_key(version: Any) -> tuple[str, Any]:
    """(manifest field, function) holding each array's contents check in ``version``.

    Example:
      >>> content_key(2)[0], content_key(1)[0]
      ('checksum', 'fingerprint')
    """
    return ("fingerprint", fingerprint) if version == 1 else ("checksum", checksum)


def json_digest(value: Any) -> str:
    """The SHA-256 of ``value`` as canonical JSON (sorted keys, no spaces).

    Example:
      >>> json_digest({"b": 1, "a": [2]}) == json_digest({"a": [2], "b": 1})
      True
    """
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _seal(manifest: dict[str, Any]) -> str:
    return json_digest({k: v for k, v in manifest.items() if k != "seal"})


def key_impl_name(key: Any) -> str:
    """The PRNG implementation name of a typed key array (or its abstract shape).

    Example:
      >>> import jax
      >>> key_impl_name(jax.random.key(0, impl="rbg"))
      'rbg'
    """
    if isinstance(key, jax.Array):
        return str(jax.random.key_impl(key))
    return str(key.dtype._impl.name)


def stored_array(entry: Entry) -> Any:
    """The array that is written for ``entry``: the primary copy, key data for keys.

    Example:
      >>> import jax
      >>> from nnx_mpmd.checkpoint.layout import collect
      >>> stored_array(collect({"k": jax.random.key(0)}).entries[0]).dtype
      dtype('uint32')
    """
    value = primary_copy(entry.value)
    if entry.kind == KEY:
        return jax.random.key_data(value)
    return value


def _describe_layout(value: Any) -> dict[str, Any]:
    mesh_ids = getattr(value, "mesh_ids", None)
    spec = getattr(getattr(primary_copy(value), "sharding", None), "spec", None)
    return {
        "meshes": list(mesh_ids) if mesh_ids is not None else None,
        "spec": str(spec) if spec is not None else None,
    }


def build_manifest(
    layout: Layout, *, step: int | None = None, metadata: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(sealed manifest, nested dict of arrays for orbax)`` of ``layout``.

    ``metadata`` is recorded by its SHA-256; arrays are made `savable` in a multi-process run.

    Example:
      >>> from nnx_mpmd.checkpoint.layout import collect
      >>> manifest, arrays = build_manifest(collect({"step": 3}))
      >>> manifest["entries"]["step"]["value"], arrays
      (3, {})
    """
    arrays: dict[str, Any] = {}
    records: dict[str, dict[str, Any]] = {}
    pending: list[tuple[dict[str, Any], Any]] = []
    moved: list[Any] = []  # kept alive until every moved shard has arrived
    for entry in layout.entries:
        record: dict[str, Any] = {"kind": entry.kind}
        if entry.kind == VALUE:
            record["value"] = entry.value
            record["type"] = type(entry.value).__name__
        else:
            stored = stored_array(entry)
            record["shape"] = list(np.shape(primary_copy(entry.value)))
            record["dtype"] = str(stored.dtype)
            if entry.kind == KEY:
                record["impl"] = key_impl_name(primary_copy(entry.value))
            if entry.kind in (ARRAY, KEY):
                record["layout"] = _describe_layout(entry.value)
            pending.append((record, checksum(stored)))
            node = arrays
            for key in entry.path[:-1]:
                node = node.setdefault(key, {})
            node[entry.path[-1]] = savable(stored, turn=len(pending), kept=moved)
        records[entry.name] = record
    settle_moves(moved)
    for (record, _), sums in zip(pending, fingerprints([sums for _, sums in pending])):
        record["checksum"] = sums
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "metadata_sha256": None if metadata is None else json_digest(metadata),
        "entries": records,
    }
    manifest["seal"] = _seal(manifest)
    return manifest, arrays


def _target_record(entry: Entry) -> dict[str, Any]:
    value = primary_copy(entry.value)
    if entry.kind == VALUE:
        return {"kind": VALUE, "type": type(value).__name__}
    record = {"kind": entry.kind, "shape": list(np.shape(value))}
    if entry.kind == KEY:
        record["impl"] = key_impl_name(value)
        record["dtype"] = str(jax.eval_shape(jax.random.key_data, value).dtype)
    else:
        record["dtype"] = str(value.dtype)
    return record


def check_manifest(manifest: Any, where: str) -> dict[str, dict[str, Any]]:
    """Validates the manifest's header and returns its entries.

    Example:
      >>> check_manifest({"format": FORMAT, "version": 1, "entries": {}}, "ckpt")
      {}
    """
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("entries"), dict)
    ):
        raise CheckpointDamagedError(
            f"{where} has no valid nnx_mpmd manifest (the 'manifest' item is missing or "
            "corrupted); it was not written by nnx_mpmd.checkpoint or is damaged. Restore an "
            "earlier checkpoint or re-save it."
        )
    if manifest.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{where} has manifest version {manifest.get('version')!r}, this nnx_mpmd reads "
            f"versions {list(READABLE_VERSIONS)}; use the nnx_mpmd version that wrote it."
        )
    if manifest["version"] >= 2 and manifest.get("seal") != _seal(manifest):
        raise CheckpointDamagedError(
            f"checkpoint {where}/manifest was changed after it was saved (its SHA-256 seal does not match "
            "its contents); restore an earlier checkpoint (CheckpointManager.all_steps() lists "
            "them) or re-save."
        )
    return manifest["entries"]


def check_commit(
    manifest: dict[str, Any], where: str, *, step: int | None, metadata: Any = None
) -> None:
    """Refuses a step directory whose manifest, step and metadata do not belong together.

    Call after `check_manifest`; version-1 manifests pass. ``metadata=None`` skips its check.

    Raises:
      CheckpointDamagedError: the manifest was written for another step, or the
        metadata was changed or copied from another step.

    Example:
      >>> from nnx_mpmd.checkpoint.layout import collect
      >>> manifest, _ = build_manifest(collect({}), step=3, metadata={"lr": 0.1})
      >>> check_commit(manifest, "ckpt/3", step=3, metadata={"lr": 0.1})
    """
    if manifest.get("version") == 1:
        return
    if step is not None and manifest.get("step") != step:
        raise CheckpointDamagedError(
            f"checkpoint {where}/manifest belongs to step {manifest.get('step')!r}, not to step {step}: "
            "files of another step were copied into this step directory; restore an earlier "
            "step or delete this one."
        )
    if metadata is not None and manifest.get("metadata_sha256") != json_digest(metadata):
        raise CheckpointDamagedError(
            f"checkpoint {where}/metadata does not match the SHA-256 recorded in {where}/manifest when the "
            "step was saved: it was edited, or copied from another step; restore an earlier step "
            "or delete this one."
        )


STACKED_LEAF = re.compile(r"^(?P<head>.+)\.chunks\.(?P<index>\d+)\.(?P<tail>layers\..+)$")
"""A stacked `ScanStack` leaf's name: ``<stack>.chunks.<i>.layers.<leaf>``."""
_UNROLLED = re.compile(r"^(?P<head>.+)\.\d+\.(?P<leaf>.+)$")


def _layers_hint(name: str, others: Any, holder: str) -> str:
    """A hint when ``name`` is a `ScanStack` leaf and ``others`` (``holder``'s names) hold
    it unrolled, or the other way round: those convert only with the same layers in total."""
    stacked = STACKED_LEAF.match(name)
    if stacked:
        head, leaf = stacked["head"], stacked["tail"].removeprefix("layers.")
        count = sum(
            1
            for other in others
            if re.fullmatch(rf"{re.escape(head)}\.\d+\.{re.escape(leaf)}", other)
        )
        if count:
            return (
                f" {holder} holds {count} unrolled layers of this ScanStack "
                f"({head}.0.{leaf}, ...); a stack and its unrolled layers convert only when "
                "they have the same number of layers in total."
            )
        return ""
    unrolled = _UNROLLED.match(name)
    if unrolled:
        pattern = (
            rf"{re.escape(unrolled['head'])}\.chunks\.\d+\.layers\.{re.escape(unrolled['leaf'])}"
        )
        if any(re.fullmatch(pattern, other) for other in others):
            return (
                f" {holder} holds these layers as a ScanStack "
                f"({unrolled['head']}.chunks.<i>.layers.{unrolled['leaf']}); a stack and its "
                "unrolled layers convert only when they have the same number of layers in total."
            )
    return ""


def check_target(
    records: dict[str, dict[str, Any]], layout: Layout, where: str, *, partial: bool = False
) -> None:
    """Raises `CheckpointError` naming the first path where target and checkpoint differ.

    Example:
      >>> from nnx_mpmd.checkpoint.layout import collect
      >>> check_target({"step": {"kind": "value", "type": "int"}}, collect({"step": 0}), "ckpt")
    """
    targets = layout.by_name()
    for name in sorted(set(records) | set(targets)):
        if name not in records:
            raise CheckpointError(
                f"target path {name!r} is not in checkpoint {where}; the checkpoint was saved "
                "from a different model or tree (check the tree keys and the model config), or "
                f"remove that leaf from the target.{_layers_hint(name, records, 'The checkpoint')}"
            )
        if name not in targets:
            if partial:
                continue
            raise CheckpointError(
                f"checkpoint {where} has {name!r} but the target does not; add it to the target "
                "tree, or pass partial=True to restore only the target's paths."
                f"{_layers_hint(name, targets, 'The target')}"
            )
        saved, wanted = records[name], _target_record(targets[name])
        for field in ("kind", "type", "shape", "dtype", "impl"):
            if field not in wanted or wanted[field] is None:
                continue
            if saved.get(field) != wanted[field]:
                raise CheckpointError(
                    f"{field} mismatch at {name!r}: checkpoint {where} has {saved.get(field)!r}, "
                    f"the target has {wanted[field]!r}; build the target with the same model "
                    "config and dtypes as the saved run (or convert the checkpoint)."
                )
