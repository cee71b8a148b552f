"""``nnx-mpmd convert`` and ``nnx-mpmd train --init-from``: Hugging Face dirs <-> runs.

The fixtures are the checkpoints transformers wrote (tests/fixtures/make_hf_fixtures.py).
One pipelined fine-tuning step is compiled (the first loss must equal the
``nnx.jit`` loss of the loaded checkpoint); everything else restores and
exports without compiling a step.
"""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pytest
from flax import nnx

from nnx_mpmd.apps import convert, train
from nnx_mpmd.apps.train_loop import Trainer
from nnx_mpmd.checkpoint import CheckpointManager
from nnx_mpmd.errors import MpmdError
from nnx_mpmd.models import lm_loss, load_pretrained

safetensors_numpy = pytest.importorskip("safetensors.numpy")

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures"
LLAMA = FIXTURES / "hf_llama_tiny"
GPT2 = FIXTURES / "hf_gpt2_tiny"
# 2 stages on 2 meshes, a short batch that fits the fixtures' 32 positions.
SMALL = [
    "--meshes", "2", "--data", "1", "--batch-size", "4", "--microbatches", "2",
    "--seq-len", "16", "--corpus-bytes", "20000", "--steps", "1", "--warmup", "0",
    "--sample-tokens", "4", "--val-batches", "1", "--no-compile-cache",
]  # fmt: skip


def _params(model):
    return {
        ".".join(map(str, p)): np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def _assert_same_tensors(written_dir, original_dir):
    written = safetensors_numpy.load_file(str(written_dir / "model.safetensors"))
    original = safetensors_numpy.load_file(str(original_dir / "model.safetensors"))
    assert sorted(written) == sorted(original)
    for key in original:
        assert written[key].tobytes() == original[key].tobytes(), key


@pytest.mark.slow  # compiles one pipelined step: ~50 s on 2 cores
def test_train_init_from_fine_tunes_the_checkpoint_pipelined_and_exports(tmp_path):
    run_dir = tmp_path / "run"
    cfg = train.config_from_args([*SMALL, "--init-from", str(LLAMA), "--run-dir", str(run_dir)])
    convert.apply_init_from(cfg, run_dir)
    assert (cfg.model, cfg.layers) == ("llama", 3)
    trainer = Trainer(cfg, run_dir)
    assert f"llama from {LLAMA}: 3 layers, 38,624 parameters" in trainer._header()
    first_batch = trainer.batches.batch_at(0)
    reference = float(nnx.jit(lm_loss)(load_pretrained(LLAMA), first_batch))
    summary = trainer.train()
    assert summary["first_loss"] == pytest.approx(reference, rel=1e-5)
    assert (run_dir / "pretrained" / "config.json").read_text() == (
        LLAMA / "config.json"
    ).read_text()
    assert convert.main(["--run-dir", str(run_dir), "--to-hf", str(tmp_path / "hf")]) == 0
    exported = load_pretrained(tmp_path / "hf", num_stages=1)
    untrained = Trainer(cfg, run_dir).model  # loads the checkpoint afresh
    got, want = _params(exported), _params(trainer.model)
    assert sorted(got) == sorted(want) and sorted(got) == sorted(_params(untrained))
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert not np.array_equal(got["embed.module.table"], _params(untrained)["embed.module.table"])


def test_convert_from_hf_writes_a_step_0_checkpoint_that_resume_and_export_read(tmp_path):
    run_dir = tmp_path / "run"
    argv = ["--from-hf", str(GPT2), "--run-dir", str(run_dir), "--", *SMALL]
    assert convert.main(argv) == 0
    assert CheckpointManager(run_dir / "checkpoints").all_steps() == [0]
    # --to-hf of the untouched step 0 gives back the very same tensors.
    assert convert.main(["--run-dir", str(run_dir), "--to-hf", str(tmp_path / "hf")]) == 0
    _assert_same_tensors(tmp_path / "hf", GPT2)
    # --resume without --init-from rebuilds the architecture from run/pretrained/.
    cfg = train.config_from_args([*SMALL, "--resume", "--run-dir", str(run_dir)])
    convert.apply_init_from(cfg, run_dir)
    assert cfg.init_from == str(run_dir / "pretrained") and cfg.model == "gpt"
    trainer = Trainer(cfg, run_dir)
    manager = CheckpointManager(run_dir / "checkpoints")
    trainer.restore_or_start(manager)
    manager.close()
    assert trainer.start_step == 0
    want = _params(load_pretrained(GPT2, num_stages=trainer.num_stages))
    got = _params(trainer.model)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


# -- error paths --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--run-dir", "r"], "give exactly one of --from-hf DIR and --to-hf DIR"),
        (["--run-dir", "r", "--from-hf", "a", "--to-hf", "b"], "give exactly one of"),
        (["--run-dir", "r", "--to-hf", "b", "--", "--steps", "3"], "only apply with --from-hf"),
        (["--run-dir", "r", "--from-hf", "a", "--step", "3"], "--step only applies with --to-hf"),
    ],
)
def test_convert_flag_mistakes_are_one_line(argv, match, capsys):
    assert convert.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("nnx-mpmd convert: error:") and match in err and err.count("\n") == 1


