"""The instruction IR: what each mesh does, in dispatch order.

A compiled step is a flat list of instructions over numbered *slots* (a slot
holds one array, or a residual pytree). `Call` runs a compiled program on one
mesh, `Transfer` copies a value to another submesh keeping its PartitionSpec,
`Free` drops values after their last use. The runtime executes the list.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Call", "Free", "Instruction", "SlotTable", "Transfer", "insert_frees", "slots_in"]


@dataclasses.dataclass
class Call:
    """Runs ``fn`` on ``mesh``: args are built from slots, results stored in slots.

    ``args`` and ``outs`` are nested tuples of slot numbers mirroring the
    program's arguments and results (an ``int`` leaf is a slot; the
    ``residuals`` leaf of a forward is one slot holding a pytree).
    """

    mesh: int
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    outs: Any
    label: str
    task: Any = None  # the schedule Task, for stage tasks

    def reads(self) -> list[int]:
        return list(slots_in(self.args))

    def writes(self) -> list[int]:
        return list(slots_in(self.outs))


@dataclasses.dataclass
class Transfer:
    """Copies slot ``src`` (on ``src_mesh``) to slot ``dst`` on submesh ``dst_mesh``.

    ``reshape_microbatches`` (an int m) reshapes a batch ``[B, ...]`` to
    ``[m, B/m, ...]`` on the way; ``spec`` overrides the PartitionSpec (None
    keeps the source's). ``per_microbatch`` marks a stage's activation or
    cotangent for one microbatch (a batch-sharded value).
    """

    src: int
    dst: int
    dst_mesh: int
    label: str
    src_mesh: int = -1  # -1: the value comes from the host (not a submesh)
    nbytes: int = 0
    reshape_microbatches: int | None = None
    spec: Any = None
    per_microbatch: bool = False

    def reads(self) -> list[int]:
        return [self.src]

    def writes(self) -> list[int]:
        return [self.dst]


@dataclasses.dataclass
class Free:
    """Drops the values in ``slots``."""

    slots: tuple[int, ...]

    def reads(self) -> list[int]:
        return []

    def writes(self) -> list[int]:
        return []


Instruction = Call | Transfer | Free


def slots_in(tree: Any) -> Iterator[int]:
    """The slot numbers in a nested tuple of slots, in order."""
    if isinstance(tree, int):
        yield tree
    elif isinstance(tree, tuple | list):
        for t in tree:
            yield from slots_in(t)


class SlotTable:
    """Allocates slot numbers for symbolic keys."""

    def __init__(self) -> None:
        self.index: dict[Any, int] = {}

    def __call__(self, key: Any) -> int:
        slot = self.index.get(key)
        if slot is None:
            slot = self.index[key] = len(self.index)
        return slot

    def __contains__(self, key: Any) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)


def insert_frees(program: list[Instruction], keep: set[int]) -> list[Instruction]:
    """Adds a `Free` after the last read of every slot not in ``keep``."""
    last_read: dict[int, int] = {}
    written: set[int] = set()
    for i, ins in enumerate(program):
        for s in ins.reads():
            last_read[s] = i
        written.update(ins.writes())
    frees: dict[int, list[int]] = {}
    for slot, i in last_read.items():
        if slot not in keep:
            frees.setdefault(i, []).append(slot)
    # Values written but never read (and not kept) are dropped right away.
    for i, ins in enumerate(program):
        for s in ins.writes():
            if s not in keep and s not in last_read:
                frees.setdefault(i, []).append(s)
    result: list[Instruction] = []
    for i, ins in enumerate(program):
        result.append(ins)
        if i in frees:
            result.append(Free(tuple(sorted(set(frees[i])))))
    return result
