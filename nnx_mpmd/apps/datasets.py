"""``nnx-mpmd train --dataset``: the user's files as packed, shuffled, resumable batches.

``--dataset PATH`` names a text file, a directory (every ``.txt``, ``.jsonl`` and
``.parquet`` file under it, in sorted order) or a glob of such files. Their
documents (`nnx_mpmd.apps.token_files.read_documents`) are tokenized once into
a cached token file, each followed by the end-of-document token: the
tokenizer's EOS, or for the character tokenizer the character `EOD_CHAR`
(ASCII "end of text", ``\\x03``), which its vocabulary always holds. A file
tokenizer without an EOS separates documents by the tokens of a blank line.

The token stream is cut into ``len // seq_len`` sequences of ``seq_len + 1``
tokens (neighbours share one token: the last target of one is the first input
of the next). `PackedBatches` draws them through a grain ``MapDataset``
shuffled by ``--seed`` and reshuffled every epoch: example ``j`` is the
``j``-th of that endless order and batch ``i`` holds examples
``i * batch_size ... (i + 1) * batch_size - 1``. Any row of any batch can be read
alone (``batch_at(i, rows)``), and the position saved in every checkpoint lets
``--resume`` continue at exactly the next example.

The held-out data is ``--val-dataset PATH`` or the last ``--val-fraction`` of the
token stream (default 5%).

Example:
    >>> import numpy as np
    >>> batches = PackedBatches(np.arange(41, dtype=np.int32), batch_size=2, seq_len=4, seed=0)
    >>> batches.num_sequences, next(batches)["inputs"].shape
    (10, (2, 4))
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import importlib.util
import os
import pathlib
import shutil
from collections.abc import Iterator
from typing import Any, cast

import numpy as np

from nnx_mpmd.apps.data import (
    BatchIterator,
    CharTokenizer,
    ResumableBatches,
    stdlib_corpus,
    train_val_split,
)
from nnx_mpmd.apps.text_tokenizers import (
    DATA_INSTALL,
    EOD_CHAR,
    check_tokenizer_file,
    eos_id_of,
    tokenizer_into_run,
)
from nnx_mpmd.apps.token_files import (
    PARQUET_INSTALL,
    cache_key,
    char_vocabulary,
    tokenize_to_cache,
)
from nnx_mpmd.errors import MpmdError

__all__ = [
    "DATASET_SUFFIXES",
    "add_data_arguments",
    "DEFAULT_VAL_FRACTION",
    "EOD_CHAR",
    "PackedBatches",
    "TrainingData",
    "build_data",
    "check_data_args",
    "removed_on_error",
    "resolve_dataset_files",
]

DATASET_SUFFIXES = (".txt", ".jsonl", ".parquet")
#: The held-out share of the token stream without ``--val-dataset``/``--val-fraction``.
DEFAULT_VAL_FRACTION = 0.05
CACHE_DIR = "data_cache"
_GLOB_CHARS = "*?["
_KINDS = ", ".join(DATASET_SUFFIXES)


def resolve_dataset_files(spec: str, option: str = "--dataset") -> list[pathlib.Path]:
    """The ``.txt``/``.jsonl``/``.parquet`` files ``spec`` names (file, directory or glob), sorted.

    Raises:
      MpmdError: the path does not exist, the glob matches nothing, the directory
        or glob holds no dataset file, a file has another extension or cannot be read.

    Example:
      >>> resolve_dataset_files("no/such/dir")
      Traceback (most recent call last):
      ...
      nnx_mpmd.errors.MpmdError: --dataset no/such/dir does not exist; ...
    """
    if any(c in spec for c in _GLOB_CHARS):
        matches = sorted(pathlib.Path(p) for p in glob.glob(spec, recursive=True))
        matches = [p for p in matches if p.is_file()]
        if not matches:
            raise MpmdError(
                f"{option} {spec}: the pattern matches no file; check the pattern (quote it "
                "so the shell leaves it to nnx-mpmd), e.g. 'data/**/*.txt'."
            )
        files = [p for p in matches if p.suffix in DATASET_SUFFIXES]
        if not files:
            raise MpmdError(
                f"{option} {spec}: the pattern matches {len(matches)} files but none ends in "
                f"{_KINDS}; rename them or change the pattern."
            )
    else:
        path = pathlib.Path(spec)
        if not path.exists():
            raise MpmdError(
                f"{option} {spec} does not exist; pass a text file, a directory or a glob of "
                f"{_KINDS} files."
            )
        if path.is_dir():
            files = sorted(
                p
                for p in path.rglob("*")
                if p.is_file()
                and p.suffix in DATASET_SUFFIXES
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            if not files:
                raise MpmdError(
                    f"{option} {spec} holds no {_KINDS} files; add some, or point {option} "
                    "at another directory."
                )
        elif path.suffix not in DATASET_SUFFIXES:
            raise MpmdError(
                f"{option} {spec}: unknown file type {path.suffix!r}; use {_KINDS} files "
                "(a .txt file is read as one document)."
            )
        else:
            files = [path]
    for path in files:
        if not os.access(path, os.R_OK):
            raise MpmdError(f"{option}: {path} cannot be read; fix its permissions.")
    return files


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--dataset``, ``--val-dataset``, ``--val-fraction``, ``--text-field`` and
    ``--tokenizer`` to ``nnx-mpmd train``'s parser.

    Example:
      >>> p = argparse.ArgumentParser()
      >>> add_data_arguments(p)
      >>> p.parse_args(["--dataset", "texts/"]).text_field
      'text'
    """
    parser.add_argument(
        "--dataset",
        default=None,
        metavar="PATH",
        help="train on your data: a file, a directory or a glob of .txt, .jsonl and .parquet "
        "files (documents are tokenized once, cached under RUN/data_cache, and packed into "
        "--seq-len sequences; needs pip install 'nnx-mpmd[data]')",
    )
    parser.add_argument(
        "--val-dataset",
        default=None,
        metavar="PATH",
        help="held-out data, like --dataset (default: the last --val-fraction of --dataset)",
    )
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        metavar="F",
        help="held-out share of the tokens (default: 0.05)",
    )
    parser.add_argument(
        "--text-field", default="text", metavar="NAME", help="text field of .jsonl/.parquet"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="a Hugging Face tokenizer.json or a SentencePiece .model (copied into the run "
        "directory; default: characters of the data)",
    )


