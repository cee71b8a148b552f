"""``nnx-mpmd train --dataset/--tokenizer``: packing, tokenizer files, caching, resume, errors.

The tokenizer files are trained here, in ``tmp_path``, on a few lines: a Hugging
Face BPE (``tokenizers``) and a SentencePiece model (``sentencepiece``). The
training runs use a 2-stage GPT small enough to compile in seconds; their
losses are compared with the same model stepped by `nnx.jit`, and a stopped and
resumed run with the straight one, bit for bit (in one process) and under
``nnx-mpmd launch`` with 2 processes (to float rounding).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from flax import nnx

from nnx_mpmd.apps import datasets, text_tokenizers, token_files, train
from nnx_mpmd.apps.data import CharTokenizer
from nnx_mpmd.apps.datasets import PackedBatches, resolve_dataset_files
from nnx_mpmd.apps.text_tokenizers import EOD_CHAR, tokenizer_from_dict, tokenizer_into_run
from nnx_mpmd.errors import MpmdError

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "cats",
    "watch",
    "from",
    "far",
    "away",
]
# 2 stages on 2 meshes x 1 device, 8 sequences of 16 tokens a step.
TINY = [
    "--meshes", "2", "--data", "1", "--layers", "2", "--batch-size", "8",
    "--microbatches", "2", "--seq-len", "16", "--log-every", "1", "--ckpt-every", "2",
    "--warmup", "1", "--steps", "4", "--sample-tokens", "0", "--val-batches", "1",
]  # fmt: skip


def _lines(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=10)) for _ in range(count)]


@pytest.fixture
def text_folder(tmp_path):
    """Two .txt documents and a .jsonl file of 20 documents (about 6 kB)."""
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("\n".join(_lines(40, 1)))
    (folder / "sub" / "b.txt").write_text("\n".join(_lines(40, 2)))
    records = [json.dumps({"text": line, "id": i}) for i, line in enumerate(_lines(20, 3))]
    (folder / "c.jsonl").write_text("\n".join(records) + "\n")
    (folder / "notes.md").write_text("not a dataset file")
    return folder


@pytest.fixture(scope="module")
def hf_tokenizer_file(tmp_path_factory):
    """A byte-level BPE tokenizer.json with an <|endoftext|> token, trained on a few lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_lines(50, 4), trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def spm_model_file(tmp_path_factory):
    """A SentencePiece unigram model trained on a few lines."""
    import sentencepiece as spm

    folder = tmp_path_factory.mktemp("spm")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_lines(50, 5)),
        model_prefix=str(folder / "spm"),
        vocab_size=60,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return folder / "spm.model"


# -- files and documents --------------------------------------------------------------


def test_a_directory_gives_its_dataset_files_in_sorted_order(text_folder):
    names = [p.relative_to(text_folder).as_posix() for p in resolve_dataset_files(str(text_folder))]
    assert names == ["a.txt", "c.jsonl", "sub/b.txt"]
    globbed = resolve_dataset_files(str(text_folder / "**" / "*.txt"))
    assert [p.name for p in globbed] == ["a.txt", "b.txt"]


def test_jsonl_lines_and_parquet_rows_are_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d.jsonl").write_text('{"body": "one"}\n\n{"body": "two"}\n')
    assert list(token_files.read_documents(tmp_path / "d.jsonl", "body")) == ["one", "two"]
    pq.write_table(pa.table({"text": ["x", None, "yz"]}), tmp_path / "d.parquet")
    assert list(token_files.read_documents(tmp_path / "d.parquet")) == ["x", "yz"]


def test_documents_are_packed_each_followed_by_the_end_of_document_token(tmp_path):
    (tmp_path / "a.txt").write_text("ab")
    (tmp_path / "b.jsonl").write_text('{"text": "ba"}\n{"text": ""}\n{"text": "c"}\n')
    files = resolve_dataset_files(str(tmp_path))
    chars = token_files.char_vocabulary(files, "text", tmp_path / "cache", extra=EOD_CHAR)
    assert chars == EOD_CHAR + "abc"
    tok = CharTokenizer(list(chars))
    tokens = token_files.tokenize_to_cache(files, tok, [0], tmp_path / "cache", "train")
    assert tok.decode(tokens) == "ab\x03ba\x03c\x03"  # the empty document adds nothing
    assert isinstance(tokens, np.memmap)


