"""Pipeline schedules: the task IR, generators, validation, simulation and pictures.

A schedule says, for every mesh, in which order it runs the forward (``F``)
and backward (``B``, or ``BI`` then ``BW`` when split) passes of its stages on
the microbatches. The same schedule object serves the simulator and the
runtime. Everything here is pure Python; matplotlib is imported only when a
Gantt chart is drawn.

Example:
    >>> from nnx_mpmd.schedules import OneFOneB, simulate
    >>> tl = simulate(OneFOneB().tasks(4, 4, 8))
    >>> round(tl.bubble_fraction, 4), tl.peak_activations
    (0.2727, (4, 3, 2, 1))
"""

from nnx_mpmd.schedules.draw import plot_gantt, plot_timelines, to_ascii
from nnx_mpmd.schedules.generators import (
    Custom,
    Eager1F1B,
    GPipe,
    Interleaved1F1B,
    LoopedBFS,
    OneFOneB,
    Schedule,
    order_by_rule,
)
from nnx_mpmd.schedules.profile import (
    ProfileComparison,
    compare_profile,
    fit_costs,
    measured_timeline,
)
from nnx_mpmd.schedules.registry import SCHEDULES, get_schedule
from nnx_mpmd.schedules.simulate import Costs, Timeline, peak_activations, simulate
from nnx_mpmd.schedules.tasks import (
    KINDS,
    Task,
    TaskLists,
    format_tasks,
    looped_placement,
    overlap_groups,
    parse_tasks,
    v_placement,
)
from nnx_mpmd.schedules.validate import format_grid, validate
from nnx_mpmd.schedules.zero_bubble import DualPipeV, ZeroBubbleH1, ZeroBubbleH2, ZeroBubbleV

__all__ = [
    "KINDS",
    "SCHEDULES",
    "Costs",
    "Custom",
    "DualPipeV",
    "Eager1F1B",
    "GPipe",
    "Interleaved1F1B",
    "LoopedBFS",
    "OneFOneB",
    "ProfileComparison",
    "Schedule",
    "Task",
    "TaskLists",
    "Timeline",
    "ZeroBubbleH1",
    "ZeroBubbleH2",
    "ZeroBubbleV",
    "compare_profile",
    "fit_costs",
    "format_grid",
    "format_tasks",
    "get_schedule",
    "looped_placement",
    "measured_timeline",
    "order_by_rule",
    "overlap_groups",
    "parse_tasks",
    "peak_activations",
    "plot_gantt",
    "plot_timelines",
    "simulate",
    "to_ascii",
    "v_placement",
    "validate",
]
