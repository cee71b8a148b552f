"""Pipelined generation: sequences in flight through the stages, equal to unpipelined decoding."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from pipeline_models import make_mesh

import nnx_mpmd as mp
from nnx_mpmd.aot.stats import count_compilations
from nnx_mpmd.models import build_model

VOCAB = 64


def _model(stages, family="gpt"):
    return build_model(family, "tiny", num_stages=stages, rngs=nnx.Rngs(0), vocab_size=VOCAB)


def _prompts(rows, length=6, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, size=(rows, length)).astype(np.int32)


# (schedule, stages, meshes, microbatches, temperature, top_k, model, KV cache)
CASES = [
    (mp.OneFOneB, 2, 2, 2, 0.0, None, "gpt", True),
    (mp.OneFOneB, 2, 2, 2, 0.0, None, "gpt", False),
    (mp.GPipe, 4, 4, 4, 0.0, None, "gpt", True),
    (mp.OneFOneB, 4, 4, 4, 0.8, 5, "gpt", True),
    (mp.OneFOneB, 4, 4, 4, 0.8, 5, "gpt", False),
    (mp.Interleaved1F1B, 4, 2, 2, 1.0, None, "gpt", True),
    (mp.ZeroBubbleH1, 2, 2, 4, 0.7, 3, "gpt", True),
    (mp.Interleaved1F1B, 4, 2, 4, 0.0, None, "llama", True),
    (mp.GPipe, 2, 2, 2, 0.9, 4, "llama", True),
]


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: (
        f"{c[0].__name__}-S{c[1]}-M{c[2]}-m{c[3]}-T{c[4]}-k{c[5]}-{c[6]}"
        + ("-cache" if c[7] else "-window")
    ),
)
def test_pipelined_tokens_equal_unpipelined_tokens(case):
    schedule, stages, meshes, m, temperature, top_k, family, kv_cache = case
    generator = mp.Generator(
        mesh=make_mesh(meshes, 2 if meshes == 2 else 1),
        schedule=schedule(),
        num_microbatches=m,
        window=64,
        temperature=temperature,
        top_k=top_k,
        kv_cache=kv_cache,
    )
    prompts = _prompts(8)
    got = generator(_model(stages, family), prompts, 10, seed=7)
    want = generator.reference(_model(stages, family), prompts, 10, seed=7)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[:, :6], prompts)
    if temperature:  # sampling draws different tokens for different seeds
        other = generator.reference(_model(stages, family), prompts, 10, seed=8)
        assert (other != want).any()


@pytest.mark.parametrize("data", [1, 2])
def test_decoding_compiles_once_keeps_caches_on_their_stages_and_equals_the_window(data):
    """Cached decoding (prefill and decode: two steps) and the recomputed window (one)
    compile nothing on a second call; each cache stays on its stage, sharded like the
    microbatches; the cached tokens are the window's. One case per data size: both
    generators are built once for all three checks."""
    mesh = make_mesh(2, data)
    tokens, models = {}, {}
    for kv_cache, steps in [(True, 2), (False, 1)]:
        generator = mp.Generator(
            mesh=mesh, schedule=mp.OneFOneB(), num_microbatches=2, window=64, kv_cache=kv_cache
        )
        models[kv_cache] = _model(2)
        generator(models[kv_cache], _prompts(4), 3)
        with count_compilations() as counter:
            tokens[kv_cache] = generator(models[kv_cache], _prompts(4, seed=1), 12)
        assert counter.count == 0 and generator.num_compiled_steps == steps, kv_cache
    np.testing.assert_array_equal(tokens[True], tokens[False])
    _assert_caches_on_their_stages(models[True], mesh, data)


def _assert_caches_on_their_stages(model, mesh, data):
    for block, stage in zip(model.blocks, model.block_stages, strict=True):
        for cache in (block.attn.cached_key, block.attn.cached_value):
            sharding = cache.get_value().sharding
            assert set(sharding.device_set) == set(mesh.submesh(stage).devices.flat)
            assert tuple(sharding.spec)[:2] == ((None, "data") if data > 1 else (None, None))
    assert cache.get_metadata()["mpmd_stage"] == stage == 1


class _NoCacheLM(nnx.Module):
    def __init__(self):
        self.embed = mp.Stage(nnx.Embed(VOCAB, 8, rngs=nnx.Rngs(0)), stage=0)
        self.head = mp.Stage(nnx.Linear(8, VOCAB, rngs=nnx.Rngs(1)), stage=1)

    def __call__(self, tokens):
        return self.head(self.embed(tokens))


def test_kv_cache_modes():
    generator = mp.Generator(
        mesh=make_mesh(2, 1), schedule=mp.OneFOneB(), num_microbatches=2, window=16
    )
    assert generator.uses_cache(_model(2)) and not generator.uses_cache(_NoCacheLM())
    out = generator(_NoCacheLM(), _prompts(4, 3), 2)  # no cache: the window is recomputed
    assert out.shape == (4, 5) and generator.num_compiled_steps == 1
    required = mp.Generator(
        mesh=make_mesh(2, 1), schedule=mp.OneFOneB(), num_microbatches=2, window=16, kv_cache=True
    )
    with pytest.raises(mp.CompileError, match=r"_NoCacheLM has no init_cache\(batch_size\)"):
        required(_NoCacheLM(), _prompts(4, 3), 2)


def test_a_scanned_zoo_model_decodes_with_stacked_caches():
    """``scan_layers=True``: each stacked attention gets caches stacked along the layer
    axis; the tokens equal the unpipelined decoding's and the recomputed window's."""

    def scanned():
        return build_model(
            "llama", "tiny", num_stages=4, rngs=nnx.Rngs(0), vocab_size=VOCAB, n_layers=8,
            scan_layers=True,
        )  # fmt: skip

    settings = dict(mesh=make_mesh(2, 2), schedule=mp.Interleaved1F1B(), num_microbatches=2,
                    window=64, temperature=0.8, top_k=5)  # fmt: skip
    generator, model, prompts = mp.Generator(**settings), scanned(), _prompts(4, 5)
    assert generator.uses_cache(model)
    got = generator(model, prompts, 6, seed=3)
    key = model.blocks.chunks[0].module.layers.attn.cached_key
    assert key.shape[:2] == (2, 2)  # [layers of the chunk, microbatches, ...]
    np.testing.assert_array_equal(got, generator.reference(scanned(), prompts, 6, seed=3))
    window = mp.Generator(**settings, kv_cache=False)(scanned(), prompts, 6, seed=3)
    np.testing.assert_array_equal(got, window)


# (vocab_size, temperature, top_k, KV cache): a limit below the model's 64 ids, greedy
# and sampled; a limit of all 64 ids.
LIMIT_CASES = [(40, 0.0, None, True), (40, 2.0, 50, False), (VOCAB, 0.8, 5, True)]


@pytest.mark.parametrize(
    "limit,temperature,top_k,kv_cache",
    LIMIT_CASES,
    ids=["greedy-40", "sampled-40-window", "sampled-all"],
)
def test_vocab_size_limits_the_ids_chosen(limit, temperature, top_k, kv_cache):
    """A tokenizer of 40 ids for a model of 64: no id >= 40 is ever chosen, pipelined or
    under nnx.jit; a limit of the whole vocabulary gives the unlimited tokens."""
    settings = dict(mesh=make_mesh(2, 1), schedule=mp.OneFOneB(), num_microbatches=2,
                    window=64, temperature=temperature, top_k=top_k, kv_cache=kv_cache)  # fmt: skip
    prompts = _prompts(4)  # ids of all 64: the limit is on the ids chosen
    limited = mp.Generator(**settings, vocab_size=limit)
    got = limited(_model(2), prompts, 10, seed=7)
    unlimited = mp.Generator(**settings).reference(_model(2), prompts, 10, seed=7)
    if limit == VOCAB:
        np.testing.assert_array_equal(got, unlimited)
        return
    assert (unlimited[:, 6:] >= limit).any()  # without the limit the model picks them
    assert (got[:, 6:] < limit).all()
    np.testing.assert_array_equal(got, limited.reference(_model(2), prompts, 10, seed=7))
    if not temperature:  # greedy: the first new token is the argmax over the allowed ids
        logits = nnx.jit(lambda model, x: model(x))(_model(2), prompts)
        np.testing.assert_array_equal(got[:, 6], np.argmax(logits[:, -1, :limit], axis=-1))


@pytest.mark.parametrize(
    "prompts,new,match",
    [
        (np.zeros((4,), np.int32), 2, r"prompts must be int token ids \[B, P\]"),
        (np.zeros((4, 0), np.int32), 2, r"with P >= 1, got shape \(4, 0\)"),
        (np.zeros((4, 3), np.float32), 2, r"int token ids.*float32"),
        (np.zeros((4, 60), np.int32), 5, r"60 prompt tokens \+ 5 new ones exceed the window of 64"),
        (np.zeros((3, 4), np.int32), 2, r"3 prompts do not split into 2 microbatches"),
        (np.zeros((4, 4), np.int32), -1, r"max_new_tokens=-1 must be an int >= 0"),
    ],
)
def test_bad_prompts_are_errors(prompts, new, match):
    generator = mp.Generator(
        mesh=make_mesh(2, 1), schedule=mp.OneFOneB(), num_microbatches=2, window=64
    )
    with pytest.raises(mp.CompileError, match=match):
        generator(_model(2), prompts, new)


def test_window_longer_than_the_cache_is_an_error():
    generator = mp.Generator(
        mesh=make_mesh(2, 1), schedule=mp.OneFOneB(), num_microbatches=2, window=256
    )
    with pytest.raises(mp.CompileError, match=r"window=256\) is longer than the model's max_len"):
        generator(_model(2), _prompts(4), 2)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": -1.0}, r"temperature=-1.0\): use 0 \(greedy\) or more"),
        ({"top_k": 0}, r"top_k=0\): use an int >= 1"),
        ({"window": 0}, r"window=0\): use the model's context length"),
        ({"kv_cache": "yes"}, r"kv_cache='yes'\): use True, False or None"),
        ({"vocab_size": 0}, r"vocab_size=0\): use the tokenizer's vocab_size"),
        ({"vocab_size": 40.0}, r"vocab_size=40.0\): use the tokenizer's vocab_size"),
    ],
)
def test_bad_settings_are_errors(kwargs, match):
    settings = {"window": 64, **kwargs}
    with pytest.raises(mp.CompileError, match=match):
        mp.Generator(mesh=make_mesh(2, 1), schedule=mp.OneFOneB(), num_microbatches=2, **settings)
