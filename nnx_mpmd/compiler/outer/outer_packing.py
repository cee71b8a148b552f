"""Mesh inference: the small values one program sends to one mesh travel as one array.

A global-norm clip computes a partial sum of squares per parameter on the mesh
that holds the parameter, and every mesh needs all of them (`outer_assign`
runs the cheap ``sqrt`` of their sum on each mesh rather than shipping it).
Moved one by one, that is one transfer per parameter leaf and pair of meshes
on every step: 204 transfers for a 4-stage GPT ``tiny``, and tens of thousands
for a deep model on eight meshes, each costing host time. Small parameters
(biases, norm scales) can also move whole, when that is as cheap as reducing
them first.

`pack_transfers` groups the small values (scalars and replicated arrays of at
most `PACK_MAX_BYTES`) that one program sends to one mesh before one level into
a `PackedTransfer`. The sending program returns them flattened and concatenated
in one array (in the order the transfers were needed), one `Transfer` moves
the array, and each program on the receiving mesh that reads one of them takes
the array and slices its values out. The numbers are the same: packing and
slicing copy values and do no arithmetic, so the receivers add the same partial
sums in the same order.

Only values read by programs on the receiving mesh are packed: a value that is
also a step output there, a region input, or copied on from there to another
mesh keeps its own transfer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax import lax

from nnx_mpmd.compiler.jaxpr_utils import var_bytes
from nnx_mpmd.compiler.outer.outer_assign import HOST, Segment, ValueOnMesh

__all__ = [
    "PACK_MAX_BYTES",
    "PackOnMesh",
    "PackedTransfer",
    "pack_transfers",
    "pack_values",
    "packed_function",
]

PACK_MAX_BYTES = 16 * 1024  # larger values move on their own: copying them costs more


@dataclasses.dataclass(frozen=True)
class PackedTransfer:
    """Small values that one program sends to one mesh, moved as one array.

    Attributes:
      vars: the values, in the order of the array.
      src: the sending mesh.
      dst: the receiving mesh.
      segment: the segment of the receiving programs.
      level: the level the array arrives before.
      source: the `outer_emit.OuterGroup` of the program that computes them.
    """

    vars: tuple[Any, ...]
    src: int
    dst: int
    segment: Segment
    level: int
    source: Any

    @property
    def nbytes(self) -> int:
        """The array's bytes: the values' bytes."""
        return sum(var_bytes(v) for v in self.vars)

    @property
    def size(self) -> int:
        """The array's length: the values' elements."""
        return sum(math.prod(v.aval.shape) for v in self.vars)

    def on(self, mesh: int) -> PackOnMesh:
        """Slot key of the array on ``mesh`` (`src` or `dst`)."""
        return PackOnMesh(self.vars, mesh)

    def text(self, names: Mapping[Any, str]) -> str:
        """What it moves, for reports: ``3 values (a, b, c)``."""
        shown = [names.get(v, "?") for v in self.vars[:3]]
        more = ", ..." if len(self.vars) > 3 else ""
        return f"{len(self.vars)} values ({', '.join(shown)}{more})"

    def layout(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """Per value, its offset in the array and its shape."""
        out, offset = [], 0
        for v in self.vars:
            out.append((offset, tuple(v.aval.shape)))
            offset += math.prod(v.aval.shape)
        return tuple(out)


@dataclasses.dataclass(frozen=True)
class PackOnMesh:
    """Slot key: the array of a `PackedTransfer`'s values on mesh ``mesh``."""

    vars: tuple[Any, ...]
    mesh: int


def _packable(t: Any, kept: set[ValueOnMesh]) -> bool:
    aval = t.var.aval
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    replicated = spec is None or (
        all(entry is None for entry in spec)
        and not getattr(spec, "unreduced", None)
        and not getattr(spec, "reduced", None)
    )
    return (
        t.src != HOST
        and not t.as_batch
        and isinstance(getattr(aval, "shape", None), tuple)
        and var_bytes(t.var) <= PACK_MAX_BYTES
        and replicated
        and ValueOnMesh(t.var, t.dst) not in kept
    )


