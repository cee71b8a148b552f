"""`verify`: run a plan's top configurations, pipelined and SPMD, and measure them.

Each configuration runs on a copy of the model: the pipelined ones with
`mp.jit` and the planned split, the SPMD alternatives with their `jax.jit`
step (`nnx_mpmd.planner.spmd`). A `Verification` holds what was predicted
and what was measured; `Plan.with_measurements` closes the plan over them.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import optax
from flax import nnx

from nnx_mpmd.jit.jit import jit
from nnx_mpmd.placement.mesh import MpmdMesh
from nnx_mpmd.planner.profile_units import train_step_of
from nnx_mpmd.planner.search import Candidate
from nnx_mpmd.planner.spmd import SpmdCandidate, measure_spmd
from nnx_mpmd.schedules import get_schedule

if TYPE_CHECKING:
    from nnx_mpmd.planner.plan import Plan

__all__ = ["Verification", "verify"]


@dataclasses.dataclass(frozen=True)
class Verification:
    """A configuration's predicted and measured step time and peak memory.

    Attributes:
      candidate: the configuration run: a pipelined `Candidate` or an SPMD
        alternative (`nnx_mpmd.planner.spmd.SpmdCandidate`).
      measured_step_s: the median of the timed steps.
      measured_peak_bytes: per mesh, the peak live bytes per device
        (`memory=True`); for an SPMD alternative, one entry: XLA's memory
        analysis of its compiled step (0 where the backend gives none).
    """

    candidate: Candidate | SpmdCandidate
    measured_step_s: float
    measured_peak_bytes: tuple[int, ...]

    @property
    def time_error(self) -> float:
        """(predicted - measured) / measured step time."""
        return self.candidate.step_s / self.measured_step_s - 1.0

    @property
    def memory_error(self) -> float:
        """(predicted - measured) / measured, of the highest peak over meshes."""
        return max(self.candidate.peak_bytes) / max(max(self.measured_peak_bytes), 1) - 1.0


def _own_copy(model: Any) -> Any:
    """``model`` cloned with its own buffers: a donating step deletes the ones it reads
    (`nnx.clone` shares them with ``model``)."""
    copy = nnx.clone(model)
    nnx.update(
        copy, jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, nnx.state(copy))
    )
    return copy


def verify(
    planned: Plan,
    model: Any,
    loss_fn: Callable[[Any, Any], Any],
    batch: Any,
    mesh: MpmdMesh,
    tx: optax.GradientTransformation,
    *,
    top: int = 3,
    steps: int = 5,
) -> list[Verification]:
    """Runs the plan's ``top`` configurations and measures them.

    The top of `Plan.ranking` is run: pipelined configurations and SPMD
    alternatives alike. Each runs on a copy of ``model``: one step to compile,
    ``steps`` timed steps (the median counts), and (pipelined) one with
    ``memory=True``. The step donates the copy's state when the plan was made
    for a donating step (`Plan.donate`).

    Args:
      planned: the `Plan`.
      model: the model given to `plan` (it is not changed).
      loss_fn: the loss given to `plan`.
      batch: one step's batch.
      mesh: the `MpmdMesh` planned for.
      tx: the optimizer's transformation.
      top: how many configurations to run (the best first).
      steps: timed steps per configuration.

    Returns:
      One `Verification` per configuration run.
    """
    results = []
    for candidate, _, _ in planned.ranking()[:top]:
        if isinstance(candidate, SpmdCandidate):
            seconds, peaks = measure_spmd(
                candidate, model, loss_fn, batch, mesh, tx, steps=steps, donate=planned.donate
            )
            results.append(Verification(candidate, seconds, peaks))
            continue
        copy = planned.apply(_own_copy(model), candidate)
        optimizer = nnx.Optimizer(copy, tx, wrt=nnx.Param)
        step = jit(
            train_step_of(loss_fn),
            mesh=mesh,
            schedule=get_schedule(candidate.schedule),
            num_microbatches=candidate.num_microbatches,
            donate_argnums=(0, 1) if planned.donate else (),
        )
        jax.block_until_ready(step(copy, optimizer, batch))
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            jax.block_until_ready(step(copy, optimizer, batch))
            times.append(time.perf_counter() - start)
        jax.block_until_ready(step(copy, optimizer, batch, memory=True))
        peaks = tuple(int(b) for b in step.last_memory["peak_bytes"])
        results.append(Verification(candidate, statistics.median(times), peaks))
    return results
