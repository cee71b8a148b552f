"""Faults of whole runs: a training process SIGKILLed while a checkpoint save is in progress.

``nnx-mpmd train`` saves through `nnx_mpmd.checkpoint.CheckpointManager`, which
lets orbax write each step into ``<step>.orbax-checkpoint-tmp`` and rename it
when complete. A process killed mid-save must leave the last complete
checkpoint as the latest one, and ``--resume`` must continue from it, never
from the half-written step.

The kill is deterministic: tests/mp_scripts/stalled_save_train.py runs
``nnx-mpmd train`` with orbax's JSON writer patched to stall inside the save of
one step (after the step's temporary directory and arrays were started) and to
write a marker file; the test kills the process as soon as the marker appears.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mp_launch import logged_losses, train_env

from nnx_mpmd.checkpoint import CheckpointManager

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parents[1] / "mp_scripts"

# 2 stages on 2 CPU devices, a save every 2 steps: compiles and trains in seconds.
TRAIN = [
    "--meshes", "2", "--data", "1", "--layers", "2", "--batch-size", "8",
    "--microbatches", "2", "--seq-len", "32", "--corpus-bytes", "100000",
    "--log-every", "1", "--ckpt-every", "2", "--keep", "2", "--warmup", "1",
    "--steps", "6", "--devices", "2", "--sample-tokens", "0", "--val-batches", "0",
]  # fmt: skip
STALLED_STEP = 4
TIMEOUT_S = 300  # bounds a hang, not the happy path on a loaded machine


def _kill_during_save(run_dir: Path, marker: Path) -> list[str]:
    """Starts the stalling run, SIGKILLs it mid-save; returns the checkpoint dir's entries."""
    log = run_dir.parent / "killed.log"
    command = [
        "timeout", "-k", "5", str(TIMEOUT_S), sys.executable, str(SCRIPTS / "stalled_save_train.py"),
        *TRAIN, "--run-dir", str(run_dir),
    ]  # fmt: skip
    env = train_env(
        NNX_MPMD_TEST_STALL_SAVE_STEP=str(STALLED_STEP), NNX_MPMD_TEST_STALL_MARKER=str(marker)
    )
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + TIMEOUT_S
            while not marker.exists():
                assert proc.poll() is None, (
                    "the run ended before the stalled save:\n" + (log.read_text()[-4000:])
                )
                assert time.monotonic() < deadline, "no stalled save within the time limit"
                time.sleep(0.1)
            entries = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
            os.kill(int(marker.read_text()), signal.SIGKILL)  # the python process itself
            # GNU timeout passes the child's death by signal on: it dies of SIGKILL too.
            assert proc.wait(timeout=30) in (-signal.SIGKILL, 128 + signal.SIGKILL)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return entries


@pytest.mark.slow  # two short training runs in fresh processes (about 30-45 s on 2 cores)
def test_kill_during_save_resumes_from_last_complete_checkpoint(tmp_path):
    run_dir, marker = tmp_path / "run", tmp_path / "save-stalled"
    entries = _kill_during_save(run_dir, marker)
    # The kill landed mid-save: step 4 exists only as orbax's temporary directory.
    assert "2" in entries and str(STALLED_STEP) not in entries, entries
    assert any(name.startswith(f"{STALLED_STEP}.orbax-checkpoint-tmp") for name in entries)
    killed_losses = logged_losses(run_dir)

    manager = CheckpointManager(run_dir / "checkpoints", async_save=False)
    try:
        assert manager.all_steps() == [2]
        assert manager.latest_step() == 2
        assert manager.metadata()["step"] == 2
    finally:
        manager.close()

    resumed = subprocess.run(
        ["timeout", "-k", "5", str(TIMEOUT_S), sys.executable, "-m", "nnx_mpmd", "train",
         *TRAIN, "--run-dir", str(run_dir), "--resume"],
        cwd=ROOT, env=train_env(), capture_output=True, text=True,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    assert "resumed from step 2" in resumed.stdout
    losses = logged_losses(run_dir)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    # Continuing from step 2 repeats the killed run's steps 3 and 4 exactly.
    for step in (3, 4):
        assert losses[step] == pytest.approx(killed_losses[step], rel=1e-5)
    manager = CheckpointManager(run_dir / "checkpoints", async_save=False)
    try:
        assert manager.all_steps() == [4, 6]  # step 4 saved again, completely
        assert manager.metadata(STALLED_STEP)["step"] == STALLED_STEP
    finally:
        manager.close()
