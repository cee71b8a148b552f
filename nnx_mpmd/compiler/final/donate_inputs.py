"""Donating the state of donated step arguments to the programs that replace it.

``mp.jit(step, donate_argnums=...)`` (or ``donate_argnames``) lets the step
reuse the buffers of those arguments' NNX state, as ``nnx.jit`` with the same
arguments does: an Adam update then writes the new parameters and moments into
the old ones' memory instead of holding both, which takes the state's size
off a mesh's peak (the update is where it peaks for a large model).

`donate_step_inputs` is the pass. A program donates a step input when the
input's state leaf is donated, the call is the input's last reader in the
step (nothing reads it after, on any mesh: no transfer, no program), the step
does not return it unchanged, the call passes it once, and the program returns
a value of the input's shape and dtype that XLA can write into
(`nnx_mpmd.compiler.ir.Call.aliases`, set by mesh inference for the
outer programs). The call then runs the program jitted with those arguments
donated, and its ``structure`` says so, so a twin program that donates
differently is not shared with it.

Example:
  >>> import jax
  >>> from nnx_mpmd.compiler.ir import Call, Free, ProgramKey, Transfer
  >>> update = jax.jit(lambda p, g: (p - g,))
  >>> key = ProgramKey("post", index=0, mesh=0)
  >>> call = Call(0, key, update, (0, 1), (2,), "post.L0.mesh0", aliases=(0,))
  >>> donate_step_inputs([call, Free((0, 1))], keep={2}, donated_slots={0})[0].donated
  (0,)
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

from nnx_mpmd.compiler.ir import (
    Call,
    Instruction,
    Transfer,
    TransferBatch,
    last_reads,
    last_use,
    slots_in,
)
from nnx_mpmd.compiler.jaxpr_utils import named_jit

__all__ = ["donate_step_inputs", "transfer_sources"]


def donate_step_inputs(
    program: Sequence[Instruction], keep: set[int], donated_slots: set[int]
) -> list[Instruction]:
    """Pass: calls that last read a donated step input donate it (see the module docstring)."""
    if not donated_slots:
        return list(program)
    last_read, _ = last_reads(program)
    result = list(program)
    for i, ins in enumerate(program):
        if not isinstance(ins, Call) or not ins.aliases:
            continue
        argnums = _donatable_arguments(i, ins, keep, donated_slots, last_read)
        wrapped = getattr(ins.fn, "__wrapped__", None)
        if argnums and wrapped is not None:
            donated = tuple(sorted({*ins.donated, *argnums}))
            structure = None if ins.structure is None else (ins.structure, "donate", donated)
            fn = named_jit(wrapped, ins.label, donate_argnums=donated)
            result[i] = dataclasses.replace(ins, fn=fn, donated=donated, structure=structure)
    return result


def transfer_sources(program: Sequence[Instruction]) -> set[int]:
    """The slots some transfer of ``program`` reads: not to be donated across processes.

    A move to another process may read the buffer after later programs ran.

    Example:
      >>> transfer_sources([Transfer(0, 3, 1, "tied embedding", src_mesh=0)])
      {0}
    """
    kinds = (Transfer, TransferBatch)
    return {slot for ins in program if isinstance(ins, kinds) for slot in ins.reads()}


def _donatable_arguments(
    i: int, ins: Call, keep: set[int], donated_slots: set[int], last_read: dict[int, int]
) -> tuple[int, ...]:
    """The arguments among ``ins.aliases`` that call ``i`` may donate."""
    found = []
    passed = collections.Counter(slots_in(ins.args))  # once per call, not once per argument
    for n in ins.aliases:
        slot: Any = ins.args[n] if n < len(ins.args) else None
        if (
            isinstance(slot, int)
            and slot in donated_slots
            and last_use(i, ins, slot, last_read, keep, passed)
        ):
            found.append(n)
    return tuple(found)
