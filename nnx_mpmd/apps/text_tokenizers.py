"""Tokenizers of the main job: the built-in character tokenizer, and tokenizer files.

Every tokenizer has ``vocab_size``, ``encode(text) -> int32 array``,
``decode(ids) -> str``, ``to_dict()`` and ``eos_id`` (the id that ends a
document, or None); `tokenizer_from_dict` rebuilds one from the ``to_dict()``
saved in checkpoint metadata, so ``nnx-mpmd generate`` decodes with the
tokenizer the run trained with.

``--tokenizer PATH`` takes a Hugging Face ``tokenizer.json`` (`HFTokenizer`, the
``tokenizers`` package) or a SentencePiece ``.model`` (`SentencePieceTokenizer`,
the ``sentencepiece`` package); both come with ``pip install 'nnx-mpmd[data]'``.
`tokenizer_into_run` copies the file into the run directory; ``to_dict()``
records its name there and its sha256, and `tokenizer_from_dict` reloads exactly
that file (a different file with the same name is refused).

Example:
    >>> from nnx_mpmd.apps.data import CharTokenizer
    >>> tok = tokenizer_from_dict(CharTokenizer.from_text("ab").to_dict())
    >>> tok.decode(tok.encode("ba"))
    'ba'
"""

from __future__ import annotations

import abc
import hashlib
import os
import pathlib
import shutil
from typing import Any, Protocol

import numpy as np

from nnx_mpmd.apps.data import CharTokenizer
from nnx_mpmd.errors import MpmdError

__all__ = [
    "DATA_INSTALL",
    "EOD_CHAR",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "TextTokenizer",
    "check_tokenizer_file",
    "eos_id_of",
    "file_sha256",
    "load_tokenizer_file",
    "tokenizer_from_dict",
    "tokenizer_into_run",
]

#: The hint printed when an optional data package is missing.
DATA_INSTALL = "pip install 'nnx-mpmd[data]'"
#: The character the character tokenizer reserves to end a document (ASCII "end of text").
EOD_CHAR = "\x03"
#: Token strings taken as a tokenizer file's end of document, first match wins.
EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
_SUFFIXES = {".json": "hf", ".model": "sentencepiece"}


class TextTokenizer(Protocol):
    """What the main job needs of a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Any) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


def file_sha256(path: str | pathlib.Path) -> str:
    """The hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _import_optional(module: str, what: str) -> Any:
    """Imports ``module``, or raises a one-line MpmdError naming the extra to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise MpmdError(
            f"{what} needs the '{module}' package, which is not installed; {DATA_INSTALL}."
        ) from None


def check_tokenizer_file(path: str | pathlib.Path) -> str:
    """The kind (``"hf"``/``"sentencepiece"``) of a ``--tokenizer`` file, checked before any write.

    Raises:
      MpmdError: the file is missing or unreadable, its extension is unknown, or the
        package that reads it is not installed.

    Example:
      >>> check_tokenizer_file("missing/tokenizer.json")
      Traceback (most recent call last):
      ...
      nnx_mpmd.errors.MpmdError: --tokenizer missing/tokenizer.json does not exist; ...
    """
    path = pathlib.Path(path)
    kind = _SUFFIXES.get(path.suffix)
    if not path.exists():
        raise MpmdError(
            f"--tokenizer {path} does not exist; pass a Hugging Face tokenizer.json or a "
            "SentencePiece .model file."
        )
    if kind is None:
        raise MpmdError(
            f"--tokenizer {path}: unknown tokenizer file type {path.suffix!r}; pass a Hugging "
            "Face tokenizer.json (.json) or a SentencePiece model (.model)."
        )
    if not path.is_file():
        raise MpmdError(f"--tokenizer {path} is not a file; pass the tokenizer file itself.")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise MpmdError(
            f"--tokenizer {path} cannot be read ({e.strerror}); fix its permissions."
        ) from None
    _import_optional("tokenizers" if kind == "hf" else "sentencepiece", f"--tokenizer {path}")
    return kind


class _FileTokenizer(abc.ABC):
    """What the file tokenizers share: their file's name, sha256 and description."""

    kind = ""
    path: pathlib.Path
    name: str
    sha256: str

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids; each file format says how many."""

    def to_dict(self) -> dict[str, Any]:
        """The file's name in the run directory and its sha256 (see `tokenizer_from_dict`)."""
        return {"type": self.kind, "file": self.name, "sha256": self.sha256}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path}, vocab_size={self.vocab_size})"


class HFTokenizer(_FileTokenizer):
    """A Hugging Face ``tokenizer.json`` read by the ``tokenizers`` package.

    ``encode`` adds no special tokens; ``eos_id`` is the first of `EOS_TOKENS` in the
    vocabulary, or None.

    Args:
      path: the ``tokenizer.json`` file.
      name: its file name inside the run directory (for `to_dict`).

    Example:
      >>> tok = HFTokenizer("tokenizer.json")  # doctest: +SKIP
      >>> tok.decode(tok.encode("hello"))  # doctest: +SKIP
      'hello'
    """

    kind = "hf"

    def __init__(self, path: str | pathlib.Path, name: str | None = None) -> None:
        tokenizers = _import_optional("tokenizers", f"tokenizer file {path}")
        self.path = pathlib.Path(path)
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as e:  # the Rust side raises a plain Exception
            raise MpmdError(
                f"--tokenizer {self.path} is not a Hugging Face tokenizer.json ({e}); pass "
                "the tokenizer.json of a tokenizers/transformers tokenizer."
            ) from None
        self.name = name or self.path.name
        self.sha256 = file_sha256(self.path)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.eos_id = next((vocab[t] for t in EOS_TOKENS if t in vocab), None)

    @property
    def vocab_size(self) -> int:
        """Number of token ids (added tokens included)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (no special tokens added) as an int32 array."""
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids: Any) -> str:
        """The text of a sequence of token ids."""
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)])


