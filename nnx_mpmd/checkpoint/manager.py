"""`CheckpointManager`: numbered, asynchronous, layout-independent checkpoints.

A thin layer over ``orbax.checkpoint.CheckpointManager``. Each step directory
holds the items ``arrays`` and ``manifest`` (as written by `save`) and
``metadata``: a JSON dict of the caller's choosing (the model config, the data
position, ...). Orbax writes each step into a temporary directory and renames
it when complete; unfinished steps (a crash or SIGKILL mid-save) are never
listed and never restored.

With ``async_save=True`` (the default) `CheckpointManager.save` returns once the
arrays are copied off the devices; the files are written in the background
while training continues. Call `CheckpointManager.wait_until_finished` (or
`CheckpointManager.close`, or leave the ``with`` block) before the process exits.

Each step is sealed: its manifest records the step and the SHA-256 of its
metadata, and a checksum of every array (see `nnx_mpmd.checkpoint.manifest`);
once the step has committed, process 0 records the size and CRC-32 of each of
its files (`nnx_mpmd.checkpoint.file_checksums`; for an asynchronous save at
the next `save`, `wait_until_finished` or `close`), checked before a restore
reads anything. A step directory without orbax's commit marker, with files of
another step, or with changed files raises `CheckpointDamagedError` naming the path;
`CheckpointManager.restore_newest_intact` then falls back to the newest intact
step, and `CheckpointManager.set_aside` moves the skipped steps out of the way.

A save that fails (a full disk) raises one `CheckpointError` naming the step
directory and the free space, at the next `save`, `wait_until_finished` or
`close`; the steps written before are untouched.

In a multi-process run every call waits for the other processes (orbax's
barriers, the checksum exchange) only while they live: a process that dies
meanwhile is named in a `DistributedError` within the heartbeat timeout
(`nnx_mpmd.runtime.coordination.bounded_by_peers`) instead of orbax's 300 s.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from nnx_mpmd.checkpoint.core import read_failure, restore_layout, save_args
from nnx_mpmd.checkpoint.file_checksums import check_files, record_files
from nnx_mpmd.checkpoint.global_arrays import use_coordination_barriers
from nnx_mpmd.checkpoint.layout import collect
from nnx_mpmd.checkpoint.manifest import check_commit, check_manifest
from nnx_mpmd.errors import CheckpointDamagedError, CheckpointError, DistributedError
from nnx_mpmd.runtime.coordination import bounded_by_peers, get_coordination

__all__ = ["CheckpointManager", "Restored"]

#: The file orbax writes into a step directory once every item is committed.
COMMIT_MARKER = "commit_success.txt"


class _DropRethrownSaveErrors(logging.Filter):
    """Drops orbax's log records of exceptions in its background save threads: orbax
    re-raises each in the caller's thread, where `CheckpointManager` turns it into one
    `CheckpointError` (otherwise a full disk prints a dozen tracebacks)."""

    PATTERNS = ("raised an exception", "background save thread", "thread (save_finalize)")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or "orbax" not in record.pathname:
            return True
        message = record.getMessage()
        return not any(pattern in message for pattern in self.PATTERNS)


_SAVE_ERROR_FILTER = _DropRethrownSaveErrors()


class Restored(NamedTuple):
    """What `CheckpointManager.restore_newest_intact` restored."""

    step: int
    """The step restored."""
    metadata: dict[str, Any]
    """Its JSON metadata."""
    skipped: list[str]
    """One line per newer step that was skipped, naming it and why."""


class CheckpointManager:
    """Saves and restores numbered checkpoints of a tree in ``directory``.

    Args:
      directory: where step directories are written (created if missing).
      max_to_keep: keep only the newest this many steps (None keeps all).
      save_interval_steps: `save` writes only steps divisible by this.
      async_save: write files in the background while training continues.

    Example:
      >>> import tempfile
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
      >>> with CheckpointManager(tempfile.mkdtemp(), max_to_keep=2) as mgr:
      ...     for step in range(3):
      ...         _ = mgr.save(step, {"model": model}, metadata={"data_position": step * 8})
      ...     mgr.wait_until_finished()
      ...     print(mgr.all_steps(), mgr.metadata()["data_position"])
      [1, 2] 16
    """

    def __init__(
        self,
        directory: str | Path,
        max_to_keep: int | None = None,
        save_interval_steps: int = 1,
        async_save: bool = True,
    ) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise CheckpointError(
                f"CheckpointManager({directory}): max_to_keep={max_to_keep} must be >= 1 or "
                "None (keep every step)."
            )
        if save_interval_steps < 1:
            raise CheckpointError(
                f"CheckpointManager({directory}): save_interval_steps={save_interval_steps} "
                "must be >= 1."
            )
        self._directory = Path(directory).absolute()
        self._async = async_save
        logging.getLogger("absl").addFilter(_SAVE_ERROR_FILTER)  # once: filters are a set
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_save,
            create=True,
        )
        use_coordination_barriers()
        self._unrecorded: dict[int, str | None] = {}  # saved step -> its manifest's seal
        self._records = 0  # file records written (the barriers' names)
        handlers = {
            "arrays": ocp.PyTreeCheckpointHandler(),
            "manifest": ocp.JsonCheckpointHandler(),
            "metadata": ocp.JsonCheckpointHandler(),
        }
        self._manager = bounded_by_peers(
            f"opening the checkpoint directory {self._directory}",
            lambda: ocp.CheckpointManager(self._directory, options=options, item_handlers=handlers),
        )

    @property
    def directory(self) -> Path:
        """The directory that holds the step directories."""
        return self._directory

    def save(self, step: int, tree: Any, metadata: dict[str, Any] | None = None) -> bool:
        """Saves ``tree`` (and JSON ``metadata``) as ``step``.

        Args:
          step: the step number (an int >= 0, larger than every saved step).
          tree: the pytree to save (see `nnx_mpmd.checkpoint.save`).
          metadata: a JSON-able dict saved beside the arrays.

        Returns:
          True if the step was saved, False if ``save_interval_steps`` skipped it.

        Raises:
          CheckpointError: a bad step number, metadata that is not JSON, or a
            leaf that cannot be saved.
          DistributedError: another process died during the save (multi-process runs).
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise CheckpointError(
                f"CheckpointManager({self._directory}).save: step={step!r} must be an int >= 0."
            )
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, dict):
            raise CheckpointError(
                f"CheckpointManager({self._directory}).save(step={step}): metadata must be a "
                f"dict, got {type(metadata).__name__}."
            )
        try:
            json.dumps(metadata)
        except TypeError as error:
            raise CheckpointError(
                f"CheckpointManager({self._directory}).save(step={step}): metadata is not "
                f"JSON-serializable ({error}); store numbers, strings, lists and dicts only."
            ) from error
        if step in self._manager.all_steps():
            raise CheckpointError(
                f"step {step} already exists in {self._directory}; save a larger step or "
                "delete that step directory."
            )
        if not self._manager.should_save(step):
            return False

        def save_step() -> bool:
            self._manager.wait_until_finished()  # orbax waits too: the earlier steps commit
            self._record_files()  # ... before this save may delete them (max_to_keep)
            args = save_args(tree, metadata, step)
            self._unrecorded[step] = args["manifest"].item.get("seal")
            return bool(self._manager.save(step, args=args))

        with self._save_failures(step):
            saved = bounded_by_peers(
                f"saving checkpoint step {step} to {self._directory}", save_step
            )
            if not self._async:  # committed already: record its files now
                self._record_files_together()
        return saved

    def _record_files(self) -> None:
        """Process 0 records the files of the steps saved and committed since the last call
        (`nnx_mpmd.checkpoint.file_checksums`). Call when no save is in flight."""
        pending, self._unrecorded = self._unrecorded, {}
        if jax.process_index() != 0:
            return
        for step, seal in pending.items():
            where = self._directory / str(step)
            if not (where / COMMIT_MARKER).exists():  # deleted since (max_to_keep)
                continue
            try:
                record_files(where, step=step, manifest_seal=seal)
            except FileNotFoundError:  # deleted meanwhile: nothing to record
                continue

    def _resolve(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(
                    f"no checkpoint in {self._directory} (no finished step); check the "
                    "directory, or start from scratch when nothing was saved yet."
                )
            return steps[-1]
        if step not in steps:
            raise CheckpointError(
                f"step {step} is not in {self._directory}; available steps: {steps}."
            )
        return step

    def restore(
        self, target: Any, step: int | None = None, *, partial: bool = False, verify: bool = True
    ) -> Any:
        """Restores ``step`` (the latest by default) into ``target``.

        See `nnx_mpmd.checkpoint.restore` for how leaves are placed.

        Args:
          target: a tree with the same logical structure as the saved one.
          step: the step to restore; None restores the latest finished step.
          partial: allow checkpoint entries that ``target`` does not have.
          verify: recompute fingerprints and fail on corrupted data.

        Returns:
          ``target`` with non-NNX leaves replaced; NNX objects updated in place.

        Raises:
          CheckpointDamagedError: the step is incomplete, damaged, or mixed with
            another step's files (the message names the path).
          CheckpointError: no such step, a mismatching target, or files this
            process may not read.
          DistributedError: another process died during the restore (multi-process runs).
        """
        self.wait_until_finished()
        step = self._resolve(step)
        return bounded_by_peers(
            f"restoring checkpoint step {step} from {self._directory}",
            self._restore,
            target,
            step,
            partial,
            verify,
        )

    def _restore(self, target: Any, step: int, partial: bool, verify: bool) -> Any:
        where = str(self._directory / str(step))
        layout = collect(target, where="target")
        manifest = self._manifest(step)
        if verify:
            try:
                check_files(Path(where), step=step, manifest_seal=manifest.get("seal"))
            except OSError as error:
                raise read_failure(error, where, f"has unreadable files ({error})") from error

        def reader(item: dict, restore_args: dict, partial_read: bool) -> dict:
            args = ocp.args.PyTreeRestore(
                item, restore_args=restore_args, partial_restore=partial_read
            )
            return self._manager.restore(step, args=ocp.args.Composite(arrays=args))["arrays"]

        return restore_layout(layout, manifest, reader, where, partial=partial, verify=verify)

    def latest_step(self) -> int | None:
        """The newest finished step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every finished step, ascending."""
        return sorted(self._manager.all_steps())

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The JSON metadata saved with ``step`` (the latest by default).

        Raises:
          CheckpointDamagedError: the step is incomplete, or its metadata was
            changed or copied from another step.
        """
        self.wait_until_finished()
        step = self._resolve(step)
        where = self._directory / str(step)
        manifest = self._manifest(step)
        try:
            metadata = dict(self._read_json(step, "metadata") or {})
        except DistributedError:
            raise
        except Exception as error:
            raise read_failure(
                error,
                str(where),
                f"has unreadable metadata ({where}/metadata: {type(error).__name__}); it is "
                "damaged: restore an earlier step.",
            ) from error
        check_commit(manifest, str(where), step=step, metadata=metadata)
        return metadata

    def _read_json(self, step: int, item: str) -> Any:
        """The JSON ``item`` (manifest, metadata) of ``step``, read while the peers live."""
        return bounded_by_peers(
            f"reading the {item} of checkpoint step {step} in {self._directory}",
            lambda: self._manager.restore(
                step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()})
            )[item],
        )

    def _manifest(self, step: int) -> dict[str, Any]:
        """The checked manifest of a committed ``step``."""
        where = self._directory / str(step)
        self._check_committed(where)
        try:
            manifest = self._read_json(step, "manifest")
        except DistributedError:
            raise
        except Exception as error:
            raise read_failure(
                error,
                str(where),
                f"has an unreadable manifest ({where}/manifest: {type(error).__name__}); it is "
                "truncated or corrupted: restore an earlier step or re-save.",
            ) from error
        check_manifest(manifest, str(where))
        check_commit(manifest, str(where), step=step)
        return manifest

    @staticmethod
    def _check_committed(where: Path) -> None:
        if where.is_dir() and not os.access(where, os.R_OK | os.X_OK):
            raise read_failure(PermissionError(errno.EACCES, "Permission denied"), str(where), "")
        missing = [name for name in (COMMIT_MARKER, "manifest") if not (where / name).exists()]
        if missing:
            raise CheckpointDamagedError(
                f"checkpoint {where} is incomplete: it has no {' and no '.join(missing)} "
                "(orbax writes the commit marker last), so its save did not finish or the "
                "directory was copied only in part; restore an earlier step or delete this one."
            )

    def restore_newest_intact(
        self,
        target: Any,
        *,
        before: int | None = None,
        check: Callable[[int, dict[str, Any]], None] | None = None,
        partial: bool = False,
    ) -> Restored:
        """Restores the newest step that is complete and verifies, skipping damaged ones.

        Only `CheckpointDamagedError` skips a step; a collective in a multi-process run.

        Args:
          target: as for `restore`.
          before: consider only steps up to this one (None: all).
          check: called with a step's number and metadata before its arrays are
            read (for example to refuse changed settings); what it raises is raised.
          partial: as for `restore`.

        Returns:
          `Restored` ``(step, metadata, skipped)``.

        Raises:
          CheckpointError: no step, or none intact (listing why each was skipped).

        Example:
          >>> import tempfile, jax.numpy as jnp
          >>> mgr = CheckpointManager(tempfile.mkdtemp(), async_save=False)
          >>> _ = mgr.save(1, {"w": jnp.ones(2)}, {"step": 1})
          >>> (mgr.directory / "2").mkdir()  # a stray, empty step
          >>> restored = mgr.restore_newest_intact({"w": jnp.zeros(2)})
          >>> restored.step, restored.skipped[0].split(":")[0]
          (1, 'skipped step 2')
        """
        self.wait_until_finished()
        self._manager.reload()  # the directory as it is now (stray steps included)
        steps = [s for s in self.all_steps() if before is None or s <= before]
        if not steps:
            raise CheckpointError(
                f"no checkpoint in {self._directory}"
                + (f" at or before step {before}" if before is not None else "")
                + f" (steps: {self.all_steps()}); check the directory and the step."
            )
        skipped: list[str] = []
        for step in reversed(steps):
            try:
                metadata = self.metadata(step)
                if check is not None:
                    check(step, metadata)
                self.restore(target, step, partial=partial)
            except CheckpointDamagedError as error:
                skipped.append(f"skipped step {step}: {error}")
                continue
            return Restored(step, metadata, skipped)
        raise CheckpointDamagedError(
            f"no intact checkpoint in {self._directory}: " + " ".join(skipped)
        )

    def set_aside(self, steps: list[int]) -> list[Path]:
        """Renames step directories to ``<step>.set-aside`` so that new saves can reuse the
        step numbers; the files are kept for inspection. A collective (process 0 renames).

        Returns:
          The new paths.
        """
        self.wait_until_finished()
        moved = []
        for step in steps:
            source, target = self._directory / str(step), self._directory / f"{step}.set-aside"
            n = 1
            while target.exists():
                n += 1
                target = self._directory / f"{step}.set-aside-{n}"
            if jax.process_index() == 0:
                shutil.move(source, target)
            moved.append(target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"nnx_mpmd set_aside {steps}")
        self._manager.reload()
        return moved

    @contextlib.contextmanager
    def _save_failures(self, step: int | None) -> Iterator[None]:
        """Turns a failed (background) save into one `CheckpointError` naming the step
        directory and the free space."""
        try:
            yield
        except (CheckpointError, DistributedError):
            raise
        except Exception as error:
            raise save_failure(error, self._directory, step) from None

    def is_saving_in_progress(self) -> bool:
        """Whether a background save is still being written."""
        return bool(self._manager.is_saving_in_progress())

    def wait_until_finished(self) -> None:
        """Blocks until every background save has been written.

        Raises:
          CheckpointError: a background save failed (a full disk), naming the
            step directory and the free space; earlier steps are intact.
          DistributedError: another process died meanwhile (multi-process runs).
        """
        with self._save_failures(None):
            bounded_by_peers(
                f"waiting for the checkpoint saves in flight to {self._directory} to commit",
                self._manager.wait_until_finished,
            )
            self._record_files_together()

    def _record_files_together(self) -> None:
        """`_record_files`, then (when there was something to record) a barrier, so that
        every process sees the records before it restores."""
        recorded = bool(self._unrecorded)
        self._record_files()
        if recorded and jax.process_count() > 1:
            self._records += 1
            get_coordination().barrier(
                f"checkpoint/files/{self._directory}/{self._records}",
                "recording a checkpoint's file checksums",
            )

    def close(self) -> None:
        """Waits for background saves and releases orbax's resources.

        Raises:
          CheckpointError, DistributedError: as `wait_until_finished`.
        """
        with self._save_failures(None):
            bounded_by_peers(
                f"closing the checkpoint manager of {self._directory} (saves in flight commit)",
                self._manager.close,
            )
            self._record_files_together()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self._directory)!r}, steps={self.all_steps()})"


_DISK_FULL = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up"}
_DISK_FULL[errno.EFBIG] = "a file reached the size limit (ulimit -f)"
_DISK_FULL_TEXT = {
    "no space left on device": errno.ENOSPC,
    "disk quota exceeded": errno.EDQUOT,
    "file too large": errno.EFBIG,
}


def _disk_full_reason(error: BaseException) -> str | None:
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _DISK_FULL:
            return _DISK_FULL[seen.errno]
        text = str(seen).lower()
        for phrase, code in _DISK_FULL_TEXT.items():
            if phrase in text:
                return _DISK_FULL[code]
        seen = seen.__cause__ or seen.__context__
    return None


def save_failure(error: BaseException, directory: Path, step: int | None) -> CheckpointError:
    """The one error for a save of ``step`` (None: the one in flight) into ``directory`` that
    failed with ``error``: it names the step directory, the free space and what is intact.

    Example:
      >>> import errno, tempfile
      >>> from pathlib import Path
      >>> error = OSError(errno.ENOSPC, "No space left on device")
      >>> "the disk is full" in str(save_failure(error, Path(tempfile.mkdtemp()), 4))
      True
    """
    # The save that failed left its temporary directory; orbax may report it only at the
    # next save, so that directory names the step better than ``step``.
    unfinished = sorted(
        directory.glob("*.orbax-checkpoint-tmp*"),
        key=lambda p: int(p.name.split(".")[0]) if p.name.split(".")[0].isdigit() else -1,
    )
    if unfinished:
        where = str(unfinished[-1])
    else:
        where = str(directory if step is None else directory / str(step))
    try:
        free = f"{shutil.disk_usage(directory).free / 2**20:,.1f} MiB free"
    except OSError:
        free = "free space unknown"
    kept = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
    intact = f"steps {kept} are untouched" if kept else "no earlier step was saved"
    reason = _disk_full_reason(error)
    why = (
        reason
        or f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
    )
    return CheckpointError(
        f"saving checkpoint {where} failed: {why} ({free} on {directory}); {intact} and the "
        "unfinished step is never restored. Free space (or raise the limit), then continue "
        "with --resume / CheckpointManager.restore."
    )
