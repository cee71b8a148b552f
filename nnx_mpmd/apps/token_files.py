"""Documents of the user's dataset files, tokenized once into a cached token file.

A ``.txt`` file is one document; a ``.jsonl`` file holds one document per line
(the string field ``--text-field``, default ``text``); a ``.parquet`` file one
per row of that column (``pyarrow``, ``pip install 'nnx-mpmd[parquet]'``).
`tokenize_to_cache` encodes the documents in order, ends each with the
end-of-document token, and writes the ids as raw int32 into
``RUN/data_cache/NAME-KEY.tokens`` with a JSON sidecar. The key hashes every
file's path, size and modification time, the tokenizer's ``to_dict()`` (its
sha256 for a tokenizer file) and the text field, so a resumed or repeated run
in the same directory maps the file (`numpy.memmap`) instead of tokenizing again,
and a changed file or tokenizer is tokenized afresh.

Each process of a multi-process run that finds no cache writes its own
temporary file and renames it into place (the contents are identical), so no
process waits for another; only the process that shows progress draws a bar.

This module imports no JAX.

Example:
    >>> import tempfile
    >>> from nnx_mpmd.apps.data import CharTokenizer
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "a.txt").write_text("abc")
    >>> tok = CharTokenizer(["a", "b", "c", "\\x03"])
    >>> tokens = tokenize_to_cache([d / "a.txt"], tok, 3, d / "cache", "train")
    >>> tokens.tolist()
    [0, 1, 2, 3]
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from nnx_mpmd.errors import MpmdError

__all__ = [
    "PARQUET_INSTALL",
    "cache_key",
    "char_vocabulary",
    "read_documents",
    "tokenize_to_cache",
]

PARQUET_INSTALL = "pip install 'nnx-mpmd[parquet]'"
_PARQUET_BATCH_ROWS = 1024


def _jsonl_documents(path: pathlib.Path, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise MpmdError(
                    f"{path}:{number}: not a JSON object ({e.msg}); every line of a .jsonl "
                    "dataset must be one JSON object."
                ) from None
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise MpmdError(
                    f"{path}:{number}: no string field {text_field!r} (the line has {keys}); "
                    "name the field with --text-field."
                )
            yield text


def _parquet_documents(path: pathlib.Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise MpmdError(
            f"--dataset {path}: .parquet files need pyarrow, which is not installed; "
            f"{PARQUET_INSTALL}."
        ) from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError
        raise MpmdError(f"{path} is not a readable parquet file ({e}).") from None
    if text_field not in parquet.schema_arrow.names:
        raise MpmdError(
            f"{path}: no column {text_field!r} (columns: {parquet.schema_arrow.names}); name "
            "the text column with --text-field."
        )
    for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield str(text)


def read_documents(path: str | pathlib.Path, text_field: str = "text") -> Iterator[str]:
    """The documents of one ``.txt``, ``.jsonl`` or ``.parquet`` file, in file order.

    Raises:
      MpmdError: a ``.jsonl`` line that is not JSON or lacks the field, a parquet
        file without the column, or pyarrow missing for a ``.parquet`` file.

    Example:
      >>> import tempfile
      >>> p = pathlib.Path(tempfile.mkdtemp()) / "d.jsonl"
      >>> _ = p.write_text('{"text": "a"}\\n{"text": "b"}\\n')
      >>> list(read_documents(p))
      ['a', 'b']
    """
    path = pathlib.Path(path)
    if path.suffix == ".jsonl":
        return _jsonl_documents(path, text_field)
    if path.suffix == ".parquet":
        return _parquet_documents(path, text_field)
    return iter([path.read_text(encoding="utf-8", errors="replace")])


def cache_key(files: Sequence[pathlib.Path], tokenizer: dict[str, Any], text_field: str) -> str:
    """A short hash of the files (path, size, mtime), the tokenizer and the text field.

    Example:
      >>> len(cache_key([], {"type": "char", "chars": "ab"}, "text"))
      16
    """
    stats = []
    for path in files:
        stat = pathlib.Path(path).stat()
        stats.append([str(pathlib.Path(path).resolve()), stat.st_size, stat.st_mtime_ns])
    blob = json.dumps([stats, tokenizer, text_field], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _read_cache(tokens_path: pathlib.Path, meta_path: pathlib.Path) -> np.ndarray | None:
    """The cached tokens when both files are there and agree, else None."""
    if not (tokens_path.is_file() and meta_path.is_file()):
        return None
    try:
        count = int(json.loads(meta_path.read_text())["num_tokens"])
    except (ValueError, KeyError, TypeError):
        return None
    if count < 1 or tokens_path.stat().st_size != 4 * count:
        return None
    return np.memmap(tokens_path, dtype=np.int32, mode="r", shape=(count,))


@contextlib.contextmanager
def _progress(files: Sequence[pathlib.Path], name: str, shown: bool) -> Iterator[Any]:
    """A rich progress bar over the files' bytes (a no-op callable when not shown)."""
    if not shown:
        yield lambda advance: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

    total = sum(pathlib.Path(f).stat().st_size for f in files)
    with Progress(
        TextColumn(f"[bold]tokenizing {name}"), BarColumn(), DownloadColumn(), TimeElapsedColumn()
    ) as progress:
        task = progress.add_task(name, total=total)
        yield lambda advance: progress.advance(task, advance)


