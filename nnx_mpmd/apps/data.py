"""Data for the main training job: a corpus every machine has, a tokenizer, batches.

The corpus is the Python standard library's own source code (``*.py`` files
under ``sysconfig.get_paths()["stdlib"]``, read in sorted order), so training
needs no download. It is tokenized character by character. `BatchIterator`
draws random windows with a generator seeded by ``(seed, batch index)``: batch
``i`` is the same on every run, and a resumed run that restores ``position``
continues with exactly the batches it would have seen.

Example:
    >>> tok = CharTokenizer.from_text("hello world")
    >>> tokens = tok.encode("hello world")
    >>> it = BatchIterator(tokens, batch_size=2, seq_len=4, seed=0)
    >>> batch = next(it)
    >>> batch["inputs"].shape, batch["targets"].dtype.name, it.position
    ((2, 4), 'int32', 1)
"""

from __future__ import annotations

import abc
import pathlib
import sysconfig
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from nnx_mpmd.errors import MpmdError

__all__ = [
    "BatchIterator",
    "ResumableBatches",
    "CharTokenizer",
    "stdlib_corpus",
    "train_val_split",
]

DEFAULT_CORPUS_BYTES = 2_000_000
# Third-party code can live under the stdlib directory on some installs; leave it
# out so the corpus depends only on the Python version.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def _ascii_printable(text: str) -> str:
    return "".join(c if (" " <= c <= "~" or c in "\n\t") else "?" for c in text)


def stdlib_corpus(
    max_bytes: int = DEFAULT_CORPUS_BYTES,
    *,
    root: str | pathlib.Path | None = None,
    ascii_only: bool = True,
) -> str:
    """The standard library's Python source, at most ``max_bytes`` characters, the same everywhere.

    Sorted paths under ``root`` (default: the stdlib); ``ascii_only`` keeps the vocabulary < 100.

    Example:
      >>> text = stdlib_corpus(10_000)
      >>> len(text)
      10000
    """
    if max_bytes < 1:
        raise MpmdError(f"stdlib_corpus: max_bytes={max_bytes} must be >= 1.")
    base = pathlib.Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files = sorted(
        path.relative_to(base).as_posix()
        for path in base.rglob("*.py")
        if path.is_file() and not _SKIPPED_DIRS.intersection(path.relative_to(base).parts)
    )
    if not files:
        raise MpmdError(
            f"stdlib_corpus: no *.py files under {base}; pass root= a directory with "
            "Python sources."
        )
    pieces: list[str] = []
    size = 0
    for name in files:
        text = (base / name).read_text(encoding="utf-8", errors="replace")
        if ascii_only:
            text = _ascii_printable(text)
        pieces.append(text + "\n\n")
        size += len(pieces[-1])
        if size >= max_bytes:
            break
    return "".join(pieces)[:max_bytes]