def check_data_args(cfg: Any) -> None:
    """Checks the data options of ``cfg`` before anything is written (no JAX, no reading).

    Raises:
      MpmdError: a missing dataset or tokenizer file, options that contradict each
        other, or an optional package the options need is not installed.

    Example:
      >>> import argparse
      >>> check_data_args(argparse.Namespace(dataset=None, val_dataset=None,
      ...     val_fraction=None, tokenizer=None, text_field="text"))
    """
    dataset, val_dataset = cfg.dataset, cfg.val_dataset
    if val_dataset is not None and dataset is None:
        raise MpmdError("--val-dataset needs --dataset (the training data); add --dataset PATH.")
    if val_dataset is not None and cfg.val_fraction is not None:
        raise MpmdError(
            f"--val-dataset {val_dataset} and --val-fraction {cfg.val_fraction} contradict each "
            "other; keep one of them."
        )
    if cfg.val_fraction is not None and not 0.0 < cfg.val_fraction < 1.0:
        raise MpmdError(f"--val-fraction={cfg.val_fraction} must lie in (0, 1), e.g. 0.05.")
    if not cfg.text_field:
        raise MpmdError("--text-field must not be empty; the default is 'text'.")
    if cfg.tokenizer is not None:
        check_tokenizer_file(cfg.tokenizer)
    if dataset is None:
        return
    files = resolve_dataset_files(dataset)
    if val_dataset is not None:
        files += resolve_dataset_files(val_dataset, "--val-dataset")
    if importlib.util.find_spec("grain") is None:
        raise MpmdError(
            f"--dataset needs the 'grain' package to load data, which is not installed; "
            f"{DATA_INSTALL}."
        )
    parquet = [p for p in files if p.suffix == ".parquet"]
    if parquet and importlib.util.find_spec("pyarrow") is None:
        raise MpmdError(
            f"--dataset: {parquet[0]} is a .parquet file, which needs pyarrow (not installed); "
            f"{PARQUET_INSTALL}."
        )


def _shuffle_seed(seed: int) -> int:
    """A 32-bit seed for grain's shuffle (it takes no more) from ``--seed`` (63 bits)."""
    return int(np.random.SeedSequence(seed).generate_state(1)[0])


