"""Hugging Face checkpoints <-> zoo models: `load_pretrained` and `save_pretrained`.

A Hugging Face model directory holds ``config.json`` and ``model.safetensors``
(or shards listed in ``model.safetensors.index.json``). `load_pretrained` builds
the zoo model the config describes, in any stage layout (``num_stages``,
unrolled or ``scan_layers``), and assigns every parameter from the tensor of the
same role; `save_pretrained` writes the reverse. The tensors are read and
written with safetensors' numpy API (``pip install 'nnx-mpmd[hf]'``).

Name mapping (``L`` is a block index; GPT-2 tensors live under ``transformer.``,
Llama tensors under ``model.``):

=================================  ===============================================
zoo parameter (per block)          GPT-2 tensor / Llama tensor
=================================  ===============================================
``attn_norm.scale`` / ``.bias``    ``h.L.ln_1.weight`` / ``.bias``; ``layers.L.input_layernorm.weight``
``attn.query|key|value.kernel``    thirds of ``h.L.attn.c_attn.weight`` (Conv1D, ``[in, out]``);
                                   ``layers.L.self_attn.q_proj|k_proj|v_proj.weight``, transposed
``attn.out.kernel``                ``h.L.attn.c_proj.weight``; ``layers.L.self_attn.o_proj.weight``.T
``mlp_norm.*``                     ``h.L.ln_2.*``; ``layers.L.post_attention_layernorm.weight``
``mlp.up|down.kernel`` (+ bias)    ``h.L.mlp.c_fc|c_proj.weight`` (+ ``.bias``)
``mlp.gate|up|down.kernel``        ``layers.L.mlp.gate_proj|up_proj|down_proj.weight``.T
=================================  ===============================================

plus the embeddings (``wte``, ``wpe``; ``embed_tokens``), the final norm
(``ln_f``; ``norm``) and, for an untied Llama, ``lm_head.weight`` (transposed).
A tied head has no tensor of its own: the zoo head reuses the embedding table.

Example:
    >>> import tempfile
    >>> from flax import nnx
    >>> from nnx_mpmd.models import build_model
    >>> model = build_model("llama", "tiny", num_stages=2, rngs=nnx.Rngs(0))
    >>> out = save_pretrained(model, tempfile.mkdtemp())
    >>> again = load_pretrained(out, num_stages=4)
    >>> again.num_stages, again.config.d_model
    (4, 64)
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_mpmd.errors import MpmdError
from nnx_mpmd.models.gpt import GPT, GPTConfig
from nnx_mpmd.models.hf_config import hf_config_from_zoo, read_hf_config, zoo_config_from_hf
from nnx_mpmd.models.llama import Llama

__all__ = ["hf_tensors_from_model", "load_pretrained", "save_pretrained"]

HF_INSTALL = "pip install 'nnx-mpmd[hf]'"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"

Path = tuple[Any, ...]
# A rule: zoo suffix -> (HF tensor name, with {L} for the block index; HF tensor -> zoo
# value; zoo value -> HF tensor, or None for a slice of a concatenated tensor).


def _safetensors_numpy() -> Any:
    try:
        import safetensors.numpy as st_numpy
    except ImportError:
        raise MpmdError(
            f"reading and writing Hugging Face checkpoints needs safetensors; {HF_INSTALL}"
        ) from None
    return st_numpy


def _gpt_rules(cfg: GPTConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global rules, per-block rules) of GPT-2: zoo suffix -> (HF name, to_zoo, from_zoo)."""
    d = cfg.d_model
    same = (lambda t: t, lambda v: v)

    def third(i: int) -> tuple[Callable, Callable | None]:
        return (lambda t: t[..., i * d : (i + 1) * d], None)

    per_block: dict[str, Any] = {
        "attn_norm.scale": ("h.{L}.ln_1.weight", *same),
        "attn_norm.bias": ("h.{L}.ln_1.bias", *same),
        "mlp_norm.scale": ("h.{L}.ln_2.weight", *same),
        "mlp_norm.bias": ("h.{L}.ln_2.bias", *same),
        "attn.out.kernel": ("h.{L}.attn.c_proj.weight", *same),
        "attn.out.bias": ("h.{L}.attn.c_proj.bias", *same),
        "mlp.up.kernel": ("h.{L}.mlp.c_fc.weight", *same),
        "mlp.up.bias": ("h.{L}.mlp.c_fc.bias", *same),
        "mlp.down.kernel": ("h.{L}.mlp.c_proj.weight", *same),
        "mlp.down.bias": ("h.{L}.mlp.c_proj.bias", *same),
    }
    for i, name in enumerate(("query", "key", "value")):
        per_block[f"attn.{name}.kernel"] = ("h.{L}.attn.c_attn.weight", *third(i))
        per_block[f"attn.{name}.bias"] = ("h.{L}.attn.c_attn.bias", *third(i))
    global_rules = {
        "embed.token.table": ("wte.weight", *same),
        "embed.position.table": ("wpe.weight", *same),
        "head.norm.scale": ("ln_f.weight", *same),
        "head.norm.bias": ("ln_f.bias", *same),
    }
    return global_rules, per_block


