"""``nnx-mpmd train`` whose clean stop stalls before its checkpoint (spawned by tests).

Usage: ``python slow_stop_train.py TRAIN_ARGS...`` with ``NNX_MPMD_TEST_STOP_MARKER=PATH``.

When a stop signal has been honoured (`StopSignals.should_stop` turns true), the
run writes ``"<pid>"`` to PATH and sleeps instead of saving, so the test can send
the second signal while the stop is certainly in progress: it must end the
process at once. The stall lives in this test script, not in the library.
"""

from __future__ import annotations

import os
import sys
import time

from nnx_mpmd.apps import train
from nnx_mpmd.apps.stop_signals import StopSignals

MARKER = os.environ["NNX_MPMD_TEST_STOP_MARKER"]
STALL_S = 120.0  # far longer than the test waits; the test's timeout bounds it too
_should_stop = StopSignals.should_stop


def _stalling_should_stop(self, steps_run):
    if not _should_stop(self, steps_run):
        return False
    with open(MARKER + ".part", "w") as f:
        f.write(str(os.getpid()))
    os.replace(MARKER + ".part", MARKER)  # the test never reads a half-written marker
    time.sleep(STALL_S)
    return True


StopSignals.should_stop = _stalling_should_stop

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:]))
