"""The model zoo: parameter counts, stage layout, causality, training, sharding, errors."""

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_mpmd as mp
from nnx_mpmd.annotate.annotate import STAGE_KEY, STAGES_KEY
from nnx_mpmd.models import (
    GPT,
    MODELS,
    GPTConfig,
    Llama,
    LlamaConfig,
    build_model,
    count_params,
    lm_loss,
    preset_names,
)

FAMILIES = ["gpt", "llama"]


@pytest.mark.parametrize(
    ("name", "preset", "expected"),
    [("gpt", "gpt2-124m", 124_439_808), ("llama", "llama-1b", 1_100_048_384)],
)
@pytest.mark.parametrize("num_stages", [1, 4])
def test_real_presets_have_published_parameter_counts(name, preset, expected, num_stages):
    model = nnx.eval_shape(
        lambda: build_model(name, preset, num_stages=num_stages, rngs=nnx.Rngs(0))
    )
    assert count_params(model) == expected


@pytest.mark.parametrize("name", FAMILIES)
def test_small_preset_has_a_few_million_parameters(name):
    model = nnx.eval_shape(lambda: build_model(name, "small", num_stages=2, rngs=nnx.Rngs(0)))
    assert 1_000_000 < count_params(model) < 10_000_000


def _stages_of(variable):
    metadata = variable.get_metadata()
    return metadata[STAGE_KEY], metadata[STAGES_KEY]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_stage_layout(name, num_stages):
    model = build_model(name, "tiny", num_stages=num_stages, rngs=nnx.Rngs(0))
    last = num_stages - 1
    assert model.num_stages == num_stages
    # Every parameter carries a stage.
    params = [v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]
    assert params and all(STAGE_KEY in v.get_metadata() for v in params)
    # Blocks: contiguous, non-decreasing, every stage has at least one.
    block_stages = [block.stage for block in model.blocks]
    assert block_stages == list(model.block_stages)
    assert block_stages[0] == 0 and block_stages[-1] == last
    assert all(b - a in (0, 1) for a, b in itertools.pairwise(block_stages))
    assert sorted(set(block_stages)) == list(range(num_stages))
    for block in model.blocks:
        kernel = block.module.attn.query.kernel
        assert _stages_of(kernel) == (block.stage, (block.stage,))
    # Embedding on stage 0, head on the last stage.
    assert model.embed.stage == 0 and model.head.stage == last
    assert _stages_of(model.head.module.norm.scale) == (last, (last,))
    table = model.embed.module.token.table if name == "gpt" else model.embed.module.table
    if name == "gpt":  # tied: shared by the first and the last stage, owned by stage 0
        assert model.head.module.proj is None
        assert model.head.module.embedding.table is table
        assert _stages_of(table) == (0, tuple(sorted({0, last})))
        assert _stages_of(model.embed.module.position.table) == (0, (0,))
    else:
        assert _stages_of(table) == (0, (0,))
        assert _stages_of(model.head.module.proj.kernel) == (last, (last,))


def _stacked_block_state(unrolled):
    """The unrolled model's block parameters stacked along a new leading (layer) axis."""
    states = [nnx.state(block.module, nnx.Param).to_pure_dict() for block in unrolled.blocks]
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)


@pytest.mark.parametrize("name", FAMILIES)
def test_scanned_blocks_have_the_unrolled_stages_and_outputs(name):
    """``scan_layers=True`` stacks the blocks into one scanned chunk per stage, on the same
    stages as the unrolled blocks; given the unrolled weights, it computes the same logits."""
    unrolled = build_model(name, "tiny", num_stages=3, rngs=nnx.Rngs(0), n_layers=6)
    scanned = build_model(
        name, "tiny", num_stages=3, rngs=nnx.Rngs(0), n_layers=6, scan_layers=True
    )
    assert isinstance(scanned.blocks, mp.ScanStack)
    assert scanned.block_stages == unrolled.block_stages
    starts = [0, *itertools.accumulate(unrolled.block_stages.count(s) for s in range(3))]
    assert scanned.blocks.chunk_ranges() == list(itertools.pairwise(starts))
    assert [chunk.stage for chunk in scanned.blocks.chunks] == [0, 1, 2]
    for chunk in scanned.blocks.chunks:
        assert _stages_of(chunk.module.layers.attn.query.kernel) == (chunk.stage, (chunk.stage,))
    assert count_params(scanned) == count_params(unrolled)

    stacked = _stacked_block_state(unrolled)
    for chunk, (start, stop) in zip(scanned.blocks.chunks, itertools.pairwise(starts), strict=True):
        nnx.update(
            chunk.module.layers, jax.tree.map(lambda a, lo=start, hi=stop: a[lo:hi], stacked)
        )
    for attr in ("embed", "head"):
        nnx.update(getattr(scanned, attr), nnx.state(getattr(unrolled, attr), nnx.Param))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)
    forward = nnx.jit(lambda model, tokens: model(tokens))  # eager, it compiles op by op
    np.testing.assert_allclose(
        forward(scanned, tokens), forward(unrolled, tokens), rtol=1e-5, atol=1e-5
    )