class SentencePieceTokenizer(_FileTokenizer):
    """A SentencePiece ``.model`` read by the ``sentencepiece`` package.

    ``encode`` adds neither BOS nor EOS; ``eos_id`` is the model's EOS id, or None.

    Args:
      path: the ``.model`` file.
      name: its file name inside the run directory (for `to_dict`).

    Example:
      >>> tok = SentencePieceTokenizer("spm.model")  # doctest: +SKIP
      >>> tok.decode(tok.encode("hello"))  # doctest: +SKIP
      'hello'
    """

    kind = "sentencepiece"

    def __init__(self, path: str | pathlib.Path, name: str | None = None) -> None:
        spm = _import_optional("sentencepiece", f"tokenizer file {path}")
        self.path = pathlib.Path(path)
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except Exception as e:  # sentencepiece raises OSError or RuntimeError
            raise MpmdError(
                f"--tokenizer {self.path} is not a SentencePiece model ({e}); pass the .model "
                "file that SentencePieceTrainer wrote."
            ) from None
        self.name = name or self.path.name
        self.sha256 = file_sha256(self.path)
        eos = int(self._sp.eos_id())
        self.eos_id = eos if eos >= 0 else None

    @property
    def vocab_size(self) -> int:
        """Number of pieces."""
        return int(self._sp.get_piece_size())

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` as an int32 array."""
        return np.asarray(self._sp.encode(text, out_type=int), dtype=np.int32)

    def decode(self, ids: Any) -> str:
        """The text of a sequence of token ids."""
        return self._sp.decode([int(i) for i in np.asarray(ids).reshape(-1)])


def load_tokenizer_file(
    path: str | pathlib.Path, name: str | None = None
) -> HFTokenizer | SentencePieceTokenizer:
    """The tokenizer of a ``tokenizer.json`` or SentencePiece ``.model`` file.

    ``name`` is its file name in the run directory (default: its own).

    Example:
      >>> load_tokenizer_file("tokenizer.json").vocab_size  # doctest: +SKIP
      1000
    """
    kind = check_tokenizer_file(path)
    cls = HFTokenizer if kind == "hf" else SentencePieceTokenizer
    return cls(path, name)


def tokenizer_into_run(
    path: str | pathlib.Path, run_dir: str | pathlib.Path
) -> HFTokenizer | SentencePieceTokenizer:
    """Copies a tokenizer file into ``run_dir`` (``tokenizer.json``/``.model``) and loads the copy.

    An identical copy already there (a resumed run) is kept.

    Example:
      >>> tokenizer_into_run("my/tokenizer.json", "runs/x").to_dict()  # doctest: +SKIP
      {'type': 'hf', 'file': 'tokenizer.json', 'sha256': '...'}
    """
    source = pathlib.Path(path)
    kind = check_tokenizer_file(source)
    target = pathlib.Path(run_dir) / ("tokenizer.json" if kind == "hf" else "tokenizer.model")
    if not (target.exists() and file_sha256(target) == file_sha256(source)):
        # Every process of a run copies: each renames its own whole copy into place.
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        shutil.copyfile(source, partial)
        os.replace(partial, target)
    return load_tokenizer_file(target, target.name)


def eos_id_of(tokenizer: Any) -> int | None:
    """The id that ends a document: the tokenizer's ``eos_id``, the character tokenizer's
    `EOD_CHAR` when its vocabulary holds it, else None."""
    if isinstance(tokenizer, CharTokenizer):
        return tokenizer.chars.index(EOD_CHAR) if EOD_CHAR in tokenizer.chars else None
    return getattr(tokenizer, "eos_id", None)


def tokenizer_from_dict(
    data: dict[str, Any], run_dir: str | pathlib.Path | None = None
) -> TextTokenizer:
    """Rebuilds the tokenizer a ``to_dict()`` result describes (files from ``run_dir``).

    Raises:
      MpmdError: for a description of an unknown type, or a tokenizer file that is
        missing from ``run_dir`` or differs from the one the run trained with.
    """
    kind = data.get("type") if isinstance(data, dict) else None
    if kind == "char":
        return CharTokenizer.from_dict(data)
    if kind in ("hf", "sentencepiece"):
        if run_dir is None or not isinstance(data.get("file"), str):
            raise MpmdError(
                f"a {kind} tokenizer is reloaded from its file in the run directory; pass "
                "run_dir (the run that trained with it)."
            )
        path = pathlib.Path(run_dir) / data["file"]
        if not path.is_file():
            raise MpmdError(
                f"the run's tokenizer file {path} is missing; copy the --tokenizer file the "
                f"run trained with back to {path}."
            )
        if file_sha256(path) != data.get("sha256"):
            raise MpmdError(
                f"the tokenizer file {path} differs from the one the run trained with (sha256 "
                f"{data.get('sha256')}); restore that file."
            )
        cls = HFTokenizer if kind == "hf" else SentencePieceTokenizer
        return cls(path, data["file"])
    raise MpmdError(
        f"unknown tokenizer description of type {kind!r} (run directory {run_dir}); "
        "it was written by a newer nnx_mpmd, or the checkpoint metadata is damaged."
    )
