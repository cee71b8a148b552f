"""The main job's data: stdlib corpus, character tokenizer, resumable batches."""

import json

import numpy as np
import pytest

from nnx_mpmd.apps.data import BatchIterator, CharTokenizer, stdlib_corpus, train_val_split
from nnx_mpmd.errors import MpmdError


def test_stdlib_corpus_is_deterministic_capped_and_ascii():
    first = stdlib_corpus(50_000)
    assert first == stdlib_corpus(50_000)
    assert len(first) == 50_000
    assert set(first) <= {chr(c) for c in range(32, 127)} | {"\n", "\t"}
    assert "def " in first and "import " in first
    assert stdlib_corpus(60_000).startswith(first)


def test_stdlib_corpus_reads_sorted_files_and_skips_site_packages(tmp_path):
    (tmp_path / "b.py").write_text("B = 2\n")
    (tmp_path / "a.py").write_text("A = 'é'\n")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "c.py").write_text("C = 3\n")
    (tmp_path / "notes.txt").write_text("not python")
    assert stdlib_corpus(1000, root=tmp_path) == "A = '?'\n\n\nB = 2\n\n\n"
    assert stdlib_corpus(1000, root=tmp_path, ascii_only=False).startswith("A = 'é'")
    assert stdlib_corpus(3, root=tmp_path) == "A ="


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [(dict(max_bytes=0), r"max_bytes=0 must be >= 1"), (dict(root="EMPTY"), r"no \*\.py files")],
)
def test_stdlib_corpus_errors(tmp_path, kwargs, match):
    if kwargs.get("root") == "EMPTY":
        kwargs["root"] = tmp_path
    with pytest.raises(MpmdError, match=match):
        stdlib_corpus(**kwargs)


@pytest.mark.parametrize("text", ["hello world", "def f(x):\n\treturn x + 1\n", "aaaa"])
def test_tokenizer_round_trip_and_json(text):
    tok = CharTokenizer.from_text(text)
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.vocab_size == len(set(text))
    restored = CharTokenizer.from_dict(json.loads(json.dumps(tok.to_dict())))
    assert restored == tok and restored.encode(text).tolist() == ids.tolist()
    assert hash(restored) == hash(tok)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda tok: tok.encode("hex"), r"character 'x' is not in the vocabulary"),
        (lambda tok: tok.decode([0, 7]), r"ids must lie in \[0, 3\)"),
        (lambda tok: CharTokenizer.from_dict({"type": "bpe"}), r"expected \{'type': 'char'"),
        (lambda tok: CharTokenizer(["a", "a"]), r"distinct single characters"),
        (lambda tok: CharTokenizer([]), r"non-empty list"),
    ],
)
def test_tokenizer_errors(call, match):
    tok = CharTokenizer.from_text("he!")
    with pytest.raises(MpmdError, match=match):
        call(tok)


@pytest.mark.parametrize("fraction", [0.1, 0.5])
def test_train_val_split(fraction):
    tokens = np.arange(100)
    train, val = train_val_split(tokens, fraction)
    assert len(val) == round(100 * fraction)
    assert np.concatenate([train, val]).tolist() == tokens.tolist()


@pytest.mark.parametrize(
    ("tokens", "fraction", "match"),
    [(np.arange(10), 0.0, r"must lie in \(0, 1\)"), (np.arange(1), 0.5, r"too few to split")],
)
def test_train_val_split_errors(tokens, fraction, match):
    with pytest.raises(MpmdError, match=match):
        train_val_split(tokens, fraction)


@pytest.mark.parametrize(("batch_size", "seq_len"), [(1, 1), (4, 16)])
def test_batches_are_shifted_windows_of_the_stream(batch_size, seq_len):
    tokens = np.arange(1000, dtype=np.int32)
    batch = next(BatchIterator(tokens, batch_size, seq_len, seed=3))
    assert batch["inputs"].shape == batch["targets"].shape == (batch_size, seq_len)
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    np.testing.assert_array_equal(np.diff(batch["inputs"], axis=1), 1)
    np.testing.assert_array_equal(batch["targets"][:, -1], batch["inputs"][:, -1] + 1)


def test_batches_are_deterministic_and_depend_on_seed():
    def first_batches(seed):
        it = BatchIterator(np.arange(5000), 4, 8, seed=seed)
        return [next(it)["inputs"] for _ in range(5)]

    a, b, c = first_batches(0), first_batches(0), first_batches(1)
    assert all((x == y).all() for x, y in zip(a, b))
    assert not all((x == z).all() for x, z in zip(a, c))
    assert not (a[0] == a[1]).all()


def test_resume_continues_with_exactly_the_same_batches():
    tokens = np.arange(5000)
    uninterrupted = BatchIterator(tokens, 2, 8, seed=7)
    expected = [next(uninterrupted) for _ in range(6)]
    first = BatchIterator(tokens, 2, 8, seed=7)
    for _ in range(3):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["position"] == 3
    resumed = BatchIterator(tokens, 2, 8, seed=7)
    resumed.load_state_dict(state)
    for want in expected[3:]:
        got = next(resumed)
        np.testing.assert_array_equal(got["inputs"], want["inputs"])
        np.testing.assert_array_equal(got["targets"], want["targets"])
    assert resumed.position == 6
    np.testing.assert_array_equal(resumed.batch_at(0)["inputs"], expected[0]["inputs"])


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((np.arange(100), 0, 8), r"batch_size=0 and seq_len=8 must be >= 1"),
        ((np.arange(8), 2, 8), r"8 tokens are too few for seq_len=8"),
    ],
)
def test_batch_iterator_construction_errors(args, match):
    with pytest.raises(MpmdError, match=match):
        BatchIterator(*args)


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"position": 1, "seed": 9}, r"saved seed=9 but this iterator has seed=0"),
        ({"position": 1, "seq_len": 4}, r"saved seq_len=4"),
        ({"position": -1}, r"position=-1 must be an int >= 0"),
        ({}, r"position=None"),
    ],
)
def test_load_state_dict_errors(state, match):
    it = BatchIterator(np.arange(100), 2, 8, seed=0)
    with pytest.raises(MpmdError, match=match):
        it.load_state_dict(state)
