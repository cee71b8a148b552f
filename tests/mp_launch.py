"""Launching test scripts as several local processes, bounded and retried.

Shared by the multi-process tests. Every launch runs under ``timeout -k 5 N``
(JAX catches SIGTERM) and ``nnx-mpmd launch`` listens on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "mp_scripts"

# A safety net from before the exit-race fix and the lost output transfers
# (docs/guides/multi-process.md): a run that hits the time limit is tried again, at
# most ATTEMPTS times in all; any other failure, or a hang on every attempt, fails
# the test. A run expected to lose a process to SIGKILL must use `launch_once`: the
# launcher then exits with 137, which reads as a timeout here. Set
# NNX_MPMD_TEST_LAUNCH_ATTEMPTS=1 to soak-test without retries.
ATTEMPTS = int(os.environ.get("NNX_MPMD_TEST_LAUNCH_ATTEMPTS", "3"))
TIMED_OUT = (124, 137)
# A launch's time limit bounds a hang, not the happy path: CI's 2-core host may be
# loaded several times over, and a run that merely runs slowly must not hit it.
LAUNCH_TIMEOUT_S = 300
# A run expected to succeed counts a peer dead after the library's default 10 s without
# a heartbeat (a loaded machine can stall a process for seconds); tests in which a
# process dies (`launch_once`) keep 3 s, so that the survivors give up quickly.
SUCCESS_HEARTBEAT_S = "10"


#: XLA code-generation flags a subprocess inherits: the O0, the emitter choice and the
#: unsplit LLVM module of tests/conftest.py (or what the XLA_FLAGS of the test run set).
CODEGEN_FLAGS = (
    "--xla_backend_optimization_level",
    "--xla_cpu_use_fusion_emitters",
    "--xla_cpu_parallel_codegen_split_count",
)


def codegen_flags() -> str:
    """This run's XLA code-generation flags (tests/conftest.py sets them), or ''.

    Those named by `CODEGEN_FLAGS` (``--xla_backend_optimization_level=N``, ...):
    a subprocess that builds its own ``XLA_FLAGS`` passes them on, so that it compiles
    as the test process does (both sides of every comparison alike, and faster).
    """
    flags = os.environ.get("XLA_FLAGS", "").split()
    return " ".join(f for f in flags if f.startswith(CODEGEN_FLAGS))


def dump_after_s(timeout: int) -> int:
    """When a launched script under a ``timeout`` s limit prints its stacks and exits.

    Just before the limit, so that a hang shows where it hung, and never sooner: a
    script that runs slowly on a loaded machine is not cut short.
    """
    return max(timeout - 20, 1)


def env_for_launch(**extra: str) -> dict[str, str]:
    """The environment of a launched run: CPU, short heartbeats, no inherited settings.

    XLA_FLAGS keeps only the test run's code-generation flags (`codegen_flags`; both
    sides of every comparison compile with them): the launcher and the scripts set the
    device counts. A hung script prints its stacks and exits just before the time
    limit (``NNX_MPMD_DUMP_AFTER_S``, `dump_after_s`). The compilation cache is off
    unless the command names one
    (``--compile-cache``): a launched ``nnx-mpmd train`` would otherwise fill
    ``~/.cache/nnx_mpmd/jax``.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("NNX_MPMD_")}
    env.pop("XLA_FLAGS", None)
    if codegen_flags():
        env["XLA_FLAGS"] = codegen_flags()
    env.update(JAX_PLATFORMS="cpu", NNX_MPMD_HEARTBEAT_S="3")
    env.update(NNX_MPMD_DUMP_AFTER_S=str(dump_after_s(LAUNCH_TIMEOUT_S)))
    env.update(NNX_MPMD_COMPILE_CACHE="off")
    env.update(extra)
    return env


def launch(
    script: str | list[str],
    *args: str,
    processes: int = 2,
    devices_per_process: int = 4,
    timeout: int = LAUNCH_TIMEOUT_S,
    fresh=(),
    **env: str,
) -> tuple[subprocess.CompletedProcess, float]:
    """Runs ``script`` on ``processes`` local processes; returns (result, seconds).

    ``script``: a file under ``mp_scripts/``, or a whole command line (a list).

    ``fresh``: ``(path, is_output_folder)`` pairs removed before a retry (output
    folders are recreated empty).

    The run is expected to succeed: peers count as dead after `SUCCESS_HEARTBEAT_S`
    unless ``env`` says otherwise.
    """
    env = {"NNX_MPMD_HEARTBEAT_S": SUCCESS_HEARTBEAT_S, **env}
    for attempt in range(ATTEMPTS):
        if attempt:
            for path, keep_dir in fresh:
                shutil.rmtree(path, ignore_errors=True)
                if keep_dir:  # an output folder the script expects to exist
                    Path(path).mkdir(parents=True)
        done, elapsed = launch_once(
            script,
            *args,
            processes=processes,
            devices_per_process=devices_per_process,
            timeout=timeout,
            **env,
        )
        if done.returncode not in TIMED_OUT:
            break
    return done, elapsed


