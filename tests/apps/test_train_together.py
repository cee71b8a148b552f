"""The features of issue 48 together: data, tokenizer files, precision, evaluation, config
files, pretrained weights and ``generate`` in the same runs.

Each feature has its own tests elsewhere; these check that they combine. The runs
are tiny (one mesh, one layer, two steps) and run in-process. Every number is
checked against the same model under ``nnx.jit``.
"""

from __future__ import annotations

import io
import json
import pathlib
import shutil

import pytest
from flax import nnx

from nnx_mpmd.apps import convert, generate_cli, plan, sampling, train
from nnx_mpmd.apps.data import stdlib_corpus
from nnx_mpmd.checkpoint import CheckpointManager
from nnx_mpmd.errors import CheckpointError, MpmdError
from nnx_mpmd.jit.precision import precision_from_names
from nnx_mpmd.models import MODELS, lm_loss, load_pretrained

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("grain")
pytest.importorskip("safetensors")

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures"
LLAMA = FIXTURES / "hf_llama_tiny"  # vocab_size 96, max_position_embeddings 32
PROMPT = "def "
# One mesh of one device, one layer, two steps: the cheapest run that trains and saves.
ONE_MESH = [
    "--meshes", "1", "--data", "1", "--layers", "1", "--batch-size", "2",
    "--microbatches", "1", "--seq-len", "16", "--steps", "2", "--warmup", "0",
    "--sample-tokens", "0", "--val-batches", "0", "--ckpt-every", "1",
]  # fmt: skip


