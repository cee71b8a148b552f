"""``nnx-mpmd generate``: a trained run's model continues a prompt in any layout.

One tiny run (2 stages, 2 steps, a checkpoint at each) is trained in-process
for the module; every test reads it. The greedy text is checked against the
model restored by hand and decoded under ``nnx.jit`` without the KV cache
(`nnx_mpmd.apps.sampling.generate`).
"""

from __future__ import annotations

import io
import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

import nnx_mpmd as mp
from nnx_mpmd.apps import cli, generate_cli, sampling, train
from nnx_mpmd.apps.text_tokenizers import tokenizer_from_dict
from nnx_mpmd.checkpoint import CheckpointManager
from nnx_mpmd.errors import (
    CheckpointDamagedError,
    CheckpointError,
    MeshError,
    MpmdError,
    PartitionError,
)
from nnx_mpmd.models import MODELS

PROMPT = "def "
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 2-step run of 2 layers on 2 meshes, checkpointed at steps 1 and 2."""
    run_dir = tmp_path_factory.mktemp("generate") / "run"
    argv = [
        "--meshes", "2", "--data", "1", "--layers", "2", "--batch-size", "4",
        "--microbatches", "2", "--seq-len", "32", "--corpus-bytes", "20000", "--steps", "2",
        "--warmup", "0", "--lr", "0.03", "--seed", "3", "--ckpt-every", "1", "--keep", "2", "--sample-tokens", "0",
        "--val-batches", "0", "--run-dir", str(run_dir),
    ]  # fmt: skip
    train.run(train.config_from_args(argv))
    return run_dir


def _restored(run_dir, step: int) -> tuple:
    """``step``'s model restored by hand onto one device, and the run's tokenizer."""
    manager = CheckpointManager(run_dir / "checkpoints", async_save=False)
    meta = manager.metadata(step)
    model_cls, config_cls = MODELS[meta["config"]["model"]]
    config = config_cls.from_dict({**meta["config"]["model_config"], "num_stages": 1})
    model = model_cls(config, rngs=nnx.Rngs(1))
    manager.restore({"model": model}, step, partial=True)
    manager.close()
    return model, tokenizer_from_dict(meta["tokenizer"])


def _reference(run_dir, step: int) -> str:
    """The greedy text of ``step``'s model decoded under ``nnx.jit`` by recomputing the
    window (no KV cache, no pipeline)."""
    model, tokenizer = _restored(run_dir, step)
    tokens = sampling.generate(model, tokenizer, PROMPT, NEW_TOKENS, temperature=0.0)
    return tokenizer.decode(tokens)


def _args(run_dir, *extra: str) -> list[str]:
    base = ["--run-dir", str(run_dir), "--prompt", PROMPT, "--max-tokens", str(NEW_TOKENS)]
    return [*base, *extra]


@pytest.mark.parametrize(
    "layout",
    [["--meshes", "1", "--data", "1"], ["--meshes", "2", "--data", "2"]],
    ids=["one-device", "pipelined-2x2"],
)
def test_greedy_text_equals_the_restored_model_under_nnx_jit(run_dir, capsys, layout):
    expected = _reference(run_dir, 2)
    assert cli.main(["generate", *_args(run_dir, *layout)]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected + "\n"
    assert len(expected) == len(PROMPT) + NEW_TOKENS
    assert "checkpoint step 2" in captured.err
    assert f"{NEW_TOKENS} tokens in" in captured.err and "tokens/s" in captured.err


def test_sampled_text_is_the_same_in_every_layout_with_the_same_rows(run_dir):
    # A 2-step model says mostly spaces greedily; sampling shows every logit.
    sampling_args = ["--temperature", "1.5", "--seed", "5", "--microbatches", "2"]
    texts = []
    for layout in (["--meshes", "1"], ["--meshes", "2"]):
        cfg = generate_cli.config_from_args(_args(run_dir, *sampling_args, *layout))
        texts.append(generate_cli.run(cfg, out=io.StringIO(), err=io.StringIO())["text"])
    model, tokenizer = _restored(run_dir, 2)
    generator = mp.Generator(
        mesh=mp.MpmdMesh(jax.make_mesh((1, 1), ("stage", "data")), "stage"),
        schedule=mp.OneFOneB(),
        num_microbatches=2,
        window=model.config.max_len,
        temperature=1.5,
    )
    prompts = np.tile(tokenizer.encode(PROMPT), (2, 1))
    expected = tokenizer.decode(generator.reference(model, prompts, NEW_TOKENS, seed=5)[0])
    assert texts == [expected, expected]
    assert len(set(expected[len(PROMPT) :])) > 3  # not a run of one character
    cfg = generate_cli.config_from_args(_args(run_dir, *sampling_args, "--meshes", "1"))
    cfg.seed = 6
    assert generate_cli.run(cfg, out=io.StringIO(), err=io.StringIO())["text"] != expected


class _FewerIds:
    """The run's tokenizer as if it had only its first ``vocab_size`` ids: the
    ``tokenizer.json`` of an ``--init-from`` run, smaller than the checkpoint's vocabulary."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self._tokenizer, self.vocab_size = tokenizer, vocab_size

    def encode(self, text: str) -> np.ndarray:
        return self._tokenizer.encode(text)

    def decode(self, ids) -> str:
        ids = np.asarray(ids)
        if ids.size and ids.max() >= self.vocab_size:
            raise MpmdError(f"id {int(ids.max())} is not one of my {self.vocab_size} tokens")
        return self._tokenizer.decode(ids)


