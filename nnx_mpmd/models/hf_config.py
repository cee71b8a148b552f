"""Hugging Face ``config.json`` <-> zoo config (`GPTConfig`, `LlamaConfig`).

Only architectures whose forward the zoo computes exactly are accepted:
``GPT2LMHeadModel`` (tanh GELU, tied head, learned positions) and
``LlamaForCausalLM`` (SiLU gate, rotate-half RoPE without scaling, no
projection biases). Any other ``architectures`` / ``model_type``, or a setting
that changes the numbers (``rope_scaling``, ``attention_bias``, another
activation...), raises a one-line `MpmdError` naming what is supported.

Rotary embeddings: Hugging Face's Llama checkpoints store ``q_proj`` and
``k_proj`` already permuted for the "rotate half" layout (dimension ``i`` pairs
with ``i + head_dim / 2``), which is the layout of `nnx_mpmd.models.layers.apply_rope`;
so the projections are copied without any permutation (an interleaved-pair
checkpoint, as Meta's original ones, would need one and is not read here).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from nnx_mpmd.errors import MpmdError
from nnx_mpmd.models.gpt import GPTConfig
from nnx_mpmd.models.layers import ModelConfig
from nnx_mpmd.models.llama import LlamaConfig

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "hf_config_from_zoo",
    "read_hf_config",
    "zoo_config_from_hf",
]

#: Hugging Face architecture -> (zoo family, HF model_type).
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "GPT2LMHeadModel": ("gpt", "gpt2"),
    "LlamaForCausalLM": ("llama", "llama"),
}
_BY_MODEL_TYPE = {model_type: arch for arch, (_, model_type) in SUPPORTED_ARCHITECTURES.items()}
_GPT_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")


def _supported_text() -> str:
    return ", ".join(
        f"{arch} (model_type {mt!r})" for arch, (_, mt) in SUPPORTED_ARCHITECTURES.items()
    )


def read_hf_config(path: str | pathlib.Path) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face model directory, as a dict.

    Raises:
      MpmdError: the directory or its ``config.json`` is missing or not a JSON object.

    Example:
      >>> read_hf_config("no/such/dir")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      nnx_mpmd.errors.MpmdError: no/such/dir/config.json: not found; ...
    """
    file = pathlib.Path(path) / "config.json"
    if not file.is_file():
        raise MpmdError(
            f"{file}: not found; point at a Hugging Face model directory holding "
            "config.json and model.safetensors."
        )
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MpmdError(f"{file}: cannot be read as JSON ({e}); is it a config.json?") from None
    if not isinstance(data, dict):
        raise MpmdError(f"{file}: holds {type(data).__name__}, not a JSON object.")
    return data


def _architecture(hf: dict[str, Any], where: str) -> str:
    archs = hf.get("architectures") or []
    if isinstance(archs, list):
        for arch in archs:
            if arch in SUPPORTED_ARCHITECTURES:
                return arch
    if not archs and hf.get("model_type") in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[hf["model_type"]]
    named = archs or hf.get("model_type")
    raise MpmdError(
        f"{where}: architecture {named!r} is not in the model zoo; supported: {_supported_text()}."
    )


def _refuse(where: str, setting: str, value: Any, why: str) -> None:
    raise MpmdError(f"{where}: {setting}={value!r} is not supported ({why}).")


def _gpt_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    activation = hf.get("activation_function", "gelu_new")
    if activation not in _GPT_ACTIVATIONS:
        _refuse(where, "activation_function", activation, f"the zoo GPT uses {_GPT_ACTIVATIONS}")
    for flag, default in (
        ("scale_attn_by_inverse_layer_idx", False),
        ("reorder_and_upcast_attn", False),
    ):
        if bool(hf.get(flag, default)) != default:
            _refuse(where, flag, hf[flag], "the zoo GPT scales attention by 1/sqrt(head_dim)")
    if not hf.get("scale_attn_weights", True):
        _refuse(where, "scale_attn_weights", False, "the zoo GPT scales attention scores")
    if not hf.get("tie_word_embeddings", True):
        _refuse(where, "tie_word_embeddings", False, "GPT-2 ties its head to wte")
    return dict(
        vocab_size=hf["vocab_size"],
        max_len=hf.get("n_positions", 1024),
        n_layers=hf["n_layer"],
        d_model=hf["n_embd"],
        n_heads=hf["n_head"],
        d_ff=hf.get("n_inner"),
        tie_embeddings=True,
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
    )