def _bpe(out: pathlib.Path, text_file: pathlib.Path, vocab_size: int) -> pathlib.Path:
    """A byte-level BPE ``tokenizer.json`` of exactly ``vocab_size`` ids, trained on the text
    (multi-character tokens; ``<|endoftext|>`` ends documents)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, limit_alphabet=48, special_tokens=["<unk>", "<|endoftext|>"]
    )
    tokenizer.train([str(text_file)], trainer)
    assert tokenizer.get_vocab_size() == vocab_size
    tokenizer.save(str(out))
    return out


@pytest.fixture(scope="module")
def text_and_tokenizer(tmp_path_factory):
    """A slice of the standard library as a text file, and a BPE tokenizer.json of 96 ids
    trained on it (the Llama fixture's vocabulary)."""
    where = tmp_path_factory.mktemp("together")
    text = where / "text.txt"
    text.write_text(stdlib_corpus(6000))
    return text, _bpe(where / "tokenizer.json", text, 96)


def _restored(run_dir: pathlib.Path, step: int | None = None):
    """The run's model of ``step`` (default: the latest) restored by hand onto one device,
    and the checkpoint's metadata."""
    manager = CheckpointManager(run_dir / "checkpoints", async_save=False)
    step = manager.latest_step() if step is None else step
    meta = manager.metadata(step)
    model_cls, config_cls = MODELS[meta["config"]["model"]]
    config = config_cls.from_dict({**meta["config"]["model_config"], "num_stages": 1})
    model = model_cls(config, rngs=nnx.Rngs(1))
    manager.restore({"model": model}, step, partial=True)
    manager.close()
    return model, meta


# -- the features together ----------------------------------------------------------------


@pytest.mark.slow  # compiles one step and a greedy decoding: ~30 s on 2 cores
def test_dataset_and_tokenizer_file_then_generate_decodes_with_that_tokenizer(
    tmp_path, text_and_tokenizer
):
    from nnx_mpmd.apps.text_tokenizers import HFTokenizer

    text, tokenizer_file = text_and_tokenizer
    run_dir = tmp_path / "run"
    argv = [*ONE_MESH, "--dataset", str(text), "--tokenizer", str(tokenizer_file)]
    train.run(train.config_from_args([*argv, "--run-dir", str(run_dir)]))
    out = io.StringIO()
    generated = generate_cli.run(
        generate_cli.config_from_args(
            [
                *("--run-dir", str(run_dir), "--prompt", PROMPT, "--max-tokens", "8"),
                *("--meshes", "1", "--data", "1"),
            ]
        ),
        out=out,
        err=io.StringIO(),
    )
    model, meta = _restored(run_dir)
    assert meta["tokenizer"]["type"] == "hf"
    tokenizer = HFTokenizer(tokenizer_file)  # the user's file: the run's copy is identical
    want = tokenizer.decode(sampling.generate(model, tokenizer, PROMPT, 8, temperature=0.0))
    assert generated["text"] == want
    assert out.getvalue() == want + "\n"  # streamed token by token, the same text


def test_init_from_with_its_tokenizer_and_a_dataset_uses_the_checkpoints_context(
    tmp_path, text_and_tokenizer
):
    """--init-from DIR (with DIR/tokenizer.json) + --dataset, no --seq-len: the sequences are
    the checkpoint's 32 positions, not the preset's 64, so a held-out part of 33-64 tokens
    is enough."""
    from nnx_mpmd.apps.text_tokenizers import HFTokenizer

    text, tokenizer_file = text_and_tokenizer
    hf_dir = tmp_path / "hf"
    shutil.copytree(LLAMA, hf_dir)
    shutil.copyfile(tokenizer_file, hf_dir / "tokenizer.json")
    tokenizer = HFTokenizer(tokenizer_file)
    words = stdlib_corpus(600).split()
    held_out = " ".join(words[:8])
    while len(tokenizer.encode(held_out)) + 1 < 45:  # +1: the end-of-document token
        held_out += " " + words[len(held_out.split())]
    val = tmp_path / "val.txt"
    val.write_text(held_out)
    run_dir = tmp_path / "run"
    argv = [*ONE_MESH, "--dataset", str(text), "--val-dataset", str(val), "--layers", "3"]
    argv.remove("--seq-len")
    argv.remove("16")
    cfg = train.config_from_args([*argv, "--init-from", str(hf_dir), "--run-dir", str(run_dir)])
    convert.apply_init_from(cfg, run_dir)
    assert cfg.tokenizer == str(hf_dir / "tokenizer.json")
    from nnx_mpmd.apps.train_loop import Trainer

    trainer = Trainer(cfg, run_dir)
    assert trainer.seq_len == 32 and trainer.tokenizer.to_dict()["type"] == "hf"
    assert 32 < len(trainer.val_tokens) <= 64
    batch = trainer.batches.batch_at(0)
    reference = float(nnx.jit(lm_loss)(load_pretrained(hf_dir), batch))
    assert float(nnx.jit(lm_loss)(trainer.model, batch)) == pytest.approx(reference, rel=1e-6)


@pytest.mark.slow  # compiles a bfloat16 step and its evaluation twice: ~40 s on 2 cores
def test_config_file_with_data_and_precision_is_read_back_by_resume(tmp_path, text_and_tokenizer):
    """A --config TOML with the data, precision and evaluation flags; the run stops at step
    1; --resume with no other flag continues it from RUN/config.toml, after the tokenizer
    file it was given is gone (the run's copy is used). bfloat16 with --eval-every: the
    logged held-out loss equals nnx.jit's under the same policy."""
    text, tokenizer_file = text_and_tokenizer
    own_tokenizer = tmp_path / "mine.json"
    shutil.copyfile(tokenizer_file, own_tokenizer)
    run_dir = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(
        f'dataset = "{text}"\ntokenizer = "{own_tokenizer}"\nval_fraction = 0.2\n'
        'dtype = "bfloat16"\neval_every = 1\neval_batches = 1\nseq_len = 16\n'
        f'run_dir = "{run_dir}"\n'
    )
    argv = [a for a in ONE_MESH if a not in ("--seq-len", "16")]
    first = train.run(train.config_from_args([*argv, "--config", str(config), "--stop-at", "1"]))
    assert first["steps_run"] == 1
    own_tokenizer.unlink()
    cfg = train.config_from_args(["--resume", "--run-dir", str(run_dir)])
    assert (cfg.dataset, cfg.dtype, cfg.eval_every, cfg.seq_len) == (str(text), "bfloat16", 1, 16)
    assert cfg.tokenizer == str(run_dir / "tokenizer.json")
    second = train.run(cfg)
    assert second["steps_run"] == 1
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all("eval_loss" in r for r in records)
    # The held-out loss of step 2, recomputed under nnx.jit with the run's precision policy.
    model, _ = _restored(run_dir, 2)
    from nnx_mpmd.apps.data import BatchIterator
    from nnx_mpmd.apps.train_loop import Trainer

    trainer = Trainer(cfg, run_dir)  # rebuilds the same held-out tokens; restores nothing
    batch = next(BatchIterator(trainer.val_tokens, 2, 16, seed=1))
    policy = precision_from_names("bfloat16", "float32")
    want = float(nnx.jit(policy.wrap(lm_loss))(model, batch))
    assert records[-1]["eval_loss"] == pytest.approx(want, rel=1e-5)


# -- loose ends -----------------------------------------------------------------------------


def test_resume_reuses_the_runs_copy_of_its_tokenizer(tmp_path, text_and_tokenizer):
    """The saved config names a tokenizer file that is gone: --resume takes RUN/tokenizer.json;
    a --tokenizer given anew wins."""
    _, tokenizer_file = text_and_tokenizer
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copyfile(tokenizer_file, run_dir / "tokenizer.json")
    (run_dir / "config.toml").write_text(f'tokenizer = "{tmp_path / "gone.json"}"\n')
    cfg = train.config_from_args(["--resume", "--run-dir", str(run_dir)])
    assert cfg.tokenizer == str(run_dir / "tokenizer.json")
    again = train.config_from_args(
        ["--resume", "--run-dir", str(run_dir), "--tokenizer", str(tokenizer_file)]
    )
    assert again.tokenizer == str(tokenizer_file)
    other = tmp_path / "other.json"
    other.write_text(tokenizer_file.read_text().replace("<unk>", "<UNK>"))
    copy = (run_dir / "tokenizer.json").read_bytes()
    with pytest.raises(
        MpmdError, match=r"--tokenizer .*other\.json differs from the tokenizer the"
    ):
        train.config_from_args(["--resume", "--run-dir", str(run_dir), "--tokenizer", str(other)])
    assert (run_dir / "tokenizer.json").read_bytes() == copy  # the run's copy is untouched
    with pytest.raises(MpmdError, match=r"--tokenizer .*gone\.json does not exist"):
        train.config_from_args(
            ["--run-dir", str(tmp_path / "new"), "--config", str(run_dir / "config.toml")]
        )
    # A character-level run (its config names no tokenizer) ignores a stray tokenizer.json.
    (run_dir / "config.toml").write_text("steps = 5\n")
    assert train.config_from_args(["--resume", "--run-dir", str(run_dir)]).tokenizer is None


def test_a_resume_with_another_tokenizer_names_the_tokenizer(monkeypatch):
    import nnx_mpmd.apps.train_resume as train_resume
    from nnx_mpmd.apps.train_resume import check_resumable

    class Tokenizer:
        def to_dict(self):
            return {"type": "char", "chars": ["a"]}

    class Trainer:
        cfg, notes, tokenizer = None, [], Tokenizer()

    settings = {k: 0 for k in train_resume.RESUME_KEYS + train_resume.LAYOUT_KEYS}
    monkeypatch.setattr(train_resume, "run_settings", lambda trainer: settings)
    saved = {"tokenizer": {"type": "hf", "file": "tokenizer.json", "sha256": "ab" * 32}}
    with pytest.raises(
        CheckpointError,
        match=r"the tokenizer differs \(saved: a tokenizer file tokenizer.json .*now: the "
        r"characters of the corpus.*resume without --tokenizer",
    ):
        check_resumable(Trainer(), {**saved, "config": settings}, pathlib.Path("ckpts"))


def test_plan_takes_the_init_from_checkpoint(tmp_path, monkeypatch, capsys):
    """``nnx-mpmd plan --init-from DIR`` plans the checkpoint's model (family, depth,
    vocabulary), and the train command it prints repeats --init-from."""
    seen = {}

    def fake_plan_and_save(cfg, trainer):
        seen["cfg"], seen["trainer"] = cfg, trainer
        print(f"train with: nnx-mpmd train --plan x{plan._model_options(cfg)}")

    monkeypatch.setattr(plan, "_plan_and_save", fake_plan_and_save)
    argv = ["--meshes", "1", "--data", "1", "--batch-size", "2", "--microbatches", "1"]
    argv += ["--seq-len", "16", "--corpus-bytes", "20000", "--init-from", str(LLAMA)]
    cfg = plan.build_parser().parse_args(argv, namespace=train.TrainConfig())
    plan.run(cfg)
    trainer = seen["trainer"]
    assert (seen["cfg"].model, trainer.num_layers) == ("llama", 3)
    assert trainer.model.config.vocab_size == 96
    assert f"--init-from {LLAMA}" in capsys.readouterr().out


def test_convert_saves_the_train_options_for_resume(tmp_path):
    """``convert --from-hf`` writes RUN/config.toml (``train --resume`` reads the options
    back) through the trainer's public `save_checkpoint`."""
    run_dir = tmp_path / "run"
    options = ["--meshes", "2", "--data", "1", "--batch-size", "4", "--microbatches", "2"]
    options += ["--seq-len", "16", "--corpus-bytes", "20000", "--steps", "7", "--lr", "0.01"]
    assert convert.main(["--from-hf", str(LLAMA), "--run-dir", str(run_dir), "--", *options]) == 0
    cfg = train.config_from_args(["--resume", "--run-dir", str(run_dir)])
    assert (cfg.steps, cfg.lr, cfg.meshes, cfg.seq_len) == (7, 0.01, 2, 16)
    convert.apply_init_from(cfg, run_dir)
    assert cfg.init_from == str(run_dir / "pretrained")  # the run's copy, not the source


@pytest.mark.parametrize("kind", ["byte-level BPE", "SentencePiece"])
def test_a_file_tokenizer_streams_multi_character_tokens_as_one_decode(tmp_path, kind):
    from nnx_mpmd.apps.text_tokenizers import HFTokenizer, SentencePieceTokenizer

    text = tmp_path / "t.txt"
    text.write_text("def café(x):\n    return x → 'naïve' 日本語, it's fine.\n" * 30)
    if kind == "SentencePiece":
        spm = pytest.importorskip("sentencepiece")
        spm.SentencePieceTrainer.train(
            input=str(text), model_prefix=str(tmp_path / "sp"), vocab_size=290, hard_vocab_limit=False,
            byte_fallback=True, character_coverage=1.0, minloglevel=2,
        )  # fmt: skip
        tokenizer = SentencePieceTokenizer(tmp_path / "sp.model")
    else:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        bpe.train([str(text)], trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet))
        bpe.save(str(tmp_path / "tokenizer.json"))
        tokenizer = HFTokenizer(tmp_path / "tokenizer.json")
    ids = tokenizer.encode("def café(x): → 日本語 it's fine, ÿ")
    out = io.StringIO()
    stream = generate_cli.TextStream(tokenizer, ids[:2], out)
    pieces = []
    for token in ids[2:]:
        before = out.getvalue()
        stream.add(int(token))
        pieces.append(out.getvalue()[len(before) :])
    stream.finish()
    assert out.getvalue() == tokenizer.decode(ids) + "\n"
    assert "\ufffd" not in "".join(pieces)  # an unfinished character waits for its last byte
    assert sum(bool(p) for p in pieces) >= len(ids) // 2  # it streams, not all at the end


def test_the_text_stream_goes_on_when_a_token_rewrites_earlier_text():
    """A decoder that cleans up (``"a ."`` decodes as ``"a."``) changes text already
    written: the stream keeps what it wrote and goes on with the rest, losing nothing."""

    class CleaningUp:
        def decode(self, ids):
            return "".join(chr(i) for i in ids).replace(" .", ".")

    out = io.StringIO()
    stream = generate_cli.TextStream(CleaningUp(), [ord("a")], out)
    for ch in " .bc":
        stream.add(ord(ch))
    stream.finish()
    assert out.getvalue() == "a bc\n"
