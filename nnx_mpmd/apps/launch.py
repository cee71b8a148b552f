"""``nnx-mpmd launch``: start N local processes of one script under ``jax.distributed``.

Process 0 hosts the coordination service on ``127.0.0.1`` (a free port),
listening on that interface only (``NNX_MPMD_COORDINATOR_BIND``, passed as
``coordinator_bind_address`` to ``jax.distributed.initialize``). Each
process gets ``NNX_MPMD_PROCESS_ID``, ``NNX_MPMD_NUM_PROCESSES`` and
``NNX_MPMD_COORDINATOR`` (read by `nnx_mpmd.distributed.initialize`) and, with
``--devices-per-process K``, ``XLA_FLAGS`` for K simulated CPU devices. Output
lines are prefixed with ``[pI]``. When a process fails, the others get
``--grace`` seconds to notice and stop on their own, then are terminated; the
exit status is the first failure's (0 when all succeed). When process 0 (the
coordinator) fails first, a note says that the others' aborts follow from it
(`coordinator_lost_note`).

Stopping: the first SIGTERM or SIGINT the launcher gets is forwarded to every
process (each ``nnx-mpmd train`` then saves a checkpoint of one agreed step and
exits); those still running ``--stop-grace`` seconds later are killed, and the
launcher exits with ``128 + signal`` after a line saying what happened. A
second signal kills every process at once. The processes run in their own
process group (a Ctrl-C in the terminal reaches them once, through the
launcher) and, on Linux, die with the launcher even when it is SIGKILLed
(``prctl(PR_SET_PDEATHSIG)``). Known noise of JAX's CPU collectives (Gloo's
connection lines, the coordination service's recoverability warning) is
hidden unless ``--verbose`` is given (`is_noise`).

Example:
    >>> main(["--processes", "2", "--", "python", "-c", "print('hi')"])  # doctest: +SKIP
    [p0] hi
    [p1] hi
    0
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any, cast

from nnx_mpmd.errors import MpmdError
from nnx_mpmd.runtime.process_env import launch_env

__all__ = ["coordinator_lost_note", "free_port", "is_noise", "launch", "main", "stop_summary"]

#: Lines of the processes' output hidden without ``--verbose``: logs that every
#: healthy multi-process CPU run prints and that say nothing about this run.
NOISE = (
    re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks"),
    re.compile(r"coordination_service\.cc:\d+\].*Using experimental recoverable task feature"),
)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free right now.

    Example:
      >>> 0 < free_port() < 65536
      True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def is_noise(line: str) -> bool:
    """Whether an output line (without ``[pI]``) is known noise, hidden without ``--verbose``.

    Example:
      >>> is_noise("[Gloo] Rank 1 is connected to 1 peer ranks. Expected number ...")
      True
      >>> is_noise("step 4/40  loss 4.0659")
      False
    """
    return any(pattern.search(line) for pattern in NOISE)


def _pump(
    stream: IO[bytes], prefix: str, out: IO[str], lock: threading.Lock, verbose: bool = True
) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        if not verbose and is_noise(line):
            continue
        with lock:
            out.write(f"{prefix}{line}\n")
            out.flush()
    stream.close()


def _stop(procs: Sequence[subprocess.Popen], kill_after_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + kill_after_s
    for p in procs:
        remaining = deadline - time.monotonic()
        try:
            p.wait(timeout=max(remaining, 0.01))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


PR_SET_PDEATHSIG = 1  # linux/prctl.h
#: The "when" of a stop whose second signal killed every process: its grace period is over.
_KILLED_AT_ONCE = -float("inf")


def _die_with_launcher_hook() -> Any:
    """A ``preexec_fn`` that makes a started process get SIGKILL when the launcher dies.

    Linux only (``prctl(PR_SET_PDEATHSIG)``); None elsewhere. The function is
    looked up here, before any fork, so the child only calls it.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    launcher = os.getpid()

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != launcher:  # the launcher died before the signal was armed
            os._exit(1)

    return hook


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    """Sends ``signum`` to a started process and its own children (its process group)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signum)
    except OSError:  # not a group leader (or already gone): the process itself
        with contextlib.suppress(OSError):
            proc.send_signal(signum)


class _SignalInbox:
    """SIGTERM and SIGINT received by the launcher, for its polling loop to act on
    (the handler only records them: the loop may hold the output lock)."""

    def __init__(self) -> None:
        self._received: list[int] = []
        self._previous: dict[int, Any] = {}

    def install(self) -> _SignalInbox:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def _record(self, signum: int, frame: Any) -> None:
        self._received.append(signum)

    def take(self) -> list[int]:
        received, self._received = self._received, []
        return received

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}


def _status_of(code: int | None) -> str:
    if code is None:
        return "running"
    return str(128 - code if code < 0 else code)


def stop_summary(
    signum: int, codes: Sequence[int | None], killed: Sequence[int], grace_s: float
) -> str:
    """The launcher's line after a stop signal: which processes stopped and which were killed.

    Example:
      >>> stop_summary(signal.SIGTERM, [-9, 143], [0], 60)  # doctest: +ELLIPSIS
      'nnx-mpmd launch: stopped by SIGTERM: process 0 was still running 60 s after it ...'
    """
    name = signal.Signals(signum).name
    statuses = ", ".join(f"p{i}: {_status_of(c)}" for i, c in enumerate(codes))
    if not killed:
        return (
            f"nnx-mpmd launch: stopped by {name}: every process exited within the {grace_s:g} s "
            f"grace period (--stop-grace), after saving its checkpoint if it is nnx-mpmd train "
            f"(exit statuses {statuses})."
        )
    which = ", ".join(str(i) for i in killed)
    who = f"process {which} was" if len(killed) == 1 else f"processes {which} were"
    return (
        f"nnx-mpmd launch: stopped by {name}: {who} still running {grace_s:g} s after it "
        "(--stop-grace) and killed (SIGKILL); a checkpoint being written is lost, and --resume "
        f"continues from the last complete one (exit statuses {statuses})."
    )


def coordinator_lost_note(status: int) -> str:
    """The line the launcher prints when process 0 (the coordinator) fails first, given its status.

    JAX then aborts the others, whose messages only say process 0 is gone.

    Example:
      >>> coordinator_lost_note(137).split(". ")[0]
      'nnx-mpmd launch: process 0 (the coordinator) failed first (killed by signal 9)'
    """
    how = f"killed by signal {status - 128}" if status > 128 else f"exit status {status}"
    return (
        f"nnx-mpmd launch: process 0 (the coordinator) failed first ({how}). It hosts the "
        "coordination service, so JAX aborts the other processes as soon as they lose it "
        "('Terminating process because the JAX distributed service detected fatal errors'): "
        "the cause is in process 0's output ([p0] lines)."
    )


def _failed_first(index: int, status: int) -> str:
    """The launcher's line naming process ``index`` (not 0) as the first to fail."""
    how = f"killed by signal {status - 128}" if status > 128 else f"exit status {status}"
    return (
        f"nnx-mpmd launch: process {index} failed first ({how}); the others stop because of "
        f"it (a DistributedError naming process {index}): the cause is in its output "
        f"([p{index}] lines)."
    )