def _data_options(**options) -> object:
    """The data options of ``nnx-mpmd train``, parsed, with ``options`` set."""
    cfg = train.config_from_args([])
    for name, value in options.items():
        setattr(cfg, name, value)
    return cfg


def test_held_out_data_is_the_val_dataset_or_the_last_val_fraction(text_folder, tmp_path):
    files = resolve_dataset_files(str(text_folder))
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("\n".join(_lines(10, 9)))
    by_file = datasets.build_data(
        _data_options(dataset=str(text_folder), val_dataset=str(held_out)), tmp_path / "a", 16
    )
    assert isinstance(by_file.tokenizer, CharTokenizer) and EOD_CHAR in by_file.tokenizer.chars
    assert by_file.tokenizer.decode(by_file.val_tokens) == held_out.read_text() + EOD_CHAR
    whole = sum(len(d) + 1 for f in files for d in token_files.read_documents(f))
    assert len(by_file.train_tokens) == whole
    assert by_file.sample_prompt == files[0].read_text()[:4]
    split = datasets.build_data(
        _data_options(dataset=str(text_folder), val_fraction=0.25), tmp_path / "b", 16
    )
    assert len(split.val_tokens) == round(0.25 * whole)
    assert len(split.train_tokens) + len(split.val_tokens) == whole
    assert "held out (the last 25% of the tokens)" in split.notes[0]


def test_an_empty_tokenizer_path_alone_is_an_mpmd_error(tmp_path):
    # Before: build_data took "" for "no tokenizer" and then called None.encode.
    with pytest.raises(MpmdError, match=r"--tokenizer \.: unknown tokenizer file type"):
        datasets.build_data(_data_options(tokenizer="", corpus_bytes=5000), tmp_path / "run", 16)


def test_a_tokenizer_file_alone_tokenizes_the_builtin_corpus(spm_model_file, tmp_path):
    from nnx_mpmd.apps.data import BatchIterator, stdlib_corpus

    data = datasets.build_data(
        _data_options(tokenizer=str(spm_model_file), corpus_bytes=5000), tmp_path / "run", 16
    )
    assert data.tokenizer.to_dict()["file"] == "tokenizer.model"
    tokens = data.tokenizer.encode(stdlib_corpus(5000))
    np.testing.assert_array_equal(np.concatenate([data.train_tokens, data.val_tokens]), tokens)
    assert isinstance(data.batches(4, 16, 0), BatchIterator)


# -- batches --------------------------------------------------------------------------


def test_packed_batches_are_shuffled_sequences_deterministic_per_seed():
    tokens = np.arange(10 * 4 + 1, dtype=np.int32)  # 10 sequences of 4 (+1)
    a = PackedBatches(tokens, batch_size=5, seq_len=4, seed=3)
    b = PackedBatches(tokens, batch_size=5, seq_len=4, seed=3)
    first = [a.batch_at(i) for i in range(4)]
    for i, batch in enumerate(first):
        np.testing.assert_array_equal(batch["inputs"], b.batch_at(i)["inputs"])
        assert batch["inputs"].dtype == np.int32 and batch["inputs"].shape == (5, 4)
        np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
        assert (batch["inputs"][:, 0] % 4 == 0).all()  # each row starts a packed sequence
    starts = [b["inputs"][:, 0] // 4 for b in first]
    epoch0, epoch1 = np.concatenate(starts[:2]), np.concatenate(starts[2:])
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))  # every sequence once an epoch
    assert not np.array_equal(epoch0, np.arange(10))  # shuffled
    assert not np.array_equal(epoch0, epoch1)  # reshuffled every epoch
    other = PackedBatches(tokens, batch_size=5, seq_len=4, seed=4).batch_at(0)["inputs"]
    assert not np.array_equal(other, first[0]["inputs"])


