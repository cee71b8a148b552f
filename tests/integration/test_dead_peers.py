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

The pieces are unit-tested without processes: a wait run through
`Coordination.call_watching_peers` (and `Coordination.barrier`) gives up naming
a peer whose heartbeat stopped, orbax is told to use the coordination
service's barriers, and the launcher names the first process that failed.
"""

from __future__ import annotations

import io
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from absl import flags
from mp_launch import ROOT, check, launch_cache, launch_once, train_env

import nnx_mpmd as mp
from nnx_mpmd.apps import launch as launcher
from nnx_mpmd.checkpoint import global_arrays
from nnx_mpmd.runtime import coordination

# 2 stages on 2 processes x 1 CPU device, a save every 2 steps: compiles in seconds.
ARGS = [
    "--meshes", "2", "--data", "1", "--layers", "2", "--batch-size", "8",
    "--microbatches", "2", "--seq-len", "32", "--corpus-bytes", "100000",
    "--log-every", "1", "--ckpt-every", "2", "--keep", "2", "--warmup", "1",
    "--steps", "4", "--sample-tokens", "0", "--val-batches", "0",
]  # fmt: skip
BOUND_S = 20.0  # what holds for a death mid-step (issue 47)
TIMEOUT_S = 300  # bounds a hang; a loaded machine compiles slowly (stacks dumped before it)


def _run_dying(tmp_path, die_at: str, *extra: str, **env: str):
    """Launches the dying script; returns (launcher output, seconds from the death to the end)."""
    marker = tmp_path / f"died-{die_at}"
    done, _ = launch_once(
        "dying_peer_train.py",
        *ARGS,
        "--run-dir", str(tmp_path / "run"),
        "--compile-cache", launch_cache(),
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
    print(f"the run ended {seconds:.1f} s after process 1 died")  # the margin, in -rP logs


@pytest.mark.multiprocess
@pytest.mark.slow  # one 2-process launch, compiling a 2-stage GPT
def test_death_during_a_save_is_named(tmp_path):
    done, output, seconds = _run_dying(tmp_path, "save", NNX_MPMD_TEST_DIE_STEP="4")
    _check_named(done, output, seconds, "checkpoint")


@pytest.mark.multiprocess
@pytest.mark.slow  # one run of one process (the checkpoint), one 2-process launch
def test_death_during_a_restore_is_named(tmp_path):
    # The checkpoint to resume from: one process with both devices writes it (in the
    # test run's compilation cache) for half the cost of a launch; any layout restores.
    first = subprocess.run(
        ["timeout", "-k", "5", str(TIMEOUT_S), sys.executable, "-m", "nnx_mpmd", "train",
         *ARGS, "--devices", "2", "--run-dir", str(tmp_path / "run"), "--stop-at", "2"],
        cwd=ROOT, env=train_env(), capture_output=True, text=True,
    )  # fmt: skip
    check(first)
    done, output, seconds = _run_dying(tmp_path, "restore", "--resume")
    _check_named(done, output, seconds, "restoring")


@pytest.mark.multiprocess
@pytest.mark.slow  # one 2-process launch
def test_death_at_exit_is_named(tmp_path):
    done, output, seconds = _run_dying(tmp_path, "exit")
    _check_named(done, output, seconds, "finishing")


@pytest.mark.multiprocess
@pytest.mark.slow  # one 2-process launch
def test_death_during_the_checksum_exchange_is_named(tmp_path):
    done, output, seconds = _run_dying(tmp_path, "fingerprints")
    _check_named(done, output, seconds, "checkpoint")


@pytest.mark.multiprocess
@pytest.mark.slow  # one 2-process launch
def test_death_during_validation_is_named(tmp_path):
    done, output, seconds = _run_dying(tmp_path, "validation", "--val-batches", "1")
    _check_named(done, output, seconds, "computing the validation loss")


# --- the pieces, without processes ------------------------------------------------------


RELEASED_AFTER_S = 10.0  # the fake waits end by themselves: a regression fails, never hangs


class SilentPeerClient:
    """A coordination client in which process 1 beat once and then stopped (it died)."""

    def __init__(self):
        self.store = {"nnx_mpmd/alive/1": "1"}
        self.released = threading.Event()  # frees the abandoned waits at the end of a test

    def key_value_try_get(self, key):
        return self.store[key]

    def wait_at_barrier(self, key, timeout_ms):
        if not self.released.wait(RELEASED_AFTER_S):  # bounded even if nothing gives up
            raise RuntimeError(f"DEADLINE_EXCEEDED: barrier {key}")


@pytest.fixture
def dead_peer():
    """(watcher of process 0 of 2 with a 0.3 s heartbeat, its client); process 1 is silent."""
    client = SilentPeerClient()
    yield coordination.Coordination(client, 0, 2, heartbeat_s=0.3, start=False), client
    client.released.set()


def test_a_wait_that_never_returns_is_given_up_naming_the_dead_peer(dead_peer):
    watcher, client = dead_peer
    with pytest.raises(
        mp.DistributedError,
        match=r"^process 1 died while process 0 was saving checkpoint step 4; the run cannot",
    ):
        watcher.call_watching_peers(
            "saving checkpoint step 4", client.released.wait, RELEASED_AFTER_S
        )


def test_a_barrier_with_a_dead_peer_is_given_up_naming_it(dead_peer):
    watcher, _ = dead_peer
    with pytest.raises(mp.DistributedError, match=r"^process 1 died while process 0 was exiting"):
        watcher.barrier("exit", "exiting", timeout_s=300.0)


def test_a_failure_that_a_dead_peer_explains_names_the_peer(dead_peer):
    watcher, _ = dead_peer

    def cancelled():
        raise RuntimeError("CANCELLED: Stale barrier invocation is cancelled: task disconnected")

    with pytest.raises(mp.DistributedError, match=r"process 1 died while process 0 was restoring"):
        watcher.call_watching_peers("restoring checkpoint step 2", cancelled)


def test_a_watched_call_returns_its_value_and_passes_library_errors_on(dead_peer, monkeypatch):
    watcher, _ = dead_peer
    assert watcher.call_watching_peers("adding", lambda a, b: a + b, 1, 2) == 3
    blamed = []
    monkeypatch.setattr(watcher, "blame_peers", blamed.append)

    def refused():
        raise mp.CheckpointError("step 4 already exists")

    with pytest.raises(mp.CheckpointError, match="step 4 already exists"):
        watcher.call_watching_peers("saving", refused)
    assert blamed == []  # a refusal of the library is not blamed on the peers


def test_bounded_by_peers_on_one_process_is_the_call():
    assert coordination.bounded_by_peers("adding", lambda a, b: a + b, 1, 2) == 3


def test_orbax_is_told_to_use_the_coordination_services_barriers(monkeypatch):
    flag = flags.FLAGS["experimental_orbax_use_distributed_barrier"]
    monkeypatch.setattr(flag, "value", False)
    monkeypatch.setattr(flag, "present", 0)
    global_arrays.use_coordination_barriers()  # one process: left alone
    assert flag.value is False
    monkeypatch.setattr(global_arrays, "multi_process", lambda: True)
    global_arrays.use_coordination_barriers()
    assert flag.value is True
    assert flags.FLAGS.experimental_orbax_use_distributed_barrier is True  # what orbax reads
    monkeypatch.setattr(flag, "value", False)  # given on the command line: kept
    global_arrays.use_coordination_barriers()
    assert flag.value is False


def test_launch_names_the_first_process_that_failed():
    fail_1 = "import os, sys, time; p = os.environ['NNX_MPMD_PROCESS_ID']; "
    fail_1 += "sys.exit(3) if p == '1' else time.sleep(1)"
    out = io.StringIO()
    assert launcher.launch([sys.executable, "-c", fail_1], 2, out=out, grace_s=5) == 3
    assert "nnx-mpmd launch: process 1 failed first (exit status 3); the others stop" in (
        out.getvalue()
    )
    assert "coordinator" not in out.getvalue()


class SilentPeerStore(SilentPeerClient):
    """The same, with a key-value store of bytes: process 1 never publishes its table."""

    def key_value_set_bytes(self, key, data, allow_overwrite=False):
        self.store[key] = data

    def key_value_delete(self, key):
        self.store.pop(key, None)

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        if key in self.store:
            return self.store[key]
        self.released.wait(timeout_ms / 1000)
        raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")


def test_the_checksum_exchange_names_a_dead_peer(monkeypatch):
    client = SilentPeerStore()
    watcher = coordination.Coordination(client, 0, 2, heartbeat_s=0.3, start=False)
    monkeypatch.setattr(global_arrays, "multi_process", lambda: True)
    monkeypatch.setattr(global_arrays, "get_coordination", lambda: watcher)
    monkeypatch.setattr(global_arrays.jax, "process_count", lambda: 2)
    try:
        with pytest.raises(
            mp.DistributedError, match=r"^process 1 died while process 0 was saving a checkpoint"
        ):
            global_arrays.exchange(np.array([1, 2], np.uint32), "saving a checkpoint")
    finally:
        client.released.set()
    assert any("/exchange/" in key and key.endswith("/0") for key in client.store)  # its own
