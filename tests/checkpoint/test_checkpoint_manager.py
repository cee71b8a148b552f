"""CheckpointManager: steps, retention, metadata, async saves, SIGKILL faults, example."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_helpers import Net, batches, make_optimizer, param_values, run_steps
from mp_launch import codegen_flags
from orbax.checkpoint import JsonCheckpointHandler

from nnx_mpmd.checkpoint import CheckpointManager

TESTS = Path(__file__).parents[1]
ROOT = TESTS.parent
KILLED = (-9, 137)  # timeout re-raises the SIGKILL, or exits 128 + 9


def run_bounded(args: list[str], seconds: int) -> subprocess.CompletedProcess:
    """Runs a Python script under ``timeout -k 5 seconds`` and captures its output."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = codegen_flags()  # the worker adds its device count
    return subprocess.run(
        ["timeout", "-k", "5", str(seconds), sys.executable, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=False,
    )


def worker(*args: str) -> subprocess.CompletedProcess:
    return run_bounded([str(TESTS / "checkpoint_worker.py"), *args], 240)  # bounds a hang only


@pytest.mark.parametrize("async_save", [True, False])
def test_steps_retention_interval_and_metadata(tmp_path, async_save):
    with CheckpointManager(
        tmp_path, max_to_keep=2, save_interval_steps=2, async_save=async_save
    ) as mgr:
        saved = [
            mgr.save(step, {"w": jnp.full((3,), float(step)), "step": step}, {"pos": step * 10})
            for step in range(7)
        ]
        assert saved == [True, False, True, False, True, False, True]
        mgr.wait_until_finished()
        assert mgr.all_steps() == [4, 6] and mgr.latest_step() == 6
        assert mgr.metadata() == {"pos": 60} and mgr.metadata(4) == {"pos": 40}
        out = mgr.restore({"w": jnp.zeros(3), "step": 0})
        assert out["step"] == 6 and out["w"].tolist() == [6.0] * 3
        assert mgr.restore({"w": jnp.zeros(3), "step": 0}, step=4)["step"] == 4
        assert "steps=[4, 6]" in repr(mgr)
    # a new manager (a new process, after a restart) sees the same steps
    with CheckpointManager(tmp_path) as again:
        assert again.all_steps() == [4, 6]
        assert again.metadata() == {"pos": 60}


def test_metadata_defaults_to_empty_dict(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(0, {"w": jnp.zeros(2)})
        assert mgr.metadata() == {}


def _hold_background_json_writes(monkeypatch) -> threading.Event:
    """Orbax's background JSON writes wait for the returned event (at most 60 s).

    The save is then still in flight after the steps however the machine's load
    splits the time between the steps and the background write.
    """
    release = threading.Event()
    write = JsonCheckpointHandler._save_fn

    async def held(self, item, directory):
        await asyncio.to_thread(release.wait, 60)
        return await write(self, item, directory)

    monkeypatch.setattr(JsonCheckpointHandler, "_save_fn", held)
    return release


def test_async_save_overlaps_training_and_changes_nothing(tmp_path, monkeypatch):
    release = _hold_background_json_writes(monkeypatch)
    data = batches(0, 3)
    model, optimizer = Net((0, 0, 1, 1), seed=3), None
    optimizer = make_optimizer(model)
    run_steps(model, optimizer, data[:1])  # compile outside the measured window
    snapshot = param_values(model)
    big = jax.random.normal(jax.random.key(1), (24 * 1024 * 1024,))

    reference = Net((0, 0, 1, 1), seed=3)
    reference_opt = make_optimizer(reference)
    run_steps(reference, reference_opt, data[:1])
    expected = run_steps(reference, reference_opt, data[1:])

    with CheckpointManager(tmp_path, async_save=True) as mgr:
        mgr.save(1, {"model": model, "optimizer": optimizer, "big": big})
        losses = run_steps(model, optimizer, data[1:])
        in_flight_after_steps = mgr.is_saving_in_progress()
        release.set()
        mgr.wait_until_finished()
        assert in_flight_after_steps, "the save finished before the train steps ran"
        assert losses == expected
        restored = Net(None, seed=9)
        mgr.restore({"model": restored, "optimizer": make_optimizer(restored), "big": big})
    for key, value in snapshot.items():
        np.testing.assert_array_equal(param_values(restored)[key], value)


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    result = worker("kill-during-save", str(tmp_path))
    assert result.returncode in KILLED, result.stdout + result.stderr
    assert "SAVED 1" in result.stdout and "KILLING" in result.stdout
    assert any(p.name.startswith("2.orbax-checkpoint-tmp") for p in tmp_path.iterdir())
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        assert mgr.all_steps() == [1]
        out = mgr.restore({"w": jnp.zeros(1000), "big": jnp.zeros(8)})
        assert out["w"][:3].tolist() == [0.0, 1.0, 2.0]
        assert mgr.metadata() == {"data_position": 1}
        assert mgr.save(2, {"w": jnp.ones(2)})  # the stale partial step is replaced
        assert mgr.all_steps() == [1, 2]


def losses_of(stdout: str) -> dict[int, str]:
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return {line["step"]: line["loss"] for line in lines if "step" in line}


def test_resume_after_sigkill_reproduces_uninterrupted_losses(tmp_path):
    steps = "6"
    clean = worker("train", str(tmp_path / "clean"), steps)
    assert clean.returncode == 0, clean.stderr
    killed = worker("train", str(tmp_path / "crash"), steps, "--kill-at", "3")
    assert killed.returncode in KILLED, killed.stderr
    resumed = worker("train", str(tmp_path / "crash"), steps)
    assert resumed.returncode == 0, resumed.stderr
    assert '"resumed_from"' in resumed.stdout

    expected = losses_of(clean.stdout)
    before, after = losses_of(killed.stdout), losses_of(resumed.stdout)
    assert sorted(expected) == list(range(6))
    assert min(after) <= max(before) + 1  # resumed at the last finished step, not from 0
    assert {**before, **after} == expected
    assert all(expected[s] == after[s] for s in after)


def test_example_resumes(tmp_path):
    result = run_bounded(
        [
            str(ROOT / "examples" / "04_checkpoint_resume.py"),
            "--steps",
            "4",
            "--dir",
            str(tmp_path),
        ],
        120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resumed losses match" in result.stdout
