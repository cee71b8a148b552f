"""``nnx-mpmd train --init-from DIR``: a run that starts from a Hugging Face directory.

`apply_init_from` takes the model family and depth from the directory's
``config.json``, `pretrained_model` builds and loads the model, and
`keep_pretrained_config` keeps ``config.json`` (and ``tokenizer.json``) in
``RUN/pretrained/``, so that a resumed run rebuilds the same architecture
without ``--init-from``. ``nnx-mpmd train``, ``nnx-mpmd plan``, the trainer and
``nnx-mpmd convert --from-hf`` (`nnx_mpmd.apps.convert`) all build on these;
this module imports none of them. It imports no JAX at the top level.
"""

from __future__ import annotations

import pathlib
import shutil
from typing import Any

__all__ = [
    "PRETRAINED_DIR",
    "apply_init_from",
    "keep_pretrained_config",
    "pretrained_max_len",
    "pretrained_model",
]

#: Where a run keeps the ``config.json`` (and ``tokenizer.json``) it started from.
PRETRAINED_DIR = "pretrained"
KEPT_FILES = ("config.json", "tokenizer.json")


def apply_init_from(cfg: Any, run_dir: pathlib.Path) -> None:
    """Sets ``cfg.model`` and ``cfg.layers`` from a Hugging Face ``config.json``.

    From ``cfg.init_from``, or on ``--resume`` its copy ``run_dir/pretrained``; a
    ``tokenizer.json`` there becomes ``cfg.tokenizer`` unless one is given.

    Raises:
      MpmdError: a missing or unsupported ``config.json``, or ``--layers`` that
        differs from the checkpoint's depth.
    """
    from nnx_mpmd.errors import MpmdError
    from nnx_mpmd.models.hf_config import read_hf_config, zoo_config_from_hf

    kept = run_dir / PRETRAINED_DIR
    if cfg.resume and (kept / "config.json").is_file():
        cfg.init_from = str(kept)  # the run's own copy: the original may have moved
    if not getattr(cfg, "init_from", None):
        return
    source = pathlib.Path(cfg.init_from)
    family, model_cfg = zoo_config_from_hf(
        read_hf_config(source), where=f"--init-from {source / 'config.json'}"
    )
    if cfg.layers is not None and cfg.layers != model_cfg.n_layers:
        raise MpmdError(
            f"--layers {cfg.layers} differs from the {model_cfg.n_layers} layers of "
            f"--init-from {source}; drop --layers (a pretrained model keeps its depth)."
        )
    cfg.model = family
    cfg.layers = model_cfg.n_layers
    tokenizer_file = source / "tokenizer.json"
    if tokenizer_file.is_file() and hasattr(cfg, "tokenizer") and cfg.tokenizer is None:
        cfg.tokenizer = str(tokenizer_file)


def pretrained_max_len(init_from: str | pathlib.Path) -> int:
    """The ``max_len`` of a Hugging Face directory's model: a run's default ``--seq-len`` from it.

    Raises:
      MpmdError: a missing or unsupported ``config.json``.
    """
    from nnx_mpmd.models.hf_config import read_hf_config, zoo_config_from_hf

    source = pathlib.Path(init_from)
    _, model_cfg = zoo_config_from_hf(
        read_hf_config(source), where=f"--init-from {source / 'config.json'}"
    )
    return int(model_cfg.max_len)


def pretrained_model(
    init_from: str | pathlib.Path, *, num_stages: int, vocab_size: int, **overrides: Any
) -> Any:
    """The zoo model of a Hugging Face directory, with its weights when it has them.

    A run's ``pretrained/`` copy has the config only; ``vocab_size`` must fit the checkpoint's.

    Raises:
      MpmdError: the tokenizer does not fit the checkpoint's vocabulary, or the
        directory cannot be read.
    """
    from flax import nnx

    from nnx_mpmd.errors import MpmdError
    from nnx_mpmd.models import MODELS, load_pretrained
    from nnx_mpmd.models.hf_config import read_hf_config, zoo_config_from_hf

    source = pathlib.Path(init_from)
    where = f"--init-from {source / 'config.json'}"
    family, cfg = zoo_config_from_hf(
        read_hf_config(source), num_stages=num_stages, where=where, **overrides
    )
    if vocab_size > cfg.vocab_size:
        raise MpmdError(
            f"the tokenizer has {vocab_size} tokens but {where} has a vocabulary of "
            f"{cfg.vocab_size}: its ids would not fit the embedding table. Train with the "
            f"checkpoint's own tokenizer ({source / 'tokenizer.json'}), or one of at most "
            f"{cfg.vocab_size} tokens."
        )
    has_weights = any(
        (source / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")
    )
    if has_weights:
        return load_pretrained(source, num_stages=num_stages, **overrides)
    return MODELS[family][0](cfg, rngs=nnx.Rngs(0))  # its values come from the checkpoint


def keep_pretrained_config(init_from: str | pathlib.Path, run_dir: pathlib.Path) -> None:
    """Copies ``init_from``'s ``config.json`` and ``tokenizer.json`` to ``run_dir/pretrained``."""
    source, kept = pathlib.Path(init_from), run_dir / PRETRAINED_DIR
    if source.resolve() == kept.resolve():
        return
    kept.mkdir(exist_ok=True)
    for name in KEPT_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, kept / name)
