"""A model with its own functional KV cache decodes pipelined with it (mp.FunctionalKVCache).

The model is written like published NNX decoders, not for nnx_mpmd: no
PipelinedModel, annotated afterwards with mp.assign_stages, each layer taking
and returning its own dict cache {"k", "v", "index"}, the model returning
``(logits, cache)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from pipeline_models import make_mesh

import nnx_mpmd as mp
from nnx_mpmd.aot.stats import count_compilations

VOCAB, DIM, HEADS, WINDOW = 32, 16, 2, 16


class Attention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.qkv = nnx.Linear(DIM, 3 * DIM, rngs=rngs)
        self.out = nnx.Linear(DIM, DIM, rngs=rngs)

    def __call__(self, x, positions, cache):
        rows, length, _ = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(rows, length, 3 * HEADS, -1), 3, axis=2)
        if cache is None:  # the whole sequence, causal
            key_positions, new = positions, None
        else:  # write at each row's index, attend to everything written so far
            write = jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice(c, u, (i, 0, 0)))
            k = write(cache["k"], k, cache["index"])
            v = write(cache["v"], v, cache["index"])
            key_positions = jnp.broadcast_to(jnp.arange(k.shape[1]), (rows, k.shape[1]))
            new = {"k": k, "v": v, "index": cache["index"] + length}
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
        visible = key_positions[:, None, None, :] <= positions[:, None, :, None]
        weights = jax.nn.softmax(jnp.where(visible, scores, -1e9), axis=-1)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(x.shape)), new


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.attn = Attention(rngs)
        self.mlp = nnx.Linear(DIM, DIM, rngs=rngs)

    def __call__(self, x, positions, cache):
        y, cache = self.attn(self.norm(x), positions, cache)
        x = x + y
        return x + jnp.tanh(self.mlp(x)), cache


class OutsideLM(nnx.Module):
    """Tied embeddings, learned positions, a functional cache per layer."""

    def __init__(self, layers: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.position = nnx.Embed(WINDOW, DIM, rngs=rngs)
        self.layers = nnx.List([Block(rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)

    def init_cache(self, batch_size, max_len):
        def empty():
            kv = jnp.zeros((batch_size, max_len, HEADS, DIM // HEADS))
            return {"k": kv, "v": kv, "index": jnp.zeros((batch_size,), jnp.int32)}

        return {f"layer_{i}": empty() for i in range(len(self.layers))}

    def __call__(self, tokens, cache=None, positions=None):
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embed(tokens) + self.position(positions)
        new_cache = None if cache is None else {}
        for i, layer in enumerate(self.layers):
            x, layer_cache = layer(x, positions, None if cache is None else cache[f"layer_{i}"])
            if cache is not None:
                new_cache[f"layer_{i}"] = layer_cache
        return self.embed.attend(self.norm(x)), new_cache


def _model(stages: int) -> OutsideLM:
    model = OutsideLM(stages, nnx.Rngs(0))
    rules = {"embed": 0, "position": 0, "norm": stages - 1}
    mp.assign_stages(model, rules | {f"layers.{i}": i for i in range(stages)})
    return model


def _prompts(rows: int, length: int = 4, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(rows, length)).astype(np.int32)


def _plain_nnx_decoding(model, prompts, new_tokens, temperature, seed):
    """The reference: a plain NNX loop over the model's own cache, one device."""
    rows, length = prompts.shape
    call = nnx.jit(lambda m, tokens, cache, positions: m(tokens, cache, positions))
    cache = model.init_cache(rows, WINDOW)
    out, tokens = [prompts], jnp.asarray(prompts)
    positions = jnp.broadcast_to(jnp.arange(length), prompts.shape)
    for position in range(length, length + new_tokens):
        logits, cache = call(model, tokens, cache, positions)
        last = logits[:, -1].astype(jnp.float32)
        if temperature:
            keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), position), rows)
            new = jax.vmap(jax.random.categorical)(keys, last / temperature)
        else:
            new = jnp.argmax(last, axis=-1)
        tokens = new[:, None].astype(jnp.int32)
        positions = jnp.full((rows, 1), position, jnp.int32)
        out.append(np.asarray(tokens))
    return np.concatenate(out, axis=1)


AUTO, EXPLICIT = jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit

