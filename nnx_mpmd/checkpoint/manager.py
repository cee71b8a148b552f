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

In a multi-process run every call waits for the other processes (orbax's
barriers, the fingerprint collective) only while they live: a process that dies
meanwhile is named in a `DistributedError` within the heartbeat timeout
(`nnx_mpmd.runtime.coordination.bounded_by_peers`) instead of orbax's 300 s.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import TracebackType
from typing import Any

import orbax.checkpoint as ocp

from nnx_mpmd.checkpoint.core import restore_layout, save_args
from nnx_mpmd.checkpoint.global_arrays import use_coordination_barriers
from nnx_mpmd.checkpoint.layout import collect
from nnx_mpmd.errors import CheckpointError, DistributedError
from nnx_mpmd.runtime.coordination import bounded_by_peers

__all__ = ["CheckpointManager"]


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
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_save,
            create=True,
        )
        use_coordination_barriers()
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
        return bool(
            bounded_by_peers(
                f"saving checkpoint step {step} to {self._directory}",
                lambda: self._manager.save(step, args=save_args(tree, metadata)),
            )
        )

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
          CheckpointError: no such step, a mismatching target, or damaged data.
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
        try:
            manifest = self._manager.restore(
                step, args=ocp.args.Composite(manifest=ocp.args.JsonRestore())
            )["manifest"]
        except Exception as error:
            raise CheckpointError(
                f"checkpoint {where} has an unreadable manifest ({type(error).__name__}); it is "
                "truncated or corrupted: restore an earlier step or re-save."
            ) from error

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
        """The JSON metadata saved with ``step`` (the latest by default)."""
        self.wait_until_finished()
        step = self._resolve(step)
        try:
            restored = bounded_by_peers(
                f"reading the metadata of checkpoint step {step} in {self._directory}",
                lambda: self._manager.restore(
                    step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore())
                ),
            )
            return dict(restored["metadata"] or {})
        except DistributedError:
            raise
        except Exception as error:
            raise CheckpointError(
                f"checkpoint {self._directory / str(step)} has unreadable metadata "
                f"({type(error).__name__}); it is damaged: restore an earlier step."
            ) from error

    def is_saving_in_progress(self) -> bool:
        """Whether a background save is still being written."""
        return bool(self._manager.is_saving_in_progress())

    def wait_until_finished(self) -> None:
        """Blocks until every background save has been written."""
        bounded_by_peers(
            f"waiting for the checkpoint saves in flight to {self._directory} to commit",
            self._manager.wait_until_finished,
        )

    def close(self) -> None:
        """Waits for background saves and releases orbax's resources."""
        bounded_by_peers(
            f"closing the checkpoint manager of {self._directory} (saves in flight commit)",
            self._manager.close,
        )

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