class PackedBatches(ResumableBatches):
    """Batches of packed sequences drawn in grain's shuffled, per-epoch order.

    Args:
      tokens: the 1-D token stream (documents and their separators).
      batch_size: sequences per batch.
      seq_len: tokens per input sequence (each example holds ``seq_len + 1``).
      seed: seed of the order.
      data_key: identifies the token stream in `state_dict` (a resume checks it).

    Example:
      >>> b = PackedBatches(np.arange(41, dtype=np.int32), batch_size=4, seq_len=4, seed=1)
      >>> whole = b.batch_at(3)
      >>> part = b.batch_at(3, rows=np.array([1, 3]))
      >>> bool((part["targets"] == whole["targets"][[1, 3]]).all())
      True
    """

    def __init__(
        self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0, data_key: str = ""
    ) -> None:
        try:
            import grain
        except ImportError:
            raise MpmdError(f"--dataset needs the 'grain' package; {DATA_INSTALL}.") from None
        self.tokens = tokens
        if batch_size < 1 or seq_len < 1:
            raise MpmdError(
                f"PackedBatches: batch_size={batch_size} and seq_len={seq_len} must be >= 1."
            )
        self.num_sequences = (len(tokens) - 1) // seq_len
        if self.num_sequences < 1:
            raise MpmdError(
                f"the dataset has {len(tokens)} tokens, too few for one sequence of --seq-len "
                f"{seq_len} (+1 for the targets); add text, or lower --seq-len."
            )
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.data_key = data_key
        self.position = 0
        order = grain.MapDataset.range(self.num_sequences).shuffle(seed=_shuffle_seed(seed))
        #: Example ``j`` of the endless, per-epoch reshuffled order.
        self.examples = order.repeat(None).map(self._sequence)

    def _sequence(self, k: int) -> np.ndarray:
        start = int(k) * self.seq_len
        return np.array(self.tokens[start : start + self.seq_len + 1], dtype=np.int32)

    def batch_at(self, index: int, rows: Any = None) -> dict[str, np.ndarray]:
        """``{"inputs", "targets"}`` of batch ``index`` (not ``position``), or its ``rows`` only."""
        rows = np.arange(self.batch_size) if rows is None else self._checked_rows(rows)
        first = int(index) * self.batch_size
        # A mapped grain dataset may hold None (filtered); this one never does.
        picked = [cast(np.ndarray, self.examples[first + int(r)]) for r in rows]
        chunk = np.stack(picked) if rows.size else None
        if chunk is None:
            chunk = np.zeros((0, self.seq_len + 1), np.int32)
        return {"inputs": chunk[:, :-1], "targets": chunk[:, 1:]}

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (saved as checkpoint metadata ``"data"``)."""
        return {
            "position": self.position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_tokens": len(self.tokens),
            "num_sequences": self.num_sequences,
            "data_key": self.data_key,
        }

    SETTINGS = ("seed", "batch_size", "seq_len", "num_tokens", "data_key")

    def _mismatch(self, key: str, saved: Any, mine: Any) -> str:
        return (
            f"the saved data state has {key}={saved!r} but this run's dataset has "
            f"{key}={mine!r} (another --dataset, --tokenizer or changed files); "
            "resume with the same data, or start a new --run-dir."
        )


@dataclasses.dataclass
class TrainingData:
    """The tokenizer and token streams of a run with ``--dataset`` or ``--tokenizer``.

    Attributes:
      tokenizer: the run's tokenizer (its vocabulary sizes the model).
      train_tokens: the training token stream (a memory map for ``--dataset``).
      val_tokens: the held-out token stream.
      sample_prompt: the prompt of the run's final sample.
      data_key: identifies the training token stream ("" without ``--dataset``).
      notes: lines for the run's log.
    """

    tokenizer: Any
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    sample_prompt: str
    data_key: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)

    def batches(self, batch_size: int, seq_len: int, seed: int) -> Any:
        """The training batch source: `PackedBatches` for a dataset, else the stdlib
        corpus's random windows (`nnx_mpmd.apps.data.BatchIterator`)."""
        if not self.data_key:
            return BatchIterator(self.train_tokens, batch_size, seq_len, seed=seed)
        return PackedBatches(self.train_tokens, batch_size, seq_len, seed, self.data_key)