def test_untied_gpt_has_its_own_head():
    cfg = GPTConfig.preset("tiny", num_stages=2, tie_embeddings=False)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    assert _stages_of(model.embed.module.token.table) == (0, (0,))
    assert _stages_of(model.head.module.proj.kernel) == (1, (1,))
    tied = GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0))
    assert count_params(model) - count_params(tied) == cfg.d_model * cfg.vocab_size


def test_heavy_head_gets_fewer_blocks_on_the_last_stage():
    cfg = GPTConfig.preset("gpt2-124m", num_stages=4)
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    counts = [list(model.block_stages).count(s) for s in range(4)]
    assert sum(counts) == 12 and counts[-1] == min(counts) and min(counts) >= 1


@pytest.mark.parametrize("name", FAMILIES)
def test_forward_shape_dtype_and_causality(name):
    model = build_model(name, "tiny", num_stages=2, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 256, dtype=jnp.int32)
    logits = model(tokens)
    assert logits.shape == (2, 16, 256) and logits.dtype == jnp.float32
    changed = tokens.at[:, 9].set((tokens[:, 9] + 1) % 256)
    other = model(changed)
    np.testing.assert_allclose(logits[:, :9], other[:, :9], rtol=1e-6, atol=1e-6)
    assert not np.allclose(logits[:, 9:], other[:, 9:])


@pytest.mark.parametrize("name", FAMILIES)
def test_bfloat16_compute_keeps_float32_params_and_logits(name):
    model = build_model(name, "tiny", num_stages=1, rngs=nnx.Rngs(0), dtype="bfloat16")
    assert model.config.dtype == jnp.bfloat16
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    reference = build_model(name, "tiny", num_stages=1, rngs=nnx.Rngs(0))
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
    forward = nnx.jit(lambda model, tokens: model(tokens))  # eager, it compiles op by op
    logits = forward(model, tokens)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, forward(reference, tokens), atol=0.1)


def test_lm_loss_is_mean_token_cross_entropy():
    model = build_model("gpt", "tiny", num_stages=1, rngs=nnx.Rngs(0), vocab_size=11)
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, 11, size=(3, 5)).astype(np.int32)
    targets = rng.integers(0, 11, size=(3, 5)).astype(np.int32)
    logits = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(inputs)), np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, targets[..., None], -1).mean()
    batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}
    got = nnx.jit(lm_loss)(model, batch)
    assert float(got) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_one_jitted_sgd_step_lowers_the_loss(name):
    model = build_model(name, "tiny", num_stages=2, rngs=nnx.Rngs(0), vocab_size=32)
    optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, 32, dtype=jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    @nnx.jit
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lm_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    before = train_step(model, optimizer, batch)
    after = nnx.jit(lm_loss)(model, batch)  # eager, it would compile op by op
    assert float(after) < float(before)
    # The tied embedding receives gradient from both of its uses and stays shared.
    if name == "gpt":
        assert model.head.module.embedding is model.embed.module.token


