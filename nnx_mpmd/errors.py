"""The one exception hierarchy of nnx_mpmd.

Every error raised by the library derives from :class:`MpmdError`. Messages say
what was wrong, where (a parameter path, a stage, a mesh) and how to fix it.

Example:
    >>> import nnx_mpmd as mp
    >>> try:
    ...     raise mp.ScheduleError("task F0.3 appears twice on mesh 0; remove one")
    ... except mp.MpmdError as e:
    ...     print(type(e).__name__)
    ScheduleError
"""

from __future__ import annotations

__all__ = [
    "CheckpointDamagedError",
    "CheckpointError",
    "CompileError",
    "DistributedError",
    "MeshError",
    "MpmdError",
    "NonFiniteError",
    "PartitionError",
    "PlacementError",
    "PlanError",
    "ScheduleError",
]


class MpmdError(Exception):
    """Base class of every error raised by nnx_mpmd."""


class MeshError(MpmdError):
    """An `MpmdMesh` is malformed or does not fit the model or schedule."""


class PartitionError(MpmdError):
    """Stage annotations are missing, inconsistent, or cannot be split into stages."""


class PlacementError(MpmdError):
    """State cannot be placed on (or is placed inconsistently with) the submeshes."""


class ScheduleError(MpmdError):
    """A schedule is invalid, deadlocks, or does not fit the stages and meshes."""


class CompileError(MpmdError):
    """A train step cannot be compiled into per-mesh programs."""


class CheckpointError(MpmdError):
    """A checkpoint cannot be saved, or does not match the restore target."""


class CheckpointDamagedError(CheckpointError):
    """A checkpoint's files are incomplete, changed or mixed from other steps.

    Unlike other `CheckpointError`s (a target that does not match, a permission
    problem) another, older checkpoint may be intact: `CheckpointManager.restore`
    falls back to it when asked.
    """


class DistributedError(MpmdError):
    """A multi-process run failed: a peer died, timed out, or disagrees."""


class PlanError(MpmdError):
    """The planner found no configuration: nothing fits the memory budget, or nothing runs."""


class NonFiniteError(MpmdError):
    """A step checked with ``mp.jit(..., check_finite=True)`` made a NaN or inf."""