def tokenize_to_cache(
    files: Sequence[pathlib.Path],
    tokenizer: Any,
    separator: int | Sequence[int] | None,
    cache_dir: str | pathlib.Path,
    name: str,
    text_field: str = "text",
    show_progress: bool = False,
) -> np.ndarray:
    """The token stream of ``files`` (read-only int32 memmap), from the cache or tokenized into it.

    ``separator`` id(s) follow every document; ``name`` (``train``/``val``) starts the file name.

    Raises:
      MpmdError: the files hold no tokens, or a document cannot be read.
    """
    cache_dir = pathlib.Path(cache_dir)
    key = cache_key(files, tokenizer.to_dict(), text_field)
    tokens_path = cache_dir / f"{name}-{key}.tokens"
    meta_path = tokens_path.with_suffix(".json")
    cached = _read_cache(tokens_path, meta_path)
    if cached is not None:
        return cached
    tail = np.asarray([] if separator is None else separator, dtype=np.int32).reshape(-1)
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = tokens_path.with_name(f".{tokens_path.name}.{os.getpid()}.tmp")
    count = documents = 0
    try:
        with open(partial, "wb") as out, _progress(files, name, show_progress) as advance:
            for path in files:
                for text in read_documents(path, text_field):
                    ids = np.asarray(tokenizer.encode(text), dtype=np.int32)
                    if not ids.size:
                        continue
                    out.write(ids.tobytes())
                    out.write(tail.tobytes())
                    count += ids.size + tail.size
                    documents += 1
                advance(pathlib.Path(path).stat().st_size)
        if count == 0:
            raise MpmdError(
                f"the {name} dataset ({len(files)} files, first {files[0]}) holds no text; "
                "point --dataset at files with text in them."
            )
        os.replace(partial, tokens_path)
    finally:
        partial.unlink(missing_ok=True)
    meta = {"num_tokens": count, "documents": documents, "files": [str(f) for f in files]}
    meta_partial = meta_path.with_name(f".{meta_path.name}.{os.getpid()}.tmp")
    meta_partial.write_text(json.dumps(meta, indent=1))
    os.replace(meta_partial, meta_path)
    return np.memmap(tokens_path, dtype=np.int32, mode="r", shape=(count,))


def char_vocabulary(
    files: Sequence[pathlib.Path],
    text_field: str,
    cache_dir: str | pathlib.Path,
    extra: str = "",
) -> str:
    """Every character of the files' documents and ``extra``, sorted; cached in ``cache_dir``.

    The character tokenizer of a ``--dataset`` run without ``--tokenizer``; the cache
    spares a second run from reading the documents.

    Example:
      >>> import tempfile
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> _ = (d / "a.txt").write_text("cab")
      >>> char_vocabulary([d / "a.txt"], "text", d / "cache")
      'abc'
    """
    cache_dir = pathlib.Path(cache_dir)
    path = (
        cache_dir / f"vocab-{cache_key(files, {'type': 'char', 'extra': extra}, text_field)}.json"
    )
    if path.is_file():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return str(json.loads(path.read_text())["chars"])
    chars = set(extra)
    for file in files:
        for text in read_documents(file, text_field):
            chars.update(text)
    vocabulary = "".join(sorted(chars))
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps({"chars": vocabulary}))
    os.replace(partial, path)
    return vocabulary
