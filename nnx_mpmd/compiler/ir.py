"""The instruction IR: what each mesh does, in dispatch order.

A compiled step is a flat list of instructions over numbered *slots* (a slot
holds one array, or a residual pytree). `Call` runs a compiled program on one
mesh, `Transfer` copies a value to another submesh keeping its PartitionSpec,
`TransferBatch` makes several independent transfers in one move, `Free` drops
values after their last use. The runtime executes the list.

Instructions are frozen dataclasses with a text form, one line each, that
round-trips: ``parse_instructions(format_instructions(program), programs)``
equals ``program``, where ``programs`` maps each program's name (``F0``,
``B1``, ``post.L0.mesh2``) to the callable a `Call` runs.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import re
import shlex
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from jax.sharding import PartitionSpec

from nnx_mpmd.errors import CompileError
from nnx_mpmd.schedules.tasks import Task

__all__ = [
    "Call",
    "Donatable",
    "Free",
    "Instruction",
    "ProgramKey",
    "SlotTable",
    "Transfer",
    "TransferBatch",
    "format_instruction",
    "format_instructions",
    "donate_dead_arguments",
    "insert_frees",
    "last_reads",
    "last_use",
    "parse_instructions",
    "slots_in",
]


_SLOT_AT = re.compile(r"^\d+@-?\d+ ->$")
_KEY_TEXT = re.compile(r"^([A-Za-z_]+?)(\d+)?(?:\.L(\d+))?(?:\.mesh(\d+))?$")


@dataclasses.dataclass(frozen=True, order=True)
class ProgramKey:
    """Names one compiled program: what it computes, for which stage, on which mesh.

    ``kind`` is a stage task kind (``F``, ``B``, ``FB``, ``BI``, ``BW``, ``Fwd``
    forward-only, ``init`` accumulators) or a program of the outer code (``pre``
    / ``post``: the step's code before / after the pipelined region, one program
    per level and mesh) or of the region's outputs (``stack``, ``zeros``, ``sum``).
    ``index`` is the outer program's level, or the output a region-output program
    makes. The text form (``F0``, ``init1``, ``post.L0.mesh2``) is the program's
    name in `format_instructions` and its XLA module's name (``jit_F0``).

    A program that runs several stage tasks overlapped (`Task.with_next`) has
    ``members``, the keys of the programs it runs, and the text form joins
    theirs with ``+`` (``F0+B7``); its ``kind`` joins their kinds (``F+B``).

    Example:
      >>> str(ProgramKey("post", index=0, mesh=2))
      'post.L0.mesh2'
      >>> ProgramKey.parse("BW1")
      ProgramKey(kind='BW', stage=1, mesh=None, index=None)
      >>> [str(k) for k in ProgramKey.parse("F0+B7").parts()]
      ['F0', 'B7']
    """

    kind: str
    stage: int | None = None
    mesh: int | None = None
    index: int | None = None
    members: tuple[ProgramKey, ...] = dataclasses.field(default=(), repr=False)

    @classmethod
    def overlapped(cls, members: Sequence[ProgramKey]) -> ProgramKey:
        """The key of a program that runs ``members`` in one program, in order."""
        return cls("+".join(m.kind for m in members), members=tuple(members))

    def parts(self) -> tuple[ProgramKey, ...]:
        """The stage programs this program runs: its ``members``, or itself."""
        return self.members or (self,)

    def __str__(self) -> str:
        if self.members:
            return "+".join(map(str, self.members))
        text = self.kind + ("" if self.stage is None else str(self.stage))
        text += "" if self.index is None else f".L{self.index}"
        return text + ("" if self.mesh is None else f".mesh{self.mesh}")

    @classmethod
    def parse(cls, text: str) -> ProgramKey:
        """Reads the text form; raises `CompileError` for anything else."""
        if "+" in text:
            return cls.overlapped([cls.parse(part) for part in text.split("+")])
        match = _KEY_TEXT.match(text)
        if match is None:
            raise CompileError(
                f"{text!r} is not a program name: names read KIND[STAGE][.LINDEX][.meshMESH], "
                "e.g. F0, init1, post.L0.mesh2."
            )
        kind, *numbers = match.groups()
        stage, index, mesh = (None if n is None else int(n) for n in numbers)
        return cls(kind, stage=stage, mesh=mesh, index=index)


@dataclasses.dataclass(frozen=True)
class Call:
    """Runs program ``program`` (the callable ``fn``) on ``mesh``: args are built
    from slots, results stored in slots.

    ``args`` and ``outs`` are nested tuples of slot numbers mirroring the
    program's arguments and results (an ``int`` leaf is a slot; the
    ``residuals`` leaf of a forward is one slot holding a pytree).
    ``donated`` lists the arguments `donate_dead_arguments` made the program
    donate (besides the accumulators every program donates).
    """

    mesh: int
    program: ProgramKey
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    outs: Any
    label: str
    task: Any = None  # the schedule Task (a tuple of them for overlapped tasks)
    donated: tuple[int, ...] = ()  # arguments donated by `donate_dead_arguments`
    # A hashable key of what ``fn`` computes (`jaxpr_utils.structure_key`), or None:
    # calls with equal keys on equal-shaped submeshes run the same program.
    structure: Any = dataclasses.field(default=None, compare=False, repr=False)
    # Arguments that are step inputs and have a result of their shape and dtype to
    # write into (outer programs): what `donate_inputs.donate_step_inputs` may donate.
    aliases: tuple[int, ...] = dataclasses.field(default=(), compare=False, repr=False)

    def reads(self) -> list[int]:
        return list(slots_in(self.args))

    def writes(self) -> list[int]:
        return list(slots_in(self.outs))


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Copies slot ``src`` (on ``src_mesh``) to slot ``dst`` on submesh ``dst_mesh``.

    ``reshape_microbatches`` (an int m) reshapes a batch ``[B, ...]`` to
    ``[m, B/m, ...]`` on the way; ``spec`` overrides the PartitionSpec (None
    keeps the source's). ``per_microbatch`` marks a stage's activation or
    cotangent for one microbatch (a batch-sharded value). ``value_type`` is
    the moved value's ``(shape, dtype name, weak type)`` when the compiler
    knows it (a packed transfer, which also sets ``spec``): ahead-of-time
    compilation then types the destination without waiting for the source's
    program (text form ``type=float32[18]``, and ``weak_type``).
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
    value_type: tuple[tuple[int, ...], str, bool] | None = None

    def reads(self) -> list[int]:
        return [self.src]

    def writes(self) -> list[int]:
        return [self.dst]


@dataclasses.dataclass(frozen=True)
class TransferBatch:
    """Several `Transfer`s made in one move (one ``jax.device_put`` of a list).

    No member reads what another writes, so they may move together in any
    order; the `batch_transfers` pass of `nnx_mpmd.compiler.final.transfer_batching`
    makes them from consecutive transfers.

    Example:
      >>> batch = TransferBatch((Transfer(1, 2, 1, "a", src_mesh=0), Transfer(3, 4, 0, "b", src_mesh=1)))
      >>> batch.reads(), batch.writes(), batch.label
      ([1, 3], [2, 4], 'a; b')
    """

    transfers: tuple[Transfer, ...]

    @property
    def label(self) -> str:
        """The members' labels, joined by ``; ``."""
        return "; ".join(t.label for t in self.transfers)

    @property
    def nbytes(self) -> int:
        """The bytes the members move, in all."""
        return sum(t.nbytes for t in self.transfers)

    def reads(self) -> list[int]:
        return [t.src for t in self.transfers]

    def writes(self) -> list[int]:
        return [t.dst for t in self.transfers]


