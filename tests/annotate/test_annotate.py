"""Tests of stage annotation: Stage, PipelinedModel, assign_stages, auto_stage."""

import itertools
import random
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_mpmd.annotate.annotate import (
    PipelinedModel,
    Stage,
    assign_stages,
    auto_stage,
    balanced_partition,
    logical_paths,
    num_stages,
    shared_variables,
    stage_summary,
    tag_stage,
    validate_stages,
    variable_stage,
)
from nnx_mpmd.errors import PartitionError


class Block(nnx.Module):
    def __init__(self, dim, *, rngs):
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.linear = nnx.Linear(dim, dim, rngs=rngs)

    def __call__(self, x):
        return x + jax.nn.gelu(self.linear(self.norm(x)))


class TiedHead(nnx.Module):
    def __init__(self, embed, dim, *, rngs):
        self.embed = embed
        self.norm = nnx.LayerNorm(dim, rngs=rngs)

    def __call__(self, x):
        return self.embed.attend(self.norm(x))


class TinyGPT(PipelinedModel):
    """Embedding on stage 0, two blocks per stage, a tied head on the last stage."""

    def __init__(self, num_stages=3, vocab=11, dim=8, *, rngs):
        embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.embed = Stage(embed, stage=0)
        self.blocks = nnx.List(
            [Stage(Block(dim, rngs=rngs), stage=i // 2) for i in range(2 * num_stages)]
        )
        self.head = Stage(TiedHead(embed, dim, rngs=rngs), stage=num_stages - 1)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class PlainGPT(nnx.Module):
    """The same shape of model, written without any Stage."""

    def __init__(self, vocab=11, dim=8, depth=4, *, rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.blocks = nnx.List([Block(dim, rngs=rngs) for _ in range(depth)])
        self.extra = nnx.Dict(final=nnx.LayerNorm(dim, rngs=rngs))
        self.lm_head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.extra["final"](x))


TOKENS = jnp.array([[1, 2, 3, 4], [5, 6, 7, 8]])


# ---------------------------------------------------------------- Stage


def test_stage_forwards_attributes_and_methods_to_the_wrapped_module():
    embed = nnx.Embed(5, 3, rngs=nnx.Rngs(0))
    stage = Stage(embed, stage=0)
    x = jnp.ones((2, 3))
    np.testing.assert_array_equal(stage.attend(x), embed.attend(x))
    assert stage.num_embeddings == 5
    assert stage.embedding is embed.embedding
    assert stage.stage == 0 and stage.module is embed  # own attributes win


def test_stage_missing_attribute_raises_attribute_error():
    stage = Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=0)
    with pytest.raises(AttributeError, match="no_such_thing"):
        stage.no_such_thing
    assert not hasattr(stage, "__no_dunder__")


def test_stage_without_module_does_not_recurse():
    bare = object.__new__(Stage)
    with pytest.raises(AttributeError, match="'Stage' object has no attribute 'attend'"):
        bare.attend


def test_stage_survives_split_merge_and_jit():
    model = TinyGPT(rngs=nnx.Rngs(0))
    expected = model(TOKENS)
    graphdef, state = nnx.split(model)
    rebuilt = nnx.merge(graphdef, state)
    np.testing.assert_allclose(rebuilt(TOKENS), expected, rtol=1e-6)
    assert rebuilt.embed.num_embeddings == 11
    jitted = nnx.jit(lambda m, t: m(t))(model, TOKENS)
    np.testing.assert_allclose(jitted, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "0"])
def test_stage_rejects_bad_stage_numbers(bad):
    with pytest.raises(PartitionError, match=r"stage number must be an int >= 0"):
        Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=bad)


def test_tag_stage_records_owner_and_all_stages():
    layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    tag_stage(layer, 4)
    tag_stage(layer, 2)
    metadata = layer.kernel.get_metadata()
    assert metadata["mpmd_stage"] == 2 and metadata["mpmd_stages"] == (2, 4)
    assert variable_stage(layer.bias) == 2
    assert variable_stage(nnx.Param(jnp.zeros(1))) is None


# ---------------------------------------------------------------- PipelinedModel


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_num_stages_and_validate(stages):
    model = TinyGPT(num_stages=stages, rngs=nnx.Rngs(0))
    assert model.num_stages == stages == num_stages(model)
    assert model.validate() == stages == validate_stages(model)


def test_num_stages_counts_stages_without_parameters():
    model = nnx.Dict(
        a=Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=0),
        act=Stage(nnx.Dict(), stage=1),
    )
    assert num_stages(model) == 2
    assert validate_stages(model) == 2
    assert num_stages(nnx.Linear(2, 2, rngs=nnx.Rngs(0))) == 0


