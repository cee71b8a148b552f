"""How the zoo's transformer blocks are split into stages: unrolled or scanned.

A zoo model (`GPT`, `Llama`) balances its blocks over ``cfg.num_stages`` stages
by forward FLOPs (`assign_block_stages`). `staged_blocks` builds them one of
two ways:

- unrolled (default): an ``nnx.List`` of ``Stage``-wrapped blocks, one Python
  call per block, so each stage program contains every one of its blocks;
- scanned (``cfg.scan_layers``): one `ScanStack` whose layers are stacked along
  a leading axis and cut into one chunk per stage. Each stage program then
  holds a single loop body however many blocks the stage has, so compilation
  does not grow with depth (the usual JAX idiom for deep models).

Both give the same stages and the same numbers for the same weights; their
parameter paths differ (``blocks.3.attn...`` vs
``blocks.chunks.0.layers.attn...``), and a checkpoint of either restores into
the other (`nnx_mpmd.checkpoint.recut`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from nnx_mpmd.annotate.annotate import Stage, auto_stage
from nnx_mpmd.annotate.scan_stack import ScanStack, stage_ranges
from nnx_mpmd.errors import PartitionError

__all__ = [
    "assign_block_stages",
    "block_flops",
    "count_params",
    "run_blocks",
    "stage_ranges",
    "staged_blocks",
]


def assign_block_stages(
    num_blocks: int,
    num_stages: int,
    *,
    block_cost: float,
    embed_cost: float,
    head_cost: float,
    where: str = "model",
) -> list[int]:
    """Balances transformer blocks over stages, counting embedding and head costs.

    The embedding's cost goes to the first block and the head's to the last.

    Args:
      num_blocks: number of transformer blocks.
      num_stages: number of stages (1 <= num_stages <= num_blocks).
      block_cost: cost of one block (e.g. forward FLOPs per token).
      embed_cost: cost of the embedding (runs with the first block).
      head_cost: cost of the final norm and head (runs with the last block).
      where: the model name for error messages.

    Returns:
      The stage of each block: contiguous, non-decreasing, 0 to num_stages - 1.

    Example:
      >>> assign_block_stages(4, 2, block_cost=1.0, embed_cost=0.0, head_cost=2.0)
      [0, 0, 0, 1]
    """
    if not 1 <= num_stages <= num_blocks:
        raise PartitionError(
            f"{where}: cannot split {num_blocks} blocks into {num_stages} stages; "
            f"use 1 <= num_stages <= {num_blocks}."
        )
    weights = [float(block_cost)] * num_blocks
    weights[0] += float(embed_cost)
    weights[-1] += float(head_cost)
    return auto_stage(range(num_blocks), num_stages, weights=weights)


def count_params(model: Any) -> int:
    """Number of parameter scalars in ``model`` (shared parameters counted once).

    Works on abstract models from ``nnx.eval_shape`` too.

    Example:
      >>> count_params(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
      8
    """
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return sum(math.prod(leaf.shape) for leaf in leaves)


def block_flops(cfg: Any, block_params: int) -> float:
    """Forward FLOPs per token of one block: matmuls plus causal attention.

    Example:
      >>> from nnx_mpmd.models import GPTConfig
      >>> block_flops(GPTConfig.preset("tiny"), 1000)
      10192.0
    """
    return 2.0 * block_params + 2.0 * cfg.max_len * cfg.d_model


def staged_blocks(
    cfg: Any, make_block: Callable[[nnx.Rngs], nnx.Module], *, rngs: nnx.Rngs, where: str
) -> tuple[nnx.List | ScanStack, tuple[int, ...]]:
    """``(blocks, stage of each block)``: ``cfg.n_layers`` blocks balanced over ``cfg.num_stages``.

    ``cfg.scan_layers`` picks a `ScanStack` (one chunk per stage) over an ``nnx.List`` of stages.

    Example:
      >>> from nnx_mpmd.models.gpt import GPTBlock, GPTConfig
      >>> cfg = GPTConfig.preset("tiny", num_stages=2, scan_layers=True)
      >>> blocks, stages = staged_blocks(
      ...     cfg, lambda r: GPTBlock(cfg, rngs=r), rngs=nnx.Rngs(0), where="GPT")
      >>> stages, blocks.chunk_ranges()
      ((0, 0, 1, 1), [(0, 2), (2, 4)])
    """
    one_block = nnx.eval_shape(lambda: make_block(nnx.Rngs(0)))
    stages = tuple(
        assign_block_stages(
            cfg.n_layers,
            cfg.num_stages,
            block_cost=block_flops(cfg, count_params(one_block)),
            embed_cost=0.0,
            head_cost=2.0 * cfg.d_model * cfg.vocab_size,
            where=where,
        )
    )
    if cfg.scan_layers:
        stack = ScanStack(make_block, cfg.n_layers, rngs=rngs)
        stack.split(stage_ranges(stages))
        return stack, stages
    blocks = [make_block(rngs) for _ in range(cfg.n_layers)]
    return nnx.List([Stage(b, stage=s) for b, s in zip(blocks, stages, strict=True)]), stages


def run_blocks(blocks: nnx.List | ScanStack, x: Any, *args: Any) -> Any:
    """``x`` through every block of `staged_blocks`, each also given ``args``.

    Example:
      >>> from nnx_mpmd.models.gpt import GPTBlock, GPTConfig
      >>> cfg = GPTConfig.preset("tiny", scan_layers=True)
      >>> stack, _ = staged_blocks(cfg, lambda r: GPTBlock(cfg, rngs=r), rngs=nnx.Rngs(0),
      ...                          where="GPT")
      >>> run_blocks(stack, jax.numpy.ones((1, 3, 64))).shape
      (1, 3, 64)
    """
    if isinstance(blocks, ScanStack):
        return blocks(x, *args)
    for block in blocks:
        x = block(x, *args)
    return x
