"""The main job ``nnx-mpmd train``: outputs, resume, and clear errors on bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from mp_launch import codegen_flags
from shared_results import once_per_test_run

from nnx_mpmd.apps import cli, train

# A run small enough to compile and train in seconds: 2 stages on 2 meshes.
TINY = [
    "--meshes", "2", "--data", "1", "--layers", "2", "--batch-size", "8",
    "--microbatches", "2", "--seq-len", "32", "--corpus-bytes", "100000",
    "--log-every", "1", "--ckpt-every", "2", "--warmup", "1",
]  # fmt: skip


def _env(device_flag: bool = True, cache_home=None) -> dict[str, str]:
    """A subprocess's environment; its compilation cache goes under ``cache_home``
    (``$XDG_CACHE_HOME``, the default location), or is off without one. Without
    ``device_flag`` XLA_FLAGS keeps only this run's code-generation flags: the command
    sets its own device count."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", NNX_MPMD_COMPILE_CACHE="off")
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_ENABLE_COMPILATION_CACHE"):
        env.pop(name, None)
    if cache_home is not None:
        env.pop("NNX_MPMD_COMPILE_CACHE")
        env["XDG_CACHE_HOME"] = str(cache_home)
    if not device_flag:
        env.pop("XLA_FLAGS", None)
        if codegen_flags():
            env["XLA_FLAGS"] = codegen_flags()
    return env


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _finish_a_run(directory):
    run_dir = directory / "run"
    cache_home = directory / "cache_home"  # the default cache goes here
    cache_home.mkdir()
    argv = [*TINY, "--steps", "4", "--devices", "2", "--profile", "--sample-tokens", "12"]
    proc = subprocess.run(
        [sys.executable, "-m", "nnx_mpmd", "train", *argv, "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        env=_env(device_flag=False, cache_home=cache_home),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc


@pytest.fixture(scope="module")
def finished_run():
    """A 4-step run in a fresh process that must set its own CPU device count.

    Run once for all xdist workers (tests/shared_results.py): tests read its run
    directory and copy it before they change anything.
    """
    run_dir, proc = once_per_test_run("train-finished-run", _finish_a_run)
    proc.cache_dir = run_dir.parent / "cache_home" / "nnx_mpmd" / "jax"
    return run_dir, proc


def test_run_writes_the_compilation_cache_by_default(finished_run):
    _, proc = finished_run
    entries = list(proc.cache_dir.glob("*-cache"))
    assert len(entries) >= 4, sorted(p.name for p in proc.cache_dir.iterdir())
    assert any(p.name.startswith("jit_F0-") for p in entries)
    assert f"compile cache {proc.cache_dir}" in proc.stdout


def test_no_compile_cache_writes_no_cache(tmp_path):
    argv = [*TINY, "--steps", "1", "--ckpt-every", "0", "--val-batches", "0"]
    argv += ["--sample-tokens", "0", "--run-dir", str(tmp_path / "run"), "--no-compile-cache"]
    proc = subprocess.run(
        [sys.executable, "-m", "nnx_mpmd", "train", *argv],
        capture_output=True,
        text=True,
        env=_env(cache_home=tmp_path / "cache_home"),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compile cache off" in proc.stdout
    assert not (tmp_path / "cache_home" / "nnx_mpmd").exists()  # (matplotlib caches there)


def test_run_writes_metrics_pictures_checkpoints_and_sample(finished_run):
    run_dir, proc = finished_run
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for record in metrics:
        assert {"step", "loss", "tokens_per_s", "lr"} <= record.keys()
        assert np.isfinite(record["loss"]) and record["tokens_per_s"] > 0
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    for name in ("loss.png", "schedule.png", "schedule_measured.png"):
        assert (run_dir / name).read_bytes()[:4] == b"\x89PNG", name
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [2, 4]
    sample = (run_dir / "sample.txt").read_text()
    assert sample.startswith("def ") and len(sample.rstrip("\n")) == 4 + 12
    assert "2 stages on 2 meshes x 1 data" in proc.stdout
    assert "validation loss" in proc.stdout


def test_resume_reproduces_uninterrupted_losses(finished_run, tmp_path):
    reference = {m["step"]: m["loss"] for m in _metrics(finished_run[0])}
    args = [*TINY, "--steps", "4", "--sample-tokens", "0", "--val-batches", "0"]
    args += ["--run-dir", str(tmp_path)]
    # Stop after step 3 as if killed: the last checkpoint is step 2, so step 3 reruns, here
    # with the blocks scanned: the unrolled blocks' checkpoint restores into the stack.
    assert train.main([*args, "--stop-at", "3"]) == 0
    assert [m["step"] for m in _metrics(tmp_path)] == [1, 2, 3]
    assert train.main([*args, "--resume", "--scan-layers"]) == 0
    resumed = _metrics(tmp_path)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    np.testing.assert_allclose(
        [m["loss"] for m in resumed], [reference[s] for s in (1, 2, 3, 4)], rtol=1e-5
    )


BAD_INPUTS = [
    (["--schedule", "zigzag"], r"unknown schedule 'zigzag'"),
    (["--preset", "huge"], r"unknown --preset 'huge' for --model gpt"),
    (["--model", "bert"], r"unknown --model 'bert'"),
    (["--meshes", "4", "--data", "4"], r"needs 16 devices but JAX has 8"),
    (["--batch-size", "10", "--microbatches", "4"], r"--batch-size=10 is not divisible"),
    (["--batch-size", "8", "--microbatches", "4", "--data", "4"], r"does not split over"),
    (["--steps", "0"], r"--steps=0 must be >= 1"),
    (["--lr", "-1"], r"--lr=-1.0 must be a number > 0"),
    (["--lr", "nan"], r"--lr=nan must be a number > 0"),
    (["--stop-at", "9", "--steps", "4"], r"--stop-at=9 must lie in"),
    (["--seq-len", "500"], r"--seq-len=500 must lie in \[1, 64\]"),
    (["--schedule", "interleaved", "--layers", "4"], r"--layers 4 is too few.*add --layers 8"),
    (
        ["--schedule", "dualpipev", "--microbatches", "4"],
        r"at least .* 8 microbatches.*--microbatches",
    ),
    (["--resume"], r"--resume: .* holds no checkpoints/ directory"),
    (["--allow-changed-settings"], r"only applies with --resume"),
    (["--compile-cache", "c", "--no-compile-cache"], r"--compile-cache=c and --no-compile-cache"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_INPUTS, ids=lambda x: str(x)[:40])
def test_bad_input_exits_2_with_message(argv, message, tmp_path, capsys):
    status = train.main(["--corpus-bytes", "20000", "--run-dir", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("nnx-mpmd train: error: ")
    assert "Traceback" not in err
    assert __import__("re").search(message, err), err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--seed", "1"], r"seed: saved 0, now 1"),
        (["--batch-size", "4"], r"batch_size: saved 8, now 4"),
        (
            ["--lr", "0.01", "--warmup", "2", "--steps", "6"],
            r"lr: saved 0.003, now 0.01; warmup: saved 1, now 2; steps: saved 4, now 6\)",
        ),
        (["--preset", "small"], r"preset: saved 'tiny', now 'small'.*would not match"),
    ],
)
def test_resume_into_changed_settings_exits_2(finished_run, change, message, capsys):
    run_dir = finished_run[0]
    argv = [*TINY, "--steps", "4", "--run-dir", str(run_dir), "--resume", *change]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not fit this run" in err, err
    assert __import__("re").search(message, err), err
    if "--preset" not in change:
        assert "pass --allow-changed-settings" in err


def test_resume_accepts_changed_settings_when_asked_and_logs_every_change(
    finished_run, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run[0], run_dir)
    argv = [*TINY, "--steps", "5", "--lr", "0.01", "--run-dir", str(run_dir), "--resume"]
    argv += ["--allow-changed-settings", "--schedule", "gpipe", "--microbatches", "4"]
    argv += ["--sample-tokens", "0", "--val-batches", "0", "--scan-layers"]
    assert train.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert (
        "settings changed since the checkpoint of step 4 (accepted): lr: saved 0.003, now "
        "0.01; steps: saved 4, now 5" in out
    ), out
    assert (  # the unrolled blocks' checkpoint restores into scanned blocks
        "layout changed since the checkpoint of step 4: schedule: saved '1f1b', now 'gpipe'; "
        "microbatches: saved 2, now 4; scan_layers: saved False, now True" in out
    ), out
    assert [m["step"] for m in _metrics(run_dir)] == [1, 2, 3, 4, 5]


def _train_in_process(argv: list[str], run_dir) -> tuple[list[float], list[np.ndarray]]:
    from flax import nnx

    from nnx_mpmd.apps.train_loop import Trainer

    trainer = Trainer(train.config_from_args([*argv, "--run-dir", str(run_dir)]), run_dir)
    trainer.train()
    state = [np.asarray(x) for x in jax.tree.leaves(nnx.state(trainer.model))]
    state += [np.asarray(x) for x in jax.tree.leaves(nnx.state(trainer.optimizer))]
    return [m["loss"] for m in _metrics(run_dir)], state


def test_resume_reproduces_the_straight_run_bit_for_bit(tmp_path):
    args = [*TINY, "--steps", "4", "--sample-tokens", "0", "--val-batches", "0"]
    straight_losses, straight_state = _train_in_process(args, tmp_path / "straight")
    _train_in_process([*args, "--stop-at", "2"], tmp_path / "split")
    losses, state = _train_in_process([*args, "--resume"], tmp_path / "split")
    assert len(losses) == len(straight_losses) == 4
    assert np.array_equal(losses, straight_losses), (losses, straight_losses)
    assert len(state) == len(straight_state) > 0
    for got, want in zip(state, straight_state, strict=True):
        assert np.array_equal(got, want)


def test_the_step_donates_by_default_and_no_donate_trains_the_same_numbers(tmp_path):
    from nnx_mpmd.apps.train_loop import Trainer

    args = [*TINY, "--steps", "3", "--sample-tokens", "0", "--val-batches", "0"]
    for extra, expected in (([], {0, 1}), (["--no-donate"], set())):
        run_dir = tmp_path / f"config{len(extra)}"
        trainer = Trainer(
            train.config_from_args([*args, *extra, "--run-dir", str(run_dir)]), run_dir
        )
        assert trainer.step_fn.donate_argnums == expected
    donated_losses, donated_state = _train_in_process(args, tmp_path / "donated")
    kept_losses, kept_state = _train_in_process([*args, "--no-donate"], tmp_path / "kept")
    assert np.array_equal(donated_losses, kept_losses), (donated_losses, kept_losses)
    for got, want in zip(donated_state, kept_state, strict=True):
        assert np.array_equal(got, want)


def test_run_dir_with_checkpoints_needs_resume(finished_run, capsys):
    argv = [*TINY, "--steps", "6", "--run-dir", str(finished_run[0])]
    assert train.main(argv) == 2
    assert "already holds checkpoints (latest step 4); pass --resume" in capsys.readouterr().err


def test_command_line_reports_too_few_devices_without_traceback(tmp_path):
    argv = ["train", "--devices", "2", "--meshes", "2", "--data", "2", "--run-dir", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "nnx_mpmd", *argv],
        capture_output=True,
        text=True,
        env=_env(device_flag=False),
        timeout=120,
    )
    assert proc.returncode == 2
    assert "needs 4 devices but JAX has 2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_dispatches_train_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--schedule", "--meshes", "--resume", "--ckpt-every", "--profile"):
        assert option in out


def test_set_cpu_devices_keeps_an_existing_count(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=3")
    train.set_cpu_devices(8)
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=3"
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1")
    train.set_cpu_devices(8)
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8"


def test_default_cache_dir_ignores_off_and_uses_a_named_directory(monkeypatch, tmp_path):
    from nnx_mpmd.aot.compile_cache import default_cache_dir

    monkeypatch.setenv("NNX_MPMD_COMPILE_CACHE", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "nnx_mpmd" / "jax"
    monkeypatch.setenv("NNX_MPMD_COMPILE_CACHE", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"


class _FakeCoordination:
    """Stands in for the coordination service's key-value store (one process's view)."""

    def __init__(self, store: dict):
        self.store = store

    def publish(self, key, value):
        self.store[key] = value

    def fetch(self, key, peer, where, timeout_s=None):
        assert peer == 0
        self.waits = [*getattr(self, "waits", []), (key, where, timeout_s)]
        return self.store[key]

    def barrier(self, name, where):
        self.barriers = [*getattr(self, "barriers", []), (name, where)]


@pytest.mark.parametrize("process", [0, 1])
def test_every_process_takes_process_0s_run_dir(monkeypatch, process):
    import nnx_mpmd.runtime.coordination as coordination

    store = {train.RUN_DIR_KEY: "runs/20261126-030000"} if process else {}
    fake = _FakeCoordination(store)
    monkeypatch.setattr(coordination, "get_coordination", lambda: fake)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: process)
    mine = train.pathlib.Path("runs/20261126-030001")  # timed a second later
    expected = "runs/20261126-030000" if process else str(mine)
    assert str(train.agree_on_run_dir(mine)) == expected
    assert store == {train.RUN_DIR_KEY: expected}
    if process:
        [(_, where, _)] = fake.waits
        assert "run directory" in where


@pytest.mark.parametrize("process", [0, 1])
def test_other_processes_wait_for_process_0s_outputs_longer_than_the_exit_barrier(
    monkeypatch, process
):
    import nnx_mpmd.runtime.coordination as coordination

    store = {train.FINISHED_KEY: True} if process else {}
    fake = _FakeCoordination(store)
    monkeypatch.setattr(coordination, "get_coordination", lambda: fake)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: process)
    train.finish_together()
    assert store == {train.FINISHED_KEY: True}
    [(_, where)] = fake.barriers  # every process meets at the end: a death there is named
    assert "finishing the run" in where
    if process:  # process 1 waited, with a bound far beyond the peers' default
        [(key, where, timeout_s)] = fake.waits
        assert key == train.FINISHED_KEY and "sample" in where
        assert timeout_s == train.FINISH_WAIT_S > 10 * coordination.peer_timeout_s()
    else:
        assert not hasattr(fake, "waits")
