"""``nnx-mpmd train``'s memory check: refuse a run whose state cannot fit, before compiling.

A model or batch too big for a device used to end, after minutes of
compiling, in XLA's raw ``RESOURCE_EXHAUSTED``. Before anything compiles, the
trainer now predicts each mesh's peak with the planner's memory model
(`nnx_mpmd.planner.search.predict`): the parameters, optimizer state and
gradient accumulators of the mesh's stages, the batch, (without donation) the
update's second copy of the state, and the activations each forward keeps for
its backward, as many microbatches of them as the schedule holds at once.
Activations are estimated from the zoo config (`activation_bytes_per_token`:
about ``10·d + 2·d_ff + 2·heads·T`` values per token and block, plus the
logits on the last stage), since measuring them needs a profile
(``nnx-mpmd plan``); parameters are counted as if sharded over ``--data``. It
compares that with the device's memory limit (``bytes_limit`` of
``jax.Device.memory_stats``, or ``$NNX_MPMD_DEVICE_MEMORY_BYTES``, which
overrides it, e.g. for CPU, whose devices report none); with no limit known
nothing is checked. ``--skip-memory-check`` skips it.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_mpmd.annotate.stage import variable_stage
from nnx_mpmd.errors import PlanError
from nnx_mpmd.planner.profile_units import UnitCosts
from nnx_mpmd.planner.search import predict

__all__ = [
    "MEMORY_ENV_VAR",
    "activation_bytes_per_token",
    "check_memory",
    "device_memory_limit",
    "predicted_peaks",
]

#: Bytes per device to check against, overriding what the device reports.
MEMORY_ENV_VAR = "NNX_MPMD_DEVICE_MEMORY_BYTES"


def device_memory_limit(device: Any) -> int | None:
    """Bytes one device may use (``$NNX_MPMD_DEVICE_MEMORY_BYTES``, else ``bytes_limit``), or None.

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


def activation_bytes_per_token(config: Any, seq_len: int) -> tuple[int, int]:
    """Bytes one token keeps for the backward: ``(per block, logits on the last stage)``.

    A pre-norm block keeps about ``10·d + 2·d_ff + 2·heads·T`` values per token.

    Example:
      >>> from nnx_mpmd.models.gpt import GPTConfig
      >>> activation_bytes_per_token(GPTConfig(d_model=64, n_heads=2, vocab_size=100), 32)
      (5120, 800)
    """
    d = int(config.d_model)
    ffn = int(getattr(config, "ffn_dim", 4 * d))
    itemsize = jnp.dtype(getattr(config, "dtype", jnp.float32)).itemsize
    per_block = (10 * d + 2 * ffn + 2 * int(config.n_heads) * seq_len) * itemsize
    return per_block, 2 * int(config.vocab_size) * 4  # logits are float32


def _stage_activation_bytes(trainer: Any, rows: int) -> list[int]:
    """Each stage's kept bytes per microbatch: its share of the blocks, and the head's logits."""
    num_stages = trainer.num_stages
    block_params = [0] * num_stages
    for path, node in nnx.iter_graph(trainer.model):
        if isinstance(node, nnx.Param) and "blocks" in map(str, path):
            stage = variable_stage(node)
            block_params[stage if stage is not None else 0] += _nbytes(node.get_value())
    total = sum(block_params) or 1
    per_block, logits = activation_bytes_per_token(trainer.model.config, trainer.seq_len)
    tokens = rows * trainer.seq_len
    layers = trainer.num_layers
    kept = [tokens * per_block * layers * b // total for b in block_params]
    kept[-1] += tokens * logits
    return kept


def predicted_peaks(trainer: Any) -> tuple[int, ...]:
    """Each mesh's predicted peak bytes per device, activations included (an estimate)."""
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
    rows = cfg.batch_size // cfg.microbatches // data
    batch_row = rows * trainer.seq_len * 4 * 2
    batch = [batch_row if s in (0, num_stages - 1) else 0 for s in range(num_stages)]
    kept = _stage_activation_bytes(trainer, rows)
    donate = not getattr(cfg, "no_donate", False)

    def peaks(kept_bytes: list[int]) -> tuple[int, ...]:
        zeros = (0.0,) * num_stages
        costs = UnitCosts(
            paths=tuple(str(s) for s in range(num_stages)),
            microbatch_size=cfg.batch_size // cfg.microbatches,
            remat=False,
            F=(1.0,) * num_stages, BI=zeros, BW=zeros,
            kept_bytes=tuple(kept_bytes), split_bytes=(0,) * num_stages,
            state_bytes=tuple(state), param_bytes=tuple(params), batch_bytes=tuple(batch),
        )  # fmt: skip
        return predict(
            cfg.schedule, cfg.meshes, cfg.microbatches, range(num_stages),
            [False] * num_stages, costs, donate=donate,
        ).peak_bytes  # fmt: skip

    # A forward fused with its own backward keeps nothing between tasks in the
    # planner's model, but holds one microbatch's activations while it runs.
    without = peaks([0] * num_stages)
    held = [0] * cfg.meshes
    for stage, b in enumerate(kept):
        mesh = stage % cfg.meshes
        held[mesh] = max(held[mesh], b)
    return tuple(
        max(w_kept, w + h) for w_kept, w, h in zip(peaks(kept), without, held, strict=True)
    )


def check_memory(trainer: Any) -> None:
    """Refuses (`PlanError`) a run whose predicted peak on a mesh is above the device limit."""
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
        f"mesh {worst} needs about {peaks[worst] / mib:,.1f} MiB per device for the "
        f"parameters, optimizer state, gradients, batch and activations of its stages "
        f"(estimated), but a device has {limit / mib:,.1f} MiB. Use more --meshes (now "
        f"{cfg.meshes}), fewer --layers or a smaller --preset (now {cfg.preset}), a smaller "
        f"--batch-size (now {cfg.batch_size}) or more --microbatches (now {cfg.microbatches}); "
        "or pass --skip-memory-check to try anyway."
    )