def test_batch_at_rows_builds_exactly_those_rows_of_the_batch():
    batches = PackedBatches(np.arange(200, dtype=np.int32), batch_size=8, seq_len=6, seed=0)
    whole = batches.batch_at(5)
    rows = np.array([6, 1, 3])
    part = batches.batch_at(5, rows=rows)
    for key in ("inputs", "targets"):
        np.testing.assert_array_equal(part[key], whole[key][rows])
    assert batches.batch_at(5, rows=np.array([], int))["inputs"].shape == (0, 6)
    with pytest.raises(
        MpmdError,
        match=r"PackedBatches.batch_at: rows must lie in \[0, 8\) \(the batch size\), got min 8 max 8",
    ):
        batches.batch_at(0, rows=[8])


def test_state_dict_resumes_at_the_next_batch_and_refuses_other_data():
    tokens = np.arange(300, dtype=np.int32)
    batches = PackedBatches(tokens, batch_size=4, seq_len=8, seed=1, data_key="k")
    next(batches)
    state = batches.state_dict()
    expected = next(batches)
    resumed = PackedBatches(tokens, batch_size=4, seq_len=8, seed=1, data_key="k")
    resumed.load_state_dict(json.loads(json.dumps(state)))
    np.testing.assert_array_equal(next(resumed)["inputs"], expected["inputs"])
    changed = PackedBatches(tokens, batch_size=4, seq_len=8, seed=1, data_key="other")
    with pytest.raises(MpmdError, match=r"saved data state has data_key='k'.*new --run-dir"):
        changed.load_state_dict(state)


# -- tokenizer files ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["hf", "sentencepiece"])
def test_tokenizer_file_is_copied_into_the_run_and_reloaded_by_its_sha256(
    kind, hf_tokenizer_file, spm_model_file, tmp_path
):
    source = hf_tokenizer_file if kind == "hf" else spm_model_file
    tok = tokenizer_into_run(source, tmp_path / "run")
    saved = tok.to_dict()
    assert saved["type"] == kind and (tmp_path / "run" / saved["file"]).is_file()
    assert saved["sha256"] == text_tokenizers.file_sha256(source)
    ids = tok.encode("the lazy dog")
    assert ids.dtype == np.int32 and 0 < len(ids) < len("the lazy dog")
    assert tok.decode(ids) == "the lazy dog"
    assert tok.eos_id is not None and 0 <= tok.eos_id < tok.vocab_size
    again = tokenizer_from_dict(json.loads(json.dumps(saved)), tmp_path / "run")
    np.testing.assert_array_equal(again.encode("quick fox"), tok.encode("quick fox"))
    (tmp_path / "run" / saved["file"]).write_bytes(b"changed")
    with pytest.raises(MpmdError, match=r"differs from the one the run trained with"):
        tokenizer_from_dict(saved, tmp_path / "run")
    (tmp_path / "run" / saved["file"]).unlink()
    with pytest.raises(MpmdError, match=r"tokenizer file .* is missing; copy the --tokenizer"):
        tokenizer_from_dict(saved, tmp_path / "run")


def test_the_token_cache_is_reused_and_redone_when_a_file_changes(text_folder, monkeypatch):
    files = resolve_dataset_files(str(text_folder))
    tok = CharTokenizer(list(EOD_CHAR + "\n " + "".join(sorted(set("".join(WORDS))))))
    cache = text_folder.parent / "cache"
    first = np.array(token_files.tokenize_to_cache(files, tok, [0], cache, "train"))
    real_read = token_files.read_documents

    def refuse(*args, **kwargs):
        raise AssertionError("read the documents although the cache holds them")

    monkeypatch.setattr(token_files, "read_documents", refuse)
    np.testing.assert_array_equal(
        token_files.tokenize_to_cache(files, tok, [0], cache, "train"), first
    )
    monkeypatch.setattr(token_files, "read_documents", real_read)
    (text_folder / "a.txt").write_text("the dog")
    changed = token_files.tokenize_to_cache(files, tok, [0], cache, "train")
    assert tok.decode(changed[:8]) == "the dog\x03"
    assert len(list(cache.glob("train-*.tokens"))) == 2