# (schedule, stages, microbatches, data parallel, axis types, temperature)
CASES = [
    (mp.OneFOneB, 2, 2, 1, EXPLICIT, 0.0),
    (mp.GPipe, 2, 2, 2, AUTO, 0.9),
    (mp.OneFOneB, 2, 4, 2, EXPLICIT, 0.0),
    (mp.OneFOneB, 4, 4, 1, EXPLICIT, 0.7),
    (mp.GPipe, 4, 2, 2, AUTO, 0.0),
    (mp.Interleaved1F1B, 4, 2, 1, EXPLICIT, 0.0),
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c[0].__name__}-S{c[1]}-m{c[2]}-d{c[3]}-{c[4].name}-T{c[5]}"
)
@pytest.mark.filterwarnings("ignore::nnx_mpmd.ReplicatedBatchWarning")
def test_cached_tokens_equal_plain_nnx_and_recomputed_decoding(case):
    schedule, stages, microbatches, data, axis_types, temperature = case
    meshes = 2 if schedule is mp.Interleaved1F1B else stages
    mesh = make_mesh(meshes, data, axis_types)
    prompts = _prompts(8)
    make = dict(mesh=mesh, schedule=schedule(), num_microbatches=microbatches, window=WINDOW)
    cached = mp.Generator(**make, temperature=temperature, kv_cache=True)
    model = _model(stages)
    got = cached(mp.FunctionalKVCache(model), prompts, 8, seed=3)
    want = _plain_nnx_decoding(_model(stages), prompts, 8, temperature, seed=3)
    np.testing.assert_array_equal(got, want)
    recompute = mp.Generator(**make, temperature=temperature, kv_cache=False)
    np.testing.assert_array_equal(
        recompute(mp.FunctionalKVCache(_model(stages)), prompts, 8, seed=3), want
    )
    if temperature:  # the sampled tokens depend on the seed
        assert (_plain_nnx_decoding(_model(stages), prompts, 8, temperature, seed=4) != want).any()


