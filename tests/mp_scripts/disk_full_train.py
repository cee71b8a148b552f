"""``nnx-mpmd train`` whose disk is full during the save of one step (spawned by tests).

Usage: ``python disk_full_train.py TRAIN_ARGS...`` with ``NNX_MPMD_TEST_FULL_STEP=N``.

Orbax writes each JSON item (manifest, metadata) of a step in its background
save thread. Here, for step N only, that write raises ``OSError(ENOSPC)`` as a
full disk does, after the step's temporary directory and arrays were started:
the save fails in the background while training goes on, as on a real full
disk. The failure lives in this test script (a patch of orbax's JSON writer),
not in the library. Set ``XLA_FLAGS`` for the device count: orbax imports JAX
first.
"""

from __future__ import annotations

import errno
import os
import sys

from orbax.checkpoint import JsonCheckpointHandler

from nnx_mpmd.apps import train

FULL_STEP = os.environ["NNX_MPMD_TEST_FULL_STEP"]

_write_json = JsonCheckpointHandler._save_fn  # orbax 0.12: writes one JSON item


async def _write_json_on_full_disk(self, item, directory):
    # directory: CHECKPOINTS/<step>.orbax-checkpoint-tmp-<n>/<item> while the step is unfinished.
    step_dir = os.path.basename(os.path.dirname(os.fspath(directory)))
    if step_dir.split(".", 1)[0] == FULL_STEP:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(directory))
    return await _write_json(self, item, directory)


JsonCheckpointHandler._save_fn = _write_json_on_full_disk

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:]))
