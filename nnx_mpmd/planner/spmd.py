"""The alternatives to a pipeline: data parallel and FSDP over all the mesh's devices.

A pipeline pays only when it beats the plain SPMD ways of using the same
devices. This module predicts and measures two of them, each with gradient
accumulation over microbatches (the same global batch per step):

- ``"dp"``: data parallel over every device: parameters and optimizer state
  replicated, rows split, gradients all-reduced.
- ``"fsdp"``: fully sharded data parallel: parameters and optimizer state
  sharded over every device (each leaf along its largest dimension that the
  device count divides), all-gathered where they are used, gradients
  reduce-scattered.

The prediction is in the planner's units: the profiled compute of every unit
(`UnitCosts`, at the same rows per device), the profiled update, and the
collectives' bytes over the link speed measured on these devices
(`measure_link`). The measurement compiles the real step with `jax.jit` and
times it, like `verify` does for pipelined configurations.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_mpmd.errors import PlanError
from nnx_mpmd.jit.losses import value_and_grad
from nnx_mpmd.placement.mesh import MpmdMesh
from nnx_mpmd.planner.profile_units import UnitCosts

__all__ = ["SPMD_KINDS", "LinkCosts", "SpmdCandidate", "SpmdStep", "measure_link", "spmd_step"]

#: The SPMD alternatives, by name: data parallel and fully sharded data parallel.
SPMD_KINDS = ("dp", "fsdp")
_AXIS = "spmd"
_NAMES = {"dp": "data parallel", "fsdp": "FSDP"}


@dataclasses.dataclass(frozen=True)
class SpmdCandidate:
    """One SPMD configuration over all devices and what the cost model predicts for it.

    Attributes:
      kind: ``"dp"`` (data parallel) or ``"fsdp"`` (parameters sharded).
      num_devices: the devices it runs on (all of the mesh's).
      num_microbatches: gradient accumulation steps per step (the global
        batch is the pipeline's).
      step_s: predicted seconds per step.
      peak_bytes: predicted peak bytes per device, as a one-element tuple
        (the devices are alike).

    Example:
      >>> c = SpmdCandidate("fsdp", 8, 2, 0.01, (100,))
      >>> c.label, c.schedule, c.num_stages
      ('FSDP over 8 devices, m=2', 'FSDP', 1)
    """

    kind: str
    num_devices: int
    num_microbatches: int
    step_s: float
    peak_bytes: tuple[int, ...]

    # Where code prints a pipelined `Candidate`'s fields over `verify`'s results, an
    # SPMD alternative reads as one stage over all devices, never rematted.
    @property
    def schedule(self) -> str:
        """Its name where a pipeline's schedule goes (``"data parallel"``, ``"FSDP"``)."""
        return _NAMES.get(self.kind, self.kind)

    @property
    def num_stages(self) -> int:
        """1: every device runs the whole model."""
        return 1

    @property
    def remat(self) -> tuple[bool, ...]:
        """``()``: no stage recomputes its forward."""
        return ()

    @property
    def label(self) -> str:
        """What it is, in words (``data parallel over 8 devices, m=2``)."""
        name = _NAMES.get(self.kind, self.kind)
        return f"{name} over {self.num_devices} devices, m={self.num_microbatches}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpmdCandidate:
        """Reads `to_dict`'s output."""
        fields: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in data.items()
        }
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class LinkCosts:
    """The measured cost of a collective over all devices: ``latency_s + bytes / bytes_per_s``.

    ``bytes`` is what each device sends in a ring: ``2 (n-1)/n`` of the
    buffer for an all-reduce, ``(n-1)/n`` for an all-gather or a
    reduce-scatter.

    Example:
      >>> LinkCosts(1e-4, 1e9).seconds(1e6)
      0.0011
    """

    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        """The time of one collective that moves ``nbytes`` per device."""
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bytes_per_s

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict."""
        return dataclasses.asdict(self)


def all_devices_mesh(mesh: MpmdMesh) -> jax.sharding.Mesh:
    """A one-axis mesh (``"spmd"``) of every device of ``mesh``, in its order."""
    devices = np.asarray(mesh.jax_mesh.devices).reshape(-1)
    return jax.sharding.Mesh(devices, (_AXIS,))


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    """The median seconds of ``fn()`` waited for, after one untimed run."""
    jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_link(mesh: MpmdMesh, nbytes: int, repeats: int = 5) -> LinkCosts:
    """`LinkCosts` from timing an all-reduce over all of ``mesh`` at a small size and at ``nbytes``.

    ``nbytes`` per device is clipped to 64 KiB .. 16 MiB (the gradient bytes are a fair size).
    The latency is the small one's time; one device has zero latency and infinite speed.

    Example:
      >>> # measure_link(mesh, 4 << 20).seconds(1 << 20) -> seconds for 1 MiB per device
      >>> callable(measure_link)
      True
    """
    flat = all_devices_mesh(mesh)
    n = flat.devices.size
    if n == 1:
        return LinkCosts(0.0, float("inf"))
    reduce = jax.jit(
        jax.shard_map(
            lambda v: jax.lax.psum(v, _AXIS), mesh=flat, in_specs=P(_AXIS), out_specs=P(_AXIS)
        )
    )

    def seconds(per_device: int) -> float:
        count = max(1, per_device // 4)
        x = jax.device_put(np.ones((n * count,), np.float32), NamedSharding(flat, P(_AXIS)))
        return _timed(lambda: reduce(x), repeats)

    large = min(max(int(nbytes), 1 << 16), 1 << 24)  # 64 KiB .. 16 MiB per device
    small_s, large_s = seconds(4), seconds(large)
    moved = 2 * (n - 1) / n * (large - 4)
    return LinkCosts(small_s, moved / max(large_s - small_s, 1e-9))


def predict_spmd(
    kind: str,
    costs: UnitCosts,
    num_meshes: int,
    num_devices: int,
    num_microbatches: int,
    link: LinkCosts,
    *,
    donate: bool = False,
) -> SpmdCandidate:
    """The cost model's `SpmdCandidate` (step time, peak memory) of one ``"dp"``/``"fsdp"`` setup.

    ``costs`` (no remat) must be profiled at the same rows per device; ``num_meshes``
    gives the contention measured.

    Example:
      >>> unit = UnitCosts(("a", "b"), 4, False, F=(1.0, 1.0), BI=(1.0, 1.0), BW=(1.0, 1.0),
      ...     kept_bytes=(10, 10), split_bytes=(0, 0), state_bytes=(300, 300),
      ...     param_bytes=(100, 100))
      >>> c = predict_spmd("dp", unit, 2, 2, 2, LinkCosts(0.0, 100.0))
      >>> c.step_s, c.peak_bytes  # 2 microbatches x 2 units x (F + B), 2 all-reduces of 200 B
      (16.0, (1400,))
    """
    if kind not in SPMD_KINDS:
        raise PlanError(f"unknown SPMD alternative {kind!r}; use one of {list(SPMD_KINDS)}.")
    n, m = num_devices, num_microbatches
    slowdown = costs.slowdown(num_meshes)
    compute = m * sum(f + b for f, b in zip(costs.F, costs.full_backward(), strict=True))
    params, state = sum(costs.param_bytes), sum(costs.state_bytes)
    ring = (n - 1) / n
    if kind == "dp":
        comm = m * link.seconds(2 * ring * params)
        update = costs.other_s * slowdown
        held_state, held_params = state + params, 0
    else:
        comm = m * (2 * link.seconds(ring * params) + link.seconds(ring * params))
        update = costs.other_s * slowdown / n
        # The sharded state and gradients, and one unit's parameters gathered at a time.
        held_state = (state + params) / n
        held_params = max(costs.param_bytes, default=0)
    batch = m * sum(costs.batch_bytes)
    live = sum(costs.kept_bytes)
    update_copy = 0 if donate else (state / n if kind == "fsdp" else state)
    peak = int(held_state + held_params + batch + max(live, update_copy))
    return SpmdCandidate(kind, n, m, float(compute * slowdown + comm + update), (peak,))


def spmd_microbatches(
    batch_size: int, num_meshes: int, num_devices: int, counts: Sequence[int]
) -> list[int]:
    """The accumulation steps whose rows per device match a profiled pipeline microbatch:
    ``m / num_meshes`` for every pipeline count ``m`` it divides, where the rows split."""
    found = []
    for m in counts:
        k = m // num_meshes
        if m % num_meshes == 0 and k >= 1 and batch_size % (k * num_devices) == 0:
            found.append(k)
    return sorted(set(found))


def spmd_candidates(
    costs: Sequence[UnitCosts],
    mesh: MpmdMesh,
    batch_size: int,
    counts: Sequence[int],
    link: LinkCosts,
    *,
    donate: bool = False,
) -> list[SpmdCandidate]:
    """Every SPMD alternative the profiles can predict, fastest first.

    ``counts`` are the pipeline's microbatch counts, whose profiles are reused.
    """
    n = int(mesh.jax_mesh.devices.size)
    by_size = {c.microbatch_size: c for c in costs if not c.remat}
    found = []
    for k in spmd_microbatches(batch_size, mesh.num_meshes, n, counts):
        profile = by_size.get(batch_size // (k * mesh.num_meshes))
        if profile is None:
            continue
        for kind in SPMD_KINDS:
            found.append(predict_spmd(kind, profile, mesh.num_meshes, n, k, link, donate=donate))
    return sorted(found, key=lambda c: (c.step_s, c.peak_bytes))


def _fsdp_spec(x: Any, n: int) -> P:
    """Shards ``x`` along its largest dimension that ``n`` divides; replicated if none."""
    shape = getattr(x, "shape", ())
    dims = [d for d in range(len(shape)) if shape[d] % n == 0 and shape[d] >= n]
    if not dims:
        return P()
    dim = max(dims, key=lambda d: shape[d])
    return P(*([None] * dim), _AXIS)


def spmd_step(
    kind: str,
    model: Any,
    loss_fn: Callable[[Any, Any], Any],
    tx: optax.GradientTransformation,
    mesh: MpmdMesh,
    num_microbatches: int,
    *,
    donate: bool = False,
) -> tuple[SpmdStep, Any]:
    """The SPMD train step of ``model`` over every device of ``mesh``, and its placed state.

    State replicated (``"dp"``) or sharded (``"fsdp"``); ``nnx.jit``'s numbers to float rounding.

    Args:
      kind: ``"dp"`` or ``"fsdp"``.
      model: the model (not changed: a copy with its own buffers is placed).
      loss_fn: ``loss_fn(model, microbatch) -> loss``.
      tx: the optimizer's transformation.
      mesh: the pipeline's mesh (all of its devices are used).
      num_microbatches: accumulation steps per step.
      donate: whether the step donates the state it is given.

    Returns:
      ``(step, state)``: ``step(state, batch) -> (loss, new_state)``, and the
      placed state of the model and a fresh optimizer.

    Raises:
      PlanError: an unknown ``kind``.

    Example:
      >>> # step, state = spmd_step("fsdp", model, loss_fn, optax.adam(1e-3), mesh, 2)
      >>> # loss, state = step(state, batch)
      >>> callable(spmd_step)
      True
    """
    if kind not in SPMD_KINDS:
        raise PlanError(f"unknown SPMD alternative {kind!r}; use one of {list(SPMD_KINDS)}.")
    flat = all_devices_mesh(mesh)
    n = flat.devices.size
    copy = nnx.clone(model)
    optimizer = nnx.Optimizer(copy, tx, wrt=nnx.Param)
    graphdef, state = nnx.split((copy, optimizer))

    def spec(x: Any) -> NamedSharding:
        return NamedSharding(flat, _fsdp_spec(x, n) if kind == "fsdp" else P())

    state_shardings = jax.tree.map(spec, state)
    state = jax.tree.map(
        lambda x, s: jax.device_put(jnp.array(x, copy=True), s), state, state_shardings
    )

    def train(state: Any, stacked: Any) -> tuple[Any, Any]:
        # The rows arrive as [m, B/m, ...], each microbatch split over every device;
        # the loss sees the user's [B, ...] (value_and_grad splits it the same way).
        batch = jax.tree.map(lambda x: x.reshape((-1, *x.shape[2:])), stacked)
        local_model, local_opt = nnx.merge(graphdef, state)
        grad_fn = value_and_grad(loss_fn, num_microbatches=num_microbatches)
        loss, grads = grad_fn(local_model, batch)
        local_opt.update(local_model, grads)
        return loss, nnx.state((local_model, local_opt))

    jitted = jax.jit(
        train,
        out_shardings=(NamedSharding(flat, P()), state_shardings),
        donate_argnums=(0,) if donate else (),
    )
    return SpmdStep(jitted, NamedSharding(flat, P(None, _AXIS)), num_microbatches), state


@dataclasses.dataclass(frozen=True)
class SpmdStep:
    """An SPMD train step: ``step(state, batch) -> (loss, new_state)`` (see `spmd_step`)."""

    jitted: Any
    rows: NamedSharding
    num_microbatches: int

    def place(self, batch: Any) -> Any:
        """``batch`` as ``[m, B/m, ...]`` microbatches, each one's rows split over the
        devices (split on the rows instead, a microbatch would sit on a few devices)."""
        m = self.num_microbatches

        def put(x: Any) -> Any:
            x = np.asarray(x)
            return jax.device_put(x.reshape((m, x.shape[0] // m, *x.shape[1:])), self.rows)

        return jax.tree.map(put, batch)

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
        return self.jitted(state, self.place(batch))

    def peak_bytes(self, state: Any, batch: Any) -> int:
        """XLA's per-device memory of the compiled step (arguments, outputs and
        temporaries, less what is donated); 0 where the backend gives none."""
        try:
            analysis = self.jitted.lower(state, self.place(batch)).compile().memory_analysis()
        except Exception:  # an estimate only; some backends have none
            return 0
        if analysis is None:
            return 0
        used = analysis.argument_size_in_bytes + analysis.output_size_in_bytes
        return int(used + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)


def measure_spmd(
    candidate: SpmdCandidate,
    model: Any,
    loss_fn: Callable[[Any, Any], Any],
    batch: Any,
    mesh: MpmdMesh,
    tx: optax.GradientTransformation,
    *,
    steps: int = 5,
    donate: bool = False,
) -> tuple[float, tuple[int, ...]]:
    """``(seconds per step, (peak bytes per device,))``: median of ``steps`` after one, compiled."""
    step, state = spmd_step(
        candidate.kind, model, loss_fn, tx, mesh, candidate.num_microbatches, donate=donate
    )
    holder = [state]

    def once() -> Any:
        loss, holder[0] = step(holder[0], batch)
        return loss

    seconds = _timed(once, max(1, steps))
    return seconds, (step.peak_bytes(holder[0], batch),)
