"""Checksums of a checkpoint's files as stored, recorded once the step is committed.

The manifest's per-array checksums (`nnx_mpmd.checkpoint.manifest.checksum`)
cover the array values as read back; they are recomputed after orbax has read
the arrays. This module covers the bytes on disk: once a save has committed,
process 0 reads every file of the step directory (orbax's array files of every
process, the manifest, the metadata, orbax's own metadata) and writes their
sizes and CRC-32s (``zlib.crc32``) to ``file_checksums.json`` in that directory
(`record_files`). The record names the step and the seal of the step's
manifest, and is sealed itself with a SHA-256, so a record of another step or
an edited record is refused too.

A restore with ``verify=True`` checks the record before orbax reads anything
(`check_files`): a changed, truncated or missing file raises
`CheckpointDamagedError` naming it, and `CheckpointManager.restore_newest_intact`
falls back to an older step. A file that is not in the record (added later) is
ignored: orbax reads only the files its own indexes name, and those are recorded.

A step without a record is still restored, verified by the value checksums
only: checkpoints of earlier versions, and a step whose process 0 was killed
between the commit and the record (a second or so).

Example:
  >>> import tempfile
  >>> from pathlib import Path
  >>> step = Path(tempfile.mkdtemp())
  >>> _ = (step / "data").write_bytes(b"abc")
  >>> _ = record_files(step, step=1, manifest_seal="s")
  >>> check_files(step, step=1, manifest_seal="s")
  True
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

from nnx_mpmd.checkpoint.manifest import json_digest
from nnx_mpmd.errors import CheckpointDamagedError

__all__ = ["RECORD", "check_files", "file_checksums", "record_files"]

#: The record's file name, inside the step directory.
RECORD = "file_checksums.json"
FORMAT = "nnx_mpmd.file_checksums"
_CHUNK = 1 << 20


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_checksums(directory: Path) -> dict[str, dict[str, int]]:
    """``{relative path: {"size", "crc32"}}`` of every file under ``directory`` but the record.

    Example:
      >>> import tempfile
      >>> from pathlib import Path
      >>> d = Path(tempfile.mkdtemp())
      >>> _ = (d / "x").write_bytes(b"abc")
      >>> file_checksums(d)
      {'x': {'size': 3, 'crc32': 891568578}}
    """
    found = {}
    for path in sorted(directory.rglob("*")):
        if path.name.startswith(RECORD) or path.is_symlink() or not path.is_file():
            continue
        found[path.relative_to(directory).as_posix()] = {
            "size": path.stat().st_size,
            "crc32": _crc32(path),
        }
    return found


def record_files(directory: Path, *, step: int | None, manifest_seal: str | None) -> Path:
    """Writes the record of ``directory``'s files atomically and returns its path.

    Call once the save has committed, on process 0 only.

    Example:
      >>> import tempfile
      >>> from pathlib import Path
      >>> record_files(Path(tempfile.mkdtemp()), step=None, manifest_seal=None).name
      'file_checksums.json'
    """
    record: dict[str, Any] = {
        "format": FORMAT,
        "version": 1,
        "algorithm": "crc32",
        "step": step,
        "manifest_seal": manifest_seal,
        "files": file_checksums(directory),
    }
    record["seal"] = json_digest(record)
    path = directory / RECORD
    part = directory / f"{RECORD}.part-{os.getpid()}"
    part.write_text(json.dumps(record, sort_keys=True))
    os.replace(part, path)
    return path


def _damaged(directory: Path, name: str, what: str) -> CheckpointDamagedError:
    item = name.split("/", 1)[0]
    return CheckpointDamagedError(
        f"checkpoint {directory}/{item} is corrupted: its file {directory}/{name} {what} "
        f"(recorded in {directory}/{RECORD} when the step was committed); restore an earlier "
        "checkpoint (CheckpointManager.all_steps() lists them) or delete this one."
    )


def _read_record(directory: Path) -> dict[str, Any] | None:
    path = directory / RECORD
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise CheckpointDamagedError(
            f"checkpoint {directory} has an unreadable {RECORD} ({type(error).__name__}: "
            f"{error}); it is damaged: restore an earlier checkpoint or delete this one."
        ) from None
    sealed = isinstance(record, dict) and record.get("format") == FORMAT
    if not sealed or record.get("seal") != json_digest(
        {k: v for k, v in record.items() if k != "seal"}
    ):
        raise CheckpointDamagedError(
            f"checkpoint {path} was changed after it was written (its SHA-256 seal does not "
            "match its contents); restore an earlier checkpoint or delete this one."
        )
    return record


def check_files(directory: Path, *, step: int | None, manifest_seal: str | None) -> bool:
    """Compares ``directory``'s files with their record before anything is read (False: no record).

    Raises:
      CheckpointDamagedError: a recorded file is missing, has another size or
        CRC-32, or the record is damaged or belongs to another step or manifest.
    """
    record = _read_record(directory)
    if record is None:
        return False
    if record.get("step") != step or record.get("manifest_seal") != manifest_seal:
        raise CheckpointDamagedError(
            f"checkpoint {directory}/{RECORD} belongs to another save (step "
            f"{record.get('step')!r}, another manifest) than this step directory: files were "
            "copied in from elsewhere; restore an earlier checkpoint or delete this one."
        )
    for name, expected in sorted(record.get("files", {}).items()):
        path = directory / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise _damaged(directory, name, "is missing") from None
        if size != expected["size"]:
            raise _damaged(
                directory,
                name,
                f"has {size} bytes, {expected['size']} were written (truncated or overwritten)",
            )
        crc = _crc32(path)
        if crc != expected["crc32"]:
            raise _damaged(
                directory,
                name,
                f"was changed after it was saved (CRC-32 {crc:#010x}, {expected['crc32']:#010x} "
                "recorded)",
            )
    return True
