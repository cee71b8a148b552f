"""The planner: choose the pipeline configuration from measurements.

`plan` times and measures each unit of a model (its `Stage` wrappers) on the
real devices (`profile_units`), then searches the layer-to-stage split, the
schedule, the number of microbatches and per-stage remat under a per-device
memory budget, with the schedule simulator as the cost model (`search`). The
result is a `Plan`: the chosen configuration with its predicted step time and
peak memory, the runners-up, JSON to save, `Plan.apply(model)` to use it, and
`verify` to run the top configurations and compare predicted with measured.
The SPMD alternatives on the same devices (data parallel and FSDP over all of
them, `spmd`) are predicted and measured too and ranked with the pipelined
configurations, so that `Plan.verdict` can say whether pipelining pays.
"""

from nnx_mpmd.planner.plan import Plan, plan
from nnx_mpmd.planner.profile_units import UnitCosts, profile_units
from nnx_mpmd.planner.search import Candidate, predict, search
from nnx_mpmd.planner.spmd import LinkCosts, SpmdCandidate, spmd_step
from nnx_mpmd.planner.units import restage, stage_units
from nnx_mpmd.planner.verification import Verification, verify

__all__ = [
    "Candidate",
    "LinkCosts",
    "Plan",
    "UnitCosts",
    "Verification",
    "plan",
    "predict",
    "profile_units",
    "restage",
    "search",
    "SpmdCandidate",
    "spmd_step",
    "stage_units",
    "verify",
]
