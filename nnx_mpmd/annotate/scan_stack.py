"""A stack of identical layers run with ``nnx.scan``, split across stages by ranges.

Deep models often stack their blocks along a leading axis (``nnx.vmap`` to
create them, ``nnx.scan`` to run them): one compiled body instead of one per
block. A pipeline needs the stack cut into ranges that run on different
stages. `ScanStack` is that stack as a module: it holds the stacked layers as
one or more contiguous *chunks* and scans them in order. Splitting it
(`ScanStack.split`, or `assign_stages(model, {"blocks[0:4]": 0,
"blocks[4:8]": 1})`) slices every stacked Variable along its leading axis
into one chunk per range, each wrapped in `Stage`; the computation is the same
scan, run range by range, so the results equal the unsplit stack's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_mpmd.annotate.stage import STAGE_KEY, STAGES_KEY, Stage
from nnx_mpmd.errors import PartitionError

__all__ = ["ScanStack", "ScannedLayers", "split_scan_stacks", "stage_ranges"]

# The layer axis in sharding metadata: a stacked Variable's ``out_sharding`` gains a
# leading None (the layers are not sharded), and a layer inside the scan sees its own.
_LAYER_AXIS = {nnx.PARTITION_NAME: None}

_RANGE = re.compile(r"^(?P<path>.+)\[(?P<lo>-?\d*):(?P<hi>-?\d*)\]$")


class ScannedLayers(nnx.Module):
    """Layers stacked along a leading axis, run in order with ``nnx.scan``.

    Args:
      layers: one module whose Variables all have the same leading axis (the
        layer index), e.g. made with ``nnx.vmap``; each layer maps
        ``(x, *args, **kwargs) -> x``: ``x`` is carried from layer to layer,
        the other arguments (an attention mask, positions) reach every layer
        unchanged.

    Example:
      >>> import jax.numpy as jnp
      >>> stack = ScanStack(lambda rngs: nnx.Linear(2, 2, rngs=rngs), 3, rngs=nnx.Rngs(0))
      >>> chunk = stack.chunks[0]
      >>> chunk.num_layers, chunk(jnp.ones((1, 2))).shape
      (3, (1, 2))
    """

    def __init__(self, layers: nnx.Module) -> None:
        self.layers = layers

    @property
    def num_layers(self) -> int:
        """The length of the stacked axis."""
        leaves = jax.tree.leaves(nnx.state(self.layers))
        return int(leaves[0].shape[0]) if leaves else 0

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        @nnx.scan(
            in_axes=(nnx.Carry, 0, None),
            out_axes=nnx.Carry,
            transform_metadata=_LAYER_AXIS,
        )
        def run(carry: Any, layer: nnx.Module, extra: Any) -> Any:
            return _typed_like(carry, layer(carry, *extra[0], **extra[1]))

        return run(x, self.layers, (args, kwargs))


def _typed_like(carry: Any, out: Any) -> Any:
    """``out`` with each leaf resharded to its ``carry`` leaf's Explicit sharding.

    A scan needs its carry to keep its type, and on Explicit axes the sharding is
    part of it: a layer with sharded weights (``out_sharding=(None, 'data')``) gives
    a sharded result for a replicated input. Resharding changes no value.
    """
    if jax.tree.structure(carry) != jax.tree.structure(out):
        return out  # nnx.scan says what differs

    def like(before: Any, after: Any) -> Any:
        want = getattr(jax.typeof(before), "sharding", None)
        have = getattr(jax.typeof(after), "sharding", None)
        mesh = getattr(want, "mesh", None)
        if want is None or have is None or mesh is None or not mesh.axis_names:
            return after
        if not mesh.are_all_axes_explicit or want.spec == have.spec:
            return after
        return jax.sharding.reshard(after, want.spec)

    return jax.tree.map(like, carry, out)


class ScanStack(nnx.Module):
    """``num_layers`` identical layers, stacked and scanned; splittable into stage ranges.

    Args:
      make_layer: ``make_layer(rngs) -> layer``, one layer: ``layer(x, *args,
        **kwargs) -> x``, where ``x`` is carried through the layers and the
        other arguments are passed to each of them unchanged.
      num_layers: how many layers.
      rngs: the random streams; each layer gets its own split.

    Example:
      >>> import jax.numpy as jnp
      >>> stack = ScanStack(lambda rngs: nnx.Linear(4, 4, rngs=rngs), 4, rngs=nnx.Rngs(0))
      >>> before = stack(jnp.ones((2, 4)))
      >>> stack.split({(0, 2): 0, (2, 4): 1})
      >>> [(chunk.stage, chunk.module.num_layers) for chunk in stack.chunks]
      [(0, 2), (1, 2)]
      >>> bool(jnp.allclose(stack(jnp.ones((2, 4))), before))
      True
    """

    def __init__(
        self, make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int, *, rngs: nnx.Rngs
    ) -> None:
        if not isinstance(num_layers, int) or num_layers < 1:
            raise PartitionError(f"ScanStack(num_layers={num_layers!r}): use an int >= 1.")

        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=_LAYER_AXIS)
        def create(rngs: nnx.Rngs) -> nnx.Module:
            return make_layer(rngs)

        # One uncut ScannedLayers; `split` makes it one Stage(ScannedLayers) per stage.
        self.chunks: nnx.List[ScannedLayers | Stage] = nnx.List([ScannedLayers(create(rngs))])

    @property
    def num_layers(self) -> int:
        """The number of layers in all chunks."""
        return sum(_scanned(chunk).num_layers for chunk in self.chunks)

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        for chunk in self.chunks:
            x = chunk(x, *args, **kwargs)
        return x

    def chunk_ranges(self) -> list[tuple[int, int]]:
        """The ``(start, stop)`` layers of each chunk, in order.

        Returns:
          One half-open range per chunk; together they cover the stack.

        Example:
          >>> from flax import nnx
          >>> stack = ScanStack(lambda rngs: nnx.Linear(2, 2, rngs=rngs), 4, rngs=nnx.Rngs(0))
          >>> stack.split({(0, 1): 0, (1, 4): 1})
          >>> stack.chunk_ranges()
          [(0, 1), (1, 4)]
        """
        ranges, start = [], 0
        for chunk in self.chunks:
            stop = start + _scanned(chunk).num_layers
            ranges.append((start, stop))
            start = stop
        return ranges

    def split(self, ranges: Mapping[tuple[int, int], int]) -> None:
        """Cuts the stack into one `Stage`-wrapped chunk per ``(start, stop)`` range.

        Args:
          ranges: ``{(start, stop): stage}``; together the ranges must cover
            ``0..num_layers`` without gaps or overlaps.

        Raises:
          PartitionError: the ranges leave a gap, overlap, are empty or out of
            bounds, or a stage is not an int >= 0.
        """
        ordered = _check_ranges(ranges, self.num_layers)
        graphdef, state = self._whole()
        chunks: list[ScannedLayers | Stage] = []
        for (start, stop), stage in ordered:
            sliced = jax.tree.map(lambda a, lo=start, hi=stop: a[lo:hi], state)
            layers = nnx.merge(graphdef, sliced)
            _clear_stage_tags(layers)
            chunks.append(Stage(ScannedLayers(layers), stage))
        self.chunks = nnx.List(chunks)

    def _whole(self) -> tuple[Any, Any]:
        """The stacked layers' graphdef and their state, chunks joined along the layer axis."""
        for chunk in self.chunks:  # chunks of different stages differ only in these tags
            _clear_stage_tags(_scanned(chunk).layers)
        parts = [nnx.split(_scanned(chunk).layers) for chunk in self.chunks]
        graphdef = parts[0][0]
        states = _on_one_device([state for _, state in parts])
        if len(states) == 1:
            return graphdef, states[0]
        return graphdef, jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *states)