def test_only_ids_the_tokenizer_has_are_chosen(run_dir, monkeypatch):
    cfg = generate_cli.config_from_args(
        _args(run_dir, "--temperature", "1.5", "--seed", "5", "--meshes", "1")
    )
    unlimited = generate_cli.run(cfg, out=io.StringIO(), err=io.StringIO())["tokens"]
    _, tokenizer = _restored(run_dir, 2)
    limit = int(np.max(tokenizer.encode(PROMPT))) + 1  # the prompt's ids, and fewer others
    assert limit < tokenizer.vocab_size and unlimited.max() >= limit  # it draws ids past it
    restore_run = generate_cli.restore_run

    def restore_with_fewer_ids(*args, **kwargs):
        model, run_tokenizer, step = restore_run(*args, **kwargs)
        return model, _FewerIds(run_tokenizer, limit), step

    monkeypatch.setattr(generate_cli, "restore_run", restore_with_fewer_ids)
    out = io.StringIO()
    summary = generate_cli.run(cfg, out=out, err=io.StringIO())
    assert summary["tokens"].max() < limit and len(summary["tokens"]) == len(PROMPT) + NEW_TOKENS
    assert out.getvalue() == summary["text"] + "\n"


class _Recorder(io.StringIO):
    """Records the text written before each flush, and what ``progress()`` said then."""

    def __init__(self, progress=lambda: None) -> None:
        super().__init__()
        self.flushed: list[str] = []
        self.progress: list = []
        self._mark = 0
        self._progress = progress

    def flush(self) -> None:
        self.flushed.append(self.getvalue()[self._mark :])
        self.progress.append(self._progress())
        self._mark = len(self.getvalue())


def test_text_streams_one_token_at_a_time(run_dir, monkeypatch):
    # Every decoding step reads its tokens back with one jax.device_get: count them.
    reads = []
    device_get = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: reads.append(1) or device_get(x))
    out, err = _Recorder(progress=lambda: len(reads)), io.StringIO()
    cfg = generate_cli.config_from_args(_args(run_dir, "--meshes", "1", "--data", "1"))
    summary = generate_cli.run(cfg, out=out, err=err)
    # The prompt, then each character token as it was chosen, then the newline.
    assert out.flushed == [PROMPT, *summary["text"][len(PROMPT) :], "\n"]
    # Each token was written right after its step, before the next step ran.
    steps_before = [count - out.progress[0] for count in out.progress]
    assert steps_before == [0, *range(1, NEW_TOKENS + 1), NEW_TOKENS]
    assert len(summary["tokens"]) == len(PROMPT) + NEW_TOKENS
    assert summary["tokens_per_s"] > 0


def test_step_chooses_the_checkpoint(run_dir):
    err = io.StringIO()
    cfg = generate_cli.config_from_args(_args(run_dir, "--step", "1", "--meshes", "1"))
    summary = generate_cli.run(cfg, out=io.StringIO(), err=err)
    assert summary["step"] == 1
    assert summary["text"] == _reference(run_dir, 1)
    assert "checkpoint step 1" in err.getvalue()