def test_validate_lists_every_param_without_stage():
    model = nnx.Dict(
        a=Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=0),
        b=nnx.Linear(2, 2, rngs=nnx.Rngs(1)),
        c=nnx.LayerNorm(2, rngs=nnx.Rngs(2)),
    )
    with pytest.raises(PartitionError, match=r"4 parameter\(s\) .* have no stage") as info:
        validate_stages(model)
    for path in ("b.kernel", "b.bias", "c.scale", "c.bias"):
        assert path in str(info.value)
    assert "a.module.kernel" not in str(info.value)
    assert "assign_stages" in str(info.value)


def test_validate_reports_gaps_in_stage_numbers():
    model = nnx.Dict(
        a=Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=0),
        b=Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=1),
        c=Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=3),
    )
    with pytest.raises(PartitionError, match=r"uses stages \(0, 1, 3\) but not \(2,\)"):
        validate_stages(model)


def test_validate_reports_missing_and_gaps_together():
    model = nnx.Dict(
        a=Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=2),
        b=nnx.Linear(2, 2, rngs=nnx.Rngs(1)),
    )
    with pytest.raises(PartitionError, match=r"have no stage.*but not \(0, 1\)"):
        validate_stages(model)


def test_validate_requires_some_annotation():
    with pytest.raises(PartitionError, match="has no stage annotations"):
        validate_stages(nnx.Dict())


def test_shared_variables_of_tied_embedding():
    model = TinyGPT(num_stages=3, rngs=nnx.Rngs(0))
    shared = shared_variables(model)
    assert list(shared.values()) == [(0, 2)]
    (path,) = shared
    assert path[-1] == "embedding"
    assert variable_stage(model.embed.module.embedding) == 0
    assert shared_variables(PlainGPT(rngs=nnx.Rngs(0))) == {}


def test_stage_summary_table():
    model = TinyGPT(num_stages=3, vocab=11, dim=8, rngs=nnx.Rngs(0))
    text = model.stage_summary()
    lines = text.splitlines()
    assert lines[0].split() == ["stage", "params", "bytes", "paths"]
    embed_params = 11 * 8
    block_params = 2 * 8 + 8 * 8 + 8  # layer norm + linear
    rows = {line.split()[0]: line.split(maxsplit=3) for line in lines[1:5]}
    assert rows["0"][1:3] == [
        str(embed_params + 2 * block_params),
        str(4 * (embed_params + 2 * block_params)),
    ]
    assert rows["1"][1] == str(2 * block_params)
    assert rows["2"][1] == str(2 * block_params + 16)
    assert rows["0"][3] == "blocks.0-1, embed*" and rows["2"][3] == "blocks.4-5, head"
    total = embed_params + 6 * block_params + 16
    assert rows["total"][1:3] == [str(total), str(4 * total)]
    assert "is shared by stages (0, 2); counted at stage 0" in text


def test_stage_summary_shows_unassigned_parameters():
    model = nnx.Dict(
        a=Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=0),
        b=nnx.Linear(2, 3, rngs=nnx.Rngs(1)),
    )
    rows = {line.split()[0]: line.split() for line in stage_summary(model).splitlines()}
    assert rows["none"][1:] == ["9", "36", "b"]
    assert rows["0"][1:] == ["6", "24", "a"]


# ---------------------------------------------------------------- assign_stages


def test_assign_stages_wraps_modules_in_place_and_keeps_output():
    model = PlainGPT(rngs=nnx.Rngs(0))
    expected = model(TOKENS)
    result = assign_stages(
        model,
        {"embed": 0, "blocks.0": 0, "blocks.1": 1, "blocks.[23]": 2, "extra.*": 3, "lm_head": 3},
    )
    assert result is model
    assert isinstance(model.embed, Stage) and model.embed.stage == 0
    assert [b.stage for b in model.blocks] == [0, 1, 2, 2]
    assert isinstance(model.extra["final"], Stage) and model.extra["final"].stage == 3
    assert model.lm_head.stage == 3
    assert validate_stages(model) == 4
    np.testing.assert_allclose(model(TOKENS), expected, rtol=1e-6)
    assert set(logical_paths(model).values()) == set(
        logical_paths(PlainGPT(rngs=nnx.Rngs(0))).values()
    )


def test_assign_stages_glob_and_regex_disjoint():
    model = PlainGPT(rngs=nnx.Rngs(0))
    assign_stages(model, {r"blocks\.(0|1)": 0, "blocks.[23]": 1, "embed": 0, "lm_head": 1})
    assert [b.stage for b in model.blocks] == [0, 0, 1, 1]
    assert variable_stage(model.lm_head.module.kernel) == 1


