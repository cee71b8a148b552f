"""Each process of a multi-process ``nnx-mpmd train`` reads only its share of a batch.

The step says where it reads each batch leaf (`nnx_mpmd.jit.batch_placement.batch_shardings`):
for the language models, ``inputs`` on the first stage's submesh (the
embedding) and ``targets`` on the last stage's (the loss), each microbatch
split over the data axis. A process needs only the rows its devices hold
there (`nnx_mpmd.placement.process_batch.process_batch_rows`): the first
stage's processes the inputs, the last stage's the targets, each only its
data-axis shard; a process whose devices run middle stages only reads nothing.

`ProcessLocalBatches` wraps a batch source (`nnx_mpmd.apps.data.BatchIterator`,
or any source with ``batch_at(index, rows=None)``, ``position``, ``batch_size``,
``state_dict()`` and ``load_state_dict()``): each step it gathers just those
rows with ``batch_at(index, rows)`` and builds every leaf as a global array
where the step reads it (`nnx_mpmd.placement.process_batch.make_microbatched_array`),
which the step uses as is.

Set ``NNX_MPMD_DEBUG_ROWS_DIR`` to a folder to have every process append the
rows it read for each batch to ``rows-<process>.jsonl`` there (the tests count
them).

Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from nnx_mpmd.apps.data import BatchIterator
    >>> first = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    >>> last = jax.make_mesh((4,), ("data",), devices=jax.devices()[4:])
    >>> where = {"inputs": NamedSharding(first, P(None, "data")),
    ...          "targets": NamedSharding(last, P(None, "data"))}
    >>> source = BatchIterator(np.arange(200), batch_size=8, seq_len=4)
    >>> batches = ProcessLocalBatches(source, where, num_microbatches=2)
    >>> batch = next(batches)
    >>> batch["inputs"].shape, batch["targets"].array.sharding == where["targets"]
    ((8, 4), True)
    >>> source.position, batches.rows.tolist()
    (1, [0, 1, 2, 3, 4, 5, 6, 7])
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from nnx_mpmd.jit.batch_placement import batch_shardings
from nnx_mpmd.placement.process_batch import make_microbatched_array, process_batch_rows

__all__ = [
    "DEBUG_ROWS_ENV",
    "ProcessLocalBatches",
    "leaf_rows",
    "process_local_batches",
]

#: A folder where every process logs the rows it read (``rows-<process>.jsonl``).
DEBUG_ROWS_ENV = "NNX_MPMD_DEBUG_ROWS_DIR"


def leaf_rows(
    shardings: dict[str, Any],
    batch_size: int,
    num_microbatches: int,
    *,
    process: int | None = None,
    process_of: Callable[[Any], int] | None = None,
) -> dict[str, np.ndarray]:
    """Sorted global rows of each batch leaf one process supplies.

    A None sharding (a leaf not split on one submesh) means every row.

    Example:
      >>> import jax
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> rows = leaf_rows({"inputs": NamedSharding(mesh, P(None, "data")), "targets": None},
      ...                  8, 2, process=0, process_of=lambda d: d.id)
      >>> rows["inputs"].tolist(), rows["targets"].tolist()
      ([0, 1, 4, 5], [0, 1, 2, 3, 4, 5, 6, 7])
    """
    return {
        name: np.arange(batch_size, dtype=np.int64)
        if sharding is None
        else process_batch_rows(
            sharding, batch_size, num_microbatches, process=process, process_of=process_of
        )
        for name, sharding in shardings.items()
    }


class ProcessLocalBatches:
    """A batch source that gives each step its leaves built from this process's rows only.

    Args:
      source: the whole-batch source (``batch_at(index, rows)``, ``position``,
        ``batch_size``, ``state_dict``, ``load_state_dict``).
      shardings: where the step reads each leaf (see `leaf_rows`).
      num_microbatches: the step's microbatches.

    Example:
      >>> # see the module docstring
    """

    def __init__(self, source: Any, shardings: dict[str, Any], num_microbatches: int) -> None:
        self.source = source
        self.shardings = dict(shardings)
        self.num_microbatches = num_microbatches
        self.batch_size = source.batch_size
        self.leaf_rows = leaf_rows(self.shardings, self.batch_size, num_microbatches)
        #: Every row this process reads of a batch (the union of its leaves' rows).
        self.rows = functools.reduce(np.union1d, self.leaf_rows.values()).astype(np.int64)
        folder = os.environ.get(DEBUG_ROWS_ENV)
        self._log = None
        if folder:
            self._log = pathlib.Path(folder) / f"rows-{jax.process_index()}.jsonl"

    @property
    def position(self) -> int:
        """The number of batches served (the source's)."""
        return self.source.position

    def batch_at(self, index: int) -> dict[str, Any]:
        """Batch ``index``, each leaf built from this process's rows only."""
        local = self.source.batch_at(index, rows=self.rows)
        batch = {}
        for name, rows in self.leaf_rows.items():
            mine = local[name][np.searchsorted(self.rows, rows)]
            sharding = self.shardings[name]
            if sharding is None:  # read on several submeshes: the whole host leaf
                batch[name] = mine
            else:
                batch[name] = make_microbatched_array(
                    mine, sharding, self.batch_size, self.num_microbatches
                )
        if self._log is not None:
            record = {"index": index, **{n: r.tolist() for n, r in self.leaf_rows.items()}}
            with self._log.open("a") as f:
                f.write(json.dumps(record) + "\n")
        return batch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        batch = self.batch_at(self.source.position)
        self.source.position += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The source's state."""
        return self.source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the source's state."""
        self.source.load_state_dict(state)


def process_local_batches(source: Any, step: Any, model: Any, optimizer: Any) -> Any:
    """``source`` itself in one process; a `ProcessLocalBatches` over it in several.

    ``step`` is the ``mp.jit`` train step, called as ``step(model, optimizer, batch)``.

    Example:
      >>> import numpy as np
      >>> from nnx_mpmd.apps.data import BatchIterator
      >>> it = BatchIterator(np.arange(100), batch_size=8, seq_len=4)
      >>> process_local_batches(it, None, None, None) is it  # one process
      True
    """
    if jax.process_count() == 1:
        return source
    like = source.batch_at(0, rows=np.arange(1))
    whole = {k: np.zeros((source.batch_size, *v.shape[1:]), v.dtype) for k, v in like.items()}
    shardings = batch_shardings(step, model, optimizer, whole)[2]
    return ProcessLocalBatches(source, shardings, step.num_microbatches)
