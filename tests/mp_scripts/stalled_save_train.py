"""``nnx-mpmd train`` whose checkpoint save of one step stalls half-written (spawned by tests).

Usage: ``python stalled_save_train.py TRAIN_ARGS...`` with
``NNX_MPMD_TEST_STALL_SAVE_STEP=N`` and ``NNX_MPMD_TEST_STALL_MARKER=PATH``.

The save of step N creates orbax's temporary step directory and starts writing
its arrays; its JSON items (manifest, metadata) then write ``"<pid>"`` to PATH
and sleep instead of writing, so the step is never completed nor renamed to its
final name. Training goes on meanwhile (orbax saves in the background). The
test kills the process with SIGKILL once PATH exists: a save that is certainly
in progress. The stall lives in this test script (a patch of orbax's JSON
writer), not in the library. Set ``XLA_FLAGS`` for the device count: orbax
imports JAX first.
"""

from __future__ import annotations

import os
import sys
import time

from orbax.checkpoint import JsonCheckpointHandler

from nnx_mpmd.apps import train

STALL_STEP = os.environ["NNX_MPMD_TEST_STALL_SAVE_STEP"]
MARKER = os.environ["NNX_MPMD_TEST_STALL_MARKER"]
STALL_S = 120.0  # far longer than the test waits; the test's timeout bounds it too

_write_json = JsonCheckpointHandler._save_fn  # orbax 0.12: writes one JSON item


async def _stalling_write_json(self, item, directory):
    # directory: CHECKPOINTS/<step>.orbax-checkpoint-tmp-<n>/<item> while the step is unfinished.
    step_dir = os.path.basename(os.path.dirname(os.fspath(directory)))
    if step_dir.split(".", 1)[0] == STALL_STEP and ".orbax-checkpoint-tmp" in step_dir:
        with open(MARKER + ".part", "w") as f:
            f.write(str(os.getpid()))
        os.replace(MARKER + ".part", MARKER)  # the test never reads a half-written marker
        time.sleep(STALL_S)
    return await _write_json(self, item, directory)


JsonCheckpointHandler._save_fn = _stalling_write_json

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:]))