@dataclasses.dataclass(frozen=True)
class Free:
    """Drops the values in ``slots``."""

    slots: tuple[int, ...]

    def reads(self) -> list[int]:
        return []

    def writes(self) -> list[int]:
        return []


Instruction = Call | Transfer | TransferBatch | Free


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


def last_reads(program: Sequence[Instruction]) -> tuple[dict[int, int], set[int]]:
    """Per slot the index of its last reader; and the slots some instruction writes.

    Example:
      >>> last_reads([Transfer(0, 1, 1, "x"), Transfer(1, 2, 0, "x"), Free((0, 1))])
      ({0: 0, 1: 1}, {1, 2})
    """
    last_read: dict[int, int] = {}
    written: set[int] = set()
    for i, ins in enumerate(program):
        for s in ins.reads():
            last_read[s] = i
        written.update(ins.writes())
    return last_read, written


def insert_frees(program: list[Instruction], keep: set[int]) -> list[Instruction]:
    """Adds a `Free` after the last read of every slot not in ``keep``."""
    last_read, _ = last_reads(program)
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


@dataclasses.dataclass(frozen=True)
class Donatable:
    """An argument a program could donate, and how to get the program that does.

    Attributes:
      argnum: the argument (a nested tuple of slots in each `Call`).
      out_index: the result it would alias: donation is used only where the
        argument has as many slots as ``outs[out_index]``.
      donating: ``donating(argnums)`` is the program donating ``argnums`` too.
    """

    argnum: int
    out_index: int
    donating: Callable[[tuple[int, ...]], Callable[..., Any]]


