"""``nnx-mpmd train`` in which one process SIGKILLs itself at a chosen point (spawned by tests).

Usage (under ``nnx-mpmd launch``): ``python dying_peer_train.py TRAIN_ARGS...`` with

* ``NNX_MPMD_TEST_DIE_AT``: where process ``NNX_MPMD_TEST_DIE_PROCESS`` (default 1) dies:
  ``save`` (orbax writes the JSON items of the save of step ``NNX_MPMD_TEST_DIE_STEP``:
  the save is in flight), ``fingerprints`` (the exchange of the checksums of the first
  save: the dying process waits in it for process 0, which comes 6 s late, and dies
  after 3 s), ``restore`` (orbax reads the arrays of a ``--resume``),
  ``validation`` (process 0 computes the validation loss: it writes
  ``<marker>.validating`` and then takes up to a minute, and the dying process dies
  once that file exists), or ``exit`` (the train loop is done, before the processes
  finish together);
* ``NNX_MPMD_TEST_DIE_MARKER``: a file that receives the wall-clock time of the death.

The dying process writes the marker and sends itself SIGKILL: no Python cleanup, as
when the OOM killer or a node failure takes it. The patches live in this test
script, not in the library. The survivors must raise a `DistributedError` naming it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

if os.environ.get("NNX_MPMD_DUMP_AFTER_S"):  # print every stack if the script hangs
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ["NNX_MPMD_DUMP_AFTER_S"]), exit=True)

from orbax.checkpoint import JsonCheckpointHandler, PyTreeCheckpointHandler

from nnx_mpmd.apps import train, train_loop
from nnx_mpmd.checkpoint import manifest

DIE_AT = os.environ["NNX_MPMD_TEST_DIE_AT"]
DIE_PROCESS = os.environ.get("NNX_MPMD_TEST_DIE_PROCESS", "1")
DIE_STEP = os.environ.get("NNX_MPMD_TEST_DIE_STEP", "")
MARKER = os.environ["NNX_MPMD_TEST_DIE_MARKER"]
DYING = os.environ.get("NNX_MPMD_PROCESS_ID") == DIE_PROCESS


def _die() -> None:
    with open(MARKER + ".part", "w") as f:
        f.write(repr(time.time()))
    os.replace(MARKER + ".part", MARKER)  # the test never reads a half-written marker
    os.kill(os.getpid(), signal.SIGKILL)


_write_json = JsonCheckpointHandler._save_fn  # orbax 0.12: writes one JSON item


async def _dying_write_json(self, item, directory):
    # directory: CHECKPOINTS/<step>.orbax-checkpoint-tmp-<n>/<item> while the step is unfinished.
    step_dir = os.path.basename(os.path.dirname(os.fspath(directory)))
    if step_dir.split(".", 1)[0] == DIE_STEP:
        _die()
    return await _write_json(self, item, directory)


_restore_pytree = PyTreeCheckpointHandler.restore


def _dying_restore_pytree(self, *args, **kwargs):
    _die()
    return _restore_pytree(self, *args, **kwargs)


_fingerprints = manifest.fingerprints


def _dying_fingerprints(rows):
    # Dies while waiting inside the exchange of the first save: process 0 comes late.
    threading.Timer(3.0, _die).start()
    return _fingerprints(rows)


def _late_fingerprints(rows):
    time.sleep(6.0)
    return _fingerprints(rows)


_val_loss = train_loop.Trainer._val_loss
VALIDATING = MARKER + ".validating"
SLOW_VALIDATION_S = 60.0


def _slow_val_loss(self, batches):
    with open(VALIDATING, "w") as f:
        f.write(repr(time.time()))
    loss = _val_loss(self, batches)
    deadline = time.monotonic() + SLOW_VALIDATION_S  # the peer dies meanwhile
    while time.monotonic() < deadline:
        time.sleep(0.1)
    return loss


_finish_together = train.finish_together


def _die_during_validation():
    deadline = time.monotonic() + 120.0
    while not os.path.exists(VALIDATING) and time.monotonic() < deadline:
        time.sleep(0.05)
    _die()


def _dying_finish_together():
    _die()
    _finish_together()


if DYING and DIE_AT == "save":
    JsonCheckpointHandler._save_fn = _dying_write_json
elif DYING and DIE_AT == "restore":
    PyTreeCheckpointHandler.restore = _dying_restore_pytree
elif DYING and DIE_AT == "exit":
    train.finish_together = _dying_finish_together
elif DYING and DIE_AT == "fingerprints":
    manifest.fingerprints = _dying_fingerprints
if DIE_AT == "fingerprints" and os.environ.get("NNX_MPMD_PROCESS_ID") == "0":
    manifest.fingerprints = _late_fingerprints
elif DYING and DIE_AT == "validation":
    train.finish_together = _die_during_validation
if DIE_AT == "validation" and os.environ.get("NNX_MPMD_PROCESS_ID") == "0":
    train_loop.Trainer._val_loss = _slow_val_loss

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:]))