def _rope_theta(hf: dict[str, Any], where: str) -> float:
    """The RoPE base: ``rope_parameters`` (transformers 5) or ``rope_theta`` (4.x)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        _refuse(where, "rope_parameters", params, "expected a JSON object")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        _refuse(where, "rope_type", kind, "the zoo Llama has plain RoPE, without scaling")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _llama_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(where, "hidden_act", hf["hidden_act"], "the zoo Llama uses silu")
    rope_theta = _rope_theta(hf, where)
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag, False):
            _refuse(where, flag, True, "the zoo Llama's projections have no biases")
    d_model, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * n_heads != d_model:
        _refuse(where, "head_dim", head_dim, "the zoo needs head_dim = hidden_size / heads")
    return dict(
        vocab_size=hf["vocab_size"],
        max_len=hf.get("max_position_embeddings", 2048),
        n_layers=hf["num_hidden_layers"],
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads"),
        d_ff=hf["intermediate_size"],
        rope_theta=rope_theta,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def zoo_config_from_hf(
    hf: dict[str, Any], *, num_stages: int = 1, where: str = "config.json", **overrides: Any
) -> tuple[str, ModelConfig]:
    """``(family, config)`` of a Hugging Face ``config.json``; ``overrides`` win over its values.

    Raises:
      MpmdError: an architecture or setting the zoo does not compute, or a missing field.

    Example:
      >>> family, cfg = zoo_config_from_hf({"architectures": ["GPT2LMHeadModel"],
      ...     "vocab_size": 50, "n_layer": 2, "n_embd": 32, "n_head": 4})
      >>> family, cfg.n_layers, cfg.max_len
      ('gpt', 2, 1024)
    """
    arch = _architecture(hf, where)
    family = SUPPORTED_ARCHITECTURES[arch][0]
    try:
        fields = _gpt_fields(hf, where) if family == "gpt" else _llama_fields(hf, where)
    except KeyError as e:
        raise MpmdError(f"{where}: {arch} config lacks the field {e.args[0]!r}.") from None
    config_cls = GPTConfig if family == "gpt" else LlamaConfig
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise MpmdError(
            f"{where}: unknown {config_cls.__name__} field(s) {unknown}; valid fields are "
            f"{sorted(known)}."
        )
    return family, config_cls(**{**fields, "num_stages": num_stages, **overrides})


def hf_config_from_zoo(cfg: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict of a zoo config (`zoo_config_from_hf` reads it back).

    Raises:
      MpmdError: another config class, or a GPT with an untied head.

    Example:
      >>> hf_config_from_zoo(GPTConfig.preset("tiny"))["n_embd"]
      64
    """
    if isinstance(cfg, GPTConfig):
        if not cfg.tie_embeddings:
            raise MpmdError(
                "hf_config_from_zoo: a GPT with tie_embeddings=False has no GPT-2 layout "
                "(GPT2LMHeadModel ties its head); build it with tie_embeddings=True."
            )
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": cfg.vocab_size,
            "n_positions": cfg.max_len,
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads,
            "n_inner": cfg.d_ff,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.norm_eps,
            "tie_word_embeddings": True,
            "dtype": "float32",
            "torch_dtype": "float32",
        }
    if isinstance(cfg, LlamaConfig):
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_len,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.d_ff,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.kv_heads,
            "hidden_act": "silu",
            "rms_norm_eps": cfg.norm_eps,
            "head_dim": cfg.head_dim,
            "rope_theta": cfg.rope_theta,  # transformers 4.x; 5.x reads rope_parameters
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": cfg.tie_embeddings,
            "dtype": "float32",
            "torch_dtype": "float32",
        }
    raise MpmdError(
        f"hf_config_from_zoo: {type(cfg).__name__} has no Hugging Face layout; supported: "
        f"{_supported_text()}."
    )