def last_use(
    i: int,
    ins: Call,
    slot: int,
    last_read: Mapping[int, int],
    keep: set[int],
    passed: Mapping[int, int] | None = None,
) -> bool:
    """Whether call ``i`` could donate ``slot``: its last reader, not kept, passed once.

    ``last_read`` maps a slot to its last reader's index (`last_reads`); ``passed`` counts how
    often the call passes each slot (``Counter(slots_in(ins.args))``, counted here if omitted).

    Example:
      >>> call = Call(0, ProgramKey("B", stage=0), abs, (1, 1, 2), ((3,),), "B0.0")
      >>> [last_use(0, call, s, {1: 0, 2: 0}, keep=set()) for s in (1, 2)]
      [False, True]
    """
    if last_read.get(slot) != i or slot in keep:
        return False
    if passed is None:
        return list(slots_in(ins.args)).count(slot) == 1
    return passed.get(slot, 0) == 1


def _dead_after(
    i: int, ins: Call, d: Donatable, last_read: dict[int, int], written: set[int], keep: set[int]
) -> bool:
    """Whether call ``i`` may donate argument ``d.argnum``: nothing needs its slots after."""
    if d.argnum >= len(ins.args) or not isinstance(ins.outs, tuple) or d.out_index >= len(ins.outs):
        return False
    slots = list(slots_in(ins.args[d.argnum]))
    if not slots or len(slots) != len(list(slots_in(ins.outs[d.out_index]))):
        return False
    passed = collections.Counter(slots_in(ins.args))  # once per call, not once per slot
    return all(s in written and last_use(i, ins, s, last_read, keep, passed) for s in slots)


def donate_dead_arguments(
    program: Sequence[Instruction], keep: set[int], donatable: Mapping[ProgramKey, Donatable]
) -> list[Instruction]:
    """Pass: a program whose every call is the last reader of an argument donates it.

    Only step-written, unkept arguments passed once qualify; the `Free` after stays (it is cheap).

    Example:
      >>> import jax
      >>> key = ProgramKey("B", stage=1)
      >>> d = Donatable(1, 0, lambda argnums: jax.jit(lambda a, b: (b * a,), donate_argnums=argnums))
      >>> program = [Transfer(0, 1, 0, "ct"), Call(0, key, abs, (2, (1,)), ((3,),), "B1.0"), Free((1,))]
      >>> donate_dead_arguments(program, {3}, {key: d})[1].donated
      (1,)
    """
    last_read, written = last_reads(program)
    calls: dict[ProgramKey, list[tuple[int, Call]]] = {}
    for i, ins in enumerate(program):
        if isinstance(ins, Call) and ins.program in donatable:
            calls.setdefault(ins.program, []).append((i, ins))
    replaced: dict[int, Call] = {}
    for key, found in calls.items():
        d = donatable[key]
        if all(_dead_after(i, ins, d, last_read, written, keep) for i, ins in found):
            argnums = tuple(sorted({*found[0][1].donated, d.argnum}))
            fn = d.donating(argnums)
            for i, ins in found:
                replaced[i] = dataclasses.replace(ins, fn=fn, donated=argnums)
    return [replaced.get(i, ins) for i, ins in enumerate(program)]