def _llama_rules(cfg: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    same = (lambda t: t, lambda v: v)
    transposed = (lambda t: t.T, lambda v: v.T)
    per_block = {
        "attn_norm.scale": ("layers.{L}.input_layernorm.weight", *same),
        "mlp_norm.scale": ("layers.{L}.post_attention_layernorm.weight", *same),
        "attn.query.kernel": ("layers.{L}.self_attn.q_proj.weight", *transposed),
        "attn.key.kernel": ("layers.{L}.self_attn.k_proj.weight", *transposed),
        "attn.value.kernel": ("layers.{L}.self_attn.v_proj.weight", *transposed),
        "attn.out.kernel": ("layers.{L}.self_attn.o_proj.weight", *transposed),
        "mlp.gate.kernel": ("layers.{L}.mlp.gate_proj.weight", *transposed),
        "mlp.up.kernel": ("layers.{L}.mlp.up_proj.weight", *transposed),
        "mlp.down.kernel": ("layers.{L}.mlp.down_proj.weight", *transposed),
    }
    global_rules = {
        "embed.table": ("embed_tokens.weight", *same),
        "head.norm.scale": ("norm.weight", *same),
        "head.proj.kernel": ("^lm_head.weight", *transposed),  # ^: outside the prefix
    }
    return global_rules, per_block


def _rules(model: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The HF name prefix, global rules and per-block rules of a zoo model."""
    if isinstance(model, GPT):
        return ("transformer.", *_gpt_rules(model.config))
    if isinstance(model, Llama):
        return ("model.", *_llama_rules(model.config))
    raise MpmdError(
        f"{type(model).__name__} has no Hugging Face layout; load_pretrained and "
        "save_pretrained handle the zoo's GPT and Llama (nnx_mpmd.models.build_model)."
    )


def _hf_name(prefix: str, template: str, layer: int | None = None) -> str:
    name = template.format(L=layer)
    return name[1:] if name.startswith("^") else prefix + name


def _param_slots(model: Any) -> list[tuple[Path, str, list[int] | None]]:
    """Each parameter of ``model``: (flat state path, zoo suffix, block indices or None).

    Unrolled blocks (``blocks.L.attn...``) give one index; a scanned chunk
    (``blocks.chunks.C.layers.attn...``) gives the indices stacked on its axis 0.
    """
    ranges = model.blocks.chunk_ranges() if model.config.scan_layers else None
    slots = []
    for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        keys = [str(k) for k in path if k != "module"]  # the `Stage` wrappers' attribute
        if keys[0] != "blocks":
            slots.append((path, ".".join(keys), None))
        elif ranges is None:
            slots.append((path, ".".join(keys[2:]), [int(keys[1])]))
        else:  # blocks.chunks.C.layers.<suffix>
            start, stop = ranges[int(keys[2])]
            slots.append((path, ".".join(keys[4:]), list(range(start, stop))))
    return slots


def _rule_for(suffix: str, layers: list[int] | None, rules: tuple) -> tuple:
    global_rules, per_block = rules
    table = global_rules if layers is None else per_block
    if suffix not in table:
        raise MpmdError(f"no Hugging Face tensor maps to the zoo parameter {suffix!r}.")
    return table[suffix]


def _read_tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    """All tensors of a model directory (one ``model.safetensors`` or indexed shards)."""
    st_numpy = _safetensors_numpy()
    if (path / WEIGHTS).is_file():
        files = [path / WEIGHTS]
    elif (path / WEIGHTS_INDEX).is_file():
        index = json.loads((path / WEIGHTS_INDEX).read_text())
        files = [path / f for f in sorted(set(index.get("weight_map", {}).values()))]
    else:
        raise MpmdError(
            f"{path}: holds no {WEIGHTS} (nor {WEIGHTS_INDEX}); save the Hugging Face model "
            "with safe_serialization=True (the default), or pass its directory."
        )
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        try:  # bfloat16 tensors come as ml_dtypes' bfloat16 (registered by JAX)
            tensors.update(st_numpy.load_file(str(file)))
        except Exception as e:  # safetensors raises its own error types
            raise MpmdError(f"{file}: cannot be read as safetensors ({e}).") from None
    return tensors


def _is_ignored(name: str) -> bool:
    """Buffers some GPT-2 checkpoints carry (causal masks, rotary caches), and tied heads."""
    return name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq"))


def assign_hf_tensors(model: Any, tensors: dict[str, np.ndarray], where: str = "") -> None:
    """Sets every parameter of a zoo model of the checkpoint's shapes from Hugging Face tensors.

    Raises:
      MpmdError: a tensor is missing, has another shape, or is left over.
    """
    prefix, *rules = _rules(model)
    tied = model.config.tie_embeddings
    state = nnx.state(model, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    used: set[str] = set()
    new_values = []
    for path, suffix, layers in _param_slots(model):
        template, to_zoo, _ = _rule_for(suffix, layers, tuple(rules))
        parts = []
        for layer in layers or [None]:
            name = _hf_name(prefix, template, layer)
            if name not in tensors:
                raise MpmdError(
                    f"{where}: tensor {name!r} (zoo parameter {suffix}) is missing; is the "
                    "checkpoint complete and of this architecture?"
                )
            used.add(name)
            parts.append(np.asarray(to_zoo(tensors[name])))
        value = np.stack(parts) if layers is not None and _stacked(model) else parts[0]
        variable = flat[path]
        if tuple(value.shape) != tuple(variable.shape):
            raise MpmdError(
                f"{where}: tensor for zoo parameter {'.'.join(map(str, path))} has shape "
                f"{value.shape}, the model expects {variable.shape}; the config.json does not "
                "describe these weights."
            )
        new_values.append((path, variable.replace(jnp.asarray(value, variable.dtype))))
    if tied:
        used.add(_hf_name(prefix, "^lm_head.weight"))
    extra = sorted(n for n in set(tensors) - used if not _is_ignored(n))
    if extra:
        raise MpmdError(
            f"{where}: {len(extra)} tensor(s) have no place in the zoo model, e.g. {extra[:3]}; "
            "the checkpoint has parameters this architecture does not (biases, adapters?)."
        )
    nnx.update(model, nnx.from_flat_state(new_values))


def _stacked(model: Any) -> bool:
    return bool(model.config.scan_layers)


def hf_tensors_from_model(model: Any) -> dict[str, np.ndarray]:
    """The Hugging Face tensors (float32 numpy, by name) of a zoo model in any stage layout.

    Example:
      >>> from nnx_mpmd.models import build_model
      >>> tensors = hf_tensors_from_model(build_model("gpt", "tiny", num_stages=1,
      ...     rngs=nnx.Rngs(0)))
      >>> tensors["transformer.h.0.attn.c_attn.weight"].shape
      (64, 192)
    """
    prefix, *rules = _rules(model)
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    pieces: dict[str, dict[Any, np.ndarray]] = {}
    for path, suffix, layers in _param_slots(model):
        template, _, from_zoo = _rule_for(suffix, layers, tuple(rules))
        value = np.asarray(jax.device_get(flat[path].get_value()))
        stacked = layers is not None and _stacked(model)
        for i, layer in enumerate(layers or [None]):
            name = _hf_name(prefix, template, layer)
            part = value[i] if stacked else value
            # A GPT-2 c_attn tensor is the concatenation of query, key and value.
            pieces.setdefault(name, {})[suffix] = part if from_zoo is None else from_zoo(part)
    out = {}
    for name, parts in pieces.items():
        if len(parts) == 1:
            tensor = next(iter(parts.values()))
        else:
            kind = "kernel" if name.endswith("weight") else "bias"
            order = [f"attn.{n}.{kind}" for n in ("query", "key", "value")]
            tensor = np.concatenate([parts[k] for k in order], axis=-1)
        out[name] = np.ascontiguousarray(tensor, dtype=np.float32)
    return out


def load_pretrained(
    path: str | pathlib.Path,
    *,
    num_stages: int = 1,
    rngs: nnx.Rngs | None = None,
    **overrides: Any,
) -> Any:
    """Builds the zoo model of a Hugging Face directory and loads its weights.

    Args:
      path: a directory with ``config.json`` and ``model.safetensors`` (GPT-2 or Llama).
      num_stages: pipeline stages of the zoo model (blocks balanced as in `build_model`).
      rngs: random streams for the construction (the values are then overwritten);
        default ``nnx.Rngs(0)``.
      **overrides: other zoo config fields, e.g. ``scan_layers=True``, ``dtype``,
        ``fsdp``/``tensor`` mesh axes.

    Returns:
      The `GPT` or `Llama`, whose logits equal the Hugging Face model's (float32).

    Raises:
      MpmdError: a missing file, an architecture or setting the zoo lacks (the
        message names the supported ones), or tensors that do not fit the config.

    Example:
      >>> load_pretrained("no/such/dir")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      nnx_mpmd.errors.MpmdError: no/such/dir/config.json: not found; ...
    """
    path = pathlib.Path(path)
    hf = read_hf_config(path)
    family, cfg = zoo_config_from_hf(
        hf, num_stages=num_stages, where=str(path / "config.json"), **overrides
    )
    tensors = _read_tensors(path)
    model_cls = cast(Callable[..., GPT | Llama], GPT if family == "gpt" else Llama)
    model = model_cls(cfg, rngs=rngs or nnx.Rngs(0))
    assign_hf_tensors(model, tensors, where=str(path))
    return model


def save_pretrained(model: Any, path: str | pathlib.Path) -> pathlib.Path:
    """Writes a zoo model as a Hugging Face directory: ``config.json`` + ``model.safetensors``.

    Args:
      model: a zoo `GPT` (tied head) or `Llama`, in any stage layout. Its arrays
        must be readable on this process (after `nnx_mpmd.distributed.gather`
        in a multi-process run).
      path: the output directory (created; existing files of those names are replaced).

    Returns:
      ``path``; ``transformers``' ``AutoModelForCausalLM.from_pretrained(path)`` reads it.

    Raises:
      MpmdError: a model without a Hugging Face layout, or safetensors missing.

    Example:
      >>> import tempfile
      >>> from nnx_mpmd.models import build_model
      >>> out = save_pretrained(build_model("gpt", "tiny", num_stages=2, rngs=nnx.Rngs(0)),
      ...                       tempfile.mkdtemp())
      >>> sorted(p.name for p in out.iterdir())
      ['config.json', 'model.safetensors']
    """
    st_numpy = _safetensors_numpy()
    _rules(model)  # a zoo GPT or Llama
    config = hf_config_from_zoo(model.config)
    tensors = hf_tensors_from_model(model)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    st_numpy.save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path