def _on_one_device(states: list[Any]) -> list[Any]:
    """The chunks' states on one device when a step placed them on their stages' submeshes.

    Joining placed chunks would mix devices; the next `mp.jit` step places the new ones.
    Raises `PartitionError` if a chunk lives on another process's devices.
    """
    arrays = [x for state in states for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
    device_sets = {frozenset(x.sharding.device_set) for x in arrays}
    if len(device_sets) <= 1 and all(len(devices) == 1 for devices in device_sets):
        return states
    if not all(x.is_fully_addressable for x in arrays):
        raise PartitionError(
            "ScanStack.split: the stack's chunks live on other processes' devices; "
            "bring them here with mp.distributed.gather(model) on every process, then split."
        )
    # A SingleDeviceSharding (not a bare device) also drops Explicit axes from the type.
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def to_device(x: Any) -> Any:
        return jax.device_put(x, one) if isinstance(x, jax.Array) else x

    return [jax.tree.map(to_device, state) for state in states]


def _clear_stage_tags(module: Any) -> None:
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Variable):
            node.set_metadata(**{STAGE_KEY: None, STAGES_KEY: ()})


def _scanned(chunk: Any) -> ScannedLayers:
    return chunk.module if isinstance(chunk, Stage) else chunk


def _check_ranges(
    ranges: Mapping[tuple[int, int], int], num_layers: int
) -> list[tuple[tuple[int, int], int]]:
    ordered = sorted(ranges.items())
    where = ", ".join(f"[{a}:{b}]" for (a, b), _ in ordered)
    covered = 0
    for (start, stop), stage in ordered:
        if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
            raise PartitionError(
                f"ScanStack range [{start}:{stop}] maps to stage {stage!r}; stages must be ints >= 0."
            )
        if start != covered or stop <= start or stop > num_layers:
            raise PartitionError(
                f"the ranges {where} do not cut the stack's {num_layers} layers into "
                f"consecutive non-empty pieces (at layer {covered}); give ranges such as "
                f"[0:{num_layers // 2}] and [{num_layers // 2}:{num_layers}]."
            )
        covered = stop
    if covered != num_layers:
        raise PartitionError(
            f"the ranges {where} cover layers 0..{covered} of {num_layers}; add "
            f"[{covered}:{num_layers}]."
        )
    return ordered


