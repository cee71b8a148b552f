"""``nnx-mpmd train`` as two processes under ``nnx-mpmd launch`` (2 x 4 CPU devices).

The main job's 4 meshes x 2 data devices sit two meshes per process, so the
tied embedding and every activation cross between processes. One run is
stopped after step 3 (last checkpoint: step 2) and resumed by a second launch
to step 4: the losses of both must equal the unpipelined `nnx.jit` step of the
same model, optimizer and batches, and only process 0 may print the log and
write the run's files. Every process of the first launch logs the rows it read:
each reads only what its stages need (the other layout is checked in
tests/integration/test_multiprocess_local_batches.py). Launches are bounded with
``timeout -k 5 N`` and listen on 127.0.0.1 only (tests/mp_launch.py).
"""

from __future__ import annotations

import json
import math
import re
import sys

import numpy as np
import pytest
from flax import nnx
from mp_launch import check as _check
from mp_launch import launch as _launch
from mp_launch import launch_once as _launch_once
from shared_results import once_per_test_run
from test_multiprocess_local_batches import assert_each_process_read_only_its_rows

from nnx_mpmd.apps.local_batches import DEBUG_ROWS_ENV
from nnx_mpmd.apps.train import config_from_args
from nnx_mpmd.apps.train_loop import Trainer, train_step

pytestmark = pytest.mark.multiprocess

TRAIN = [sys.executable, "-m", "nnx_mpmd", "train"]
# 4 meshes x 2 data over 2 processes x 4 devices; small enough to compile in seconds.
ARGS = [
    "--meshes", "4", "--data", "2", "--layers", "4", "--batch-size", "8",
    "--microbatches", "4", "--seq-len", "32", "--corpus-bytes", "100000",
    "--log-every", "1", "--ckpt-every", "2", "--warmup", "1", "--steps", "4",
    "--val-batches", "1",
]  # fmt: skip


def _train_launched(directory):
    """Steps 1-3 in one launch, then steps 3-4 resumed from step 2's checkpoint."""
    run_dir, rows_dir = directory / "run", directory / "rows"
    rows_dir.mkdir()
    common = [*ARGS, "--run-dir", str(run_dir), "--compile-cache", str(directory / "cache")]
    first, _ = _launch(
        TRAIN, *common, "--stop-at", "3", "--sample-tokens", "0", timeout=300,
        fresh=[(run_dir, False), (rows_dir, True)], **{DEBUG_ROWS_ENV: str(rows_dir)},
    )  # fmt: skip
    _check(first)
    after_first = (run_dir / "metrics.jsonl").read_text()
    # The resumed launch also evaluates (a forward-only pipeline over both processes) and
    # writes TensorBoard event files (process 0 only).
    reporting = ["--eval-every", "4", "--eval-batches", "1", "--tensorboard"]
    resumed, _ = _launch(
        TRAIN, *common, "--resume", "--sample-tokens", "8", *reporting, timeout=300
    )
    _check(resumed)
    return run_dir, first, after_first, resumed


@pytest.fixture(scope="module")
def launched_runs():
    """Both launches, once for all xdist workers (tests/shared_results.py)."""
    return once_per_test_run("multiprocess-train", _train_launched)


def _losses(metrics_text: str) -> dict[int, float]:
    records = [json.loads(line) for line in metrics_text.splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records}


def _reference_losses(tmp_path, steps: int) -> list[float]:
    """The same model, optimizer and batches stepped by `nnx.jit` on one device."""
    trainer = Trainer(config_from_args([*ARGS, "--run-dir", str(tmp_path)]), tmp_path)
    step = nnx.jit(train_step)
    return [
        float(step(trainer.model, trainer.optimizer, next(trainer.batches))) for _ in range(steps)
    ]


@pytest.mark.slow  # two launches of two processes, each compiling a 4-stage GPT
def test_launched_train_and_resume_equal_nnx_jit(launched_runs, tmp_path):
    run_dir, _, after_first, _ = launched_runs
    reference = _reference_losses(tmp_path, 4)
    first = _losses(after_first)
    assert sorted(first) == [1, 2, 3]
    np.testing.assert_allclose([first[s] for s in (1, 2, 3)], reference[:3], rtol=1e-5)
    resumed = _losses((run_dir / "metrics.jsonl").read_text())
    assert sorted(resumed) == [1, 2, 3, 4]
    np.testing.assert_allclose([resumed[s] for s in (1, 2, 3, 4)], reference, rtol=1e-5)


@pytest.mark.slow
def test_each_launched_process_reads_only_the_rows_of_its_stages(launched_runs):
    run_dir, _, _, _ = launched_runs  # meshes 0-1 on process 0, meshes 2-3 on process 1
    assert_each_process_read_only_its_rows(run_dir.parent / "rows", steps=3, batch=8)


@pytest.mark.slow
def test_only_process_0_logs_and_writes_the_run_files(launched_runs):
    run_dir, first, _, resumed = launched_runs
    for done in (first, resumed):
        assert "[p0] gpt tiny: " in done.stdout and "(cpu, 2 processes)" in done.stdout
        assert "[p1] gpt tiny" not in done.stdout and "[p1] step " not in done.stdout
    assert "[p0] resumed from step 2" in resumed.stdout
    assert "[p0] validation loss" in resumed.stdout and "[p1] validation" not in resumed.stdout
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [2, 4]  # every process saved its part of each
    sample = (run_dir / "sample.txt").read_text()
    assert sample.startswith("def ") and len(sample.rstrip("\n")) == 4 + 8


@pytest.mark.slow
def test_launched_eval_equals_the_validation_loss_and_process_0_writes_tensorboard(launched_runs):
    run_dir, _, _, resumed = launched_runs
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 4 and last["eval_ppl"] == pytest.approx(math.exp(last["eval_loss"]))
    # The end's validation loss: nnx.jit on the gathered model, the same held-out batch.
    printed = float(re.search(r"\[p0\] validation loss ([0-9.]+)", resumed.stdout)[1])
    assert last["eval_loss"] == pytest.approx(printed, abs=1e-4)  # printed to 4 decimals
    assert "[p0] step 4/4  eval loss" in resumed.stdout and "[p1] step 4/4" not in resumed.stdout
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1


def test_too_few_devices_among_processes_is_named(tmp_path):
    done, _ = _launch_once(
        TRAIN, *ARGS, "--data", "4", "--batch-size", "16", "--run-dir", str(tmp_path / "run"), timeout=120
    )  # fmt: skip
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert (
        "--meshes 4 x --data 4 needs 16 devices but JAX has 8 among 2 processes" in done.stdout
    ), done.stdout[-3000:]
    assert "--devices-per-process" in done.stdout
