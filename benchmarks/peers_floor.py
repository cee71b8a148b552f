"""The hand-written floor of `make bench-peers`: a pipeline with no framework.

The same task graph nnx_mpmd runs, written as a user would by hand: one
``jax.jit`` program per stage task (forward returning its VJP residuals,
backward adding into the stage's gradient buffer, one update per stage) and
``jax.device_put`` between submeshes, dispatched in the schedule's order. The
order comes from nnx_mpmd's schedule (the task lists are plain data); nothing
else of nnx_mpmd runs. The batch is split and placed before the step (the
floor's best case).

Example:
    >>> import peers_models as pm
    >>> order = dispatch_order(pm.ROWS["tiny"])
    >>> order[0], len(order)
    (('F', 0, 0), 16)
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import peers_models as pm
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def dispatch_order(row: pm.Row) -> list[tuple[str, int, int]]:
    """The schedule's tasks ``(kind, stage, microbatch)`` merged into one host order.

    Meshes take turns; each issues its next task once that task's inputs exist
    (a forward needs the previous stage's, a backward the next stage's).
    """
    from nnx_mpmd.schedules import Interleaved1F1B, OneFOneB

    schedule = Interleaved1F1B() if row.virtual > 1 else OneFOneB()
    lists = schedule.tasks(row.num_stages, row.meshes, row.microbatches)
    done: set[tuple[str, int, int]] = set()
    position = [0] * len(lists)
    order = []
    last = row.num_stages - 1
    while any(position[m] < len(tasks) for m, tasks in enumerate(lists)):
        progressed = False
        for m, tasks in enumerate(lists):
            if position[m] == len(tasks):
                continue
            task = tasks[position[m]]
            s, i = task.stage, task.microbatch
            if task.kind == "F":
                ready = s == 0 or ("F", s - 1, i) in done
            else:
                ready = ("F", s, i) in done and (s == last or ("B", s + 1, i) in done)
            if ready:
                key = (task.kind[0], s, i)
                order.append(key)
                done.add(key)
                position[m] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule deadlocks at {position}")
    return order


def submeshes(row: pm.Row) -> list[jax.sharding.Mesh]:
    """One ``(data,)`` mesh per pipeline stage mesh, over consecutive devices."""
    devices = jax.devices()
    return [
        jax.sharding.Mesh(devices[m * row.data : (m + 1) * row.data], ("data",))
        for m in range(row.meshes)
    ]


class FloorStep:
    """One pipelined training step by hand.

    Args:
      row: the workload.
      params: NumPy parameters (`peers_models.init_params`).

    Example:
      >>> import peers_models as pm
      >>> row = pm.ROWS["tiny"]
      >>> step = FloorStep(row, pm.init_params(row))
      >>> xs, ys = step.place_batch(*pm.make_batch(row))
      >>> loss = step(xs, ys)
    """

    def __init__(self, row: pm.Row, params: dict) -> None:
        self.row = row
        meshes = submeshes(row)
        n = row.num_stages
        self.replicated = [NamedSharding(meshes[row.mesh_of(s)], P()) for s in range(n)]
        self.rows = [NamedSharding(meshes[row.mesh_of(s)], P("data")) for s in range(n)]
        self.params = [
            jax.device_put(pm.stage_params(row, params, s), self.replicated[s]) for s in range(n)
        ]
        self.order = dispatch_order(row)
        self._loss_cotangent = jax.device_put(jnp.ones((), jnp.float32), self.replicated[-1])
        self._forward = [jax.jit(functools.partial(self._stage_vjp, s)) for s in range(n)]
        self._backward_first = jax.jit(self._backward)
        self._backward_add = jax.jit(self._backward_accumulate, donate_argnums=2)
        self._update = jax.jit(pm.sgd, donate_argnums=0)

    def _stage_vjp(self, stage: int, sp: dict, h: jax.Array, y: jax.Array | None = None):
        row = self.row
        scale = 1.0 / row.microbatches
        if stage == row.num_stages - 1:
            return jax.vjp(
                lambda p, h: scale * pm.output_loss(row, pm.stage_forward(row, stage, p, h), y),
                sp,
                h,
            )
        if stage == 0:  # integer tokens have no cotangent: differentiate the parameters only
            out, vjp = jax.vjp(lambda p: pm.stage_forward(row, stage, p, h), sp)
            return out, vjp
        return jax.vjp(lambda p, h: pm.stage_forward(row, stage, p, h), sp, h)

    @staticmethod
    def _backward(vjp, cotangent):
        return vjp(cotangent)

    @staticmethod
    def _backward_accumulate(vjp, cotangent, grads):
        cotangents = vjp(cotangent)
        return (jax.tree.map(jnp.add, grads, cotangents[0]), *cotangents[1:])

    def place_batch(self, xs: Any, ys: Any) -> tuple[list, list]:
        """Microbatch inputs on the first stage's mesh, targets on the last's."""
        last = self.row.num_stages - 1
        return (
            [jax.device_put(x, self.rows[0]) for x in xs],
            [jax.device_put(y, self.rows[last]) for y in ys],
        )

    def __call__(self, xs: list, ys: list) -> jax.Array:
        """Runs one step (updating the parameters); returns the step's loss."""
        last = self.row.num_stages - 1
        activation: dict[tuple[int, int], jax.Array] = {}  # (stage, mb) -> its input
        residuals: dict[tuple[int, int], Any] = {}
        cotangent: dict[tuple[int, int], jax.Array] = {}  # (stage, mb) -> d loss / d output
        grads: list[Any] = [None] * self.row.num_stages
        losses = []
        for kind, s, i in self.order:
            if kind == "F":
                h = xs[i] if s == 0 else activation.pop((s, i))
                if s == last:
                    loss, residuals[s, i] = self._forward[s](self.params[s], h, ys[i])
                    losses.append(loss)
                else:
                    out, residuals[s, i] = self._forward[s](self.params[s], h)
                    activation[s + 1, i] = jax.device_put(out, self.rows[s + 1])
                continue
            g = self._loss_cotangent if s == last else cotangent.pop((s, i))
            vjp = residuals.pop((s, i))
            if grads[s] is None:
                result = self._backward_first(vjp, g)
            else:
                result = self._backward_add(vjp, g, grads[s])
            grads[s] = result[0]
            if s > 0:
                cotangent[s - 1, i] = jax.device_put(result[1], self.rows[s - 1])
        self.params = [self._update(p, g) for p, g in zip(self.params, grads, strict=True)]
        total = losses[0]
        for loss in losses[1:]:
            total = total + loss
        return total

    def merged_params(self) -> dict:
        """All stages' parameters as one model pytree (on their meshes)."""
        return pm.merge_stage_params(self.row, self.params)