def launch(
    command: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int | None = None,
    port: int | None = None,
    grace_s: float = 20.0,
    out: IO[str] | None = None,
    stop_grace_s: float = 60.0,
    verbose: bool = True,
) -> int:
    """Runs ``command`` as ``num_processes`` local processes and waits for them.

    Args:
      command: the program and its arguments (e.g. ``["python", "train.py"]``).
      num_processes: how many processes.
      devices_per_process: simulated CPU devices per process (None: leave XLA_FLAGS).
      port: the coordinator port (default: a free one).
      grace_s: after a failure, how long the others may take to stop on their own.
      out: where prefixed output goes (default ``sys.stdout``).
      stop_grace_s: after a SIGTERM or SIGINT to the launcher (forwarded to
        every process), how long they may take to save and exit before they are
        killed.
      verbose: also show the known noise of the processes' output (`is_noise`).

    Returns:
      0 when every process exits with 0; ``128 + signal`` when a SIGTERM or
      SIGINT stopped the launcher; else the first failing exit status
      (``128 + signal`` for a process killed by a signal).

    Raises:
      MpmdError: the command cannot be started (no such program); the processes
        already started are stopped.

    Example:
      >>> launch([sys.executable, "-c", "import os; print(os.environ['NNX_MPMD_PROCESS_ID'])"],
      ...        1, out=sys.stdout)
      [p0] 0
      0
    """
    out = out or cast(IO[str], sys.stdout)
    coordinator = f"127.0.0.1:{port or free_port()}"
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    inbox = _SignalInbox().install()
    stopping: tuple[int, float] | None = None  # (signal, when it came)
    try:
        die_with_launcher = _die_with_launcher_hook()
        for i in range(num_processes):
            env = launch_env(i, num_processes, coordinator, devices_per_process=devices_per_process)
            try:
                proc = subprocess.Popen(
                    list(command),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # signals reach them through the launcher only
                    preexec_fn=die_with_launcher,
                )
            except OSError as e:  # no such program, or not executable
                raise MpmdError(
                    f"cannot start process {i}'s command {command[0]!r} ({e.strerror}); check "
                    "the program after '--' is installed and on PATH (e.g. -- nnx-mpmd train)."
                ) from None
            procs.append(proc)
        # The pumps start after the last fork: no other thread runs while one forks.
        for i, proc in enumerate(procs):
            pump = threading.Thread(
                target=_pump, args=(proc.stdout, f"[p{i}] ", out, lock, verbose)
            )
            pump.daemon = True
            pump.start()
            pumps.append(pump)
        status = 0
        failed_at: float | None = None
        while True:
            for signum in inbox.take():
                stopping = _on_stop_signal(signum, stopping, procs, stop_grace_s, out, lock)
            codes = [p.poll() for p in procs]
            if stopping is not None:
                if _stop_finished(stopping, codes, procs, stop_grace_s, out, lock):
                    status = 128 + stopping[0]
                    break
                time.sleep(0.05)
                continue
            for i, code in enumerate(codes):
                if code not in (None, 0) and status == 0:
                    status = 128 - code if code < 0 else code
                    failed_at = time.monotonic()
                    if num_processes > 1:
                        note = coordinator_lost_note(status) if i == 0 else _failed_first(i, status)
                        with lock:
                            out.write(note + "\n")
                            out.flush()
            if all(code is not None for code in codes):
                break
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                _stop(procs, 5.0)
                break
            time.sleep(0.05)
    except KeyboardInterrupt:  # outside the main thread, where no handler is installed
        _stop(procs, 5.0)
        status = 130
    finally:
        inbox.uninstall()
        _stop(procs, 5.0)
        for pump in pumps:
            pump.join(timeout=5.0)
    return status


