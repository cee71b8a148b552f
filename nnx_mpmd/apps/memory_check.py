"""``nnx-mpmd train``'s memory check: refuse a run whose state cannot fit, before compiling.

A model or batch too big for a device used to end, after minutes of
compiling, in XLA's raw ``RESOURCE_EXHAUSTED``. Before anything compiles, the
trainer now predicts each mesh's peak with the planner's memory model
(`nnx_mpmd.planner.search.predict`): the parameters, optimizer state and
gradient accumulators of the mesh's stages, the batch, and (without
donation) the update's second copy of the state. Activations are left out
(they need a profile, `nnx-mpmd plan`), so the estimate is a lower bound, and
parameters are counted as if sharded over ``--data``: a run it refuses cannot
fit. It compares that with the device's memory limit (``bytes_limit`` of
``jax.Device.memory_stats``, or ``$NNX_MPMD_DEVICE_MEMORY_BYTES``, which
overrides it, e.g. for CPU, whose devices report none); with no limit known
nothing is checked. ``--skip-memory-check`` skips it.
"""

from __future__ import annotations

import os
from typing import Any

import jax
from flax import nnx

from nnx_mpmd.annotate.stage import variable_stage
from nnx_mpmd.errors import PlanError
from nnx_mpmd.planner.profile_units import UnitCosts
from nnx_mpmd.planner.search import predict

__all__ = ["MEMORY_ENV_VAR", "check_memory", "device_memory_limit", "predicted_peaks"]

#: Bytes per device to check against, overriding what the device reports.
MEMORY_ENV_VAR = "NNX_MPMD_DEVICE_MEMORY_BYTES"


def device_memory_limit(device: Any) -> int | None:
    """The memory one device may use, in bytes; None when unknown.

    Args:
      device: a ``jax.Device``.

    Returns:
      ``$NNX_MPMD_DEVICE_MEMORY_BYTES`` if set, else the device's ``bytes_limit``.

    Example:
      >>> import jax
      >>> device_memory_limit(jax.devices()[0]) is None or True
      True
    """
    named = os.environ.get(MEMORY_ENV_VAR, "").strip()
    if named:
        return int(float(named))
    try:  # only this process's devices report; CPU reports nothing
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    except Exception:
        stats = None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


def _nbytes(leaf: Any) -> int:
    return int(getattr(leaf, "size", 0)) * int(getattr(getattr(leaf, "dtype", None), "itemsize", 0))


def predicted_peaks(trainer: Any) -> tuple[int, ...]:
    """Each mesh's predicted peak bytes per device, without activations (a lower bound).

    Args:
      trainer: a `nnx_mpmd.apps.train_loop.Trainer` (model, optimizer, mesh and settings).

    Returns:
      One peak per mesh.
    """
    cfg = trainer.cfg
    num_stages = trainer.num_stages
    param_bytes = [0] * num_stages
    for _, node in nnx.iter_graph(trainer.model):
        if isinstance(node, nnx.Param):
            stage = variable_stage(node)
            param_bytes[stage if stage is not None else 0] += _nbytes(node.get_value())
    total = sum(param_bytes) or 1
    opt_bytes = sum(_nbytes(x) for x in jax.tree.leaves(nnx.state(trainer.optimizer)))
    data = max(1, cfg.data)
    params = [b // data for b in param_bytes]
    state = [p + p * opt_bytes // total for p in params]
    batch_row = cfg.batch_size // cfg.microbatches // data * trainer.seq_len * 4 * 2
    batch = [batch_row if s in (0, num_stages - 1) else 0 for s in range(num_stages)]
    zeros = (0.0,) * num_stages
    costs = UnitCosts(
        paths=tuple(str(s) for s in range(num_stages)),
        microbatch_size=cfg.batch_size // cfg.microbatches,
        remat=False,
        F=(1.0,) * num_stages, BI=zeros, BW=zeros,
        kept_bytes=(0,) * num_stages, split_bytes=(0,) * num_stages,
        state_bytes=tuple(state), param_bytes=tuple(params), batch_bytes=tuple(batch),
    )  # fmt: skip
    donate = not getattr(cfg, "no_donate", False)
    candidate = predict(
        cfg.schedule, cfg.meshes, cfg.microbatches, range(num_stages), [False] * num_stages,
        costs, donate=donate,
    )  # fmt: skip
    return candidate.peak_bytes


def check_memory(trainer: Any) -> None:
    """Refuses a run whose predicted state does not fit a device.

    Args:
      trainer: a `nnx_mpmd.apps.train_loop.Trainer`, before its first step.

    Raises:
      PlanError: a mesh's predicted peak (a lower bound) is above the device limit;
        the message gives both and what to change.
    """
    limit = device_memory_limit(jax.local_devices()[0])
    if limit is None:
        return
    peaks = predicted_peaks(trainer)
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    if peaks[worst] <= limit:
        return
    cfg = trainer.cfg
    mib = 2**20
    raise PlanError(
        f"mesh {worst} needs at least {peaks[worst] / mib:,.1f} MiB per device for the "
        f"parameters, optimizer state, gradients and batch of its stages (before "
        f"activations), but a device has {limit / mib:,.1f} MiB. Use more --meshes (now "
        f"{cfg.meshes}), fewer --layers or a smaller --preset (now {cfg.preset}), a smaller "
        f"--batch-size (now {cfg.batch_size}); or pass --skip-memory-check to try anyway."
    )
