"""Pipelined generation: sequences in flight through the stages, equal to unpipelined decoding."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from pipeline_models import make_mesh

import nnx_mpmd as mp
from nnx_mpmd.compiler.stats import count_compilations
from nnx_mpmd.models import build_model

VOCAB = 64


def _model(stages):
    return build_model("gpt", "tiny", num_stages=stages, rngs=nnx.Rngs(0), vocab_size=VOCAB)


def _prompts(rows, length=6, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, size=(rows, length)).astype(np.int32)


# (schedule, stages, meshes, microbatches, temperature, top_k)
CASES = [
    (mp.OneFOneB, 2, 2, 2, 0.0, None),
    (mp.GPipe, 4, 4, 4, 0.0, None),
    (mp.OneFOneB, 4, 4, 4, 0.8, 5),
    (mp.Interleaved1F1B, 4, 2, 2, 1.0, None),
    (mp.ZeroBubbleH1, 2, 2, 4, 0.7, 3),
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c[0].__name__}-S{c[1]}-M{c[2]}-m{c[3]}-T{c[4]}-k{c[5]}"
)
def test_pipelined_tokens_equal_unpipelined_tokens(case):
    schedule, stages, meshes, m, temperature, top_k = case
    generator = mp.Generator(
        mesh=make_mesh(meshes, 2 if meshes == 2 else 1),
        schedule=schedule(),
        num_microbatches=m,
        window=64,
        temperature=temperature,
        top_k=top_k,
    )
    prompts = _prompts(8)
    got = generator(_model(stages), prompts, 10, seed=7)
    want = generator.reference(_model(stages), prompts, 10, seed=7)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[:, :6], prompts)
    if temperature:  # sampling draws different tokens for different seeds
        other = generator.reference(_model(stages), prompts, 10, seed=8)
        assert (other != want).any()


def test_one_compilation_for_every_token_and_call():
    generator = mp.Generator(
        mesh=make_mesh(2, 1), schedule=mp.OneFOneB(), num_microbatches=2, window=64
    )
    model = _model(2)
    generator(model, _prompts(4), 3)
    with count_compilations() as counter:
        generator(model, _prompts(4, seed=1), 8)
    assert counter.count == 0 and generator.num_compiled_steps == 1


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


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": -1.0}, r"temperature=-1.0\): use 0 \(greedy\) or more"),
        ({"top_k": 0}, r"top_k=0\): use an int >= 1"),
        ({"window": 0}, r"window=0\): use the model's context length"),
    ],
)
def test_bad_settings_are_errors(kwargs, match):
    settings = {"window": 64, **kwargs}
    with pytest.raises(mp.CompileError, match=match):
        mp.Generator(mesh=make_mesh(2, 1), schedule=mp.OneFOneB(), num_microbatches=2, **settings)