def test_the_text_stream_holds_back_an_unfinished_character():
    class Bytes:
        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")

    out = _Recorder()
    stream = generate_cli.TextStream(Bytes(), list(b"a"), out)
    for byte in "é!".encode():
        stream.add(byte)
    stream.finish()
    assert out.flushed == ["a", "é", "!", "\n"]


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--max-tokens", "0"], r"--max-tokens=0 must be >= 1"),
        (["--temperature", "-1"], r"--temperature=-1.0 must be a number >= 0"),
        (["--temperature", "nan"], r"--temperature=nan must be a number >= 0"),
        (["--top-k", "0"], r"--top-k=0 must be >= 1"),
        (["--meshes", "0"], r"--meshes=0 must be >= 1"),
        (["--seed", "-2"], r"--seed=-2 must lie in"),
        (["--prompt", ""], r"--prompt is empty"),
    ],
)
def test_bad_options_are_errors(tmp_path, extra, match):
    with pytest.raises(MpmdError, match=match):
        generate_cli.config_from_args(_args(tmp_path, *extra))


def test_a_run_without_checkpoints_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match=r"no/such/run is not a directory"):
        generate_cli.run(generate_cli.config_from_args(_args(tmp_path / "no/such/run")))
    with pytest.raises(CheckpointError, match=r"holds no checkpoints/ directory"):
        generate_cli.run(generate_cli.config_from_args(_args(tmp_path)))
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(CheckpointError, match=r"holds no finished checkpoint"):
        generate_cli.run(generate_cli.config_from_args(_args(tmp_path, "--meshes", "1")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]  # nothing written


def test_a_missing_step_lists_the_saved_ones(run_dir):
    cfg = generate_cli.config_from_args(_args(run_dir, "--step", "7", "--meshes", "1"))
    with pytest.raises(CheckpointError, match=r"--step 7 is not saved in .*saved steps: \[1, 2\]"):
        generate_cli.run(cfg)


def _arrays_of_step_1(checkpoints):
    shutil.rmtree(checkpoints / "2" / "arrays")
    shutil.copytree(checkpoints / "1" / "arrays", checkpoints / "2" / "arrays")


def _edited_metadata(checkpoints):
    file = checkpoints / "2" / "metadata" / "metadata"
    file.write_text(json.dumps({**json.loads(file.read_text()), "step": 3}))


@pytest.mark.parametrize("damage", [_arrays_of_step_1, _edited_metadata])
def test_a_damaged_newest_step_is_skipped_with_a_warning(run_dir, tmp_path, damage):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    damage(copy / "checkpoints")
    err = io.StringIO()
    cfg = generate_cli.config_from_args(_args(copy, "--meshes", "1"))
    summary = generate_cli.run(cfg, out=io.StringIO(), err=err)
    assert summary["step"] == 1
    assert summary["text"] == _reference(run_dir, 1)
    assert "nnx-mpmd generate: warning: skipped step 2: " in err.getvalue()
    with pytest.raises(CheckpointDamagedError, match=r"/checkpoints/2/"):
        generate_cli.run(generate_cli.config_from_args(_args(copy, "--meshes", "1", "--step", "2")))


@pytest.mark.parametrize(
    ("layout", "error", "match"),
    [
        (["--meshes", "4", "--data", "4"], MeshError, r"needs 16 devices but JAX has 8"),
        (["--meshes", "4"], PartitionError, r"runs 4 stages, but the run's model has 2 layers"),
    ],
)
def test_a_layout_that_does_not_fit_is_an_error(run_dir, layout, error, match):
    with pytest.raises(error, match=match):
        generate_cli.run(generate_cli.config_from_args(_args(run_dir, *layout)))


@pytest.mark.parametrize(
    ("prompt", "tokens", "match"),
    [
        ("déf", "4", r"--prompt cannot be encoded with the run's tokenizer \(.*'é'"),
        ("x" * 64, "1", r"--prompt is 64 tokens, but the model's context holds 64"),
        (PROMPT, "61", r"--max-tokens 61: .* pass --max-tokens 60 or less"),
    ],
)
def test_a_prompt_the_model_cannot_take_is_an_error(run_dir, prompt, tokens, match):
    argv = ["--run-dir", str(run_dir), "--prompt", prompt, "--max-tokens", tokens]
    cfg = generate_cli.config_from_args([*argv, "--meshes", "1"])
    with pytest.raises(MpmdError, match=match):
        generate_cli.run(cfg)


def test_errors_print_one_line_and_exit_2(run_dir, tmp_path, capsys):
    assert cli.main(["generate", *_args(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("nnx-mpmd generate: error: --run-dir ")
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    assert cli.main(["generate", *_args(copy, "--step", "9")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "saved steps: [1, 2]" in err


def test_generate_is_a_subcommand(capsys):
    assert cli.main(["--help"]) == 0
    assert "generate" in capsys.readouterr().out
