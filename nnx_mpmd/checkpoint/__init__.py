"""Layout-independent checkpoints of staged NNX state, with orbax underneath.

Every array is saved once under its logical NNX path (``Stage`` wrappers and the
mesh it lived on leave no trace), so a checkpoint restores into any stage split,
any number of meshes, or a plain unplaced model.

Example:
  >>> import tempfile
  >>> from flax import nnx
  >>> import nnx_mpmd as mp
  >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  >>> path = tempfile.mkdtemp() + "/ckpt"
  >>> mp.checkpoint.save(path, {"model": model})
  >>> other = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
  >>> _ = mp.checkpoint.restore(path, {"model": other})
  >>> bool((other.kernel[...] == model.kernel[...]).all())
  True
"""

from nnx_mpmd.checkpoint.core import restore, save
from nnx_mpmd.checkpoint.manager import CheckpointManager, Restored

__all__ = ["CheckpointManager", "Restored", "restore", "save"]
