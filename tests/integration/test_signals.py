"""Stopping runs with signals: SIGTERM and SIGINT to ``nnx-mpmd train`` and ``nnx-mpmd launch``.

A first SIGTERM or SIGINT to ``train`` finishes the step in progress, saves a
checkpoint of it, prints how to continue and exits with ``128 + signal``; a
second one ends the process at once. The launcher forwards the first signal to
every process, kills those still running after ``--stop-grace`` seconds, kills
every process at a second signal, and its processes die with it even when it is
SIGKILLed. Every process is local, bounded with ``timeout -k 5 N`` (JAX catches
SIGTERM) and started in its own session, so nothing can hang or leak.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from mp_launch import SUCCESS_HEARTBEAT_S, env_for_launch, launch_cache, logged_losses, train_env

from nnx_mpmd.apps.stop_signals import exit_status, stopped_message
from nnx_mpmd.apps.train import config_from_args
from nnx_mpmd.apps.train_loop import Trainer, train_step
from nnx_mpmd.checkpoint import CheckpointManager

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parents[1] / "mp_scripts"
# Bounds a hang, not the happy path: a loaded 2-core CI host can take minutes to
# compile and reach the step where a signal is sent.
TIMEOUT_S = 300

# 2 stages on 2 CPU devices, a save every 4 steps; many steps, so that the signal
# lands mid-run however slow the machine (the run stops long before the last).
TRAIN = [
    "--meshes", "2", "--data", "1", "--layers", "2", "--batch-size", "8",
    "--microbatches", "2", "--seq-len", "32", "--corpus-bytes", "100000",
    "--log-every", "1", "--ckpt-every", "4", "--keep", "3", "--warmup", "1",
    "--steps", "400", "--devices", "2", "--sample-tokens", "0", "--val-batches", "0",
]  # fmt: skip
STOPPED = re.compile(
    r"stopped at step (\d+) \((SIG\w+)\); continue with: nnx-mpmd train --resume --run-dir (\S+)"
)


def _wait_for(condition, proc: subprocess.Popen, log: Path, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} within {TIMEOUT_S} s"
        time.sleep(0.05)


def _logged_step(run_dir: Path, step: int):
    def reached() -> bool:
        path = run_dir / "metrics.jsonl"
        return path.exists() and f'"step": {step},' in path.read_text()

    return reached


def _start(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        ["timeout", "-k", "5", str(TIMEOUT_S), *command],
        cwd=ROOT,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _signal_train(proc: subprocess.Popen, signum: int) -> None:
    """Sends ``signum`` to the training process (the child of ``timeout``)."""
    os.kill(_python_child(proc.pid), signum)


def _python_child(pid: int) -> int:
    """The child process of ``pid`` (``timeout`` starts exactly one)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            return int(stat.parent.name)
    raise AssertionError(f"process {pid} has no child")


def _stop_train(
    tmp_path: Path, signum: int, after_step: int, *extra: str
) -> tuple[Path, int, str, int]:
    """Runs ``train`` (``extra``: more flags), sends ``signum`` once ``after_step`` is
    logged; returns (run dir, exit status, output, stop step)."""
    name = signal.Signals(signum).name
    run_dir, log = tmp_path / "run", tmp_path / f"train-{name}.log"
    command = [sys.executable, "-m", "nnx_mpmd", "train", *TRAIN, "--run-dir", str(run_dir)]
    command += extra
    proc = _start(command, log, train_env())
    try:
        _wait_for(_logged_step(run_dir, after_step), proc, log, f"step {after_step}")
        _signal_train(proc, signum)
        code = proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = log.read_text()
    match = STOPPED.search(output)
    assert match, output[-4000:]
    assert match[2] == name and match[3] == str(run_dir)
    return run_dir, code, output, int(match[1])


def _saved_steps(run_dir: Path) -> list[int]:
    with CheckpointManager(run_dir / "checkpoints", async_save=False) as manager:
        return manager.all_steps()