def format_instruction(ins: Instruction) -> str:
    """One instruction as one line of text, e.g. ``call 1 F1 args=(3,4) outs=(5,6) label=F1.0``.

    A `TransferBatch` joins its members' transfer text with `` ; ``.

    Example:
      >>> format_instruction(Free((3, 4)))
      'free 3 4'
      >>> format_instruction(TransferBatch((Transfer(1, 2, 1, "a"), Transfer(3, 4, 0, "b"))))
      'transfers 1@-1 -> 2@1 label=a bytes=0 ; 3@-1 -> 4@0 label=b bytes=0'
    """
    if isinstance(ins, Free):
        return " ".join(["free", *map(str, ins.slots)])
    if isinstance(ins, Call):
        args, outs = (repr(t).replace(" ", "") for t in (ins.args, ins.outs))
        line = f"call {ins.mesh} {ins.program} args={args} outs={outs}"
        line += f" label={shlex.quote(ins.label)}"
        line += f" task={_task_text(ins.task)}" if ins.task is not None else ""
        return line + (f" donate={','.join(map(str, ins.donated))}" if ins.donated else "")
    if isinstance(ins, TransferBatch):
        return "transfers " + " ; ".join(_transfer_text(t) for t in ins.transfers)
    return "transfer " + _transfer_text(ins)


def _task_text(task: Any) -> str:
    """A task's token; an overlapped call's tasks joined by ``+``."""
    return "+".join(map(str, task)) if isinstance(task, tuple) else str(task)


def _parse_task(text: str) -> Any:
    tasks = tuple(Task.parse(t) for t in text.split("+"))
    return tasks[0] if len(tasks) == 1 else tasks


def _transfer_text(ins: Transfer) -> str:
    line = f"{ins.src}@{ins.src_mesh} -> {ins.dst}@{ins.dst_mesh}"
    line += f" label={shlex.quote(ins.label)} bytes={ins.nbytes}"
    if ins.reshape_microbatches is not None:
        line += f" reshape={ins.reshape_microbatches}"
    if ins.spec is not None:
        line += f" spec={_spec_text(ins.spec)}"
    if ins.value_type is not None:
        shape, dtype, weak = ins.value_type
        line += f" type={dtype}[{','.join(map(str, shape))}]" + (" weak_type" if weak else "")
    return line + (" per_microbatch" if ins.per_microbatch else "")


def _parse_value_type(text: str, weak: bool, line_no: int) -> tuple[tuple[int, ...], str, bool]:
    dtype, sep, rest = text.partition("[")
    try:
        if not sep or not rest.endswith("]"):
            raise ValueError(text)
        shape = tuple(int(d) for d in rest[:-1].split(",") if d)
    except ValueError:
        raise CompileError(
            f"instruction line {line_no}: cannot read the transfer type {text!r}; write it as "
            "type=DTYPE[D0,D1,...] (type=float32[] for a scalar)."
        ) from None
    return shape, dtype, weak


def _spec_text(spec: PartitionSpec) -> str:
    """``P(None, 'data', ('x', 'y'))`` as ``[None,data,x+y]`` (no spaces, no quotes)."""

    def entry(e: Any) -> str:
        if e is None:
            return "None"
        if isinstance(e, tuple):  # a trailing "+" keeps a one-axis tuple a tuple
            return "+".join(e) + ("+" if len(e) == 1 else "")
        return str(e)

    return "[" + ",".join(entry(e) for e in spec) + "]"


def _parse_spec(text: str, line_no: int) -> PartitionSpec:
    if not (text.startswith("[") and text.endswith("]")):
        raise CompileError(
            f"instruction line {line_no}: spec={text!r} is not of the form [None,data,x+y]."
        )
    body = text[1:-1]
    entries: list[Any] = []
    for e in body.split(",") if body else []:
        if e == "None":
            entries.append(None)
        else:
            entries.append(tuple(a for a in e.split("+") if a) if "+" in e else e)
    return PartitionSpec(*entries)


def format_instructions(program: Sequence[Instruction]) -> str:
    """The text form of an instruction list, one line each; `parse_instructions` reads it back.

    A `Call` prints its program's name, by which `parse_instructions` finds the callable.

    Example:
      >>> key = ProgramKey("F", stage=0)
      >>> prog = [Call(0, key, abs, (0,), 1, "F0.0"), Transfer(1, 2, 1, "x", src_mesh=0)]
      >>> print(format_instructions([*prog, Free((0,))]))
      call 0 F0 args=(0,) outs=1 label=F0.0
      transfer 1@0 -> 2@1 label=x bytes=0
      free 0
    """
    return "\n".join(format_instruction(ins) for ins in program)