def test_convert_of_an_unsupported_architecture_leaves_no_run_dir(tmp_path, capsys):
    source = tmp_path / "bert"
    source.mkdir()
    (source / "config.json").write_text('{"architectures": ["BertModel"]}')
    run_dir = tmp_path / "run"
    assert convert.main(["--from-hf", str(source), "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "'BertModel'] is not in the model zoo; supported: GPT2LMHeadModel" in err
    assert err.count("\n") == 1 and not run_dir.exists()


def test_convert_refuses_a_run_with_checkpoints_and_a_run_without(tmp_path, capsys):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert convert.main(["--from-hf", str(GPT2), "--run-dir", str(tmp_path / "run")]) == 2
    assert "already holds checkpoints/; choose a new run directory" in capsys.readouterr().err
    argv = ["--run-dir", str(tmp_path / "none"), "--to-hf", str(tmp_path / "hf")]
    assert convert.main(argv) == 2
    assert "holds no checkpoints/; point it at a run" in capsys.readouterr().err
    assert convert.main(["--run-dir", str(tmp_path / "run"), "--to-hf", str(tmp_path / "hf")])
    assert "holds no finished checkpoint to export" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_init_from_checks_layers_and_the_tokenizer_vocabulary(tmp_path, capsys):
    cfg = train.config_from_args(["--init-from", str(LLAMA), "--layers", "5"])
    with pytest.raises(MpmdError, match=r"--layers 5 differs from the 3 layers of --init-from"):
        convert.apply_init_from(cfg, tmp_path)
    with pytest.raises(MpmdError, match=r"tokenizer has 200 tokens but .* vocabulary of 96"):
        convert.pretrained_model(LLAMA, num_stages=1, vocab_size=200)
    argv = ["--init-from", str(tmp_path / "missing"), "--run-dir", str(tmp_path / "run")]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert "missing/config.json: not found" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_sampling_draws_only_ids_the_tokenizer_has():
    """A pretrained vocabulary can be larger than the tokenizer's: those ids never come out."""
    from nnx_mpmd.apps.data import CharTokenizer
    from nnx_mpmd.apps.sampling import generate_text
    from nnx_mpmd.models import build_model

    model = build_model("gpt", "tiny", num_stages=1, rngs=nnx.Rngs(0), vocab_size=40)
    tokenizer = CharTokenizer.from_text("abc")
    text = generate_text(model, tokenizer, "ab", 30, temperature=2.0, seed=3)
    assert set(text) <= {"a", "b", "c"} and len(text) == 32


def test_init_from_passes_a_tokenizer_json_along_unless_one_is_given(tmp_path):
    source = tmp_path / "hf"
    shutil.copytree(LLAMA, source)
    (source / "tokenizer.json").write_text("{}")
    cfg = train.config_from_args(["--init-from", str(source)])
    cfg.tokenizer = None  # the data helper's --tokenizer, not given
    convert.apply_init_from(cfg, tmp_path)
    assert cfg.tokenizer == str(source / "tokenizer.json")
    cfg = train.config_from_args(["--init-from", str(source)])
    cfg.tokenizer = "mine.json"
    convert.apply_init_from(cfg, tmp_path)
    assert cfg.tokenizer == "mine.json"
    keep = tmp_path / "run"
    keep.mkdir()
    convert.keep_pretrained_config(source, keep)
    assert sorted(p.name for p in (keep / "pretrained").iterdir()) == [
        "config.json",
        "tokenizer.json",
    ]


def test_init_from_into_a_run_with_checkpoints_keeps_its_pretrained_config(tmp_path):
    run_dir = tmp_path / "run"
    assert convert.main(["--from-hf", str(GPT2), "--run-dir", str(run_dir), "--", *SMALL]) == 0
    cfg = train.config_from_args([*SMALL, "--init-from", str(LLAMA), "--run-dir", str(run_dir)])
    with pytest.raises(MpmdError, match=r"already holds checkpoints \(latest step 0\)"):
        train.run(cfg)
    kept = (run_dir / "pretrained" / "config.json").read_text()
    assert kept == (GPT2 / "config.json").read_text()
