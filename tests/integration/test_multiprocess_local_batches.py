"""Under ``nnx-mpmd launch`` each process of ``nnx-mpmd train`` reads only its rows.

One launch of 2 processes x 4 CPU devices here: ``--meshes 2 --data 4`` (one mesh
per process); ``--meshes 4 --data 2`` (two meshes per process) is checked on the
first launch of tests/integration/test_multiprocess_train.py, which has that
layout. With ``NNX_MPMD_DEBUG_ROWS_DIR`` set, every process logs the rows it read
for each batch (`nnx_mpmd.apps.local_batches`): process 0 (the first stage) must
have read the ``inputs`` only, process 1 (the last stage) the ``targets`` only, each
once per step; and the losses must equal the unpipelined ``nnx.jit`` step on
the whole batches. The row computation itself, for more layouts, is tested
without processes in tests/placement/test_process_batch.py.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from flax import nnx
from mp_launch import check, launch, logged_losses

from nnx_mpmd.apps.local_batches import DEBUG_ROWS_ENV
from nnx_mpmd.apps.train import config_from_args
from nnx_mpmd.apps.train_loop import Trainer, train_step

pytestmark = pytest.mark.multiprocess

TRAIN = [sys.executable, "-m", "nnx_mpmd", "train"]
STEPS = 2
BATCH = 8
COMMON = [
    "--batch-size", str(BATCH), "--microbatches", "2", "--seq-len", "16",
    "--corpus-bytes", "20000", "--log-every", "1", "--warmup", "1", "--steps", str(STEPS),
    "--val-batches", "0", "--sample-tokens", "0",
]  # fmt: skip


def _reference_losses(args: list[str], run_dir) -> list[float]:
    """The same model, optimizer and whole batches stepped by `nnx.jit` on one device."""
    trainer = Trainer(config_from_args([*args, "--run-dir", str(run_dir)]), run_dir)
    step = nnx.jit(train_step)
    return [
        float(step(trainer.model, trainer.optimizer, next(trainer.batches))) for _ in range(STEPS)
    ]


def _rows_read(folder, process: int) -> list[dict]:
    path = folder / f"rows-{process}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_each_process_read_only_its_rows(rows_dir, steps: int, batch: int) -> None:
    """Process 0 (the first stage) read the inputs, process 1 (the last) the targets,
    every row of each of ``steps`` batches, once each."""
    everything = list(range(batch))
    first, last = _rows_read(rows_dir, 0), _rows_read(rows_dir, 1)
    assert [r["index"] for r in first] == [r["index"] for r in last] == list(range(steps))
    for record in first:  # the first stage's process: the inputs, no targets
        assert (record["inputs"], record["targets"]) == (everything, [])
    for record in last:  # the last stage's process: the targets, no inputs
        assert (record["inputs"], record["targets"]) == ([], everything)


@pytest.mark.slow  # one launch of two processes
def test_each_process_reads_only_its_rows_and_losses_equal_nnx_jit(tmp_path):
    # One mesh per process; one block per stage: the fewest that compile.
    args = [*COMMON, "--meshes", "2", "--data", "4", "--layers", "2"]
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    run_dir = tmp_path / "run"
    done, _ = launch(
        TRAIN, *args, "--run-dir", str(run_dir), timeout=300,
        fresh=[(run_dir, False), (rows_dir, True)], **{DEBUG_ROWS_ENV: str(rows_dir)},
    )  # fmt: skip
    check(done)
    assert_each_process_read_only_its_rows(rows_dir, STEPS, BATCH)
    losses = logged_losses(run_dir)
    reference = _reference_losses(args, tmp_path / "reference")
    np.testing.assert_allclose([losses[s] for s in range(1, STEPS + 1)], reference, rtol=1e-5)
