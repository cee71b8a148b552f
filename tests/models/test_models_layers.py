"""Shared layers of the model zoo against naive numpy implementations."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_mpmd.errors import PartitionError
from nnx_mpmd.models import layers
from nnx_mpmd.models.layers import ModelConfig


def naive_attention(q, k, v):
    """Loop-over-everything causal attention; query head h reads kv head h // group."""
    batch, seq, n_heads, head_dim = q.shape
    group = n_heads // k.shape[2]
    out = np.zeros_like(q, dtype=np.float64)
    for b in range(batch):
        for h in range(n_heads):
            kv = h // group
            for i in range(seq):
                scores = np.array(
                    [q[b, i, h] @ k[b, j, kv] / math.sqrt(head_dim) for j in range(i + 1)]
                )
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                out[b, i, h] = sum(weights[j] * v[b, j, kv] for j in range(i + 1))
    return out


def naive_rope(x, positions, theta=10000.0):
    """RoPE as a complex rotation of the pairs (i, i + half)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-2.0 * np.arange(half) / x.shape[-1])
    z = x[..., :half] + 1j * x[..., half:]
    rotation = np.exp(1j * positions[:, None] * freqs[None, :])  # [seq, half]
    z = z * rotation[None, :, None, :]
    return np.concatenate([z.real, z.imag], axis=-1)


@pytest.mark.parametrize(("n_heads", "n_kv"), [(4, 4), (4, 2), (4, 1), (6, 3)])
def test_causal_attention_matches_naive_loops(n_heads, n_kv):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 5, n_heads, 8)).astype(np.float32)
    k = rng.normal(size=(2, 5, n_kv, 8)).astype(np.float32)
    v = rng.normal(size=(2, 5, n_kv, 8)).astype(np.float32)
    got = layers.causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    np.testing.assert_allclose(np.asarray(got), naive_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_gqa_equals_multi_head_attention_with_repeated_kv_heads():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(1, 6, 8, 4)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 6, 2, 4)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, 6, 2, 4)), jnp.float32)
    grouped = layers.causal_attention(q, k, v)
    repeated = layers.causal_attention(q, jnp.repeat(k, 4, axis=2), jnp.repeat(v, 4, axis=2))
    np.testing.assert_allclose(grouped, repeated, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("theta", [10000.0, 500.0])
def test_rope_matches_complex_rotation(theta):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 7, 3, 8)).astype(np.float32)
    positions = np.arange(7)
    got = layers.apply_rope(jnp.asarray(x), jnp.asarray(positions), theta)
    np.testing.assert_allclose(np.asarray(got), naive_rope(x, positions, theta), atol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)

    def score(m, n):
        qm = layers.apply_rope(q, jnp.array([m]))
        kn = layers.apply_rope(k, jnp.array([n]))
        return float(jnp.sum(qm * kn))

    assert score(5, 2) == pytest.approx(score(13, 10), rel=1e-4, abs=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 4), rel=1e-3)


@pytest.mark.parametrize(
    ("n_heads", "n_kv", "rope", "bias"),
    [(4, None, None, True), (4, 2, 10000.0, False), (2, 1, 10000.0, False)],
)
def test_attention_module_matches_numpy(n_heads, n_kv, rope, bias):
    cfg = ModelConfig(d_model=16, n_heads=n_heads)
    attn = layers.Attention(
        cfg, rngs=nnx.Rngs(0), n_kv_heads=n_kv, use_bias=bias, rope_theta=rope, out_stddev=0.3
    )
    # Non-zero biases so that they are exercised.
    for dense in (attn.query, attn.key, attn.value, attn.out):
        dense.kernel.set_value(dense.kernel[...] * 10)
        if dense.bias is not None:
            dense.bias.set_value(jnp.linspace(-1, 1, dense.bias.shape[0]))
    x = np.random.default_rng(4).normal(size=(2, 5, 16)).astype(np.float32)

    def proj(dense, h):
        y = h @ np.asarray(dense.kernel[...])
        return y + np.asarray(dense.bias[...]) if dense.bias is not None else y

    kv = n_kv or n_heads
    head_dim = 16 // n_heads
    q = proj(attn.query, x).reshape(2, 5, n_heads, head_dim)
    k = proj(attn.key, x).reshape(2, 5, kv, head_dim)
    v = proj(attn.value, x).reshape(2, 5, kv, head_dim)
    if rope is not None:
        q, k = naive_rope(q, np.arange(5), rope), naive_rope(k, np.arange(5), rope)
    expected = proj(attn.out, naive_attention(q, k, v).reshape(2, 5, 16))
    np.testing.assert_allclose(np.asarray(attn(jnp.asarray(x))), expected, rtol=1e-4, atol=1e-4)


def test_norms_match_numpy():
    cfg = ModelConfig(d_model=8)
    x = np.random.default_rng(5).normal(size=(3, 8)).astype(np.float32) * 3 + 1
    ln = layers.LayerNorm(cfg, 8, rngs=nnx.Rngs(0))
    ln.scale.set_value(jnp.arange(8.0))
    ln.bias.set_value(jnp.ones(8))
    expected = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(ln(jnp.asarray(x)), expected * np.arange(8) + 1, atol=1e-4)
    rms = layers.RMSNorm(cfg, 8, rngs=nnx.Rngs(0))
    expected = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(rms(jnp.asarray(x)), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mlps_match_numpy(dtype):
    cfg = ModelConfig(d_model=8, dtype=dtype)
    x = np.random.default_rng(6).normal(size=(3, 8)).astype(np.float32)
    gelu = layers.GeluMLP(cfg, 32, rngs=nnx.Rngs(0), out_stddev=0.5)
    up = x @ np.asarray(gelu.up.kernel[...]) + np.asarray(gelu.up.bias[...])
    hidden = 0.5 * up * (1 + np.tanh(np.sqrt(2 / np.pi) * (up + 0.044715 * up**3)))
    expected = hidden @ np.asarray(gelu.down.kernel[...]) + np.asarray(gelu.down.bias[...])
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    got = gelu(jnp.asarray(x))
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), expected, rtol=tol, atol=tol)
    swiglu = layers.SwiGLU(cfg, 24, rngs=nnx.Rngs(1))
    gate = x @ np.asarray(swiglu.gate.kernel[...])
    hidden = gate / (1 + np.exp(-gate)) * (x @ np.asarray(swiglu.up.kernel[...]))
    expected = hidden @ np.asarray(swiglu.down.kernel[...])
    got = np.asarray(swiglu(jnp.asarray(x)), np.float32)
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)


def test_tied_head_uses_embedding_table():
    cfg = ModelConfig(d_model=8, vocab_size=11)
    emb = layers.Embedding(cfg, 11, 8, ("tensor", "fsdp"), rngs=nnx.Rngs(0))
    head = layers.LMHead(
        cfg, layers.RMSNorm(cfg, 8, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(0), tied_embedding=emb
    )
    assert head.proj is None
    x = np.random.default_rng(7).normal(size=(2, 8)).astype(np.float32)
    normed = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(
        head(jnp.asarray(x)), normed @ np.asarray(emb.table[...]).T, atol=1e-5
    )


def _brute_force_heaviest(weights, num_stages):
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(weights)), num_stages - 1):
        bounds = (0, *cuts, len(weights))
        best = min(best, max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@pytest.mark.parametrize(("num_blocks", "num_stages"), [(1, 1), (4, 4), (6, 2), (7, 3), (12, 4)])
@pytest.mark.parametrize("head_cost", [0.0, 2.5, 40.0])
def test_assign_block_stages_is_contiguous_nonempty_and_optimal(num_blocks, num_stages, head_cost):
    stages = layers.assign_block_stages(
        num_blocks, num_stages, block_cost=1.0, embed_cost=0.5, head_cost=head_cost
    )
    assert stages[0] == 0 and stages[-1] == num_stages - 1
    assert all(b - a in (0, 1) for a, b in itertools.pairwise(stages))
    assert sorted(set(stages)) == list(range(num_stages))
    weights = [1.0] * num_blocks
    weights[0] += 0.5
    weights[-1] += head_cost
    heaviest = max(sum(w for w, s in zip(weights, stages) if s == k) for k in range(num_stages))
    assert heaviest == pytest.approx(_brute_force_heaviest(weights, num_stages))


@pytest.mark.parametrize("num_stages", [0, 5])
def test_assign_block_stages_rejects_bad_stage_counts(num_stages):
    with pytest.raises(PartitionError, match=r"cannot split 4 blocks into .* stages"):
        layers.assign_block_stages(
            4, num_stages, block_cost=1.0, embed_cost=0.0, head_cost=0.0, where="toy"
        )


def test_count_params_counts_shared_parameters_once():
    cfg = ModelConfig(d_model=8, vocab_size=11)
    emb = layers.Embedding(cfg, 11, 8, ("tensor", "fsdp"), rngs=nnx.Rngs(0))
    head = layers.LMHead(
        cfg, layers.RMSNorm(cfg, 8, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(0), tied_embedding=emb
    )
    both = nnx.Dict(emb=emb, head=head)
    assert layers.count_params(both) == 11 * 8 + 8


def test_sharding_roles_follow_config_axes():
    assert ModelConfig().sharding("fsdp", "tensor") is None
    assert ModelConfig(fsdp="f").sharding("fsdp", "tensor") == ("f", None)
    assert ModelConfig(fsdp="f", tensor="t").sharding("tensor", None) == ("t", None)
    dense = layers.Dense(
        ModelConfig(tensor="t"), 4, 6, ("fsdp", "tensor"), rngs=nnx.Rngs(0), use_bias=True
    )
    assert dense.kernel.get_metadata()["out_sharding"] == (None, "t")
    assert dense.bias.get_metadata()["out_sharding"] == ("t",)
    plain = layers.Dense(ModelConfig(), 4, 6, ("fsdp", "tensor"), rngs=nnx.Rngs(0))
    assert "out_sharding" not in plain.kernel.get_metadata()
    assert jax.tree.leaves(nnx.state(plain))[0].shape == (4, 6)