def stage_ranges(stages: Sequence[int]) -> dict[tuple[int, int], int]:
    """``{(start, stop): stage}`` of the runs of equal stages in a per-layer list.

    The ranges `ScanStack.split` takes for layers whose stages are ``stages``.

    Example:
      >>> stage_ranges([0, 0, 0, 1, 2, 2])
      {(0, 3): 0, (3, 4): 1, (4, 6): 2}
    """
    ranges: dict[tuple[int, int], int] = {}
    start = 0
    for i in range(1, len(stages) + 1):
        if i == len(stages) or stages[i] != stages[start]:
            ranges[(start, i)] = int(stages[start])
            start = i
    return ranges


def split_scan_stacks(model: Any, mapping: Mapping[str, int]) -> dict[str, int]:
    """Splits each `ScanStack` ``mapping`` names as ``"path[start:stop]"``; returns the rest.

    Raises:
      PartitionError: a range's path is not a `ScanStack`, or the ranges of one
        stack do not cut it into consecutive pieces.

    Example:
      >>> m = nnx.Dict(blocks=ScanStack(lambda r: nnx.Linear(2, 2, rngs=r), 4, rngs=nnx.Rngs(0)))
      >>> split_scan_stacks(m, {"blocks[:1]": 0, "blocks[1:]": 1, "head": 1})
      {'head': 1}
      >>> [chunk.stage for chunk in m["blocks"].chunks]
      [0, 1]
    """
    stacks = {
        ".".join(map(str, path)): node
        for path, node in nnx.iter_graph(model)
        if isinstance(node, ScanStack)
    }
    ranges: dict[str, dict[tuple[int, int], int]] = {}
    rest = {}
    for pattern, stage in mapping.items():
        found = _RANGE.match(str(pattern))
        if found is None:
            rest[pattern] = stage
            continue
        path = found["path"]
        if path not in stacks:
            kinds = ", ".join(sorted(stacks)) or "none"
            raise PartitionError(
                f"assign_stages: {pattern!r} names layers of {path!r}, which is not an "
                f"mp.ScanStack (the model's ScanStacks: {kinds}); ranges split a ScanStack, "
                "other modules take a path without [start:stop]."
            )
        total = stacks[path].num_layers
        start, stop, _ = slice(
            *(int(x) if x else None for x in (found["lo"], found["hi"]))
        ).indices(total)
        ranges.setdefault(path, {})[(start, stop)] = stage
    for path, wanted in ranges.items():
        stacks[path].split(wanted)
    return rest