def _reference_losses(tmp_path: Path, steps: int) -> list[float]:
    """The same model, optimizer and batches stepped by `nnx.jit` on one device."""
    cfg = config_from_args([*TRAIN, "--run-dir", str(tmp_path / "reference")])
    trainer = Trainer(cfg, tmp_path / "reference")
    step = nnx.jit(train_step)
    return [
        float(step(trainer.model, trainer.optimizer, next(trainer.batches))) for _ in range(steps)
    ]


def test_exit_status_and_messages():
    from nnx_mpmd.apps.launch import stop_summary

    assert exit_status(signal.SIGTERM) == 143 and exit_status(signal.SIGINT) == 130
    assert STOPPED.search(stopped_message(3, signal.SIGINT, "r", saved=True))
    assert "without a checkpoint" in stopped_message(3, signal.SIGTERM, "r", saved=False)
    assert "every process exited" in stop_summary(signal.SIGTERM, [-15, 143], [], 5)
    assert "processes 0, 1 were still running" in stop_summary(signal.SIGINT, [-9, -9], [0, 1], 5)


@pytest.mark.slow  # a training run stopped by SIGTERM, resumed, then stopped by SIGINT
def test_sigterm_saves_the_step_and_a_resume_stopped_by_sigint_matches_a_straight_run(tmp_path):
    run_dir, code, output, stop_step = _stop_train(tmp_path, signal.SIGTERM, after_step=2)
    # GNU timeout passes the exit status on.
    assert code == 143, output[-4000:]
    assert "got SIGTERM: finishing the step in progress" in output
    # The step in progress when the signal came; the logged step itself when the signal
    # beat the loop's check after logging it (a loaded machine can delay the loop there).
    assert 2 <= stop_step < 400
    assert stop_step in _saved_steps(run_dir)  # a checkpoint of the stop step, committed
    with CheckpointManager(run_dir / "checkpoints", async_save=False) as manager:
        assert manager.metadata()["step"] == stop_step
    first = logged_losses(run_dir)
    assert max(first) == stop_step

    # The resumed run is stopped by SIGINT: the same stop, without a traceback
    # (one run for both signals: each stop costs a process start and its compiles).
    _, code, resumed, end = _stop_train(tmp_path, signal.SIGINT, stop_step + 2, "--resume")
    assert code == 130, resumed[-4000:]
    assert "Traceback" not in resumed and "KeyboardInterrupt" not in resumed, resumed[-4000:]
    assert f"resumed from step {stop_step}" in resumed
    assert stop_step + 2 <= end < 400
    assert end in _saved_steps(run_dir)
    losses = logged_losses(run_dir)
    assert sorted(losses) == list(range(1, end + 1))
    reference = _reference_losses(tmp_path, end)
    np.testing.assert_allclose([losses[s] for s in range(1, end + 1)], reference, rtol=1e-5)


@pytest.mark.slow
def test_second_signal_stops_at_once(tmp_path):
    run_dir, log, marker = tmp_path / "run", tmp_path / "train.log", tmp_path / "stopping"
    command = [
        sys.executable,
        str(SCRIPTS / "slow_stop_train.py"),
        *TRAIN,
        "--run-dir",
        str(run_dir),
    ]
    proc = _start(command, log, train_env(NNX_MPMD_TEST_STOP_MARKER=str(marker)))
    try:
        _wait_for(_logged_step(run_dir, 5), proc, log, "step 5")
        _signal_train(proc, signal.SIGTERM)
        _wait_for(marker.exists, proc, log, "the stop")  # stalled where it would save
        os.kill(int(marker.read_text()), signal.SIGTERM)
        started = time.monotonic()
        code = proc.wait(timeout=90)
        # At once: far below the 120 s the stop stalls (slow_stop_train.py), however loaded.
        assert time.monotonic() - started < 60
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = log.read_text()
    assert code in (-signal.SIGTERM, 143), output[-4000:]
    assert "stopped at step" not in output, output[-4000:]
    stop_step = max(logged_losses(run_dir))
    if stop_step % 4:  # not a periodic save's step: only the stop would have saved it
        assert stop_step not in _saved_steps(run_dir)


