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

Example:
    >>> main(["--processes", "2", "--", "python", "-c", "print('hi')"])  # doctest: +SKIP
    [p0] hi
    [p1] hi
    0
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

from nnx_mpmd.runtime.multi_process import launch_env

__all__ = ["coordinator_lost_note", "free_port", "launch", "main"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free right now.

    Args:
      host: the address to bind.

    Returns:
      The port number.

    Example:
      >>> 0 < free_port() < 65536
      True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _pump(stream: IO[bytes], prefix: str, out: IO[str], lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
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


def coordinator_lost_note(status: int) -> str:
    """What the launcher prints when process 0, which hosts the coordination service, fails first.

    JAX aborts every other process as soon as it loses the coordination
    service (its client's error poll fails within milliseconds, before any
    Python code can react), so their own messages ("Terminating process
    because the JAX distributed service detected fatal errors") only repeat
    that process 0 is gone; this note says where to look.

    Args:
      status: process 0's exit status (``128 + signal`` when killed).

    Returns:
      The note, one line.

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
) -> int:
    """Runs ``command`` as ``num_processes`` local processes and waits for them.

    Args:
      command: the program and its arguments (e.g. ``["python", "train.py"]``).
      num_processes: how many processes.
      devices_per_process: simulated CPU devices per process (None: leave XLA_FLAGS).
      port: the coordinator port (default: a free one).
      grace_s: after a failure, how long the others may take to stop on their own.
      out: where prefixed output goes (default ``sys.stdout``).

    Returns:
      0 when every process exits with 0, else the first failing exit status
      (``128 + signal`` for a process killed by a signal).

    Example:
      >>> launch([sys.executable, "-c", "import os; print(os.environ['NNX_MPMD_PROCESS_ID'])"],
      ...        1, out=sys.stdout)
      [p0] 0
      0
    """
    out = out or sys.stdout
    coordinator = f"127.0.0.1:{port or free_port()}"
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    try:
        for i in range(num_processes):
            env = launch_env(i, num_processes, coordinator, devices_per_process=devices_per_process)
            proc = subprocess.Popen(
                list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            procs.append(proc)
            pump = threading.Thread(target=_pump, args=(proc.stdout, f"[p{i}] ", out, lock))
            pump.daemon = True
            pump.start()
            pumps.append(pump)
        status = 0
        failed_at: float | None = None
        while True:
            codes = [p.poll() for p in procs]
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
    except KeyboardInterrupt:
        _stop(procs, 5.0)
        status = 130
    finally:
        _stop(procs, 5.0)
        for pump in pumps:
            pump.join(timeout=5.0)
    return status


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
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- program [args...]")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``nnx-mpmd launch``.

    Args:
      argv: the arguments after ``launch``.

    Returns:
      The exit status (see `launch`); 2 for bad arguments.

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
    )
