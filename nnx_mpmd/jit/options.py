"""`mp.jit`'s keyword options, read and checked once: `JitOptions`.

``mp.jit`` spells its options out once, in its signature, and turns them into
one frozen `JitOptions` before anything else; every later stage (tracing,
lowering, compiling, running) reads that object, as ``jax.jit`` keeps its
parsed parameters in one record. Argument positions named by parameter name
are resolved against the step in `nnx_mpmd.jit.arguments`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from nnx_mpmd.errors import CompileError, MeshError
from nnx_mpmd.jit.static_args import checked_argnames, checked_argnums
from nnx_mpmd.placement.mesh import MpmdMesh
from nnx_mpmd.schedules.registry import as_schedule

__all__ = ["DEFAULT_BATCH_AXIS", "JitOptions"]


class _DefaultBatchAxis(str):
    """The default ``batch_axis``: ``"data"`` when the submeshes have it, else None."""

    __slots__ = ()


DEFAULT_BATCH_AXIS = _DefaultBatchAxis("data")


@dataclasses.dataclass(frozen=True)
class JitOptions:
    """The options of one ``mp.jit`` step, checked; see `nnx_mpmd.jit.jit.jit` for each.

    Made by `parse`; frozen, so a step's options cannot change after it is made.

    Example:
      >>> import jax
      >>> from nnx_mpmd.placement.mesh import MpmdMesh
      >>> mesh = MpmdMesh(jax.make_mesh((1,), ("stage",), devices=jax.devices()[:1]), "stage")
      >>> options = JitOptions.parse(mesh=mesh, schedule="gpipe", num_microbatches=2)
      >>> options.batch_axis is None, options.donate_argnums
      (True, ())
    """

    mesh: MpmdMesh
    schedule: Any
    num_microbatches: int
    batch_axis: str | None
    transfer_warning_bytes: int
    compile_threads: int | None
    donate_argnums: tuple[int, ...]
    donate_argnames: tuple[str, ...]
    static_argnums: tuple[int, ...]
    static_argnames: tuple[str, ...]
    check_finite: bool

    @classmethod
    def parse(
        cls,
        *,
        mesh: Any,
        schedule: Any,
        num_microbatches: Any,
        batch_axis: Any = DEFAULT_BATCH_AXIS,
        transfer_warning_bytes: int = 1 << 20,
        compile_threads: Any = None,
        donate_argnums: int | Sequence[int] = (),
        donate_argnames: str | Sequence[str] = (),
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
        check_finite: Any = False,
    ) -> JitOptions:
        """Checks ``mp.jit``'s keyword options and returns them as one object.

        Args:
          mesh, schedule, num_microbatches, batch_axis, transfer_warning_bytes,
          compile_threads, donate_argnums, donate_argnames, static_argnums,
          static_argnames, check_finite: as `nnx_mpmd.jit.jit.jit` takes them.

        Returns:
          The options: the schedule as an object, ``batch_axis`` resolved
          against the mesh, argument positions and names as tuples.

        Raises:
          MeshError: ``mesh`` is not an `MpmdMesh`, or ``batch_axis`` names no
            axis of its submeshes.
          CompileError: another option has a value of the wrong kind.
          ScheduleError: ``schedule`` is not a schedule or a registered name.

        Example:
          >>> import jax
          >>> from nnx_mpmd.placement.mesh import MpmdMesh
          >>> devices = jax.devices()[:1]
          >>> mesh = MpmdMesh(jax.make_mesh((1,), ("stage",), devices=devices), "stage")
          >>> JitOptions.parse(mesh=mesh, schedule="gpipe", num_microbatches=0)
          Traceback (most recent call last):
          ...
          nnx_mpmd.errors.CompileError: num_microbatches must be an int >= 1, got 0.
        """
        if not isinstance(mesh, MpmdMesh):
            raise MeshError(
                f"mp.jit(mesh=...) needs an mp.MpmdMesh, got {type(mesh).__name__}; wrap it: "
                "mp.MpmdMesh(jax_mesh, 'stage')."
            )
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise CompileError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}.")
        return cls(
            mesh=mesh,
            schedule=as_schedule(schedule, "mp.jit(schedule=...)"),
            num_microbatches=num_microbatches,
            batch_axis=_resolved_batch_axis(batch_axis, mesh),
            transfer_warning_bytes=transfer_warning_bytes,
            compile_threads=_checked_compile_threads(compile_threads),
            donate_argnums=checked_argnums(donate_argnums, "donate"),
            donate_argnames=checked_argnames(donate_argnames),
            static_argnums=checked_argnums(static_argnums, "static"),
            static_argnames=checked_argnames(static_argnames),
            check_finite=_checked_check_finite(check_finite),
        )

    @property
    def compiles_ahead(self) -> bool:
        """Whether a new step's programs compile in threads before its first run."""
        return self.compile_threads != 1 and not self.mesh.is_multi_process


def _resolved_batch_axis(batch_axis: Any, mesh: MpmdMesh) -> str | None:
    """The batch axis a step uses; a name the submeshes lack is an error, never ignored."""
    if batch_axis is None:
        return None
    if isinstance(batch_axis, _DefaultBatchAxis):  # not given: "data" if there is one
        return "data" if "data" in mesh.axis_names else None
    return mesh.check_submesh_axis(
        batch_axis,
        argument="mp.jit(batch_axis=...): batch_axis",
        fix="or batch_axis=None to replicate the batch on every device of a submesh",
    )


def _checked_compile_threads(compile_threads: Any) -> int | None:
    if compile_threads is not None and (
        not isinstance(compile_threads, int) or compile_threads < 1
    ):
        raise CompileError(
            f"compile_threads must be an int >= 1 or None, got {compile_threads!r}; "
            "use 1 to compile each program when the first run reaches it."
        )
    return compile_threads


def _checked_check_finite(check_finite: Any) -> bool:
    """``mp.jit(check_finite=...)``, checked: a bool (any mesh, multi-process ones too)."""
    if not isinstance(check_finite, bool):
        raise CompileError(f"check_finite must be True or False, got {check_finite!r}.")
    return check_finite