# -- nnx-mpmd launch -------------------------------------------------------------------


def _launch(directory: Path, mode: str, *flags: str) -> tuple[subprocess.Popen, Path]:
    log = directory / "launch.log"
    command = [
        sys.executable, "-m", "nnx_mpmd", "launch", "--processes", "2", *flags, "--",
        sys.executable, str(SCRIPTS / "signal_child.py"), mode, str(directory),
    ]  # fmt: skip
    return _start(command, log, env_for_launch()), log


def _child_pids(directory: Path, proc: subprocess.Popen, log: Path) -> list[int]:
    paths = [directory / f"{i}.pid" for i in range(2)]
    _wait_for(lambda: all(p.exists() for p in paths), proc, log, "both processes")
    return [int(p.read_text()) for p in paths]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _signal_launcher(proc: subprocess.Popen, signum: int) -> None:
    os.kill(_python_child(proc.pid), signum)


def test_launch_forwards_sigterm_and_says_every_process_stopped(tmp_path):
    proc, log = _launch(tmp_path, "graceful", "--stop-grace", "30")
    pids = _child_pids(tmp_path, proc, log)
    _signal_launcher(proc, signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    output = log.read_text()
    assert output.count("got SIGTERM\n") == 2, output  # [p0] and [p1]
    assert "nnx-mpmd launch: stopped by SIGTERM: every process exited" in output, output
    assert "p0: 143, p1: 143" in output
    assert not any(_alive(pid) for pid in pids)


def test_launch_kills_stragglers_after_the_stop_grace(tmp_path):
    proc, log = _launch(tmp_path, "stubborn", "--stop-grace", "1")
    pids = _child_pids(tmp_path, proc, log)
    _signal_launcher(proc, signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    output = log.read_text()
    assert "stopped by SIGINT: processes 0, 1 were still running 1 s after it" in output, output
    assert "p0: 137, p1: 137" in output
    assert not any(_alive(pid) for pid in pids)


def test_launch_second_signal_kills_at_once(tmp_path):
    proc, log = _launch(tmp_path, "stubborn", "--stop-grace", "100")
    pids = _child_pids(tmp_path, proc, log)
    _signal_launcher(proc, signal.SIGTERM)
    _wait_for(lambda: "forwarded it" in log.read_text(), proc, log, "the first signal")
    _signal_launcher(proc, signal.SIGTERM)
    assert proc.wait(timeout=30) == 143  # long before --stop-grace
    assert "got a second SIGTERM: killed process(es) [0, 1] at once" in log.read_text()
    assert not any(_alive(pid) for pid in pids)


def test_children_die_with_a_killed_launcher(tmp_path):
    proc, log = _launch(tmp_path, "stubborn")
    pids = _child_pids(tmp_path, proc, log)
    _signal_launcher(proc, signal.SIGKILL)
    deadline = time.monotonic() + 30  # they die at once; a loaded machine reaps them late
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in pids if _alive(pid)]
    for pid in alive:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert not alive, f"processes {alive} outlived the launcher"


def test_launch_hides_gloo_lines_unless_verbose(tmp_path):
    from nnx_mpmd.apps.launch import is_noise

    assert is_noise("[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of ... : 1")
    assert is_noise(
        "W1128 02:05:43.558712    9861 coordination_service.cc:185] [67] Using experimental "
        "recoverable task feature. The default shutdown barrier will only block ..."
    )
    assert not is_noise("W1128 02:05:22.324998 9423 preemption_notifier.cc:90] SIGTERM caught")
    for flags, shown in (((), False), (("--verbose",), True)):
        proc, log = _launch(tmp_path, "graceful", *flags)
        _child_pids(tmp_path, proc, log)
        _wait_for(lambda log=log: log.read_text().count("ready") == 2, proc, log, "both ready")
        _signal_launcher(proc, signal.SIGTERM)
        proc.wait(timeout=60)
        assert ("[Gloo]" in log.read_text()) == shown, log.read_text()
        for i in range(2):
            (tmp_path / f"{i}.pid").unlink()


# 2 stages on 2 processes x 1 CPU device (the model of TRAIN), no periodic save before
# the stop's. Each process holds one stage, so the stop step must be agreed across
# processes; the 4 meshes x 2 data layout itself is tests/integration/test_multiprocess_train.py's.
LAUNCHED_TRAIN = [
    "--meshes", "2", "--data", "1", "--layers", "2", "--batch-size", "8",
    "--microbatches", "2", "--seq-len", "32", "--corpus-bytes", "100000",
    "--log-every", "1", "--ckpt-every", "100", "--warmup", "1", "--steps", "300",
    "--val-batches", "0", "--sample-tokens", "0",
]  # fmt: skip


def _stop_launched_train(tmp_path: Path, after_step: int, *resume: str) -> tuple[int, str]:
    """Launches ``train`` on 2 processes, SIGTERMs the launcher once ``after_step`` is
    logged; returns (the stop step, the output)."""
    run_dir, log = tmp_path / "run", tmp_path / f"launch{len(resume)}.log"
    command = [
        sys.executable, "-m", "nnx_mpmd", "launch", "--processes", "2",
        "--devices-per-process", "1", "--stop-grace", "120", "--",
        sys.executable, "-m", "nnx_mpmd", "train", *LAUNCHED_TRAIN, "--run-dir", str(run_dir),
        "--compile-cache", launch_cache(), *resume,
    ]  # fmt: skip
    proc = _start(command, log, env_for_launch(NNX_MPMD_HEARTBEAT_S=SUCCESS_HEARTBEAT_S))
    try:
        _wait_for(_logged_step(run_dir, after_step), proc, log, f"step {after_step}")
        _signal_launcher(proc, signal.SIGTERM)
        code = proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = log.read_text()
    assert code == 143, output[-6000:]
    # Within --stop-grace, as the launcher says (it kills stragglers, 137), not as a
    # clock on a loaded machine says: a stop that saves may take a minute there.
    assert "stopped by SIGTERM: every process exited within the 120 s" in output, output[-6000:]
    assert "p0: 143, p1: 143" in output
    match = STOPPED.search(output)
    assert match and match[2] == "SIGTERM", output[-6000:]
    assert "[p1] stopped at step" not in output  # process 0 speaks for the run
    stop_step = int(match[1])
    assert stop_step >= after_step  # the logged step, or one after (the test above says why)
    # The stop step's checkpoint is committed, with both processes' parts.
    arrays = run_dir / "checkpoints" / str(stop_step) / "arrays"
    assert (arrays / "ocdbt.process_0").is_dir() and (arrays / "ocdbt.process_1").is_dir()
    return stop_step, output


@pytest.mark.slow  # two launches of two processes, each compiling a 2-stage GPT
@pytest.mark.multiprocess
def test_sigterm_to_launch_stops_every_process_at_one_step(tmp_path):
    run_dir = tmp_path / "run"
    stop_step, _ = _stop_launched_train(tmp_path, 2)
    assert _saved_steps(run_dir) == [stop_step]  # the only checkpoint: the stop's
    # A resumed run stops the same way (JAX's sync point counts absolute steps).
    second_stop, output = _stop_launched_train(tmp_path, stop_step + 2, "--resume")
    assert f"[p0] resumed from step {stop_step}" in output
    assert _saved_steps(run_dir) == [stop_step, second_stop]
    losses = logged_losses(run_dir)
    assert sorted(losses) == list(range(1, second_stop + 1))
    stop_step = second_stop
    cfg = config_from_args([*LAUNCHED_TRAIN, "--run-dir", str(tmp_path / "reference")])
    trainer = Trainer(cfg, tmp_path / "reference")
    step = nnx.jit(train_step)
    reference = [
        float(step(trainer.model, trainer.optimizer, next(trainer.batches)))
        for _ in range(stop_step)
    ]
    np.testing.assert_allclose([losses[s] for s in range(1, stop_step + 1)], reference, rtol=1e-5)
