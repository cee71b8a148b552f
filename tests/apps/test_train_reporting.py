"""``nnx-mpmd train``'s reporting: evaluation, mfu, TensorBoard and ``--config`` files.

The runs are tiny (2 stages, 2-3 steps) and in-process (`nnx_mpmd.apps.train.run`
and ``main``). The held-out loss of the pipelined evaluation is checked against
the end-of-run validation loss, which `nnx.jit` computes on the gathered model.
"""

from __future__ import annotations

import json
import math
import pathlib
import struct
import sys

import numpy as np
import pytest
from flax import nnx

from nnx_mpmd.apps import train
from nnx_mpmd.apps.data import CharTokenizer, stdlib_corpus
from nnx_mpmd.apps.train_config import (
    PER_INVOCATION_KEYS,
    config_keys,
    read_config_file,
    toml_text,
)
from nnx_mpmd.apps.train_metrics import (
    TensorBoardLog,
    flops_per_token,
    matmul_params,
    peak_flops_per_device,
)
from nnx_mpmd.errors import MpmdError
from nnx_mpmd.models import build_model, lm_loss

# 2 stages on 2 meshes, small enough to compile and train in seconds.
TINY = [
    "--meshes", "2", "--data", "1", "--layers", "2", "--batch-size", "8",
    "--microbatches", "2", "--seq-len", "32", "--corpus-bytes", "20000",
    "--log-every", "1", "--warmup", "1", "--sample-tokens", "0",
]  # fmt: skip
# The same settings as a --config file.
TINY_TOML = """\
meshes = 2
data = 1
layers = 2
batch_size = 8
microbatches = 2
seq_len = 32
corpus_bytes = 20000
log_every = 1
warmup = 1
sample_tokens = 0
"""


