"""Saves two steps with `CheckpointManager`, the second under a tiny file-size limit.

Usage: ``python fsize_limit_save.py DIRECTORY`` (spawned by tests). ``RLIMIT_FSIZE``
(``ulimit -f``) is lowered to 4 KiB before the second, asynchronous save, so
tensorstore's own writes of its arrays fail (``EFBIG``: Python ignores SIGXFSZ)
in orbax's background threads, the real path of a full disk without needing
mount rights. Prints ``saved`` or the error's message, and exits 0 or 3.
"""

from __future__ import annotations

import resource
import sys

import jax.numpy as jnp

from nnx_mpmd.checkpoint import CheckpointManager
from nnx_mpmd.errors import CheckpointError

manager = CheckpointManager(sys.argv[1])
manager.save(1, {"w": jnp.arange(60000.0)}, metadata={"step": 1})
manager.wait_until_finished()
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
try:
    manager.save(2, {"w": -jnp.arange(60000.0)}, metadata={"step": 2})
    manager.close()
except CheckpointError as error:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    print(f"CheckpointError: {error}", file=sys.stderr)
    sys.exit(3)
print("saved")