def _say(out: IO[str], lock: threading.Lock, line: str) -> None:
    with lock:
        out.write(line + "\n")
        out.flush()


def _on_stop_signal(
    signum: int,
    stopping: tuple[int, float] | None,
    procs: Sequence[subprocess.Popen],
    stop_grace_s: float,
    out: IO[str],
    lock: threading.Lock,
) -> tuple[int, float]:
    """Forwards the first stop signal to every process; kills them all at the second."""
    name = signal.Signals(signum).name
    if stopping is None:
        for proc in procs:
            _signal_group(proc, signum)
        _say(
            out,
            lock,
            f"nnx-mpmd launch: got {name}: forwarded it to the {len(procs)} processes, which "
            f"stop after an agreed step and save a checkpoint; waiting up to {stop_grace_s:g} s "
            f"(--stop-grace). Send {name} again to kill them at once.",
        )
        return signum, time.monotonic()
    running = [i for i, proc in enumerate(procs) if proc.poll() is None]
    for proc in procs:
        _signal_group(proc, signal.SIGKILL)
    _say(
        out,
        lock,
        f"nnx-mpmd launch: got a second {name}: killed process(es) {running} at once (SIGKILL); "
        "a checkpoint being written is lost, --resume continues from the last complete one.",
    )
    return stopping[0], _KILLED_AT_ONCE


def _stop_finished(
    stopping: tuple[int, float],
    codes: Sequence[int | None],
    procs: Sequence[subprocess.Popen],
    stop_grace_s: float,
    out: IO[str],
    lock: threading.Lock,
) -> bool:
    """After a stop signal: whether every process is gone (killing stragglers once the
    grace period is over); prints the summary when so."""
    signum, since = stopping
    killed: list[int] = []
    if any(code is None for code in codes):
        if time.monotonic() - since <= stop_grace_s:
            return False
        killed = [i for i, code in enumerate(codes) if code is None]
        for i in killed:
            _signal_group(procs[i], signal.SIGKILL)
        codes = [proc.wait() for proc in procs]
    if since != _KILLED_AT_ONCE:  # after a second signal, that line said it all
        _say(out, lock, stop_summary(signum, codes, killed, stop_grace_s))
    return True


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nnx-mpmd launch",
        description="Start N local processes of a script under jax.distributed.",
        epilog="example: nnx-mpmd launch --processes 2 --devices-per-process 4 -- "
        "python train.py --steps 10",
    )
    parser.add_argument("--processes", "-n", type=int, required=True, help="number of processes")
    parser.add_argument(
        "--devices-per-process", type=int, default=None, help="simulated CPU devices per process"
    )
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    parser.add_argument(
        "--grace",
        type=float,
        default=20.0,
        help="seconds the other processes get to stop after one fails (default 20)",
    )
    parser.add_argument(
        "--stop-grace",
        type=float,
        default=60.0,
        help="after a SIGTERM or SIGINT to the launcher (forwarded to every process): seconds "
        "they get to save a checkpoint and exit before they are killed (default 60)",
    )
    parser.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="also show Gloo's connection lines and the coordination service's warnings",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- program [args...]")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``nnx-mpmd launch``: `launch`'s status, 2 for bad arguments.

    Example:
      >>> main(["--processes", "0", "--", "true"])
      nnx-mpmd launch: --processes must be >= 1, got 0
      2
    """
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if args.processes < 1:
        print(f"nnx-mpmd launch: --processes must be >= 1, got {args.processes}")
        return 2
    if args.devices_per_process is not None and args.devices_per_process < 1:
        print(
            f"nnx-mpmd launch: --devices-per-process must be >= 1, got {args.devices_per_process}"
        )
        return 2
    if not command:
        print("nnx-mpmd launch: no command given; usage: nnx-mpmd launch -n 2 -- python script.py")
        return 2
    return launch(
        command,
        args.processes,
        devices_per_process=args.devices_per_process,
        port=args.port,
        grace_s=args.grace,
        stop_grace_s=args.stop_grace,
        verbose=args.verbose,
    )
