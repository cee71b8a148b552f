"""Transfer batching: the instruction list in ticks, each tick's transfers as one move.

Three passes over the final instruction list (after `insert_frees`):

1. ``schedule_ticks`` (`schedule_ticks`) reorders the list by *ticks*: an
   instruction's tick is one more than the latest tick of the instructions it
   must follow. It must follow every earlier instruction that touches one of
   its slots (reads, writes, frees; two reads too, since a program may donate
   what it reads) and every earlier instruction that changes memory on a
   mesh it changes memory on: a call on its mesh, a transfer into it, a free
   of a value on it. So each mesh sees its own events (its tasks in the
   schedule's order, its arrivals, its frees) in the original order, and its
   live bytes go through the same values (transfers arriving in a row may
   swap: they only add bytes, so the peak is the same); only the interleaving
   of meshes changes. Calls take their earliest tick; transfers and frees their latest
   (the tick before the first instruction that must follow them), so that the
   moves of a tick meet. Within a tick nothing depends on anything else, so a
   tick is written as its frees, its calls, then its transfers: the transfers
   of one tick become consecutive.
2. ``batch_transfers`` (`batch_transfers`) turns each run of consecutive
   independent transfers into one `TransferBatch`, which the runtime makes
   with one batched copy instead of one ``jax.device_put`` per value.
   Transfers that reshape a batch into microbatches stay alone (their
   reshape is a program of its own).
3. ``merge_frees`` (`merge_frees`): consecutive `Free`s (a tick's frees) become
   one, so the runtime drops them in one step.

Each mesh still runs the same programs in the same order; only the host's
dispatch order across meshes changes, so results are the same.

Example:
  >>> from nnx_mpmd.compiler.ir import Call, ProgramKey, Transfer, format_instructions
  >>> f0, f1 = ProgramKey("F", stage=0), ProgramKey("F", stage=1)
  >>> program = [
  ...     Call(0, f0, abs, (0,), 1, "F0.0"),
  ...     Transfer(1, 2, 1, "act mb0", src_mesh=0),
  ...     Call(1, f1, abs, (2,), 3, "F1.0"),
  ...     Transfer(3, 4, 2, "act2 mb0", src_mesh=1),
  ...     Call(0, f0, abs, (5,), 6, "F0.1"),
  ...     Transfer(6, 7, 1, "act mb1", src_mesh=0),
  ... ]
  >>> print(format_instructions(batch_transfers(schedule_ticks(program))))
  call 0 F0 args=(0,) outs=1 label=F0.0
  call 0 F0 args=(5,) outs=6 label=F0.1
  transfer 1@0 -> 2@1 label='act mb0' bytes=0
  call 1 F1 args=(2,) outs=3 label=F1.0
  transfers 3@1 -> 4@2 label='act2 mb0' bytes=0 ; 6@0 -> 7@1 label='act mb1' bytes=0
"""

from __future__ import annotations

from collections.abc import Sequence

from nnx_mpmd.compiler.ir import Call, Free, Instruction, Transfer, TransferBatch
from nnx_mpmd.errors import CompileError

__all__ = ["batch_transfers", "merge_frees", "schedule_ticks", "ticks"]

# The order of kinds within one tick: frees first (memory goes back as early as
# possible), then the programs, then the transfers (one batch).
_KIND_ORDER = {Free: 0, Call: 1, Transfer: 2, TransferBatch: 2}


def _touched(ins: Instruction) -> list[int]:
    if isinstance(ins, Free):
        return list(ins.slots)
    return [*ins.reads(), *ins.writes()]


def _slot_meshes(program: Sequence[Instruction]) -> dict[int, set[int]]:
    """The mesh each slot's value lives on: its writer's, else (an input) its readers'."""
    written: dict[int, set[int]] = {}
    read: dict[int, set[int]] = {}
    for ins in program:
        if isinstance(ins, Call):
            for s in ins.writes():
                written.setdefault(s, set()).add(ins.mesh)
            for s in ins.reads():
                read.setdefault(s, set()).add(ins.mesh)
        elif isinstance(ins, Transfer | TransferBatch):
            members = ins.transfers if isinstance(ins, TransferBatch) else (ins,)
            for t in members:
                written.setdefault(t.dst, set()).add(t.dst_mesh)
                read.setdefault(t.src, set()).add(t.src_mesh)
    return {**read, **written}


def _meshes(ins: Instruction, slot_meshes: dict[int, set[int]]) -> set[int]:
    """The meshes whose memory ``ins`` changes."""
    if isinstance(ins, Call):
        return {ins.mesh}
    if isinstance(ins, Transfer):
        return {ins.dst_mesh}
    if isinstance(ins, TransferBatch):
        return {t.dst_mesh for t in ins.transfers}
    return {q for s in ins.slots for q in slot_meshes.get(s, ())}


