"""Bytes a step reduces over devices, counted from XLA's compiled programs.

`all_reduce_bytes` and `reduce_scatter_bytes` read one compiled module's HLO
text; `step_all_reduce_bytes`, `step_reduce_scatter_bytes` and
`step_reduced_bytes` multiply each program's figure by how many times the
step's instruction list calls it. They measure `grad_reduction`'s promise:
one gradient reduction per step, so about the parameter bytes per step, not
the number of microbatches times them.

XLA writes a reduction that JAX types as a reshard from unreduced to sharded
as an all-reduce and a slice on CPU; `grad_reduction` spells the FSDP
gradient's reduction as an explicit reduce-scatter (``psum_scatter``), which
XLA keeps as one on every backend.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from nnx_mpmd.compiler.ir import Call, Instruction

__all__ = [
    "all_reduce_bytes",
    "program_calls",
    "reduce_scatter_bytes",
    "step_all_reduce_bytes",
    "step_reduce_scatter_bytes",
    "step_reduced_bytes",
]

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_DTYPE_BYTES.update({"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8})
_ALL_REDUCE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+all-reduce(?:-start)?\(")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*?)\)")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def _shape_bytes(text: str) -> int:
    """The summed byte size of the array shapes written in ``text``."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        size = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
        total += size * _DTYPE_BYTES.get(dtype, 4)
    return total


def all_reduce_bytes(hlo_text: str) -> int:
    """Bytes all-reduced by one run of a compiled program: its ``all-reduce`` results' sizes.

    Example:
      >>> all_reduce_bytes("  %ar = f32[4,3]{1,0} all-reduce(f32[4,3]{1,0} %x), to_apply=%add")
      48
    """
    matches = (_ALL_REDUCE.match(line) for line in hlo_text.splitlines())
    return sum(_shape_bytes(m.group(1)) for m in matches if m is not None)


def _group_size(line: str) -> int:
    """The size of a collective's replica groups: ``{{0,1},{2,3}}`` or ``[2,2]<=[4]``."""
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if listed:
        return len(listed.group(1).split(","))
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=", line)
    return int(iota.group(1).split(",")[-1]) if iota else 1


def reduce_scatter_bytes(hlo_text: str) -> int:
    """Bytes reduce-scattered by one run of a compiled program (its operands' sizes).

    An all-reduce plus slice is counted by `all_reduce_bytes` instead.

    Example:
      >>> hlo = [
      ...     "%g = f32[8,16]{1,0} parameter(0)",
      ...     "%rs = f32[4,16]{1,0} reduce-scatter(%g), replica_groups={{0,1}}, dimensions={0}",
      ... ]
      >>> reduce_scatter_bytes("\\n".join(hlo))
      512
    """
    lines = [m for m in map(_INSTRUCTION.match, hlo_text.splitlines()) if m is not None]
    shapes = {m.group(1): m.group(2) for m in lines}
    total = 0
    for m in lines:
        result, opcode, operands = m.group(2), m.group(3), m.group(4)
        if opcode == "reduce-scatter-start":
            total += _shape_bytes(result[1 : result.index(")")])  # ((operands), results)
        elif opcode == "reduce-scatter":
            names = re.findall(r"%([\w.\-]+)", operands)
            if _SHAPE.search(operands) or not all(n in shapes for n in names):
                inline = _shape_bytes(operands)
                total += inline or _shape_bytes(result) * _group_size(m.string)
            else:
                total += sum(_shape_bytes(shapes[n]) for n in names)
    return total


def program_calls(instructions: Sequence[Instruction]) -> dict[str, int]:
    """How many times the instruction list calls each program, by program name."""
    counts: dict[str, int] = {}
    for ins in instructions:
        if isinstance(ins, Call):
            counts[str(ins.program)] = counts.get(str(ins.program), 0) + 1
    return counts


def step_all_reduce_bytes(
    instructions: Sequence[Instruction],
    executables: Any,
    count: Callable[[str], int] = all_reduce_bytes,
) -> int:
    """Bytes all-reduced by one step: each program's bytes (``count``) times its calls.

    A program compiled in several variants counts its first.
    """
    total = 0
    for name, calls in program_calls(instructions).items():
        found = executables.get(name)
        if found:
            total += calls * count(found[0].as_text())
    return total


def step_reduce_scatter_bytes(instructions: Sequence[Instruction], executables: Any) -> int:
    """Bytes reduce-scattered by one step (`reduce_scatter_bytes` times each program's calls)."""
    return step_all_reduce_bytes(instructions, executables, count=reduce_scatter_bytes)


def step_reduced_bytes(instructions: Sequence[Instruction], executables: Any) -> int:
    """Bytes one step reduces over devices: all-reduced plus reduce-scattered."""
    return step_all_reduce_bytes(instructions, executables) + step_reduce_scatter_bytes(
        instructions, executables
    )
