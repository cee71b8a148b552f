"""GPT-2 style language model: learned positions, LayerNorm, GELU MLP, tied embeddings.

Stage layout: token and position embeddings on stage 0, the final LayerNorm and
the head on the last stage, and the blocks split contiguously so that the
heaviest stage is as light as possible (see
`nnx_mpmd.models.layers.assign_block_stages`). With ``tie_embeddings`` the head
reuses the token embedding table, which is therefore shared by the first and
the last stage and owned by stage 0.

Dropout is left out: the zoo targets pipeline experiments, where runs are
compared number for number.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_mpmd.annotate.annotate import PipelinedModel, Stage
from nnx_mpmd.models import blocks, kv_cache, layers
from nnx_mpmd.models.presets import GPT_PRESETS

__all__ = ["GPT", "GPTBlock", "GPTConfig", "GPTEmbedding"]


@dataclasses.dataclass(frozen=True)
class GPTConfig(layers.ModelConfig):
    """Configuration of `GPT` (the shared fields are described in `ModelConfig`).

    Args:
      d_ff: hidden width of the MLP; None means ``4 * d_model``.
      tie_embeddings: the head reuses the token embedding table (GPT-2 does).
      norm_eps: LayerNorm epsilon.

    Example:
      >>> cfg = GPTConfig.preset("gpt2-124m")
      >>> cfg.n_layers, cfg.d_model, cfg.tie_embeddings
      (12, 768, True)
    """

    d_ff: int | None = None
    tie_embeddings: bool = True
    norm_eps: float = 1e-5

    PRESETS: ClassVar = GPT_PRESETS
    MODEL_NAME: ClassVar[str] = "gpt"

    @property
    def ffn_dim(self) -> int:
        """Hidden width of the MLP."""
        return self.d_ff if self.d_ff is not None else 4 * self.d_model


class GPTEmbedding(nnx.Module):
    """Token plus learned position embeddings.

    Example:
      >>> emb = GPTEmbedding(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0))
      >>> emb(jnp.zeros((2, 5), jnp.int32)).shape
      (2, 5, 64)
    """

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs) -> None:
        self.token = layers.Embedding(
            cfg, cfg.vocab_size, cfg.d_model, ("tensor", "fsdp"), rngs=rngs
        )
        self.position = layers.Embedding(
            cfg, cfg.max_len, cfg.d_model, (None, "fsdp"), rngs=rngs, stddev=0.01
        )

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        if positions is None:
            return self.token(tokens) + self.position(jnp.arange(tokens.shape[1]))[None]
        at = kv_cache.query_positions(positions, tokens.shape[1])
        return self.token(tokens) + self.position(at)


class GPTBlock(nnx.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``.

    Example:
      >>> block = GPTBlock(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0))
      >>> block(jnp.ones((1, 3, 64))).shape
      (1, 3, 64)
    """

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs) -> None:
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layers).
        out_stddev = 0.02 / math.sqrt(2 * cfg.n_layers)
        self.attn_norm = layers.LayerNorm(cfg, cfg.d_model, rngs=rngs, eps=cfg.norm_eps)
        self.attn = layers.Attention(cfg, rngs=rngs, use_bias=True, out_stddev=out_stddev)
        self.mlp_norm = layers.LayerNorm(cfg, cfg.d_model, rngs=rngs, eps=cfg.norm_eps)
        self.mlp = layers.GeluMLP(cfg, cfg.ffn_dim, rngs=rngs, out_stddev=out_stddev)

    def __call__(
        self, x: jax.Array, positions: jax.Array | None = None, cache_rows: jax.Array | None = None
    ) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), positions, cache_rows)
        return x + self.mlp(self.mlp_norm(x))


class GPT(PipelinedModel):
    """GPT-2 style causal language model as a `PipelinedModel`.

    Args:
      cfg: the configuration (``cfg.num_stages`` stages).
      rngs: random streams (``params`` is used).

    Returns:
      Calling the model on int tokens ``[batch, seq]`` returns float32 logits
      ``[batch, seq, vocab_size]``. With ``positions=`` and ``cache_rows=``
      (``[batch]`` ints) it decodes with the KV cache of `init_cache`: the
      tokens sit at ``positions[r]`` onwards and attend to the cached context
      (see `nnx_mpmd.models.kv_cache`).

    Example:
      >>> model = GPT(GPTConfig.preset("tiny", num_stages=2), rngs=nnx.Rngs(0))
      >>> model(jnp.zeros((2, 8), jnp.int32)).shape, model.num_stages
      ((2, 8, 256), 2)
    """

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs) -> None:
        self.config = cfg
        last = cfg.num_stages - 1
        embedding = GPTEmbedding(cfg, rngs=rngs)
        self.embed = Stage(embedding, stage=0)
        self.blocks, self.block_stages = blocks.staged_blocks(
            cfg, lambda r: GPTBlock(cfg, rngs=r), rngs=rngs, where="GPT"
        )
        norm = layers.LayerNorm(cfg, cfg.d_model, rngs=rngs, eps=cfg.norm_eps)
        tied = embedding.token if cfg.tie_embeddings else None
        self.head = Stage(layers.LMHead(cfg, norm, rngs=rngs, tied_embedding=tied), stage=last)

    def __call__(
        self,
        tokens: jax.Array,
        *,
        positions: jax.Array | None = None,
        cache_rows: jax.Array | None = None,
    ) -> jax.Array:
        layers._check_sequence(tokens, self.config)
        if positions is None:
            return self.head(blocks.run_blocks(self.blocks, self.embed(tokens)))
        x = self.embed(tokens, positions)
        return self.head(blocks.run_blocks(self.blocks, x, positions, cache_rows))

    def init_cache(self, batch_size: int, **layout: Any) -> None:
        """Gives every block a KV cache for ``batch_size`` sequences.

        Args:
          batch_size: the number of sequences decoded together.
          **layout: ``num_microbatches`` and ``batch_axis`` (see `kv_cache.init_cache`).
        """
        kv_cache.init_cache(self, batch_size, **layout)