def ticks(program: Sequence[Instruction]) -> list[int]:
    """The tick of every instruction, from 0 (see the module docstring).

    Raises:
      CompileError: an instruction is not a `Call`, `Transfer`, `TransferBatch` or `Free`.

    Example:
      >>> from nnx_mpmd.compiler.ir import Call, ProgramKey, Transfer
      >>> key = ProgramKey("F", stage=0)
      >>> ticks([Call(0, key, abs, (0,), 1, "a"), Call(1, key, abs, (2,), 3, "b"),
      ...        Transfer(1, 4, 1, "x", src_mesh=0), Free((1,))])
      [0, 0, 1, 2]
    """
    for n, ins in enumerate(program):
        if type(ins) not in _KIND_ORDER:
            raise CompileError(
                f"instruction {n} ({ins!r}) is a {type(ins).__name__}: schedule_ticks orders "
                "Call, Transfer, TransferBatch and Free only. A pass that adds an instruction "
                "kind must teach nnx_mpmd.compiler.final.transfer_batching what it depends on."
            )
    slot_meshes = _slot_meshes(program)
    tick: list[int] = []
    after: list[list[int]] = [[] for _ in program]  # what must follow each instruction
    last_toucher: dict[int, int] = {}  # slot -> index of the last instruction touching it
    last_event: dict[int, int] = {}  # mesh -> its last event other than an arrival
    arrivals: dict[int, list[int]] = {}  # mesh -> transfers into it since that event
    for n, ins in enumerate(program):
        touched, meshes = _touched(ins), _meshes(ins, slot_meshes)
        arriving = isinstance(ins, Transfer | TransferBatch)
        before = {last_toucher[s] for s in touched if s in last_toucher}
        before |= {last_event[q] for q in meshes if q in last_event}
        if not arriving:  # arrivals in a row only add bytes: their order does not matter
            before.update(m for q in meshes for m in arrivals.pop(q, ()))
        tick.append(1 + max((tick[b] for b in before), default=-1))
        for b in before:
            after[b].append(n)
        for s in touched:
            last_toucher[s] = n
        for q in meshes:
            if arriving:
                arrivals.setdefault(q, []).append(n)
            else:
                last_event[q] = n
    # Calls run as early as they can; transfers and frees as late as they can (just
    # before what must follow them), where they meet the other moves of that tick.
    for n in reversed(range(len(program))):
        if not isinstance(program[n], Call) and after[n]:
            tick[n] = min(tick[m] for m in after[n]) - 1
    return tick


def schedule_ticks(program: Sequence[Instruction]) -> list[Instruction]:
    """Pass: ``program`` reordered tick by tick; within a tick frees, calls, transfers.

    Each mesh's calls keep their order; an instruction follows every earlier one touching its slots.

    Example:
      >>> from nnx_mpmd.compiler.ir import Free
      >>> schedule_ticks([Free((0,)), Free((1,))]) == [Free((0,)), Free((1,))]
      True
    """
    tick = ticks(program)
    order = sorted(range(len(program)), key=lambda n: (tick[n], _KIND_ORDER[type(program[n])], n))
    return [program[n] for n in order]


def _batchable(ins: Instruction) -> bool:
    return isinstance(ins, Transfer) and not ins.reshape_microbatches


def batch_transfers(program: Sequence[Instruction]) -> list[Instruction]:
    """Pass: each run of consecutive independent transfers becomes one `TransferBatch`.

    A run ends at another instruction, a reshaping transfer, or a slot another member writes.

    Example:
      >>> from nnx_mpmd.compiler.ir import Transfer
      >>> chained = [Transfer(0, 1, 1, "a", src_mesh=0), Transfer(1, 2, 2, "b", src_mesh=1)]
      >>> batch_transfers(chained) == chained  # b reads what a writes: not batched
      True
    """
    result: list[Instruction] = []
    run: list[Transfer] = []
    written: set[int] = set()
    read: set[int] = set()  # the run's sources: a set, so a long run is checked in O(1)

    def flush() -> None:
        if len(run) > 1:
            result.append(TransferBatch(tuple(run)))
        else:
            result.extend(run)
        run.clear()
        written.clear()
        read.clear()

    for ins in program:
        if not _batchable(ins):
            flush()
            result.append(ins)
            continue
        assert isinstance(ins, Transfer)
        if ins.src in written or ins.dst in written or ins.dst in read:
            flush()
        run.append(ins)
        written.add(ins.dst)
        read.add(ins.src)
    flush()
    return result


def merge_frees(program: Sequence[Instruction]) -> list[Instruction]:
    """Pass: each run of consecutive frees becomes one `Free` of their slots, in order, each once.

    Example:
      >>> merge_frees([Free((3,)), Free((1, 3)), Transfer(0, 2, 1, "x"), Free((0,))])
      [Free(slots=(1, 3)), Transfer(src=0, dst=2, dst_mesh=1, label='x', src_mesh=-1, nbytes=0, reshape_microbatches=None, spec=None, per_microbatch=False, value_type=None), Free(slots=(0,))]
    """
    result: list[Instruction] = []
    for ins in program:
        if isinstance(ins, Free) and result and isinstance(result[-1], Free):
            result[-1] = Free(tuple(sorted({*result[-1].slots, *ins.slots})))
        else:
            result.append(ins)
    return result