def pack_transfers(levels: Any, kept: set[ValueOnMesh]) -> Any:
    """Pass: two or more small values one program sends to one mesh become one `PackedTransfer`.

    Replicated, at most `PACK_MAX_BYTES`, read only by programs, of one dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from nnx_mpmd.compiler.outer.outer_assign import OuterProblem, assign_meshes
      >>> from nnx_mpmd.compiler.outer.outer_emit import kept_values, level_equations
      >>> def f(a, b):  # two sums of b's mesh, both read on a's mesh
      ...     return a * jnp.sum(b) + a * jnp.max(b)
      >>> closed = jax.make_jaxpr(f)(jnp.ones(2), jnp.ones(2))
      >>> problem = OuterProblem(closed.jaxpr, [{0}, {1}], [None], ["a", "b"],
      ...                        jax.devices()[:2], lambda j, q: None)
      >>> levels = level_equations(assign_meshes(problem, {}, region_at=5))
      >>> print(pack_transfers(levels, kept_values(problem, levels)))
      pre.L0.mesh1: 0:reduce_sum 2:reduce_max
      pre.L1.mesh0: 1:mul 3:mul 4:add
      transfer packed 2 values ('b', 'b') float32 mesh1->mesh0 before pre.L1
    """
    eqns = levels.assignment.jaxpr.eqns
    producer: dict[ValueOnMesh, Any] = {}
    for group, members in levels.groups.items():
        for i in members:
            producer.update((ValueOnMesh(o, group.mesh), group) for o in eqns[i].outvars)
    bins: dict[tuple, list[Any]] = {}
    for t in levels.transfers:
        source = producer.get(ValueOnMesh(t.var, t.src)) if _packable(t, kept) else None
        if source is not None and source.segment == t.segment:
            aval = t.var.aval
            key = (source, t.dst, t.segment, t.level, str(aval.dtype), aval.weak_type)
            bins.setdefault(key, []).append(t)
    pack_of: dict[int, tuple[PackedTransfer, bool]] = {}  # id(transfer) -> (pack, first?)
    for (source, dst, segment, level, _, _), members in bins.items():
        if len(members) >= 2:
            pack = PackedTransfer(
                tuple(t.var for t in members), source.mesh, dst, segment, level, source
            )
            pack_of.update((id(t), (pack, t is members[0])) for t in members)
    transfers = []
    for t in levels.transfers:
        pack, first = pack_of.get(id(t), (None, False))
        if pack is None or first:
            transfers.append(pack or t)
    return dataclasses.replace(levels, transfers=tuple(transfers))


def transfer_text(pack: PackedTransfer, names: Mapping[Any, str]) -> str:
    """`PackedTransfer`'s line in `outer_emit.OuterLevels`' text."""
    shown = tuple(names.get(v, "?") for v in pack.vars)
    return (
        f"transfer packed {len(pack.vars)} values {shown} {pack.vars[0].aval.dtype} "
        f"mesh{pack.src}->mesh{pack.dst} before {pack.segment.name.lower()}.L{pack.level}"
    )


def pack_values(values: Sequence[Any]) -> Any:
    """Arrays of one dtype flattened into one 1-D array (dtype and weak type kept).

    Example:
      >>> import jax.numpy as jnp
      >>> pack_values([jnp.float32(1), jnp.arange(2.0)])
      Array([1., 0., 1.], dtype=float32)
    """
    return lax.concatenate([lax.reshape(x, (math.prod(x.shape),)) for x in values], 0)


def _unpack_value(packed: Any, offset: int, shape: tuple[int, ...]) -> Any:
    flat = lax.slice(packed, (offset,), (offset + math.prod(shape),))
    return lax.reshape(flat, shape)


def packed_function(
    run: Callable[..., Sequence[Any]],
    unpack: Sequence[tuple[int, tuple[int, tuple[int, ...]] | None]],
    pack: Sequence[tuple[int, ...]],
    num_outputs: int,
) -> Callable[..., tuple[Any, ...]]:
    """``run`` (free values -> outputs) reading packed arrays and returning packed ones after.

    Args:
      unpack: per free value, ``(argument, None)``, or ``(argument, (offset, shape))`` if packed.
      pack: per packed output, the positions of ``run``'s outputs it stacks.

    Example:
      >>> import jax.numpy as jnp
      >>> add_mul = lambda a, b: (a + b, a * b)
      >>> f = packed_function(add_mul, [(0, (0, ())), (0, (1, ()))], [(0, 1)], 1)
      >>> f(jnp.array([2.0, 3.0]))  # a, b read from one array; a+b alone, then packed
      (Array(5., dtype=float32), Array([5., 6.], dtype=float32))
    """

    def program(*args: Any) -> tuple[Any, ...]:
        free = [args[a] if at is None else _unpack_value(args[a], *at) for a, at in unpack]
        outs = run(*free)
        stacked = tuple(pack_values([outs[j] for j in members]) for members in pack)
        return tuple(outs[:num_outputs]) + stacked

    return program
