"""Named model sizes for `GPTConfig.preset` and `LlamaConfig.preset`.

``tiny`` trains in seconds on a CPU, ``small`` has a few million parameters and
still runs on a CPU, and the real sizes reproduce published parameter counts:
``gpt2-124m`` (124,439,808 parameters, tied embeddings) and ``llama-1b``
(TinyLlama-1.1B shapes, 1,100,048,384 parameters, untied head).

Example:
    >>> from nnx_mpmd.models.presets import preset_names
    >>> preset_names("gpt")
    ['gpt2-124m', 'small', 'tiny']
"""

from __future__ import annotations

from typing import Any

from nnx_mpmd.errors import MpmdError

__all__ = ["GPT_PRESETS", "LLAMA_PRESETS", "preset_fields", "preset_names"]

GPT_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=256, max_len=64, n_layers=4, d_model=64, n_heads=4),
    "small": dict(vocab_size=256, max_len=256, n_layers=6, d_model=256, n_heads=8),
    "gpt2-124m": dict(
        vocab_size=50257, max_len=1024, n_layers=12, d_model=768, n_heads=12, tie_embeddings=True
    ),
}

LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=256, max_len=64, n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=192
    ),
    "small": dict(
        vocab_size=256, max_len=256, n_layers=6, d_model=256, n_heads=8, n_kv_heads=4, d_ff=704
    ),
    "llama-1b": dict(
        vocab_size=32000,
        max_len=2048,
        n_layers=22,
        d_model=2048,
        n_heads=32,
        n_kv_heads=4,
        d_ff=5632,
    ),
}

_BY_MODEL = {"gpt": GPT_PRESETS, "llama": LLAMA_PRESETS}


def preset_names(model: str) -> list[str]:
    """The preset names of one model family, sorted.

    Args:
      model: ``"gpt"`` or ``"llama"``.

    Returns:
      The names accepted by that family's ``Config.preset``.

    Example:
      >>> preset_names("llama")
      ['llama-1b', 'small', 'tiny']
    """
    if model not in _BY_MODEL:
        raise MpmdError(f"unknown model family {model!r}; choose one of {sorted(_BY_MODEL)}.")
    return sorted(_BY_MODEL[model])


def preset_fields(model: str, preset: str) -> dict[str, Any]:
    """The config fields of one preset (a copy); raises `MpmdError` for an unknown one.

    Example:
      >>> preset_fields("gpt", "tiny")["n_layers"]
      4
    """
    names = preset_names(model)
    if preset not in names:
        raise MpmdError(f"unknown preset {preset!r} for model {model!r}; choose one of {names}.")
    return dict(_BY_MODEL[model][preset])
