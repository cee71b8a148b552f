"""The model zoo: GPT-2 style and Llama style language models as `PipelinedModel`s.

Example:
    >>> from flax import nnx
    >>> from nnx_mpmd.models import build_model
    >>> model = build_model("llama", "tiny", num_stages=2, rngs=nnx.Rngs(0))
    >>> type(model).__name__, model.num_stages
    ('Llama', 2)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax
from flax import nnx

from nnx_mpmd.errors import MpmdError
from nnx_mpmd.models.blocks import assign_block_stages, count_params
from nnx_mpmd.models.gpt import GPT, GPTConfig
from nnx_mpmd.models.hf_convert import load_pretrained, save_pretrained
from nnx_mpmd.models.layers import ModelConfig
from nnx_mpmd.models.llama import Llama, LlamaConfig
from nnx_mpmd.models.presets import preset_names

__all__ = [
    "GPT",
    "MODELS",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "ModelConfig",
    "assign_block_stages",
    "build_model",
    "count_params",
    "lm_loss",
    "load_pretrained",
    "preset_names",
    "save_pretrained",
]

#: model family name -> (model class, config class), as used by the CLI.
MODELS: dict[str, tuple[Callable[..., GPT | Llama], type[ModelConfig]]] = {
    "gpt": (GPT, GPTConfig),
    "llama": (Llama, LlamaConfig),
}


def lm_loss(model: Any, batch: Mapping[str, jax.typing.ArrayLike]) -> jax.Array:
    """Mean next-token cross-entropy of a language model on one batch.

    Args:
      model: a callable ``tokens [B, T] -> logits [B, T, V]`` (any zoo model).
      batch: ``{"inputs": int32[B, T], "targets": int32[B, T]}``.

    Returns:
      The scalar mean cross-entropy over all ``B * T`` tokens (float32).

    Example:
      >>> import jax.numpy as jnp
      >>> model = build_model("gpt", "tiny", num_stages=1, rngs=nnx.Rngs(0))
      >>> tokens = jnp.zeros((2, 8), jnp.int32)
      >>> float(lm_loss(model, {"inputs": tokens, "targets": tokens})) > 0
      True
    """
    logits = model(batch["inputs"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return losses.mean()


def build_model(
    name: str, preset: str, *, num_stages: int, rngs: nnx.Rngs, **overrides: Any
) -> GPT | Llama:
    """Builds a zoo model from a family name and a preset.

    Args:
      name: a key of `MODELS` (``"gpt"`` or ``"llama"``).
      preset: a preset of that family (see `preset_names`).
      num_stages: number of pipeline stages.
      rngs: random streams for the parameters.
      **overrides: config fields to change (e.g. ``vocab_size=97``).

    Returns:
      The model (a `PipelinedModel`); its config is ``model.config``.

    Example:
      >>> model = build_model("gpt", "tiny", num_stages=4, rngs=nnx.Rngs(0), vocab_size=97)
      >>> model.config.vocab_size, model.num_stages
      (97, 4)
    """
    if name not in MODELS:
        raise MpmdError(f"build_model: unknown model {name!r}; choose one of {sorted(MODELS)}.")
    model_cls, config_cls = MODELS[name]
    cfg = config_cls.preset(preset, num_stages=num_stages, **overrides)
    return model_cls(cfg, rngs=rngs)