def _metrics(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _scalars(directory: pathlib.Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of the event files in ``directory`` (TFRecord framing:
    length, its CRC, the serialized Event, its CRC)."""
    from tensorboardX.proto import event_pb2

    found: dict[str, dict[int, float]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack_from("<Q", data, at)
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                found.setdefault(value.tag, {})[event.step] = value.simple_value
    return found


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory):
    """2 steps, evaluated at each, with TensorBoard and a peak of 1 TFLOP/s per device."""
    run_dir = tmp_path_factory.mktemp("reporting") / "run"
    argv = [*TINY, "--steps", "2", "--eval-every", "1", "--eval-batches", "2"]
    argv += ["--val-batches", "2", "--ckpt-every", "0", "--tensorboard", "--peak-tflops", "1"]
    summary = train.run(train.config_from_args([*argv, "--run-dir", str(run_dir)]))
    return run_dir, summary


def test_eval_records_carry_held_out_loss_and_perplexity(evaluated_run):
    run_dir, summary = evaluated_run
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    for record in metrics:
        assert np.isfinite(record["eval_loss"])
        assert record["eval_ppl"] == pytest.approx(math.exp(record["eval_loss"]), rel=1e-12)
    # The last evaluation scores the same held-out batches as the end-of-run validation
    # loss, which nnx.jit computes on the gathered model.
    assert metrics[-1]["eval_loss"] == pytest.approx(summary["val_loss"], rel=1e-5)
    assert metrics[0]["eval_loss"] != metrics[1]["eval_loss"]  # scored after each step


def test_mfu_follows_the_flops_per_token_and_the_given_peak(evaluated_run):
    run_dir, _ = evaluated_run
    vocab = CharTokenizer.from_text(stdlib_corpus(20000)).vocab_size
    model = build_model("gpt", "tiny", num_stages=2, rngs=nnx.Rngs(0), vocab_size=vocab, n_layers=2)
    per_token = flops_per_token(matmul_params(model), 2, model.config.d_model, 32)
    for record in _metrics(run_dir):
        expected = record["tokens_per_s"] * per_token / (2 * 1e12)  # 2 devices of 1 TFLOP/s
        assert record["mfu"] == pytest.approx(expected, rel=1e-9)


def test_tensorboard_event_files_hold_the_scalars(evaluated_run):
    run_dir, _ = evaluated_run
    scalars = _scalars(run_dir / "tensorboard")
    expected_tags = {"train/loss", "train/lr", "train/tokens_per_s", "train/mfu"}
    assert expected_tags | {"eval/loss", "eval/perplexity"} <= scalars.keys()
    metrics = {m["step"]: m for m in _metrics(run_dir)}
    for step, record in metrics.items():
        assert scalars["train/loss"][step] == pytest.approx(record["loss"], rel=1e-6)
        assert scalars["eval/loss"][step] == pytest.approx(record["eval_loss"], rel=1e-6)


def test_flops_per_token_is_close_to_xla_s_count_of_a_training_step():
    """The estimate against XLA's own FLOP count of the nnx.jit step (which adds the
    elementwise work: within a few percent above the model arithmetic)."""
    for family in ("gpt", "llama"):
        model = build_model(family, "tiny", num_stages=1, rngs=nnx.Rngs(0), n_layers=2)
        batch = {"inputs": np.zeros((4, 64), np.int32), "targets": np.zeros((4, 64), np.int32)}
        step = nnx.jit(nnx.value_and_grad(lm_loss))
        cost = step.lower(model, batch).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        estimate = 4 * 64 * flops_per_token(matmul_params(model), 2, model.config.d_model, 64)
        assert 1.0 <= cost["flops"] / estimate <= 1.15, (family, cost["flops"], estimate)


def test_peak_flops_come_from_the_table_the_flag_or_nowhere():
    assert peak_flops_per_device("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_per_device("NVIDIA H100 PCIe") == 756e12  # the longest match wins
    assert peak_flops_per_device("TPU v5 lite") == 197e12
    assert peak_flops_per_device("cpu") is None
    assert peak_flops_per_device("cpu", peak_tflops=2.5) == 2.5e12


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--eval-every", "-1"], r"--eval-every=-1 must be >= 0"),
        (["--eval-batches", "0"], r"--eval-batches=0 must be >= 1"),
        (["--peak-tflops", "0"], r"--peak-tflops=0.0 must be a number > 0"),
        (["--peak-tflops", "inf"], r"--peak-tflops=inf must be a number > 0"),
    ],
)
def test_bad_reporting_flags_are_refused(argv, message):
    with pytest.raises(MpmdError, match=message):
        train.config_from_args(argv)


def test_tensorboard_without_tensorboardx_names_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails, find_spec: None
    run_dir = tmp_path / "run"
    assert train.main([*TINY, "--tensorboard", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "pip install 'nnx-mpmd[tensorboard]'" in err and len(err.strip().splitlines()) == 1
    assert not run_dir.exists()
    with pytest.raises(MpmdError, match=r"--tensorboard needs tensorboardX.*nnx-mpmd\[tensorboard"):
        TensorBoardLog(tmp_path, first_step=1)


# -- --config FILE.toml --------------------------------------------------------------------


def test_every_train_option_has_a_config_key_of_its_type(tmp_path):
    parser = train.build_parser()
    keys = config_keys(parser)
    options = {
        s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"
    }
    assert {key.option for key in keys.values()} == options
    for name, key in keys.items():
        assert key.option == "--" + name.replace("_", "-")
    assert keys["scan_layers"].kind is bool and keys["lr"].kind is float
    assert keys["batch_size"].kind is int and keys["plan"].kind is str
    # Every default written as TOML reads back as itself (None: left out).
    defaults = {name: parser.get_default(name) for name in keys if name != "config"}
    file = tmp_path / "defaults.toml"
    file.write_text(toml_text(defaults))
    assert read_config_file(file, keys) == {k: v for k, v in defaults.items() if v is not None}


def test_command_line_overrides_the_config_file_which_overrides_defaults(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(
        'steps = 7\nbatch_size = 16\nscan_layers = true\nlr = 1\nschedule = "gpipe"\n'
    )
    cfg = train.config_from_args(["--config", str(config), "--steps", "9", "--lr", "0.5"])
    assert (cfg.steps, cfg.batch_size, cfg.scan_layers, cfg.schedule) == (9, 16, True, "gpipe")
    assert cfg.lr == 0.5 and cfg.warmup == train.build_parser().get_default("warmup")
    assert train.config_from_args(["--config", str(config)]).lr == 1.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("batchsize = 8\n", r"unknown key 'batchsize'; the valid keys are: model, .*batch_size"),
        ('batch_size = "8"\n', r"key 'batch_size' \(--batch-size\) must be a TOML integer"),
        ("steps = true\n", r"key 'steps' \(--steps\) must be a TOML integer, not bool"),
        ("scan_layers = 1\n", r"key 'scan_layers' \(--scan-layers\) must be a TOML boolean"),
        ("lr = 'fast'\n", r"key 'lr' \(--lr\) must be a TOML number"),
        ("[model]\nname = 'gpt'\n", r"\[model\] is a table, but the file is flat"),
        ('config = "other.toml"\n', r"unknown key 'config'"),
        ("batch_size = \n", r"is not valid TOML"),
    ],
)
def test_bad_config_file_is_one_line_error_and_leaves_no_files(text, message, tmp_path, capsys):
    config = tmp_path / "bad.toml"
    config.write_text(text)
    run_dir = tmp_path / "run"
    assert train.main(["--config", str(config), "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--config {config}" in err
    with pytest.raises(MpmdError, match=message):
        train.config_from_args(["--config", str(config)])
    assert not run_dir.exists()


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(MpmdError, match=r"--config .*nowhere.toml: no such file"):
        train.config_from_args(["--config", str(tmp_path / "nowhere.toml")])


def test_config_toml_is_written_and_a_bare_resume_continues_with_it(tmp_path, capsys):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY_TOML + "steps = 3\nckpt_every = 2\nval_batches = 0\n")
    run_dir = tmp_path / "run"
    assert train.main(["--config", str(config), "--stop-at", "2", "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "configuration: model=gpt preset=tiny" in out and "batch_size=8" in out
    saved = (run_dir / "config.toml").read_text()
    assert "batch_size = 8\n" in saved and "steps = 3\n" in saved
    for name in PER_INVOCATION_KEYS:
        assert f"\n{name} = " not in saved
    # No flag but --resume and the run: the saved configuration (otherwise the defaults'
    # batch size and steps would be refused as changed settings).
    assert train.main(["--resume", "--run-dir", str(run_dir)]) == 0
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all("mfu" in m and m["mfu"] is None for m in metrics)  # a CPU: no known peak
    assert "mfu: not reported" in capsys.readouterr().out
    # A flag given on resume overrides the saved value, subject to the changed-settings check.
    assert train.main(["--resume", "--run-dir", str(run_dir), "--lr", "0.1"]) == 2
    assert "lr: saved 0.003, now 0.1" in capsys.readouterr().err
