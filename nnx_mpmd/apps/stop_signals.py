"""Stopping ``nnx-mpmd train`` cleanly on SIGTERM or SIGINT: finish the step, save, exit.

Clusters ask a job to stop with SIGTERM (SLURM, Kubernetes, ``kill``), a
terminal with SIGINT (Ctrl-C). `StopSignals` turns the first of either into a
request that the training loop honours after the step in progress: it saves a
checkpoint at that step, waits until it is committed and exits with
`exit_status` (``128 + signal``: 143 for SIGTERM, 130 for SIGINT). The first
signal also gives both signals back their default action, so a second one
ends the process at once (the save in flight is lost; the last complete
checkpoint stays).

In a multi-process run every process must stop after the same step, since
steps and saves are collective. JAX's preemption service agrees on it: a
process that joined ``jax.distributed`` catches SIGTERM itself (JAX's
notifier), tells the others through the coordination service, and
``jax.experimental.multihost_utils.reached_preemption_sync_point`` turns true
at the same step everywhere. There SIGINT is turned into a SIGTERM to the
process itself, and a second SIGTERM is JAX's to ignore (the launcher or the
cluster's SIGKILL ends the process). See docs/guides/reliability.md.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["STOP_SIGNALS", "StopSignals", "exit_status", "stopped_message"]

#: The signals that ask a run to stop cleanly.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(signum: int) -> int:
    """``128 + signum``: the exit status of a run stopped by ``signum``, as a shell reports it.

    Example:
      >>> exit_status(signal.SIGTERM), exit_status(signal.SIGINT)
      (143, 130)
    """
    return 128 + int(signum)


def stopped_message(step: int, signum: int, run_dir: Any, saved: bool) -> str:
    """The last line of a run stopped at ``step``: where it stopped and how to continue.

    Example:
      >>> stopped_message(7, signal.SIGTERM, "runs/a", saved=True)
      'stopped at step 7 (SIGTERM); continue with: nnx-mpmd train --resume --run-dir runs/a'
    """
    name = signal.Signals(signum).name
    if not saved:
        return (
            f"stopped at step {step} ({name}) without a checkpoint (--ckpt-every 0); "
            "nothing to resume from this run"
        )
    return f"stopped at step {step} ({name}); continue with: nnx-mpmd train --resume --run-dir {run_dir}"


def _preemption_service_running() -> bool:
    """Whether this process joined a multi-process ``jax.distributed`` run with JAX's
    preemption service on (which then owns SIGTERM)."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() <= 1:
        return False
    try:
        multihost_utils.reached_preemption_sync_point(0)
    except RuntimeError:  # the service is switched off (jax_enable_preemption_service)
        return False
    return True


class StopSignals:
    """Turns SIGTERM and SIGINT into a request to stop after the step in progress.

    Use it around a training loop: `install` it, call `begin` with the step the
    loop starts from, ask `should_stop` after every step (on every process,
    with the step's number), and `uninstall` it at the end. Outside the main
    thread it does nothing.

    Example:
      >>> stop = StopSignals().install()
      >>> stop.begin(0)
      >>> stop.should_stop(1)
      False
      >>> signal.raise_signal(signal.SIGTERM)  # doctest: +SKIP
      >>> stop.should_stop(2), stop.signum  # doctest: +SKIP
      (True, <Signals.SIGTERM: 15>)
      >>> stop.uninstall()
    """

    def __init__(self) -> None:
        #: The first stop signal this process got (None: none yet).
        self.signum: int | None = None
        #: Whether JAX's preemption service decides the stop step (multi-process runs).
        self.collective = False
        self._previous: dict[int, Any] = {}

    def install(self) -> StopSignals:
        """Installs the handlers; returns ``self`` (call it after joining ``jax.distributed``)."""
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return self
        self.collective = _preemption_service_running()
        # With the preemption service, SIGTERM stays JAX's: its notifier catches it.
        mine = (signal.SIGINT,) if self.collective else STOP_SIGNALS
        for signum in mine:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def uninstall(self) -> None:
        """Puts back the handlers `install` replaced (those that are still its own)."""
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, previous)
        self._previous = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        del frame
        self.signum = signum
        for other in self._previous:  # a second signal ends the process at once
            signal.signal(other, signal.SIG_DFL)
        name = signal.Signals(signum).name
        note = (
            f"nnx-mpmd train: got {name}: finishing the step in progress, then saving a "
            f"checkpoint (send {name} again to stop at once, without saving)\n"
        )
        os.write(2, note.encode())  # not print(): the main thread may be printing
        if self.collective:  # tell JAX's preemption notifier, which informs every process
            os.kill(os.getpid(), signal.SIGTERM)

    def begin(self, step: int) -> None:
        """Says which step the loop starts after (0, or the restored checkpoint's step).

        JAX syncs at the step after the highest any process reported, so steps are absolute.
        """
        if self.collective:
            from jax.experimental import multihost_utils

            multihost_utils.reached_preemption_sync_point(step)

    def should_stop(self, step: int) -> bool:
        """Whether the loop should stop now, after ``step``.

        Multi-process: every process calls it after every step; true at the same step everywhere.
        """
        if not self.collective:
            return self.signum is not None
        from jax.experimental import multihost_utils

        if multihost_utils.reached_preemption_sync_point(step):
            if self.signum is None:  # another process got the signal: JAX's is SIGTERM
                self.signum = signal.SIGTERM
            return True
        return False