@contextlib.contextmanager
def removed_on_error(run_dir: pathlib.Path) -> Iterator[None]:
    """Removes ``run_dir`` (and new folders above it) if it is new and the block fails.

    So a refused run leaves no files behind.

    Example:
      >>> import tempfile
      >>> run = pathlib.Path(tempfile.mkdtemp()) / "new" / "run"
      >>> try:
      ...     with removed_on_error(run):
      ...         run.mkdir(parents=True)
      ...         raise MpmdError("refused")
      ... except MpmdError:
      ...     pass
      >>> run.parent.exists()
      False
    """
    top = None
    path = run_dir.absolute()
    while not path.exists():
        top, path = path, path.parent
    try:
        yield
    except BaseException:
        if top is not None:
            shutil.rmtree(top, ignore_errors=True)
        raise


def _separator(tokenizer: Any) -> list[int]:
    eos = eos_id_of(tokenizer)
    return [eos] if eos is not None else tokenizer.encode("\n\n").tolist()


def build_data(
    cfg: Any, run_dir: pathlib.Path, seq_len: int, show_progress: bool = False
) -> TrainingData | None:
    """Tokenizer and tokens of a run with ``--dataset`` and/or ``--tokenizer``, else None.

    Copies the tokenizer into ``run_dir``, tokenizes (or reads ``run_dir/data_cache``) and
    splits off the held-out part; on an error it leaves nothing behind.

    Raises:
      MpmdError: an empty or too small dataset, an unreadable document, a bad tokenizer.
    """
    if getattr(cfg, "dataset", None) is None and getattr(cfg, "tokenizer", None) is None:
        return None
    run_dir = pathlib.Path(run_dir)
    fraction = cfg.val_fraction or DEFAULT_VAL_FRACTION
    with removed_on_error(run_dir):
        if cfg.dataset is None:  # a tokenizer file (given: see above) on the built-in corpus
            tokenizer = tokenizer_into_run(cfg.tokenizer, run_dir)
            train, val = train_val_split(
                tokenizer.encode(stdlib_corpus(cfg.corpus_bytes)), fraction
            )
            return TrainingData(tokenizer, train, val, "def ")
        tokenizer = tokenizer_into_run(cfg.tokenizer, run_dir) if cfg.tokenizer else None
        return _dataset(cfg, run_dir, seq_len, tokenizer, fraction, show_progress)


def _dataset(
    cfg: Any,
    run_dir: pathlib.Path,
    seq_len: int,
    tokenizer: Any,
    fraction: float,
    show_progress: bool,
) -> TrainingData:
    """`build_data` for ``--dataset``: tokenizes (or reads the cache) and splits."""
    files = resolve_dataset_files(cfg.dataset)
    val_files = resolve_dataset_files(cfg.val_dataset, "--val-dataset") if cfg.val_dataset else []
    cache = run_dir / CACHE_DIR
    if tokenizer is None:
        chars = char_vocabulary(files + val_files, cfg.text_field, cache, extra=EOD_CHAR)
        tokenizer = CharTokenizer(list(chars))
    separator = _separator(tokenizer)

    def tokenize(names: list[pathlib.Path], name: str) -> np.ndarray:
        return tokenize_to_cache(
            names, tokenizer, separator, cache, name, cfg.text_field, show_progress
        )

    tokens = tokenize(files, "train")
    if val_files:
        train, val = tokens, tokenize(val_files, "val")
        held_out = f"--val-dataset {cfg.val_dataset}"
    else:
        train, val = train_val_split(tokens, fraction)
        held_out = f"the last {fraction:.0%} of the tokens"
    for part, what in ((train, "training"), (val, "held-out")):
        if len(part) <= seq_len:
            raise MpmdError(
                f"--dataset {cfg.dataset}: the {what} part has {len(part)} tokens, too few for "
                f"one sequence of --seq-len {seq_len} (+1 for the targets); add text, lower "
                "--seq-len, or change --val-fraction/--val-dataset."
            )
    data_key = cache_key(files, tokenizer.to_dict(), cfg.text_field)
    stop = next((i for i, t in enumerate(train[:8]) if int(t) in separator), 8)
    prompt = tokenizer.decode(np.asarray(train[: max(1, min(4, stop))]))
    note = (
        f"dataset {cfg.dataset}: {len(files)} files, {len(train):,} training tokens "
        f"({(len(train) - 1) // seq_len:,} sequences of {seq_len}), {len(val):,} held out "
        f"({held_out}); tokenizer {type(tokenizer).__name__} of {tokenizer.vocab_size:,} ids; "
        f"token cache {cache}"
    )
    return TrainingData(tokenizer, train, val, prompt, data_key, [note])
