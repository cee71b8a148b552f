"""The zoo's KV cache: prefill plus one-token calls equal the full causal forward."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_mpmd.errors import MpmdError
from nnx_mpmd.models import build_model, kv_cache

VOCAB = 64


def _model(family, **overrides):
    return build_model(
        family, "tiny", num_stages=2, rngs=nnx.Rngs(0), vocab_size=VOCAB, **overrides
    )


@nnx.jit
def _forward(model, tokens, positions=None, cache_rows=None):
    """``model(tokens, ...)`` compiled once per shape: eager calls would compile each
    operation of the model for each shape instead."""
    return model(tokens, positions=positions, cache_rows=cache_rows)


def _tokens(rows, length, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (rows, length)), jnp.int32)


@pytest.mark.parametrize(
    "family,overrides", [("gpt", {}), ("llama", {}), ("llama", {"n_kv_heads": 2})]
)
@pytest.mark.parametrize("microbatches", [1, 2])
def test_prefill_then_one_token_calls_equal_the_full_forward(family, overrides, microbatches):
    model = _model(family, **overrides)
    tokens = _tokens(4, 10)
    full = _forward(model, tokens)
    kv_cache.init_cache(model, 4, num_microbatches=microbatches)
    rows = jnp.arange(4)
    outs = [_forward(model, tokens[:, :6], positions=jnp.zeros(4, jnp.int32), cache_rows=rows)]
    for p in range(6, 10):
        position = jnp.full(4, p, jnp.int32)
        outs.append(_forward(model, tokens[:, p : p + 1], positions=position, cache_rows=rows))
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=2e-5)


def test_a_microbatch_reads_and_writes_only_its_rows():
    model = _model("gpt")
    tokens = _tokens(4, 8)
    full = _forward(model, tokens)
    kv_cache.init_cache(model, 4, num_microbatches=2)
    for first in (0, 2):  # each microbatch of two rows on its own
        rows = jnp.arange(first, first + 2)
        part = tokens[first : first + 2]
        _forward(model, part[:, :7], positions=jnp.zeros(2, jnp.int32), cache_rows=rows)
        last = _forward(model, part[:, 7:], positions=jnp.full(2, 7, jnp.int32), cache_rows=rows)
        np.testing.assert_allclose(last[:, 0], full[first : first + 2, 7], atol=2e-5)


def test_rows_at_different_positions():
    model = _model("gpt")
    tokens = _tokens(2, 8)
    full = _forward(model, tokens)
    kv_cache.init_cache(model, 2)
    rows = jnp.arange(2)
    _forward(model, tokens[:, :5], positions=jnp.zeros(2, jnp.int32), cache_rows=rows)
    row_0_ahead = {"positions": jnp.array([5]), "cache_rows": jnp.array([0])}
    _forward(model, tokens[:1, 5:7], **row_0_ahead)
    out = _forward(
        model,
        jnp.stack([tokens[0, 7:8], tokens[1, 5:6]]),
        positions=jnp.array([7, 5]),
        cache_rows=rows,
    )
    np.testing.assert_allclose(out[0, 0], full[0, 7], atol=2e-5)
    np.testing.assert_allclose(out[1, 0], full[1, 5], atol=2e-5)


def test_init_keeps_a_cache_of_the_same_layout_and_drop_removes_it():
    model = _model("gpt")
    kv_cache.init_cache(model, 4, num_microbatches=2)
    cache = model.blocks[0].attn.cached_key
    kv_cache.init_cache(model, 4, num_microbatches=2)
    assert model.blocks[0].attn.cached_key is cache and cache.shape == (
        2,
        2,
        model.config.max_len,
        4,
        16,
    )
    kv_cache.init_cache(model, 4)
    assert model.blocks[0].attn.cached_key.shape == (1, 4, model.config.max_len, 4, 16)
    assert cache.get_metadata()["mpmd_stage"] == 0
    assert model.blocks[-1].attn.cached_value.get_metadata()["mpmd_stage"] == 1
    kv_cache.drop_cache(model)
    assert not kv_cache.has_cache(model)
    model(_tokens(2, 4))  # training calls never touch a cache


def test_sharded_config_shards_the_cache_heads_like_the_keys():
    model = _model("gpt", tensor="model")
    kv_cache.init_cache(model, 4, num_microbatches=2, batch_axis="data")
    metadata = model.blocks[0].attn.cached_key.get_metadata()
    assert metadata["out_sharding"] == (None, "data", None, "model", None)


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda m: m(_tokens(2, 3), positions=jnp.zeros(2, jnp.int32), cache_rows=jnp.arange(2)),
            r"called with positions \(KV-cache decoding\) but has no cache; call .*init_cache",
        ),
        (
            lambda m: (
                kv_cache.init_cache(m, 2),
                m(_tokens(2, 3), positions=jnp.zeros(2, jnp.int32)),
            ),
            r"without cache_rows; pass both",
        ),
        (
            lambda m: (
                kv_cache.init_cache(m, 4),
                m(_tokens(3, 3), positions=jnp.zeros(3, jnp.int32), cache_rows=jnp.arange(3)),
            ),
            r"KV cache of 4 rows called on 3 rows",
        ),
        (
            lambda m: kv_cache.init_cache(m, 5, num_microbatches=2),
            r"batch_size=5 does not split into num_microbatches=2",
        ),
        (lambda m: kv_cache.init_cache(m, 0), r"batch_size=0 must be an int >= 1"),
        (
            lambda m: kv_cache.init_cache(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), 2),
            r"Linear has no nnx_mpmd.models.layers.Attention layer",
        ),
    ],
    ids=["no-cache", "no-rows", "rows-do-not-divide", "batch-split", "batch-size", "no-attention"],
)
def test_errors(call, match):
    with pytest.raises(MpmdError, match=match):
        call(_model("gpt"))