def test_assign_stages_tags_a_variable_only():
    model = PlainGPT(rngs=nnx.Rngs(0))
    assign_stages(model, {"lm_head.kernel": 2, "lm_head.bias": 1})
    assert not isinstance(model.lm_head, Stage)
    assert variable_stage(model.lm_head.kernel) == 2
    assert variable_stage(model.lm_head.bias) == 1


def test_assign_stages_nested_matches_with_the_same_stage():
    model = PlainGPT(rngs=nnx.Rngs(0))
    assign_stages(model, {"blocks.0": 1, "blocks.0.linear": 1, "blocks.0.linear.kernel": 1})
    assert model.blocks[0].stage == 1
    assert isinstance(model.blocks[0].module.linear, nnx.Linear)


def test_assign_stages_on_existing_stage_with_same_number_is_a_no_op():
    model = TinyGPT(num_stages=2, rngs=nnx.Rngs(0))
    before = model.blocks[0]
    assign_stages(model, {"blocks.0": 0})
    assert model.blocks[0] is before


def test_assign_stages_in_plain_list_and_dict_attributes():
    class Holder(nnx.Module):
        def __init__(self):
            self.layers = nnx.data([nnx.Linear(2, 2, rngs=nnx.Rngs(0))])
            self.named = nnx.data({"x": nnx.Linear(2, 2, rngs=nnx.Rngs(1))})

    model = Holder()
    assign_stages(model, {"layers.0": 0, "named.x": 1})
    assert model.layers[0].stage == 0 and model.named["x"].stage == 1


def test_assign_stages_pattern_matching_nothing_shows_paths():
    model = PlainGPT(rngs=nnx.Rngs(0))
    with pytest.raises(PartitionError, match=r"'decoder\.\*' matches no path .*embed.*blocks\.0"):
        assign_stages(model, {"decoder.*": 0})


def test_assign_stages_invalid_regex_matches_nothing():
    with pytest.raises(PartitionError, match="matches no path"):
        assign_stages(PlainGPT(rngs=nnx.Rngs(0)), {"blocks.[": 0})


def test_assign_stages_conflicting_patterns():
    model = PlainGPT(rngs=nnx.Rngs(0))
    with pytest.raises(
        PartitionError, match=r"'blocks\.1' is matched by .*\(stage 0\).*\(stage 1\)"
    ):
        assign_stages(model, {"blocks.[01]": 0, "blocks.1": 1})
    assert not isinstance(model.blocks[0], Stage)  # nothing changed


def test_assign_stages_conflicting_nested_matches():
    model = PlainGPT(rngs=nnx.Rngs(0))
    with pytest.raises(PartitionError, match=r"inside 'blocks\.0'.*nested matches must agree"):
        assign_stages(model, {"blocks.0": 0, "blocks.0.linear": 1})


def test_assign_stages_conflicts_with_an_existing_stage():
    model = TinyGPT(num_stages=2, rngs=nnx.Rngs(0))
    with pytest.raises(PartitionError, match=r"already Stage\(stage=0\)"):
        assign_stages(model, {"blocks.0": 1})


@pytest.mark.parametrize("bad", [-1, 1.0, None, False])
def test_assign_stages_rejects_bad_stages(bad):
    with pytest.raises(PartitionError, match="stages must be ints >= 0"):
        assign_stages(PlainGPT(rngs=nnx.Rngs(0)), {"embed": bad})


def test_assign_stages_replaces_inside_a_tuple_by_rebuilding_it():
    class Holder(nnx.Module):
        def __init__(self):
            self.pair = nnx.data(
                (nnx.Linear(2, 2, rngs=nnx.Rngs(0)), nnx.Linear(2, 2, rngs=nnx.Rngs(1)))
            )

    model = Holder()
    second = model.pair[1]
    assign_stages(model, {"pair.0": 0})
    assert isinstance(model.pair, tuple) and len(model.pair) == 2
    assert model.pair[0].stage == 0 and model.pair[1] is second


def test_assign_stages_container_path_wraps_each_element():
    model = PlainGPT(rngs=nnx.Rngs(0))
    expected = model(TOKENS)
    assign_stages(model, {"embed": 0, "blocks": 0, "extra": 1, "lm_head": 1})
    assert isinstance(model.blocks, nnx.List) and len(model.blocks) == 4
    assert [b.stage for b in model.blocks] == [0, 0, 0, 0]
    assert isinstance(model.extra, nnx.Dict) and model.extra["final"].stage == 1
    np.testing.assert_allclose(model(TOKENS), expected, rtol=1e-6)


def test_assign_stages_container_and_element_must_agree():
    model = PlainGPT(rngs=nnx.Rngs(0))
    with pytest.raises(PartitionError, match=r"'blocks\.2' gets stage 1 .*inside 'blocks'"):
        assign_stages(model, {"blocks": 0, "blocks.2": 1})
    assert not isinstance(model.blocks[0], Stage)  # nothing changed


