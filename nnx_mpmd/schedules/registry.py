"""The schedule registry: names as the command line spells them, and `get_schedule`.

This module is pure Python: it imports neither JAX nor Flax.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from nnx_mpmd.errors import ScheduleError
from nnx_mpmd.schedules.generators import (
    Eager1F1B,
    GPipe,
    Interleaved1F1B,
    LoopedBFS,
    OneFOneB,
    Schedule,
)
from nnx_mpmd.schedules.zero_bubble import DualPipeV, ZeroBubbleH1, ZeroBubbleH2, ZeroBubbleV

__all__ = ["SCHEDULES", "as_schedule", "get_schedule"]

SCHEDULES: dict[str, type[Schedule]] = {
    cls.name: cls
    for cls in (
        GPipe,
        OneFOneB,
        Eager1F1B,
        Interleaved1F1B,
        LoopedBFS,
        ZeroBubbleH1,
        ZeroBubbleH2,
        ZeroBubbleV,
        DualPipeV,
    )
}
"""Schedule classes by name: gpipe, 1f1b, eager-1f1b, interleaved, looped-bfs, zb-h1, zb-h2,
zb-v, dualpipev."""


def get_schedule(name: str | Schedule, **params: Any) -> Schedule:
    """The schedule called ``name``, built with ``params`` as its fields.

    Names are case-insensitive and ``_`` reads as ``-``. A `Schedule` instance
    is returned as it is (``params`` must then be empty).

    Args:
      name: a key of `SCHEDULES` (or a `Schedule`).
      **params: the schedule's parameters, e.g. ``virtual_stages=2``.

    Returns:
      The schedule.

    Example:
      >>> get_schedule("1F1B")
      OneFOneB()
      >>> get_schedule("interleaved", virtual_stages=3)
      Interleaved1F1B(virtual_stages=3)
    """
    if isinstance(name, Schedule):
        if params:
            raise ScheduleError(
                f"get_schedule got a {type(name).__name__} instance and parameters "
                f"{sorted(params)}; pass a name with parameters, or the instance alone"
            )
        return name
    if not isinstance(name, str):
        raise ScheduleError(
            f"schedule name must be a string, got {name!r}; use one of {', '.join(SCHEDULES)}"
        )
    key = name.strip().lower().replace("_", "-")
    if key not in SCHEDULES:
        raise ScheduleError(
            f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}, or "
            "nnx_mpmd.schedules.Custom for a hand-written one"
        )
    cls = SCHEDULES[key]
    fields = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ScheduleError(
            f"schedule {key!r} has no parameter {', '.join(unknown)}; it takes "
            f"{', '.join(sorted(fields)) or 'no parameters'}"
        )
    return cls(**params)


#: What the compiler calls on a schedule object (a duck-typed one needs them too).
_SCHEDULE_METHODS = ("tasks", "mesh_of", "check")


def as_schedule(value: Any, where: str) -> Any:
    """``value`` as a schedule object: a registered name becomes its `Schedule`.

    Any object with ``tasks``, ``mesh_of`` and ``check`` is accepted too.

    Raises:
      ScheduleError: an unknown name, a schedule class (not an instance), or an
        object without those methods.

    Example:
      >>> as_schedule("gpipe", "mp.jit(schedule=...)")
      GPipe()
    """
    if isinstance(value, str):
        try:
            return get_schedule(value)
        except ScheduleError as e:
            raise ScheduleError(f"{where}: {e}") from None
    if isinstance(value, type):
        raise ScheduleError(
            f"{where} got the class {value.__name__}, not a schedule; create one: "
            f"{value.__name__}()"
        )
    missing = [m for m in _SCHEDULE_METHODS if not callable(getattr(value, m, None))]
    if missing:
        raise ScheduleError(
            f"{where} got {value!r} ({type(value).__name__}), which is not a schedule: it has "
            f"no {', '.join(missing)}; pass a schedule object such as mp.OneFOneB() or a "
            f"registered name ({', '.join(SCHEDULES)})"
        )
    return value
