"""Where a pipelined step puts each batch leaf, so a caller can build it there in advance.

A step moves every leaf it splits into microbatches (a leaf ``mp.value_and_grad``
reads) to the submesh of the stage that reads it, as ``[m, B/m, ...]`` with a
sharding the compiler chose (over the batch axis, or replicated where the
step's code rejects a sharded batch). `batch_shardings` lowers the step (no
data moves; the call that follows finds the lowering in the cache) and reads
those shardings off its batch transfers. With them, each process of a
multi-process run can build just its own rows of each leaf
(`nnx_mpmd.placement.process_batch`).

Example:
    >>> import jax, numpy as np, optax
    >>> import nnx_mpmd as mp
    >>> from flax import nnx
    >>> class Net(mp.PipelinedModel):
    ...     def __init__(self, rngs):
    ...         self.a = mp.Stage(nnx.Linear(4, 4, rngs=rngs), stage=0)
    ...         self.b = mp.Stage(nnx.Linear(4, 1, rngs=rngs), stage=1)
    ...     def __call__(self, x):
    ...         return self.b(self.a(x))
    >>> def loss_fn(model, batch):
    ...     return ((model(batch["x"]) - batch["y"]) ** 2).mean()
    >>> def step(model, opt, batch):
    ...     loss, grads = mp.value_and_grad(loss_fn)(model, batch)
    ...     opt.update(model, grads)
    ...     return loss
    >>> mesh = mp.MpmdMesh(jax.make_mesh((2, 2), ("stage", "data")), "stage")
    >>> f = mp.jit(step, mesh=mesh, schedule=mp.GPipe(), num_microbatches=2)
    >>> model = Net(nnx.Rngs(0))
    >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> batch = {"x": np.ones((8, 4), np.float32), "y": np.zeros((8, 1), np.float32)}
    >>> where = batch_shardings(f, model, opt, batch)[2]
    >>> where["x"].mesh == mesh.submesh(0), where["y"].mesh == mesh.submesh(1)
    (True, True)
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_mpmd.compiler.ir import Transfer, TransferBatch
from nnx_mpmd.compiler.outer.outer_assign import HOST

__all__ = ["batch_shardings"]


def batch_shardings(step: Any, *args: Any) -> Any:
    """Where ``step`` puts each batch leaf of ``args``, as its ``[m, B/m, ...]`` sharding.

    Lowers the step for ``args`` (``step.lower(*args)``: nothing runs,
    nothing moves, and the next call with arguments of the same types uses
    this lowering).

    Args:
      step: an ``mp.jit`` step.
      *args: its arguments (a batch of host arrays of the right shapes will do).

    Returns:
      ``args`` with a ``NamedSharding`` at every leaf the step splits into
      microbatches on one submesh, and None at every other leaf (the model
      and optimizer, other arguments, and a batch leaf read on several
      submeshes, which must stay a host array). Pass such a leaf as
      ``make_microbatched_array(rows, sharding, B, m)``
      (`nnx_mpmd.placement.process_batch`).

    Example:
      >>> # see the module docstring
    """
    traced = step.trace(*args)
    compiled = traced.lower().compiled
    flat = traced.call.flat
    first_other = len(compiled.consts) + len(flat.state_leaves)
    leaves: list[Any] = [None] * len(flat.args_leaves)
    for j, position in enumerate(flat.other_positions):
        host_slot = compiled.input_slots[first_other + j].get(HOST)
        if host_slot is not None:
            leaves[position] = _split_sharding(compiled, host_slot, step.mesh)
    return jax.tree.unflatten(flat.args_tree, leaves)


def _split_sharding(compiled: Any, slot: int, mesh: Any) -> NamedSharding | None:
    """The one destination of the microbatch split of the host value in ``slot``, or None
    when it is split for several submeshes or also moved whole (read outside the region)."""
    reads = [
        t
        for ins in compiled.instructions
        for t in (ins.transfers if isinstance(ins, TransferBatch) else (ins,))
        if isinstance(t, Transfer) and t.src == slot
    ]
    targets = {(t.dst_mesh, t.spec if t.spec is not None else P()) for t in reads}
    if len(targets) != 1 or not all(t.reshape_microbatches for t in reads):
        return None
    (mesh_id, spec) = targets.pop()
    return NamedSharding(mesh.submesh(mesh_id), spec)