def test_each_layers_cache_lives_on_its_stages_mesh_and_later_calls_do_not_compile():
    mesh = make_mesh(4, 1)
    generator = mp.Generator(mesh=mesh, schedule=mp.OneFOneB(), num_microbatches=2, window=WINDOW)
    wrapped = mp.FunctionalKVCache(_model(4))
    first = generator(wrapped, _prompts(4), 5)
    for i, leaf in enumerate(wrapped.cache_leaves):  # k, v, index per layer, in key order
        devices = set(leaf[...].sharding.device_set)
        assert devices == set(mesh.submesh(i // 3).devices.flat), (i, devices)
    with count_compilations() as counter:
        again = generator(wrapped, _prompts(4), 5)
    assert counter.count == 0 and generator.num_compiled_steps == 2
    np.testing.assert_array_equal(again, first)
    # Unpipelined, one call on every row covers both microbatches' blocks of the cache.
    reference = generator.reference(mp.FunctionalKVCache(_model(4)), _prompts(4), 5)
    np.testing.assert_array_equal(reference, first)


def _rows_last_shared_index(model, batch_size, max_len):
    """The model's cache laid out otherwise: rows on the last axis, one index for all rows."""
    cache = model.init_cache(batch_size, max_len)
    return {
        name: {
            "k": jnp.moveaxis(c["k"], 0, -1),
            "v": jnp.moveaxis(c["v"], 0, -1),
            "index": jnp.zeros((), jnp.int32),
        }
        for name, c in cache.items()
    }


def _apply_rows_last(model, tokens, cache, positions):
    rows = tokens.shape[0]
    given = {
        name: {
            "k": jnp.moveaxis(c["k"], -1, 0),
            "v": jnp.moveaxis(c["v"], -1, 0),
            "index": jnp.broadcast_to(c["index"], (rows,)),
        }
        for name, c in cache.items()
    }
    logits, new = model(tokens, given, positions)
    return logits, {
        name: {
            "k": jnp.moveaxis(c["k"], 0, -1),
            "v": jnp.moveaxis(c["v"], 0, -1),
            "index": c["index"][0],
        }
        for name, c in new.items()
    }


def test_protocol_functions_adapt_another_cache_layout():
    """init_cache/apply given as functions: rows on the last axis and a shared scalar index."""
    generator = mp.Generator(
        mesh=make_mesh(2, 1), schedule=mp.OneFOneB(), num_microbatches=2, window=WINDOW
    )
    layout = {"init_cache": _rows_last_shared_index, "apply": _apply_rows_last}
    wrapped = mp.FunctionalKVCache(_model(2), **layout)
    got = generator(wrapped, _prompts(4), 6)
    # Stored per microbatch: [microbatches, rows per microbatch, ...], the index once per microbatch.
    assert wrapped.cache_leaves[0][...].shape == (2,)
    assert wrapped.cache_leaves[1][...].shape == (2, 2, WINDOW, HEADS, DIM // HEADS)
    np.testing.assert_array_equal(got, _plain_nnx_decoding(_model(2), _prompts(4), 6, 0.0, 0))
    reference = generator.reference(mp.FunctionalKVCache(_model(2), **layout), _prompts(4), 6)
    np.testing.assert_array_equal(reference, got)


def _without_index(out):
    logits, cache = out
    return logits, {name: {"k": c["k"], "v": c["v"]} for name, c in cache.items()}


def _grown(out):
    logits, cache = out
    return logits, jax.tree.map(lambda x: jnp.concatenate([x, x], axis=0), cache)


BROKEN = {
    "logits only": (
        {"apply": lambda m, tokens, cache, positions: m(tokens, cache, positions)[0]},
        r"apply must return \(logits, new_cache\), got one array float32\[4, 1, 32\]",
    ),
    "cache of another structure": (
        {"apply": lambda m, tokens, cache, positions: _without_index(m(tokens, cache, positions))},
        r"returned a cache of structure .* same keys and leaves",
    ),
    "cache of another shape": (
        {"apply": lambda m, tokens, cache, positions: _grown(m(tokens, cache, positions))},
        r"returned cache\['layer_0'\]\['index'\] as int32\[\d+\].*keeps its shapes and dtypes",
    ),
    "no batch axis": (
        {"init_cache": lambda m, batch_size, max_len: {"k": jnp.zeros((batch_size, batch_size))}},
        r"cache\['k'\] has shape \(8, 8\) for 8 rows .* one axis of batch_size rows",
    ),
}


@pytest.mark.parametrize("broken", BROKEN, ids=list(BROKEN))
def test_a_model_breaking_the_protocol_gets_a_clear_error(broken):
    functions, message = BROKEN[broken]
    generator = mp.Generator(
        mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2, window=WINDOW
    )
    with pytest.raises(mp.CompileError, match=message):
        generator(mp.FunctionalKVCache(_model(2), **functions), _prompts(8), 2)


def test_a_functional_cache_model_passed_bare_is_told_to_wrap_it():
    generator = mp.Generator(
        mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2, window=WINDOW
    )
    with pytest.raises(
        mp.CompileError,
        match=r"OutsideLM.init_cache\(batch_size, max_len\) "
        r"takes no num_microbatches or batch_axis.*mp.FunctionalKVCache\(model\)",
    ):
        generator(_model(2), _prompts(4), 2)


def test_a_model_without_init_cache_is_told_to_pass_one():
    with pytest.raises(mp.CompileError, match=r"Linear has no init_cache.*init_cache=lambda"):
        mp.FunctionalKVCache(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


def test_a_cache_that_does_not_split_into_the_microbatches_is_an_error():
    with pytest.raises(
        mp.CompileError, match=r"batch_size=5 does not split into num_microbatches=2"
    ):
        mp.FunctionalKVCache(_model(2)).init_cache(5, num_microbatches=2, max_len=WINDOW)


def test_a_call_on_part_of_a_microbatch_is_an_error():
    wrapped = mp.FunctionalKVCache(_model(2))
    wrapped.init_cache(4, num_microbatches=2, max_len=WINDOW)
    tokens = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(mp.CompileError, match=r"call on 1 rows does not cover whole microbatches"):
        wrapped(tokens, positions=jnp.zeros((1,), jnp.int32), cache_rows=jnp.zeros((1,), jnp.int32))


def test_apply_without_a_cache_must_give_logits():
    wrapped = mp.FunctionalKVCache(_model(2), apply=lambda m, tokens, cache, positions: {"x": 1})
    with pytest.raises(mp.CompileError, match=r"apply returned dict, not logits"):
        wrapped(jnp.zeros((2, 3), jnp.int32))
