"""Shared building blocks of the model zoo: dense layers, embeddings, norms, attention.

Every parameter is an ``nnx.Param``. When a config names a ``fsdp`` or ``tensor``
mesh axis, each parameter also carries ``out_sharding`` metadata (a tuple with one
mesh-axis name or None per dimension) that the partition layer turns into a
sharding on the stage's submesh. The metadata is recorded with
``eager_sharding=False``: a model is built before anyone knows which submesh a
stage lands on, so nothing is sharded at construction time.

Sharding roles used below (``"fsdp"`` / ``"tensor"`` are replaced by the axis
names of the config, or None when the config leaves that axis out):

- projections into a wider space (q, k, v, MLP up/gate, untied head): ``(fsdp, tensor)``
- projections back to ``d_model`` (attention output, MLP down): ``(tensor, fsdp)``
- token embedding table ``[vocab, d_model]``: ``(tensor, fsdp)``
- norm scales, position tables and output biases: replicated along ``tensor``
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar, cast

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_mpmd.errors import MpmdError, PartitionError
from nnx_mpmd.models import cache_ops
from nnx_mpmd.models.blocks import assign_block_stages, count_params

__all__ = [
    "Attention",
    "Dense",
    "Embedding",
    "GeluMLP",
    "LMHead",
    "LayerNorm",
    "ModelConfig",
    "RMSNorm",
    "SwiGLU",
    "apply_rope",
    "assign_block_stages",
    "causal_attention",
    "count_params",
    "gathered",
]

Role = str | None  # "fsdp", "tensor" or None, per parameter dimension
Initializer = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Fields every model-zoo config shares (see `GPTConfig` and `LlamaConfig`).

    Args:
      num_stages: logical pipeline stages; blocks are balanced across them.
      vocab_size: number of token ids.
      max_len: longest sequence the model accepts (context length).
      n_layers: number of transformer blocks.
      d_model: width of the residual stream.
      n_heads: attention (query) heads; must divide ``d_model``.
      dtype: compute dtype of matmuls (parameters stay float32; norms, softmax
        and the returned logits are float32).
      data: mesh axis that splits the batch (used by training code, not by params).
      fsdp: mesh axis that shards parameters fully (ZeRO-3 style), or None.
      tensor: mesh axis for tensor (Megatron-style) parallelism, or None.
      scan_layers: stack the blocks and scan them (`nnx_mpmd.ScanStack`), one
        chunk per stage, instead of one call per block: each stage program
        then holds one loop body, so compiling does not grow with depth (the
        KV cache of `init_cache` is stacked the same way).

    Example:
      >>> ModelConfig(n_layers=2, num_stages=2).d_model
      128
    """

    num_stages: int = 1
    vocab_size: int = 256
    max_len: int = 128
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    dtype: Any = jnp.float32
    data: str | None = None
    fsdp: str | None = None
    tensor: str | None = None
    scan_layers: bool = False

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}
    MODEL_NAME: ClassVar[str] = "model"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        name = f"{type(self).__name__}"
        for field in ("num_stages", "vocab_size", "max_len", "n_layers", "d_model", "n_heads"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MpmdError(f"{name}.{field}={value!r}: must be an int >= 1.")
        if not isinstance(self.scan_layers, bool):
            raise MpmdError(f"{name}.scan_layers={self.scan_layers!r}: must be True or False.")
        if self.d_model % self.n_heads:
            raise PartitionError(
                f"{name}: n_heads={self.n_heads} does not divide d_model={self.d_model}; "
                "choose n_heads that divides d_model (e.g. d_model // 64)."
            )
        if self.num_stages > self.n_layers:
            raise PartitionError(
                f"{name}: num_stages={self.num_stages} is more than n_layers={self.n_layers}; "
                f"every stage needs at least one block. Use num_stages <= {self.n_layers} "
                "or more layers."
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    @property
    def sharded(self) -> bool:
        """Whether parameters carry ``out_sharding`` metadata."""
        return self.fsdp is not None or self.tensor is not None

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Any:
        """Builds a config from a named preset, with fields replaced by ``overrides``.

        Args:
          name: a key of ``cls.PRESETS`` (e.g. ``"tiny"``).
          **overrides: config fields to change, e.g. ``num_stages=4``.

        Returns:
          The config.

        Example:
          >>> from nnx_mpmd.models import GPTConfig
          >>> GPTConfig.preset("tiny", num_stages=2).num_stages
          2
        """
        if name not in cls.PRESETS:
            raise MpmdError(
                f"{cls.__name__}.preset: unknown preset {name!r} for {cls.MODEL_NAME}; "
                f"choose one of {sorted(cls.PRESETS)}."
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise MpmdError(
                f"{cls.__name__}.preset({name!r}): unknown field(s) {unknown}; "
                f"valid fields are {sorted(fields)}."
            )
        return cls(**{**cls.PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable fields (the dtype as its name); see `from_dict`.

        Example:
          >>> ModelConfig(dtype="bfloat16").to_dict()["dtype"]
          'bfloat16'
        """
        data = dataclasses.asdict(self)
        data["dtype"] = self.dtype.name
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        """Rebuilds a config from `to_dict` output.

        Example:
          >>> cfg = ModelConfig(n_layers=2)
          >>> ModelConfig.from_dict(cfg.to_dict()) == cfg
          True
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise MpmdError(
                f"{cls.__name__}.from_dict: unknown field(s) {unknown}; was the dict "
                f"written by another model family? Valid fields are {sorted(fields)}."
            )
        return cls(**data)

    def sharding(self, *roles: Role) -> tuple[str | None, ...] | None:
        """The ``out_sharding`` metadata for a parameter with these dimension roles.

        Args:
          *roles: ``"fsdp"``, ``"tensor"`` or None for each parameter dimension.

        Returns:
          A tuple of mesh-axis names (or None) per dimension, or None when the
          config shards nothing.

        Example:
          >>> ModelConfig(tensor="model").sharding("fsdp", "tensor")
          (None, 'model')
        """
        if not self.sharded:
            return None
        axes = {"fsdp": self.fsdp, "tensor": self.tensor, None: None}
        return tuple(axes[role] for role in roles)


def _param(
    cfg: ModelConfig,
    rngs: nnx.Rngs,
    init: Initializer,
    shape: tuple[int, ...],
    roles: tuple[Role, ...],
) -> nnx.Param:
    value = init(rngs.params(), shape, jnp.float32)
    spec = cfg.sharding(*roles)
    if spec is None:
        return nnx.Param(value)
    return nnx.Param(value, out_sharding=spec, eager_sharding=False)


def gathered(value: jax.Array) -> jax.Array:
    """``value`` replicated when it is sharded along Explicit mesh axes (else unchanged).

    Explicit meshes refuse ops whose output sharding is ambiguous: gather parameters where used.

    Example:
      >>> gathered(jnp.ones(3)).shape
      (3,)
    """
    sharding = getattr(jax.typeof(value), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if sharding is None or not spec or all(axis is None for axis in spec):
        return value
    return jax.sharding.reshard(
        value, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    )


def normal(stddev: float) -> Initializer:
    """A normal initializer with mean 0 and the given standard deviation."""
    return jax.nn.initializers.normal(stddev)


class Dense(nnx.Module):
    """``y = x @ kernel (+ bias)`` computed in the config's dtype.

    Args:
      cfg: the model config (dtype and sharding axes).
      in_features: input width.
      out_features: output width.
      roles: sharding roles of the kernel's two dimensions.
      rngs: random streams (``params`` is used).
      use_bias: whether to add a bias (sharded like the kernel's output dim).
      stddev: standard deviation of the kernel's normal initializer.

    Example:
      >>> from nnx_mpmd.models.layers import ModelConfig
      >>> layer = Dense(ModelConfig(), 4, 3, ("fsdp", "tensor"), rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((2, 4))).shape
      (2, 3)
    """

    def __init__(
        self,
        cfg: ModelConfig,
        in_features: int,
        out_features: int,
        roles: tuple[Role, Role],
        *,
        rngs: nnx.Rngs,
        use_bias: bool = False,
        stddev: float = 0.02,
    ) -> None:
        self.dtype = cfg.dtype
        self.kernel = _param(cfg, rngs, normal(stddev), (in_features, out_features), roles)
        self.bias = (
            _param(cfg, rngs, jax.nn.initializers.zeros, (out_features,), (roles[1],))
            if use_bias
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.dot(x.astype(self.dtype), gathered(self.kernel[...]).astype(self.dtype))
        if self.bias is not None:
            y = y + gathered(self.bias[...]).astype(self.dtype)
        return y


class Embedding(nnx.Module):
    """A lookup table ``[num_embeddings, features]`` with ``attend`` for tied heads.

    Example:
      >>> from nnx_mpmd.models.layers import ModelConfig
      >>> emb = Embedding(ModelConfig(), 10, 4, ("tensor", "fsdp"), rngs=nnx.Rngs(0))
      >>> emb(jnp.array([[1, 2]])).shape, emb.attend(jnp.ones((1, 4))).shape
      ((1, 2, 4), (1, 10))
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_embeddings: int,
        features: int,
        roles: tuple[Role, Role],
        *,
        rngs: nnx.Rngs,
        stddev: float = 0.02,
    ) -> None:
        self.dtype = cfg.dtype
        self.table = _param(cfg, rngs, normal(stddev), (num_embeddings, features), roles)

    def __call__(self, ids: jax.Array) -> jax.Array:
        table = gathered(self.table[...])
        sharding = getattr(jax.typeof(ids), "sharding", None)
        spec = getattr(sharding, "spec", None)
        if sharding is not None and spec and any(axis is not None for axis in spec):
            # Explicit mesh: rows come out sharded like the ids (e.g. batch on data).
            out_sharding = jax.sharding.NamedSharding(
                sharding.mesh, jax.sharding.PartitionSpec(*spec, None)
            )
            return table.at[ids].get(out_sharding=out_sharding).astype(self.dtype)
        return jnp.take(table, ids, axis=0).astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """Scores ``x`` against every row of the table: ``x @ table.T``."""
        return jnp.dot(x.astype(self.dtype), gathered(self.table[...]).astype(self.dtype).T)


class LayerNorm(nnx.Module):
    """Layer normalisation with scale and bias, computed in float32.

    Example:
      >>> from nnx_mpmd.models.layers import ModelConfig
      >>> LayerNorm(ModelConfig(), 4, rngs=nnx.Rngs(0))(jnp.arange(4.0)).shape
      (4,)
    """

    def __init__(self, cfg: ModelConfig, features: int, *, rngs: nnx.Rngs, eps: float = 1e-5):
        self.eps = eps
        self.scale = _param(cfg, rngs, jax.nn.initializers.ones, (features,), (None,))
        self.bias = _param(cfg, rngs, jax.nn.initializers.zeros, (features,), (None,))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * gathered(self.scale[...]) + gathered(self.bias[...])).astype(x.dtype)


class RMSNorm(nnx.Module):
    """Root-mean-square normalisation with a scale, computed in float32.

    Example:
      >>> from nnx_mpmd.models.layers import ModelConfig
      >>> RMSNorm(ModelConfig(), 4, rngs=nnx.Rngs(0))(jnp.full(4, 3.0)).round(3).tolist()
      [1.0, 1.0, 1.0, 1.0]
    """

    def __init__(self, cfg: ModelConfig, features: int, *, rngs: nnx.Rngs, eps: float = 1e-5):
        self.eps = eps
        self.scale = _param(cfg, rngs, jax.nn.initializers.ones, (features,), (None,))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.eps)
        return (y * gathered(self.scale[...])).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float = 10000.0) -> jax.Array:
    """Rotary position embedding of ``x`` ``[batch, seq, heads, head_dim]``, "rotate half" layout.

    Dimensions ``i`` and ``i + head_dim/2`` rotate by ``position * theta ** (-2i / head_dim)``.
    ``positions`` is ``[seq]`` or ``[batch, seq]``.

    Example:
      >>> x = jnp.ones((1, 3, 2, 4))
      >>> bool(jnp.allclose(apply_rope(x, jnp.arange(3))[:, 0], x[:, 0]))
      True
    """
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / x.shape[-1])
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [(batch,) seq, half]
    if angles.ndim == 2:
        angles = angles[None]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    first, second = x32[..., :half], x32[..., half:]
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], -1)
    return rotated.astype(x.dtype)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention; query head ``h`` reads key/value head ``h // (n_heads // n_kv_heads)``.

    Example:
      >>> q = k = v = jnp.ones((1, 3, 4, 2))
      >>> causal_attention(q, k[:, :, :2], v[:, :, :2]).shape
      (1, 3, 4, 2)
    """
    batch, seq, n_heads, head_dim = q.shape
    n_kv = k.shape[2]
    groups = n_heads // n_kv
    qg = q.reshape(batch, seq, n_kv, groups, head_dim)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k).astype(jnp.float32)
    scores = scores / math.sqrt(head_dim)
    mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", weights, v)
    return out.reshape(batch, seq, n_heads, head_dim).astype(q.dtype)


class Attention(nnx.Module):
    """Causal multi-head self-attention with optional grouped-query heads and RoPE.

    Args:
      cfg: the model config.
      rngs: random streams.
      n_kv_heads: key/value heads (``n_heads`` for ordinary multi-head attention).
      use_bias: biases on the four projections (GPT-2 style).
      rope_theta: apply rotary embeddings with this base, or None for none.
      out_stddev: initializer scale of the output projection.

    Calling it on ``x [batch, seq, d_model]`` attends causally within ``x``.
    With ``positions`` and ``cache_rows`` (``[batch]`` ints, see
    `nnx_mpmd.models.kv_cache`) it writes the keys and values of ``x`` into its
    cache (`kv_cache.init_cache`) at those positions and attends to everything
    cached up to each query: decoding one token at a time.

    Example:
      >>> from nnx_mpmd.models.layers import ModelConfig
      >>> attn = Attention(ModelConfig(d_model=8, n_heads=2), rngs=nnx.Rngs(0))
      >>> attn(jnp.ones((1, 5, 8))).shape
      (1, 5, 8)
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        n_kv_heads: int | None = None,
        use_bias: bool = False,
        rope_theta: float | None = None,
        out_stddev: float = 0.02,
    ) -> None:
        self.n_heads = cfg.n_heads
        self.n_kv_heads = n_kv_heads or cfg.n_heads
        self.head_dim = cfg.head_dim
        self.rope_theta = rope_theta
        self.cache_dtype = cfg.dtype
        d, kv_width = cfg.d_model, self.n_kv_heads * cfg.head_dim
        up = ("fsdp", "tensor")
        self.query = Dense(cfg, d, d, up, rngs=rngs, use_bias=use_bias)
        self.key = Dense(cfg, d, kv_width, up, rngs=rngs, use_bias=use_bias)
        self.value = Dense(cfg, d, kv_width, up, rngs=rngs, use_bias=use_bias)
        self.out = Dense(
            cfg, d, d, ("tensor", "fsdp"), rngs=rngs, use_bias=use_bias, stddev=out_stddev
        )

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array | None = None,
        cache_rows: jax.Array | None = None,
    ) -> jax.Array:
        batch, seq, _ = x.shape
        q = self.query(x).reshape(batch, seq, self.n_heads, self.head_dim)
        k = self.key(x).reshape(batch, seq, self.n_kv_heads, self.head_dim)
        v = self.value(x).reshape(batch, seq, self.n_kv_heads, self.head_dim)
        at = jnp.arange(seq) if positions is None else cache_ops.query_positions(positions, seq)
        if self.rope_theta is not None:
            q = apply_rope(q, at, self.rope_theta)
            k = apply_rope(k, at, self.rope_theta)
        if positions is None:
            out = causal_attention(q, k, v)
        else:
            out = self._attend_cached(q, k, v, at, cache_rows)
        return self.out(out.reshape(batch, seq, self.n_heads * self.head_dim))

    def _attend_cached(
        self, q: jax.Array, k: jax.Array, v: jax.Array, at: jax.Array, cache_rows: Any
    ) -> jax.Array:
        if getattr(self, "cached_key", None) is None:
            raise MpmdError(
                "Attention was called with positions (KV-cache decoding) but has no cache; "
                "call nnx_mpmd.models.kv_cache.init_cache(model, batch_size) first."
            )
        if cache_rows is None:
            raise MpmdError(
                "Attention was called with positions but without cache_rows; pass both "
                "(cache_rows: the [batch] rows of the cache the call's rows use)."
            )
        first = at[:, 0]
        # Made by kv_cache.init_cache (checked above), so not declared on the class.
        cached_key, cached_value = self.cached_key, self.cached_value  # pyright: ignore[reportAttributeAccessIssue]
        cached_key[...], keys = cache_ops.write_cache(cached_key[...], cache_rows, first, k)
        cached_value[...], values = cache_ops.write_cache(cached_value[...], cache_rows, first, v)
        return cache_ops.cached_attention(q, keys, values, at)


class GeluMLP(nnx.Module):
    """``down(gelu(up(x)))`` with biases (GPT-2 style, tanh-approximated GELU).

    Example:
      >>> from nnx_mpmd.models.layers import ModelConfig
      >>> GeluMLP(ModelConfig(d_model=8), 32, rngs=nnx.Rngs(0))(jnp.ones((2, 8))).shape
      (2, 8)
    """

    def __init__(
        self, cfg: ModelConfig, hidden: int, *, rngs: nnx.Rngs, out_stddev: float = 0.02
    ) -> None:
        d = cfg.d_model
        self.up = Dense(cfg, d, hidden, ("fsdp", "tensor"), rngs=rngs, use_bias=True)
        self.down = Dense(
            cfg, hidden, d, ("tensor", "fsdp"), rngs=rngs, use_bias=True, stddev=out_stddev
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x), approximate=True))


class SwiGLU(nnx.Module):
    """``down(silu(gate(x)) * up(x))`` without biases (Llama style).

    Example:
      >>> from nnx_mpmd.models.layers import ModelConfig
      >>> SwiGLU(ModelConfig(d_model=8), 24, rngs=nnx.Rngs(0))(jnp.ones((2, 8))).shape
      (2, 8)
    """

    def __init__(self, cfg: ModelConfig, hidden: int, *, rngs: nnx.Rngs) -> None:
        d = cfg.d_model
        self.gate = Dense(cfg, d, hidden, ("fsdp", "tensor"), rngs=rngs)
        self.up = Dense(cfg, d, hidden, ("fsdp", "tensor"), rngs=rngs)
        self.down = Dense(cfg, hidden, d, ("tensor", "fsdp"), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class LMHead(nnx.Module):
    """Final norm, then logits: tied (``embedding.attend``) or an own projection.

    With ``tied_embedding`` the head holds a reference to the embedding module,
    so wrapping the head in ``Stage(last)`` tags the embedding table as shared
    between the first and the last stage (owner: stage 0).

    Args:
      cfg: the model config.
      norm: the final normalisation layer.
      rngs: random streams.
      tied_embedding: the token embedding to reuse, or None for an untied head.

    Returns:
      float32 logits ``[..., vocab_size]`` when called.

    Example:
      >>> from nnx_mpmd.models.layers import ModelConfig
      >>> cfg = ModelConfig(d_model=8, vocab_size=11)
      >>> head = LMHead(cfg, RMSNorm(cfg, 8, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(0))
      >>> head(jnp.ones((2, 8))).shape
      (2, 11)
    """

    def __init__(
        self,
        cfg: ModelConfig,
        norm: nnx.Module,
        *,
        rngs: nnx.Rngs,
        tied_embedding: Embedding | None = None,
    ) -> None:
        self.norm = norm
        self.embedding = tied_embedding
        self.proj = (
            None
            if tied_embedding is not None
            else Dense(cfg, cfg.d_model, cfg.vocab_size, ("fsdp", "tensor"), rngs=rngs)
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.norm(x)
        # Exactly one of them is set (tied_embedding or not).
        logits = cast(Embedding, self.embedding).attend(x) if self.proj is None else self.proj(x)
        return logits.astype(jnp.float32)


def _check_sequence(tokens: Any, cfg: ModelConfig) -> None:
    if tokens.ndim != 2:
        raise MpmdError(
            f"{cfg.MODEL_NAME}: tokens must be int [batch, seq], got shape {tokens.shape}; "
            "add a batch dimension with tokens[None]."
        )
    if tokens.shape[1] > cfg.max_len:
        raise MpmdError(
            f"{cfg.MODEL_NAME}: sequence length {tokens.shape[1]} exceeds max_len="
            f"{cfg.max_len}; truncate the input or build the model with a larger max_len."
        )
