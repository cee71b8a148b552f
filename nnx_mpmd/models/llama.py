"""Llama style language model: RMSNorm, rotary positions, SwiGLU, grouped-query attention.

Stage layout: the token embedding on stage 0, the final RMSNorm and the head
(untied unless ``tie_embeddings``) on the last stage, blocks split contiguously with the heaviest stage as
light as possible (see `nnx_mpmd.models.layers.assign_block_stages`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
from flax import nnx

from nnx_mpmd.annotate.annotate import PipelinedModel, Stage
from nnx_mpmd.errors import PartitionError
from nnx_mpmd.models import blocks, kv_cache, layers
from nnx_mpmd.models.presets import LLAMA_PRESETS

__all__ = ["Llama", "LlamaBlock", "LlamaConfig"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig(layers.ModelConfig):
    """Configuration of `Llama` (the shared fields are described in `ModelConfig`).

    Args:
      n_kv_heads: key/value heads for grouped-query attention; None means
        ``n_heads``. Must divide ``n_heads``.
      d_ff: hidden width of the SwiGLU MLP.
      rope_theta: base of the rotary embedding.
      norm_eps: RMSNorm epsilon.
      tie_embeddings: the head reuses the token embedding table (as Llama
        checkpoints with ``tie_word_embeddings``); the table is then shared by
        the first and the last stage (owner: stage 0).

    Example:
      >>> cfg = LlamaConfig.preset("llama-1b")
      >>> cfg.n_heads, cfg.kv_heads, cfg.head_dim
      (32, 4, 64)
    """

    n_kv_heads: int | None = None
    d_ff: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    PRESETS: ClassVar = LLAMA_PRESETS
    MODEL_NAME: ClassVar[str] = "llama"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads):
            raise PartitionError(
                f"LlamaConfig: n_kv_heads={self.n_kv_heads} does not divide "
                f"n_heads={self.n_heads}; grouped-query attention needs every key/value "
                "head to serve the same number of query heads. Pick a divisor of n_heads."
            )
        if self.head_dim % 2:
            raise PartitionError(
                f"LlamaConfig: head_dim={self.head_dim} (d_model={self.d_model} / "
                f"n_heads={self.n_heads}) is odd; rotary embeddings rotate pairs of "
                "dimensions, so choose d_model and n_heads with an even quotient."
            )

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads


class LlamaBlock(nnx.Module):
    """Pre-norm block: ``x + attn(rms(x))`` with RoPE and GQA, then ``x + swiglu(rms(x))``.

    Example:
      >>> block = LlamaBlock(LlamaConfig.preset("tiny"), rngs=nnx.Rngs(0))
      >>> block(jax.numpy.ones((1, 3, 64))).shape
      (1, 3, 64)
    """

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.attn_norm = layers.RMSNorm(cfg, cfg.d_model, rngs=rngs, eps=cfg.norm_eps)
        self.attn = layers.Attention(
            cfg, rngs=rngs, n_kv_heads=cfg.kv_heads, rope_theta=cfg.rope_theta
        )
        self.mlp_norm = layers.RMSNorm(cfg, cfg.d_model, rngs=rngs, eps=cfg.norm_eps)
        self.mlp = layers.SwiGLU(cfg, cfg.d_ff, rngs=rngs)

    def __call__(
        self, x: jax.Array, positions: jax.Array | None = None, cache_rows: jax.Array | None = None
    ) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), positions, cache_rows)
        return x + self.mlp(self.mlp_norm(x))


class Llama(PipelinedModel):
    """Llama style causal language model as a `PipelinedModel`.

    Args:
      cfg: the configuration (``cfg.num_stages`` stages).
      rngs: random streams (``params`` is used).

    Returns:
      Calling the model on int tokens ``[batch, seq]`` returns float32 logits
      ``[batch, seq, vocab_size]``. With ``positions=`` and ``cache_rows=``
      (``[batch]`` ints) it decodes with the KV cache of `init_cache` (see
      `nnx_mpmd.models.kv_cache`).

    Example:
      >>> model = Llama(LlamaConfig.preset("tiny", num_stages=4), rngs=nnx.Rngs(0))
      >>> model(jax.numpy.zeros((2, 8), "int32")).shape, model.num_stages
      ((2, 8, 256), 4)
    """

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.config = cfg
        embedding = layers.Embedding(
            cfg, cfg.vocab_size, cfg.d_model, ("tensor", "fsdp"), rngs=rngs
        )
        self.embed = Stage(embedding, stage=0)
        self.blocks, self.block_stages = blocks.staged_blocks(
            cfg, lambda r: LlamaBlock(cfg, rngs=r), rngs=rngs, where="Llama"
        )
        norm = layers.RMSNorm(cfg, cfg.d_model, rngs=rngs, eps=cfg.norm_eps)
        tied = embedding if cfg.tie_embeddings else None
        head = layers.LMHead(cfg, norm, rngs=rngs, tied_embedding=tied)
        self.head = Stage(head, stage=cfg.num_stages - 1)

    def __call__(
        self,
        tokens: jax.Array,
        *,
        positions: jax.Array | None = None,
        cache_rows: jax.Array | None = None,
    ) -> jax.Array:
        layers._check_sequence(tokens, self.config)
        args = () if positions is None else (positions, cache_rows)
        return self.head(blocks.run_blocks(self.blocks, self.embed(tokens), *args))

    def init_cache(self, batch_size: int, **layout: Any) -> None:
        """Gives every block a KV cache for ``batch_size`` sequences.

        Args:
          batch_size: the number of sequences decoded together.
          **layout: ``num_microbatches`` and ``batch_axis`` (see `kv_cache.init_cache`).
        """
        kv_cache.init_cache(self, batch_size, **layout)