# -- training -------------------------------------------------------------------------


def _train(argv: list[str], run_dir) -> tuple[list[float], list[np.ndarray], object]:
    import jax

    from nnx_mpmd.apps.train_loop import Trainer

    trainer = Trainer(train.config_from_args([*argv, "--run-dir", str(run_dir)]), run_dir)
    trainer.train()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    state = [np.asarray(x) for x in jax.tree.leaves(nnx.state(trainer.model))]
    return [json.loads(line)["loss"] for line in lines], state, trainer


def _reference_losses(argv: list[str], run_dir, steps: int) -> list[float]:
    """The same model, optimizer and batches stepped by `nnx.jit` on one device."""
    from nnx_mpmd.apps.train_loop import Trainer, train_step

    trainer = Trainer(train.config_from_args([*argv, "--run-dir", str(run_dir)]), run_dir)
    step = nnx.jit(train_step)
    return [
        float(step(trainer.model, trainer.optimizer, next(trainer.batches))) for _ in range(steps)
    ]


def test_dataset_run_with_a_tokenizer_file_resumes_like_the_straight_run(
    text_folder, hf_tokenizer_file, tmp_path
):
    args = [*TINY, "--dataset", str(text_folder), "--tokenizer", str(hf_tokenizer_file)]
    reference = _reference_losses(args, tmp_path / "reference", 4)
    straight, straight_state, trainer = _train(args, tmp_path / "straight")
    assert trainer.model.config.vocab_size == trainer.tokenizer.vocab_size > 256
    np.testing.assert_allclose(straight, reference, rtol=1e-5)
    _train([*args, "--stop-at", "2"], tmp_path / "split")
    resumed, state, trainer = _train([*args, "--resume"], tmp_path / "split")
    assert trainer.batches.position == 4
    assert np.array_equal(resumed, straight), (resumed, straight)
    for got, want in zip(state, straight_state, strict=True):
        assert np.array_equal(got, want)
    assert len(list((tmp_path / "split" / "data_cache").glob("train-*.tokens"))) == 1
    from nnx_mpmd.checkpoint import CheckpointManager

    manager = CheckpointManager(tmp_path / "split" / "checkpoints")
    metadata = manager.metadata(4)
    manager.close()
    assert metadata["tokenizer"] == trainer.tokenizer.to_dict()
    assert metadata["tokenizer"]["type"] == "hf" and metadata["data"]["position"] == 4


@pytest.mark.slow
@pytest.mark.multiprocess
def test_launched_dataset_run_stopped_and_resumed_equals_one_process(
    text_folder, spm_model_file, tmp_path
):
    from mp_launch import check, launch, logged_losses

    args = [*TINY, "--dataset", str(text_folder), "--tokenizer", str(spm_model_file)]
    straight, _, _ = _train(args, tmp_path / "straight")
    run_dir = tmp_path / "launched"
    command = [sys.executable, "-m", "nnx_mpmd", "train", *args, "--run-dir", str(run_dir)]
    command += ["--compile-cache", str(tmp_path / "cache")]
    first, _ = launch(
        [*command, "--stop-at", "2"], processes=2, devices_per_process=1, timeout=300,
        fresh=[(run_dir, False)],
    )  # fmt: skip
    check(first)
    resumed, _ = launch([*command, "--resume"], processes=2, devices_per_process=1, timeout=300)
    check(resumed)
    assert "[p0] resumed from step 2" in resumed.stdout
    losses = logged_losses(run_dir)
    assert sorted(losses) == [1, 2, 3, 4]
    np.testing.assert_allclose([losses[s] for s in (1, 2, 3, 4)], straight, rtol=1e-5)


# -- errors ---------------------------------------------------------------------------