def _fields(tokens: list[str], line_no: int, line: str) -> dict[str, str]:
    out = {}
    for token in tokens:
        key, sep, value = token.partition("=")
        if not sep and token not in ("per_microbatch", "weak_type"):
            raise CompileError(f"instruction line {line_no} ({line!r}): cannot read {token!r}.")
        out[key] = value
    return out


def _literal(text: str, what: str, line_no: int) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise CompileError(
            f"instruction line {line_no}: {what}={text!r} is not a Python literal "
            "(slots are nested tuples of ints)."
        ) from None


def _parse_line(line: str, line_no: int, programs: Mapping[str, Any]) -> Instruction:
    tokens = shlex.split(line)
    op = tokens[0]
    if op == "free":
        return Free(tuple(int(t) for t in tokens[1:]))
    if op == "call":
        mesh, name, fields = int(tokens[1]), tokens[2], _fields(tokens[3:], line_no, line)
        if name not in programs:
            raise CompileError(
                f"instruction line {line_no} calls program {name!r}, which is not among the "
                f"programs given ({', '.join(sorted(programs)) or 'none'}); pass it in programs."
            )
        task = _parse_task(fields["task"]) if "task" in fields else None
        args = _literal(fields["args"], "args", line_no)
        outs = _literal(fields["outs"], "outs", line_no)
        key = ProgramKey.parse(name)
        donated = tuple(int(n) for n in fields["donate"].split(",")) if "donate" in fields else ()
        return Call(mesh, key, programs[name], args, outs, fields["label"], task, donated)
    if op == "transfer":
        transfer = _parse_transfer(tokens[1:], line_no, line)
        if transfer is not None:
            return transfer
    if op == "transfers":
        # A ";" token followed by "SRC@MESH ->" starts the next member (a label that is
        # ";" itself is followed by bytes=..., never by a slot).
        members: list[list[str]] = [[]]
        rest = tokens[1:]
        for n, token in enumerate(rest):
            if token == ";" and _SLOT_AT.match(" ".join(rest[n + 1 : n + 3])):
                members.append([])
            else:
                members[-1].append(token)
        batch = [_parse_transfer(m, line_no, line) for m in members]
        if all(t is not None for t in batch):
            return TransferBatch(tuple(batch))  # type: ignore[arg-type]
    raise CompileError(
        f"instruction line {line_no} ({line!r}) is not an instruction: lines start with "
        "'call', 'transfer SRC@MESH -> DST@MESH', 'transfers SRC@MESH -> DST@MESH ... ; ...' "
        "or 'free'."
    )


def _parse_transfer(tokens: list[str], line_no: int, line: str) -> Transfer | None:
    """A transfer from ``SRC@MESH -> DST@MESH field=value...`` tokens (None: not one)."""
    if len(tokens) < 3 or tokens[1] != "->":
        return None
    try:
        (src, src_mesh), (dst, dst_mesh) = (map(int, t.split("@")) for t in (tokens[0], tokens[2]))
    except ValueError:
        return None
    fields = _fields(tokens[3:], line_no, line)
    if "label" not in fields:
        raise CompileError(f"instruction line {line_no} ({line!r}): a transfer needs label=...")
    spec = fields.get("spec")
    return Transfer(
        src,
        dst,
        dst_mesh,
        fields["label"],
        src_mesh=src_mesh,
        nbytes=int(fields.get("bytes", 0)),
        reshape_microbatches=int(fields["reshape"]) if "reshape" in fields else None,
        spec=_parse_spec(spec, line_no) if spec is not None else None,
        per_microbatch="per_microbatch" in fields,
        value_type=_parse_value_type(fields["type"], "weak_type" in fields, line_no)
        if "type" in fields
        else None,
    )


def parse_instructions(text: str, programs: Mapping[str, Any]) -> list[Instruction]:
    """Reads the text `format_instructions` writes (``#`` comments and blank lines skipped).

    Raises:
      CompileError: a line is not an instruction, or names an unknown program.

    Example:
      >>> text = "call 0 F0 args=(0,) outs=1 label=F0.0\\nfree 0"
      >>> parse_instructions(text, {"F0": abs})[1]
      Free(slots=(0,))
    """
    program = []
    for line_no, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip() if raw.lstrip().startswith("#") else raw.strip()
        if line:
            program.append(_parse_line(line, line_no, programs))
    return program
