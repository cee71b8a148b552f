"""A process of ``nnx-mpmd train`` dies during a save, a restore or at exit: the survivor says so.

Two processes (one CPU device each, one stage each) under ``nnx-mpmd launch`` on
127.0.0.1. Process 1 SIGKILLs itself at a chosen point
(tests/mp_scripts/dying_peer_train.py): inside the save of the last step (the
survivor then waits for that save to commit), inside the restore of ``--resume``,
or after its last step (the survivor then waits to finish together). The survivor
must raise a `DistributedError` naming process 1 and what it was doing, and exit,
within 20 s of the death (the heartbeat is 3 s here); the launcher must name
process 1 as the process that failed first. Every launch is bounded by
``timeout -k 5 N`` (tests/mp_launch.py).
"""

from __future__ import annotations

import time

import pytest
from mp_launch import check, launch, launch_once

pytestmark = pytest.mark.multiprocess

# 2 stages on 2 processes x 1 CPU device, a save every 2 steps: compiles in seconds.
ARGS = [
    "--meshes", "2", "--data", "1", "--layers", "2", "--batch-size", "8",
    "--microbatches", "2", "--seq-len", "32", "--corpus-bytes", "100000",
    "--log-every", "1", "--ckpt-every", "2", "--keep", "2", "--warmup", "1",
    "--steps", "4", "--sample-tokens", "0", "--val-batches", "0",
]  # fmt: skip
BOUND_S = 20.0  # what holds for a death mid-step (issue 47)
TIMEOUT_S = 150


def _run_dying(tmp_path, die_at: str, *extra: str, **env: str):
    """Launches the dying script; returns (launcher output, seconds from the death to the end)."""
    marker = tmp_path / f"died-{die_at}"
    done, _ = launch_once(
        "dying_peer_train.py",
        *ARGS,
        "--run-dir", str(tmp_path / "run"),
        "--compile-cache", str(tmp_path.parent / "cache"),
        *extra,
        processes=2,
        devices_per_process=1,
        timeout=TIMEOUT_S,
        NNX_MPMD_TEST_DIE_AT=die_at,
        NNX_MPMD_TEST_DIE_MARKER=str(marker),
        **env,
    )  # fmt: skip
    ended = time.time()
    output = done.stdout + done.stderr
    assert marker.exists(), f"process 1 never reached the {die_at} point:\n{output[-6000:]}"
    return done, output, ended - float(marker.read_text())


def _check_named(done, output: str, seconds: float, doing: str) -> None:
    survivor = [line for line in output.splitlines() if line.startswith("[p0] ")]
    message = "\n".join(survivor[-30:])
    assert done.returncode != 0, output[-6000:]
    assert "nnx-mpmd train: error: DistributedError: process 1 died while process 0 was " in (
        message
    ), output[-6000:]
    assert doing in message, message
    assert "Traceback" not in message, message
    assert "nnx-mpmd launch: process 1 failed first (killed by signal 9)" in output, output[-3000:]
    assert seconds <= BOUND_S, f"the survivor took {seconds:.1f} s:\n{output[-6000:]}"


@pytest.mark.slow  # one 2-process launch, compiling a 2-stage GPT
def test_death_during_a_save_is_named(tmp_path):
    done, output, seconds = _run_dying(tmp_path, "save", NNX_MPMD_TEST_DIE_STEP="4")
    _check_named(done, output, seconds, "checkpoint")


@pytest.mark.slow  # two 2-process launches
def test_death_during_a_restore_is_named(tmp_path):
    first, _ = launch(
        "dying_peer_train.py",
        *ARGS,
        "--run-dir", str(tmp_path / "run"),
        "--compile-cache", str(tmp_path.parent / "cache"),
        "--stop-at", "2",
        processes=2,
        devices_per_process=1,
        timeout=TIMEOUT_S,
        fresh=[(tmp_path / "run", False)],
        NNX_MPMD_TEST_DIE_AT="never",
        NNX_MPMD_TEST_DIE_MARKER=str(tmp_path / "unused"),
    )  # fmt: skip
    check(first)
    done, output, seconds = _run_dying(tmp_path, "restore", "--resume")
    _check_named(done, output, seconds, "restoring")


@pytest.mark.slow  # one 2-process launch
def test_death_at_exit_is_named(tmp_path):
    done, output, seconds = _run_dying(tmp_path, "exit")
    _check_named(done, output, seconds, "finishing")