def test_assign_stages_container_element_already_staged_differently():
    model = TinyGPT(num_stages=2, rngs=nnx.Rngs(0))
    with pytest.raises(PartitionError, match=r"'blocks\.2' is already Stage\(stage=1\)"):
        assign_stages(model, {"blocks": 0})


def test_assign_stages_missing_index_lists_the_container_elements():
    model = PlainGPT(rngs=nnx.Rngs(0))
    with pytest.raises(
        PartitionError,
        match=r"'blocks\.7' matches no path .*Paths under 'blocks': blocks\.0, blocks\.1, "
        r"blocks\.2, blocks\.3\.",
    ):
        assign_stages(model, {"blocks.7": 0})


def test_assign_stages_misspelled_path_suggests_similar_paths():
    model = PlainGPT(rngs=nnx.Rngs(0))
    with pytest.raises(PartitionError, match=r"'lm_haed' matches no path .*similar paths: lm_head"):
        assign_stages(model, {"lm_haed": 0})


# ---------------------------------------------------------------- auto_stage


def brute_force_best(weights, stages):
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(weights)), stages - 1):
        bounds = [0, *cuts, len(weights)]
        heaviest = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
        best = min(best, heaviest)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_balanced_partition_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    stages = rng.randint(1, n)
    weights = [rng.randint(1, 20) for _ in range(n)]
    result = balanced_partition(weights, stages)
    assert len(result) == n and result[0] == 0 and result[-1] == stages - 1
    assert all(b - a in (0, 1) for a, b in itertools.pairwise(result))
    heaviest = max(sum(w for w, s in zip(weights, result) if s == k) for k in range(stages))
    assert heaviest == brute_force_best(weights, stages)


def quadratic_partition(weights, stages):
    """The O(stages * layers^2) programme balanced_partition replaced: the reference."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    best = [[float("inf")] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    result, i = [0] * n, n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        result[j:i] = [k - 1] * (i - j)
        i = j
    return result


def test_balanced_partition_equals_the_quadratic_programme():
    # Same split, ties included (zero weights, equal weights, rounding-prone magnitudes).
    rng = random.Random(47)
    choices = ([0, 1, 2], [1.0], [0.0, 0.1, 0.2, 0.3, 1e-17, 1e17])
    for _ in range(3000):
        n = rng.randint(1, 13)
        stages = rng.randint(1, n)
        pick = rng.randrange(4)
        if pick < 3:
            weights = [rng.choice(choices[pick]) for _ in range(n)]
        else:
            weights = [rng.random() for _ in range(n)]
        assert balanced_partition(weights, stages) == quadratic_partition(weights, stages), (
            weights,
            stages,
        )


def test_block_stages_of_100000_layers_finish():
    # The quadratic programme took over 20 minutes here; the bound only keeps CI from hanging.
    code = (
        "from nnx_mpmd.models.blocks import assign_block_stages\n"
        "s = assign_block_stages(100_000, 4, block_cost=1.0, embed_cost=3.0, head_cost=5.0)\n"
        "print(len(s), s[0], s[-1], s.count(0), s.count(3))"
    )
    done = subprocess.run(
        ["timeout", "-k", "5", "120", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["100000", "0", "3", "24999", "24997"]


def test_balanced_partition_refuses_negative_weights():
    with pytest.raises(PartitionError, match=r"layer 1 has weight -2.*>= 0"):
        balanced_partition([1, -2, 3], 2)


def test_auto_stage_balances_parameter_bytes():
    layers = [nnx.Linear(d, d, rngs=nnx.Rngs(0)) for d in (2, 2, 2, 8)]
    assert auto_stage(layers, 2) == [0, 0, 0, 1]
    assert auto_stage(layers, 2, weights=[5, 1, 1, 1]) == [0, 1, 1, 1]


def test_auto_stage_weight_count_mismatch():
    with pytest.raises(PartitionError, match="got 2 layers but 3 weights"):
        auto_stage([1, 2], 2, weights=[1, 1, 1])


@pytest.mark.parametrize(("n", "stages"), [(2, 3), (3, 0)])
def test_balanced_partition_needs_enough_layers(n, stages):
    with pytest.raises(PartitionError, match=f"cannot split {n} layers into {stages}"):
        balanced_partition([1.0] * n, stages)


def test_logical_paths_drop_stage_module_key():
    model = TinyGPT(num_stages=2, rngs=nnx.Rngs(0))
    logical = logical_paths(model)
    assert logical[("blocks", 0, "module", "linear", "kernel")] == ("blocks", 0, "linear", "kernel")