def launch_once(
    script: str | list[str],
    *args: str,
    processes: int = 2,
    devices_per_process: int = 4,
    timeout: int = LAUNCH_TIMEOUT_S,
    **env: str,
) -> tuple[subprocess.CompletedProcess, float]:
    """One bounded ``nnx-mpmd launch`` of ``script``, without retries.

    ``script``: a file under ``mp_scripts/``, or a whole command line (a list).
    A hung script dumps its stacks at ``dump_after_s(timeout)`` unless ``env`` sets
    ``NNX_MPMD_DUMP_AFTER_S``.
    """
    env = {"NNX_MPMD_DUMP_AFTER_S": str(dump_after_s(timeout)), **env}
    program = list(script) if isinstance(script, list) else [sys.executable, str(SCRIPTS / script)]
    command = [
        "timeout", "-k", "5", str(timeout), sys.executable, "-m", "nnx_mpmd", "launch",
        "--processes", str(processes), "--devices-per-process", str(devices_per_process),
        "--grace", "30", "--", *program, *args,
    ]  # fmt: skip
    start = time.monotonic()
    done = subprocess.run(
        command, cwd=ROOT, env=env_for_launch(**env), capture_output=True, text=True
    )
    return done, time.monotonic() - start


def run_single(
    script: str, *args: str, timeout: int = LAUNCH_TIMEOUT_S
) -> subprocess.CompletedProcess:
    """Runs ``script`` as one process (8 CPU devices unless the script says otherwise)."""
    command = ["timeout", "-k", "5", str(timeout), sys.executable, str(SCRIPTS / script), *args]
    env = env_for_launch(NNX_MPMD_DUMP_AFTER_S=str(dump_after_s(timeout)))
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)


def time_limit(done: subprocess.CompletedProcess) -> int | None:
    """The ``N`` of the ``timeout -k 5 N`` a run ran under, or None."""
    command = done.args if isinstance(done.args, list) else []
    if len(command) > 3 and command[0] == "timeout" and command[1] == "-k":
        return int(command[3])
    return None


def check(done: subprocess.CompletedProcess) -> None:
    """Asserts that a run succeeded, showing the end of its output otherwise.

    A run stopped by its time limit, or whose stacks were dumped just before it, says
    so first: on a loaded machine that is the likely cause, and the output alone reads
    like a crash.
    """
    limit = time_limit(done)
    said = ""
    if limit is not None and done.returncode in TIMED_OUT:
        killed = " (or a process was SIGKILLed)" if done.returncode == 137 else ""
        said = (
            f"the run hit its time limit of {limit} s (`timeout -k 5 {limit}`, exit "
            f"{done.returncode}{killed}; `launch` tries such a run {ATTEMPTS} times): it hung, "
            "or the machine was too loaded to finish in time. Stacks dumped before the limit "
            "(NNX_MPMD_DUMP_AFTER_S) are in the output below.\n"
        )
    elif "Timeout (" in done.stdout + done.stderr:  # faulthandler's header, before the limit
        said = (
            "a process ran past NNX_MPMD_DUMP_AFTER_S (just before the time limit) and dumped "
            "its stacks: it hung, or the machine was too loaded to finish in time. The stacks "
            "are in the output below.\n"
        )
    assert done.returncode == 0, said + done.stdout[-6000:] + done.stderr[-3000:]


def read_json(directory: Path, name: str) -> dict:
    """One JSON result file a script wrote."""
    return json.loads((directory / name).read_text())


def launch_cache() -> str:
    """A compilation cache for launched ``nnx-mpmd train`` runs, shared by the whole test run.

    Pass it as ``--compile-cache``: launches of the same configuration in any test
    (and xdist worker) then load process 0's programs instead of compiling them.
    Only process 0 of a launch writes entries (JAX skips the write elsewhere), so
    the processes of one launch never share what one of them is writing.
    """
    return str(Path(os.environ["NNX_MPMD_TEST_RUN_DIR"]) / "launch-cache")


def train_env(**extra: str) -> dict[str, str]:
    """The environment of an ``nnx-mpmd train`` run a test starts: 2 CPU devices,
    none of this process's ``NNX_MPMD_*`` settings, and the test run's compilation
    cache (the runs of one test compile alike); ``extra`` last."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NNX_MPMD_")}
    flags = f"--xla_force_host_platform_device_count=2 {codegen_flags()}"
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip())
    cache = jax.config.jax_compilation_cache_dir
    if cache:
        env.update(
            JAX_COMPILATION_CACHE_DIR=cache,
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        )
    env.update(extra)
    return env


def logged_losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss from a run directory's ``metrics.jsonl``."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}
