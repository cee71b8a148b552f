"""Tokenizers of the main job: the built-in character tokenizer, and (to come) files.

Every tokenizer has ``vocab_size``, ``encode(text) -> int32 array``,
``decode(ids) -> str`` and ``to_dict()``; `tokenizer_from_dict` rebuilds one from
the ``to_dict()`` saved in checkpoint metadata, so ``nnx-mpmd generate`` decodes
with the tokenizer the run trained with.

Example:
    >>> from nnx_mpmd.apps.data import CharTokenizer
    >>> tok = tokenizer_from_dict(CharTokenizer.from_text("ab").to_dict())
    >>> tok.decode(tok.encode("ba"))
    'ba'
"""

from __future__ import annotations

import pathlib
from typing import Any, Protocol

import numpy as np

from nnx_mpmd.apps.data import CharTokenizer
from nnx_mpmd.errors import MpmdError

__all__ = ["TextTokenizer", "tokenizer_from_dict"]


class TextTokenizer(Protocol):
    """What the main job needs of a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Any) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


def tokenizer_from_dict(
    data: dict[str, Any], run_dir: str | pathlib.Path | None = None
) -> TextTokenizer:
    """Rebuilds the tokenizer described by ``data`` (a ``to_dict()`` result).

    Args:
      data: the description saved in checkpoint metadata.
      run_dir: the run directory, where tokenizer files of a run are kept.

    Returns:
      The tokenizer.

    Raises:
      MpmdError: for a description of an unknown type.
    """
    kind = data.get("type") if isinstance(data, dict) else None
    if kind == "char":
        return CharTokenizer.from_dict(data)
    raise MpmdError(
        f"unknown tokenizer description of type {kind!r} (run directory {run_dir}); "
        "it was written by a newer nnx_mpmd, or the checkpoint metadata is damaged."
    )