class CharTokenizer:
    """Character-level tokenizer: one id per distinct character, sorted by code point.

    Args:
      chars: the vocabulary, one character per id.

    Example:
      >>> tok = CharTokenizer.from_text("abba")
      >>> tok.vocab_size, tok.encode("ab").tolist(), tok.decode([1, 0])
      (2, [0, 1], 'ba')
    """

    def __init__(self, chars: Sequence[str]) -> None:
        chars = list(chars)
        if not chars or any(len(c) != 1 for c in chars) or len(set(chars)) != len(chars):
            raise MpmdError(
                "CharTokenizer: the vocabulary must be a non-empty list of distinct "
                f"single characters, got {chars[:10]!r}..."
            )
        self.chars = chars
        self._ids = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """Builds the vocabulary from every character that occurs in ``text``."""
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` as an int32 array.

        Raises:
          MpmdError: when ``text`` has a character outside the vocabulary.
        """
        try:
            return np.fromiter((self._ids[c] for c in text), dtype=np.int32, count=len(text))
        except KeyError as e:
            raise MpmdError(
                f"CharTokenizer.encode: character {e.args[0]!r} is not in the vocabulary "
                f"of {self.vocab_size} characters; build the tokenizer from text that "
                "contains it."
            ) from None

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of a sequence of token ids."""
        ids = np.asarray(ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise MpmdError(
                f"CharTokenizer.decode: ids must lie in [0, {self.vocab_size}), got "
                f"min {ids.min()} max {ids.max()}."
            )
        return "".join(self.chars[int(i)] for i in ids)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable description (see `from_dict`)."""
        return {"type": "char", "chars": "".join(self.chars)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CharTokenizer:
        """Rebuilds a tokenizer from `to_dict` output."""
        if data.get("type") != "char" or not isinstance(data.get("chars"), str):
            raise MpmdError(
                f"CharTokenizer.from_dict: expected {{'type': 'char', 'chars': str}}, got "
                f"keys {sorted(data)}; pass the output of CharTokenizer.to_dict()."
            )
        return cls(list(data["chars"]))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and self.chars == other.chars

    def __hash__(self) -> int:
        return hash(tuple(self.chars))

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


def train_val_split(tokens: np.ndarray, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """``(train_tokens, val_tokens)``: a 1-D token stream split, the last ``val_fraction`` held out.

    Example:
      >>> train, val = train_val_split(np.arange(10), 0.2)
      >>> train.tolist(), val.tolist()
      ([0, 1, 2, 3, 4, 5, 6, 7], [8, 9])
    """
    if not 0.0 < val_fraction < 1.0:
        raise MpmdError(f"train_val_split: val_fraction={val_fraction} must lie in (0, 1).")
    tokens = np.asarray(tokens)
    cut = len(tokens) - max(1, round(len(tokens) * val_fraction))
    if cut < 1:
        raise MpmdError(
            f"train_val_split: {len(tokens)} tokens are too few to split with "
            f"val_fraction={val_fraction}; use a larger corpus."
        )
    return tokens[:cut], tokens[cut:]


class ResumableBatches(abc.ABC):
    """What the main job's batch sources share: iteration by ``position`` and a checked resume.

    A source implements ``batch_at(index, rows=None)`` and ``state_dict()``, names in
    ``SETTINGS`` the state keys a resume must match, and says what a mismatch means in
    ``_mismatch``.
    """

    position: int
    batch_size: int
    SETTINGS: tuple[str, ...] = ()

    @abc.abstractmethod
    def batch_at(self, index: int, rows: Any = None) -> dict[str, np.ndarray]:
        """The batch number ``index``, or only its global ``rows``."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state; `load_state_dict` resumes from it."""

    def _mismatch(self, key: str, saved: Any, mine: Any) -> str:
        return (
            f"{type(self).__name__}.load_state_dict: saved {key}={saved} but this iterator has "
            f"{key}={mine}; resume with the same data settings."
        )

    def _checked_rows(self, rows: Any) -> np.ndarray:
        """``rows`` as a 1-D int64 array of global row indices in ``[0, batch_size)``."""
        rows = np.asarray(rows)
        if rows.ndim != 1 or (rows.size and not np.issubdtype(rows.dtype, np.integer)):
            raise MpmdError(
                f"{type(self).__name__}.batch_at: rows must be a 1-D array of ints, got shape "
                f"{rows.shape} dtype {rows.dtype}; pass global row indices of the batch."
            )
        rows = rows.astype(np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.batch_size):
            raise MpmdError(
                f"{type(self).__name__}.batch_at: rows must lie in [0, {self.batch_size}) (the batch "
                f"size), got min {rows.min()} max {rows.max()}."
            )
        return rows

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch_at(self.position)
        self.position += 1
        return batch

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes at ``state["position"]`` after checking the state fits this source."""
        mine = self.state_dict()
        for key in self.SETTINGS:
            if key in state and state[key] != mine[key]:
                raise MpmdError(self._mismatch(key, state[key], mine[key]))
        position = state.get("position")
        if not isinstance(position, int) or position < 0:
            raise MpmdError(
                f"{type(self).__name__}.load_state_dict: position={position!r} must be an int >= 0."
            )
        self.position = position


class BatchIterator(ResumableBatches):
    """Deterministic, resumable iterator of language-model batches.

    Batch ``i`` holds ``batch_size`` windows starting at offsets drawn by
    ``numpy.random.default_rng((seed, i))``; ``targets`` are ``inputs`` shifted
    by one token. The iterator is endless; ``position`` counts batches served.

    Args:
      tokens: a 1-D token array with more than ``seq_len`` tokens.
      batch_size: windows per batch.
      seq_len: tokens per window.
      seed: seed of the window offsets.

    Example:
      >>> it = BatchIterator(np.arange(100), batch_size=2, seq_len=8, seed=1)
      >>> first = next(it)
      >>> state = it.state_dict()
      >>> second = next(it)
      >>> it2 = BatchIterator(np.arange(100), batch_size=2, seq_len=8, seed=1)
      >>> it2.load_state_dict(state)
      >>> bool((next(it2)["inputs"] == second["inputs"]).all())
      True
    """

    SETTINGS = ("seed", "batch_size", "seq_len", "num_tokens")

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0) -> None:
        self.tokens = np.asarray(tokens, dtype=np.int32).reshape(-1)
        if batch_size < 1 or seq_len < 1:
            raise MpmdError(
                f"BatchIterator: batch_size={batch_size} and seq_len={seq_len} must be >= 1."
            )
        if len(self.tokens) <= seq_len:
            raise MpmdError(
                f"BatchIterator: {len(self.tokens)} tokens are too few for seq_len={seq_len}; "
                "use a shorter seq_len or a larger corpus."
            )
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.position = 0

    def batch_at(self, index: int, rows: Any = None) -> dict[str, np.ndarray]:
        """``{"inputs", "targets"}`` of batch ``index`` (not of ``position``), or its ``rows`` only.

        ``rows`` (global, in ``[0, batch_size)``) lets a process read just the rows its devices use.

        Example:
          >>> it = BatchIterator(np.arange(100), batch_size=4, seq_len=8, seed=1)
          >>> part = it.batch_at(3, rows=np.array([1, 3]))["inputs"]
          >>> bool((part == it.batch_at(3)["inputs"][[1, 3]]).all())
          True
        """
        rng = np.random.default_rng((self.seed, index))
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        if rows is not None:
            starts = starts[self._checked_rows(rows)]
        windows = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        chunk = self.tokens[windows]
        return {"inputs": chunk[:, :-1], "targets": chunk[:, 1:]}

    def state_dict(self) -> dict[str, int]:
        """JSON-serialisable state; `load_state_dict` resumes from it."""
        return {
            "position": self.position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_tokens": len(self.tokens),
        }
