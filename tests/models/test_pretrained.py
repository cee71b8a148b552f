"""Hugging Face checkpoints in the zoo: `load_pretrained` / `save_pretrained`.

The fixtures in tests/fixtures/hf_*_tiny were written by the Hugging Face
``transformers`` library (tests/fixtures/make_hf_fixtures.py, run in its own
environment): randomly initialised GPT-2 and Llama checkpoints and their
logits on a fixed batch. The zoo model loaded from each must give the same
logits, unrolled or scanned, under ``nnx.jit`` and pipelined with ``mp.jit``,
and `save_pretrained` must write the same tensors back.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from pipeline_models import make_mesh

import nnx_mpmd as mp
from nnx_mpmd.errors import MpmdError
from nnx_mpmd.models import build_model, load_pretrained, save_pretrained
from nnx_mpmd.models.hf_config import read_hf_config, zoo_config_from_hf

safetensors_numpy = pytest.importorskip("safetensors.numpy")

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures"
NAMES = ["hf_gpt2_tiny", "hf_llama_tiny", "hf_llama_tied_tiny"]
#: Absolute tolerance against the Hugging Face logits (float32; magnitudes ~1).
ATOL = 1e-4


def _fixture(name):
    path = FIXTURES / name
    return path, np.load(path / "tokens.npy"), np.load(path / "logits.npy")


def _copy(name, tmp_path):
    """A writable copy of a fixture directory (checkpoint files only)."""
    out = tmp_path / name
    out.mkdir(parents=True)
    for file in ("config.json", "model.safetensors"):
        shutil.copy(FIXTURES / name / file, out / file)
    return out


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("name", NAMES)
def test_loaded_model_logits_equal_hugging_face(name, scan_layers):
    path, tokens, expected = _fixture(name)
    model = load_pretrained(path, num_stages=3, scan_layers=scan_layers)
    got = nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(got), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "name,stages,overrides",
    [
        ("hf_gpt2_tiny", 2, {}),
        ("hf_llama_tiny", 3, {"scan_layers": True}),
        ("hf_llama_tied_tiny", 2, {}),
    ],
)
def test_pipelined_loaded_model_equals_hugging_face_and_nnx_jit(name, stages, overrides):
    path, tokens, expected = _fixture(name)
    model = load_pretrained(path, num_stages=stages, **overrides)
    reference = nnx.jit(lambda m, t: m(t))(load_pretrained(path, num_stages=stages), tokens)
    forward = mp.jit(
        lambda m, t: m(t), mesh=make_mesh(stages, 1), schedule=mp.GPipe(), num_microbatches=2
    )
    got = np.asarray(forward(model, tokens))
    np.testing.assert_allclose(got, np.asarray(reference), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "name,stages,overrides",
    [
        ("hf_gpt2_tiny", 3, {"scan_layers": True}),
        ("hf_llama_tiny", 2, {}),
        ("hf_llama_tied_tiny", 3, {"scan_layers": True}),
    ],
)
def test_save_pretrained_round_trips_tensors_and_config(name, stages, overrides, tmp_path):
    path, _, _ = _fixture(name)
    model = load_pretrained(path, num_stages=stages, **overrides)
    out = save_pretrained(model, tmp_path / "out")
    original = safetensors_numpy.load_file(str(path / "model.safetensors"))
    written = safetensors_numpy.load_file(str(out / "model.safetensors"))
    assert sorted(written) == sorted(original)
    for key, tensor in original.items():
        assert written[key].dtype == tensor.dtype and written[key].shape == tensor.shape, key
        assert written[key].tobytes() == tensor.tobytes(), key
    hf_in, hf_out = read_hf_config(path), read_hf_config(out)
    assert zoo_config_from_hf(hf_out) == zoo_config_from_hf(hf_in)
    for key in set(hf_out) & set(hf_in) - {"rope_theta"}:
        assert hf_out[key] == hf_in[key], key


def test_save_pretrained_of_pipelined_model_after_a_step(tmp_path):
    """Out of a placed stage layout: the parameters live on two submeshes."""
    path, tokens, expected = _fixture("hf_llama_tiny")
    model = load_pretrained(path, num_stages=2)
    forward = mp.jit(
        lambda m, t: m(t), mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2
    )
    np.testing.assert_allclose(np.asarray(forward(model, tokens)), expected, atol=ATOL, rtol=0)
    out = save_pretrained(model, tmp_path / "out")
    again = load_pretrained(out, num_stages=1)
    np.testing.assert_allclose(np.asarray(again(jnp.asarray(tokens))), expected, atol=ATOL)


def test_zoo_model_round_trips_through_hugging_face_layout(tmp_path):
    model = build_model("gpt", "tiny", num_stages=2, rngs=nnx.Rngs(3), vocab_size=50)
    again = load_pretrained(save_pretrained(model, tmp_path), num_stages=4)
    assert again.config == model.config.__class__(**{**model.config.__dict__, "num_stages": 4})
    tokens = jnp.arange(20).reshape(2, 10) % 50
    np.testing.assert_allclose(np.asarray(again(tokens)), np.asarray(model(tokens)), atol=1e-5)


# -- error paths --------------------------------------------------------------------------


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    path = _copy("hf_gpt2_tiny", tmp_path)
    _edit_config(path, architectures=["BertForMaskedLM"], model_type="bert")
    with pytest.raises(MpmdError, match=r"'BertForMaskedLM'\].*supported: GPT2LMHeadModel"):
        load_pretrained(path)


@pytest.mark.parametrize(
    "name,changes,match",
    [
        ("hf_llama_tiny", {"rope_parameters": {"rope_type": "llama3"}}, "rope_type='llama3'"),
        ("hf_llama_tiny", {"attention_bias": True}, "attention_bias=True is not supported"),
        ("hf_llama_tiny", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("hf_gpt2_tiny", {"activation_function": "relu"}, "activation_function='relu'"),
        ("hf_gpt2_tiny", {"scale_attn_by_inverse_layer_idx": True}, "inverse_layer_idx"),
    ],
)
def test_settings_the_zoo_does_not_compute_are_refused(name, changes, match, tmp_path):
    path = _copy(name, tmp_path)
    _edit_config(path, **changes)
    with pytest.raises(MpmdError, match=match):
        load_pretrained(path)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(MpmdError, match=r"config.json: not found; point at a Hugging Face"):
        load_pretrained(tmp_path)
    path = _copy("hf_gpt2_tiny", tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(MpmdError, match=r"holds no model.safetensors"):
        load_pretrained(path)


def test_tensors_that_do_not_fit_the_config_are_named(tmp_path):
    path = _copy("hf_llama_tiny", tmp_path)
    _edit_config(path, vocab_size=97)
    with pytest.raises(MpmdError, match=r"embed.*has shape \(96, 32\).*expects \(97, 32\)"):
        load_pretrained(path)
    path = _copy("hf_gpt2_tiny", tmp_path / "b")
    tensors = safetensors_numpy.load_file(str(path / "model.safetensors"))
    del tensors["transformer.h.1.ln_2.bias"]
    tensors["transformer.h.0.adapter.weight"] = np.zeros(3, np.float32)
    safetensors_numpy.save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(MpmdError, match=r"'transformer.h.1.ln_2.bias'.*is missing"):
        load_pretrained(path)
    _edit_config(path, n_layer=1)
    with pytest.raises(MpmdError, match=r"tensor\(s\) have no place.*h.0.adapter.weight"):
        load_pretrained(path)


def test_without_safetensors_the_hint_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    with pytest.raises(MpmdError, match=r"pip install 'nnx-mpmd\[hf\]'"):
        load_pretrained(FIXTURES / "hf_gpt2_tiny")


def test_models_without_a_hugging_face_layout_are_refused(tmp_path):
    untied = build_model("gpt", "tiny", num_stages=1, rngs=nnx.Rngs(0), tie_embeddings=False)
    with pytest.raises(MpmdError, match=r"tie_embeddings=False has no GPT-2 layout"):
        save_pretrained(untied, tmp_path)
    with pytest.raises(MpmdError, match=r"Linear has no Hugging Face layout"):
        save_pretrained(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), tmp_path)


def test_unknown_override_is_named_and_known_ones_win():
    with pytest.raises(MpmdError, match=r"unknown LlamaConfig field\(s\) \['n_expert'\]"):
        load_pretrained(FIXTURES / "hf_llama_tiny", n_expert=4)
    hf = read_hf_config(FIXTURES / "hf_llama_tiny")
    assert zoo_config_from_hf(hf, norm_eps=1e-6)[1].norm_eps == 1e-6


def _write_safetensors_bf16(tensors, file):
    """A safetensors file of bfloat16 tensors, written by hand (numpy has no bfloat16)."""
    header, offset, chunks = {}, 0, []
    for name, value in tensors.items():
        data = np.asarray(value, jnp.bfloat16).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(value.shape)}
        header[name]["data_offsets"] = [offset, offset + len(data)]
        offset += len(data)
        chunks.append(data)
    text = json.dumps(header).encode()
    file.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(chunks))


def test_bfloat16_checkpoints_load_as_their_float32_values(tmp_path):
    tensors = safetensors_numpy.load_file(str(FIXTURES / "hf_llama_tiny" / "model.safetensors"))
    bf16_dir, rounded_dir = (
        _copy("hf_llama_tiny", tmp_path / "a"),
        _copy("hf_llama_tiny", tmp_path / "b"),
    )
    _write_safetensors_bf16(tensors, bf16_dir / "model.safetensors")
    rounded = {k: np.asarray(np.asarray(v, jnp.bfloat16), np.float32) for k, v in tensors.items()}
    safetensors_numpy.save_file(rounded, str(rounded_dir / "model.safetensors"))
    got = nnx.state(load_pretrained(bf16_dir), nnx.Param)
    want = nnx.state(load_pretrained(rounded_dir), nnx.Param)
    for (path, a), (_, b) in zip(nnx.to_flat_state(got), nnx.to_flat_state(want), strict=True):
        assert a.get_value().dtype == np.float32
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), path)