def _bad_inputs(folder, hf_file):
    """(argv, message) pairs; every path lies under ``folder``."""
    (folder / "empty").mkdir()
    (folder / "empty" / "e.txt").write_text("")
    (folder / "small.txt").write_text("tiny text")
    (folder / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    (folder / "vocab.txt").write_text("a b c")
    (folder / "broken.json").write_text("{not json")
    big = folder / "big.txt"
    big.write_text("\n".join(_lines(30)))
    data = ["--dataset", str(big)]
    return [
        (["--dataset", str(folder / "missing")], r"--dataset .*missing does not exist; pass a"),
        (["--dataset", str(folder / "*.csv")], r"the pattern matches no file; check the pattern"),
        (["--dataset", str(folder / "empty")], r"dataset \(1 files, .*\) holds no text"),
        (["--dataset", str(folder / "small.txt")], r"too few for one sequence of --seq-len 16"),
        (["--dataset", str(folder / "bad.jsonl")], r"bad.jsonl:2: no string field 'text' .*"),
        ([*data, "--tokenizer", str(folder / "no.json")], r"--tokenizer .* does not exist"),
        ([*data, "--tokenizer", str(folder / "vocab.txt")], r"unknown tokenizer file type '.txt'"),
        ([*data, "--tokenizer", str(folder / "broken.json")], r"is not a Hugging Face tokenizer"),
        ([*data, "--val-fraction", "1.5"], r"--val-fraction=1.5 must lie in \(0, 1\)"),
        (["--val-dataset", str(big)], r"--val-dataset needs --dataset"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_bad_data_input_exits_2_with_one_line_and_leaves_no_run_dir(
    case, tmp_path, hf_tokenizer_file, capsys
):
    folder = tmp_path / "inputs"
    folder.mkdir()
    argv, message = _bad_inputs(folder, hf_tokenizer_file)[case]
    run_dir = tmp_path / "runs" / "run"
    with pytest.raises(MpmdError, match=message):
        cfg = train.config_from_args([*TINY, *argv, "--run-dir", str(run_dir)])
        from nnx_mpmd.apps.train_loop import Trainer

        Trainer(cfg, run_dir)
    assert train.main([*TINY, *argv, "--run-dir", str(run_dir), "--no-compile-cache"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nnx-mpmd train: error: "), err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("package", "argv", "message"),
    [
        ("grain", [], r"--dataset needs the 'grain' package .* pip install 'nnx-mpmd\[data\]'"),
        (
            "tokenizers",
            ["--tokenizer", "HF"],
            r"needs the 'tokenizers' package, which is not installed; pip install",
        ),
        (
            "sentencepiece",
            ["--tokenizer", "SPM"],
            r"'sentencepiece' package, which is not installed; pip install 'nnx-mpmd\[data\]'",
        ),
        ("pyarrow", ["PARQUET"], r"needs pyarrow \(not installed\); pip install 'nnx-mpmd\["),
    ],
)
def test_a_missing_optional_package_is_named_with_its_extra(
    package, argv, message, monkeypatch, text_folder, hf_tokenizer_file, spm_model_file
):
    import importlib.util

    (text_folder / "d.parquet").write_bytes(b"")
    swap = {"HF": str(hf_tokenizer_file), "SPM": str(spm_model_file)}
    argv = [swap.get(a, a) for a in argv]
    dataset = str(text_folder / "d.parquet") if argv[:1] == ["PARQUET"] else str(text_folder)
    argv = [a for a in argv if a != "PARQUET"]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == package else real_find_spec(name, *a),
    )
    monkeypatch.setitem(sys.modules, package, None)  # `import package` raises ImportError
    with pytest.raises(MpmdError, match=message):
        train.config_from_args([*TINY, "--dataset", dataset, *argv])


def test_the_data_options_are_listed_in_the_help(capsys):
    with pytest.raises(SystemExit):
        train.build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for option in ("--dataset", "--val-dataset", "--val-fraction", "--text-field", "--tokenizer"):
        assert option in out


def test_a_run_refused_after_tokenizing_leaves_no_run_dir(text_folder, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "run"
    argv = [*TINY, "--seq-len", "100", "--dataset", str(text_folder), "--run-dir", str(run_dir)]
    assert train.main([*argv, "--no-compile-cache"]) == 2
    assert "--seq-len=100 must lie in [1, 64]" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