@pytest.mark.parametrize("name", FAMILIES)
def test_sharding_metadata(name):
    plain = build_model(name, "tiny", num_stages=2, rngs=nnx.Rngs(0))
    assert all(
        "out_sharding" not in v.get_metadata()
        for _, v in nnx.iter_graph(plain)
        if isinstance(v, nnx.Param)
    )
    model = build_model(name, "tiny", num_stages=2, rngs=nnx.Rngs(0), tensor="tensor")
    params = [v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]
    assert all(len(v.get_metadata()["out_sharding"]) == v.get_value().ndim for v in params)
    attn = model.blocks[0].module.attn
    assert attn.query.kernel.get_metadata()["out_sharding"] == (None, "tensor")
    assert attn.out.kernel.get_metadata()["out_sharding"] == ("tensor", None)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_sharded_loss_and_grads_match_unsharded(name, axis_type):
    kind = getattr(jax.sharding.AxisType, axis_type)
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(kind,) * 3)
    small = dict(n_layers=1, d_model=32, vocab_size=64, max_len=16)
    axes = dict(data="data", fsdp="fsdp", tensor="tensor")
    plain = build_model(name, "tiny", num_stages=1, rngs=nnx.Rngs(0), **small)
    model = build_model(name, "tiny", num_stages=1, rngs=nnx.Rngs(0), **small, **axes)
    graphdef, state = nnx.split(model)

    def shard(variable):
        spec = jax.sharding.PartitionSpec(*variable.get_metadata()["out_sharding"])
        value = jax.device_put(variable.get_value(), jax.sharding.NamedSharding(mesh, spec))
        return variable.replace(value)

    state = jax.tree.map(shard, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    tokens = jnp.arange(34, dtype=jnp.int32).reshape(2, 17) % 64
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    data = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    sharded_batch = jax.device_put(batch, data)

    @jax.jit
    def loss_and_grads(state, batch):
        return jax.value_and_grad(lambda s: lm_loss(nnx.merge(graphdef, s), batch))(state)

    with jax.set_mesh(mesh):
        loss, grads = loss_and_grads(state, sharded_batch)
    ref_loss, ref_grads = nnx.jit(nnx.value_and_grad(lm_loss))(plain, batch)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("config_cls", [GPTConfig, LlamaConfig])
def test_config_json_round_trip(config_cls):
    cfg = config_cls.preset("tiny", num_stages=2, dtype="bfloat16", tensor="t", scan_layers=True)
    restored = config_cls.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert restored == cfg and restored.dtype == jnp.bfloat16
    with pytest.raises(mp.MpmdError, match=r"unknown field\(s\) \['bogus'\]"):
        config_cls.from_dict({**cfg.to_dict(), "bogus": 1})


def test_registry_and_presets():
    assert set(MODELS) == {"gpt", "llama"}
    assert MODELS["gpt"] == (GPT, GPTConfig) and MODELS["llama"] == (Llama, LlamaConfig)
    for name in FAMILIES:
        for preset in preset_names(name):
            cfg = MODELS[name][1].preset(preset, num_stages=1)
            assert cfg.num_stages == 1
    assert LlamaConfig.preset("tiny").kv_heads < LlamaConfig.preset("tiny").n_heads
    assert LlamaConfig(n_heads=4, d_model=64).kv_heads == 4


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: GPTConfig.preset("huge"), mp.MpmdError, r"unknown preset 'huge' for gpt"),
        (lambda: LlamaConfig.preset("gpt2-124m"), mp.MpmdError, r"choose one of \['llama-1b'"),
        (lambda: GPTConfig.preset("tiny", n_kv_heads=2), mp.MpmdError, r"unknown field"),
        (
            lambda: GPTConfig.preset("tiny", num_stages=5),
            mp.PartitionError,
            r"num_stages=5 is more than n_layers=4",
        ),
        (
            lambda: LlamaConfig.preset("tiny", num_stages=8),
            mp.PartitionError,
            r"every stage needs at least one block",
        ),
        (
            lambda: GPTConfig(d_model=64, n_heads=5),
            mp.PartitionError,
            r"n_heads=5 does not divide d_model=64",
        ),
        (
            lambda: LlamaConfig(d_model=64, n_heads=4, n_kv_heads=3),
            mp.PartitionError,
            r"n_kv_heads=3 does not divide n_heads=4",
        ),
        (
            lambda: LlamaConfig(d_model=12, n_heads=4),
            mp.PartitionError,
            r"head_dim=3 .* is odd",
        ),
        (lambda: GPTConfig(num_stages=0), mp.MpmdError, r"num_stages=0: must be an int >= 1"),
        (lambda: GPTConfig(vocab_size=2.5), mp.MpmdError, r"vocab_size=2.5"),
        (
            lambda: GPTConfig(scan_layers="yes"),
            mp.MpmdError,
            r"scan_layers='yes': must be True or False",
        ),
        (
            lambda: build_model("bert", "tiny", num_stages=1, rngs=nnx.Rngs(0)),
            mp.MpmdError,
            r"unknown model 'bert'",
        ),
        (lambda: preset_names("bert"), mp.MpmdError, r"unknown model family 'bert'"),
    ],
)
def test_config_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize("name", FAMILIES)
def test_call_errors(name):
    model = build_model(name, "tiny", num_stages=1, rngs=nnx.Rngs(0))
    with pytest.raises(mp.MpmdError, match=r"sequence length 65 exceeds max_len=64"):
        model(jnp.zeros((1, 65), jnp.int32))
    with pytest.raises(mp.MpmdError, match=r"tokens must be int \[batch, seq\]"):
        model(jnp.zeros((8,), jnp.int32))
