"""The ``donate_dead_arguments`` pass: backwards donate the cotangents they last read.

IR level: a program donates an argument only when, in every one of its calls,
nothing needs that argument's slots afterwards (not read later, not returned,
not passed twice, not a step input or constant) and the argument has as many
slots as the result it can alias. End to end: 1F1B and ZB-H1 steps donate
their middle stages' received cotangents, XLA writes the input cotangents into
them (the received arrays are deleted after the backward), and the step's
numbers are bit for bit those of the step without donation.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from pipeline_models import build, make_batch, make_mesh, params_of, train_step_fn

import nnx_mpmd as mp
from nnx_mpmd import schedules
from nnx_mpmd.compiler.ir import (
    Call,
    Donatable,
    Free,
    ProgramKey,
    Transfer,
    donate_dead_arguments,
    format_instructions,
    parse_instructions,
    slots_in,
)
from nnx_mpmd.compiler.region import region_plan
from nnx_mpmd.runtime import executor, interpreter

B1 = ProgramKey("B", stage=1)
F1 = ProgramKey("F", stage=1)


class _Made:
    """A ``donating`` factory that records what it was asked for."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, ...]] = []

    def __call__(self, argnums: tuple[int, ...]):
        self.asked.append(argnums)
        return ("donating", argnums)


def _backward(ct: int, out: int, label: str, extra_args: tuple = ()) -> Call:
    return Call(1, B1, abs, (0, (ct,), *extra_args), ((out,),), label)


def _program(*calls: Call) -> list:
    """Each call's cotangent arrives by a transfer; frees after every call."""
    program = []
    for call in calls:
        program.append(Transfer(90 + call.args[1][0], call.args[1][0], 1, "ct", src_mesh=2))
        program += [call, Free((call.args[1][0],))]
    return program


def _donate(program, keep=frozenset(), argnum=1, out_index=0):
    made = _Made()
    out = donate_dead_arguments(program, set(keep), {B1: Donatable(argnum, out_index, made)})
    return out, made


def test_every_call_of_a_program_donates_a_dead_cotangent():
    program = _program(_backward(5, 6, "B1.0"), _backward(7, 8, "B1.1"))
    out, made = _donate(program)
    calls = [ins for ins in out if isinstance(ins, Call)]
    assert [c.donated for c in calls] == [(1,), (1,)]
    assert all(c.fn == ("donating", (1,)) for c in calls) and made.asked == [(1,)]
    # The frees stay (a donated buffer no result aliases stays alive).
    assert [ins for ins in out if isinstance(ins, Free)] == [Free((5,)), Free((7,))]


def test_text_form_round_trips_the_donated_arguments():
    out, _ = _donate(_program(_backward(5, 6, "B1.0")))
    text = format_instructions(out)
    assert "donate=1" in text
    assert parse_instructions(text, {"B1": abs})[1].donated == (1,)


@pytest.mark.parametrize(
    "why",
    ["read later", "kept", "passed twice", "a step input", "results differ in number"],
)
def test_one_call_that_needs_its_cotangent_keeps_the_whole_program_from_donating(why):
    first, second = _backward(5, 6, "B1.0"), _backward(7, 8, "B1.1")
    keep: set[int] = set()
    if why == "passed twice":
        second = _backward(7, 8, "B1.1", extra_args=(7,))
    program = _program(first, second)
    if why == "read later":
        program.append(Call(1, F1, abs, (7,), 9, "F1.2"))
    elif why == "kept":
        keep = {5}
    elif why == "a step input":  # nothing in the step writes slot 7: the caller's array
        program = [ins for ins in program if not (isinstance(ins, Transfer) and ins.dst == 7)]
    elif why == "results differ in number":
        program[program.index(second)] = Call(1, B1, abs, (0, (7,)), ((8, 10),), "B1.1")
    out, made = _donate(program, keep)
    assert [c.donated for c in out if isinstance(c, Call) and c.program == B1] == [(), ()]
    assert made.asked == [] and out == program


def test_an_argument_or_result_the_call_does_not_have_is_never_donated():
    program = _program(_backward(5, 6, "B1.0"))
    assert _donate(program, argnum=4)[0] == program
    assert _donate(program, out_index=3)[0] == program


def test_a_wide_argument_is_checked_in_time_linear_in_its_slots(monkeypatch):
    # Counting how often each slot is passed once per call, not once per slot: a
    # backward reading thousands of accumulator slots was quadratic in them.
    import nnx_mpmd.compiler.ir as ir

    width = 400
    walks = [0]
    real = ir.slots_in

    def counted(tree):
        walks[0] += 1
        return real(tree)

    grads, outs = tuple(range(1000, 1000 + width)), tuple(range(2000, 2000 + width))
    call = Call(1, B1, abs, (0, grads), (outs,), "B1.0")
    program = [*(Transfer(3000 + g, g, 1, "ct", src_mesh=2) for g in grads), call, Free(grads)]
    monkeypatch.setattr(ir, "slots_in", counted)
    out, made = _donate(program)
    assert [c.donated for c in out if isinstance(c, Call)] == [(1,)] and made.asked == [(1,)]
    assert walks[0] < 10 * width  # quadratic: about width * width nodes walked


# ------------------------------------------------------------------ end to end


def _run(schedule_cls, data, donate, monkeypatch, steps=2):
    if not donate:
        monkeypatch.setattr(region_plan, "donatable_cotangents", lambda fns: {})
    model, opt, loss_fn, kind = build("lm", "adamw", 4)
    step = mp.jit(
        train_step_fn(loss_fn), mesh=make_mesh(4, data), schedule=schedule_cls(), num_microbatches=4
    )
    losses = [float(step(model, opt, make_batch(kind, 8 * data, seed=s))) for s in range(steps)]
    monkeypatch.undo()
    return step, losses, params_of(model)


@pytest.mark.filterwarnings("ignore::nnx_mpmd.compiler.trace.trace_step.ReplicatedBatchWarning")
@pytest.mark.parametrize("data", [1, 2])
@pytest.mark.parametrize("schedule_cls", [schedules.OneFOneB, schedules.ZeroBubbleH1])
def test_donating_cotangents_gives_the_same_bits(schedule_cls, data, monkeypatch):
    _, losses, params = _run(schedule_cls, data, True, monkeypatch)
    _, plain_losses, plain_params = _run(schedule_cls, data, False, monkeypatch)
    assert losses == plain_losses
    for path in params:
        np.testing.assert_array_equal(params[path], plain_params[path], err_msg=path)


class _Consumed(interpreter.Observer):
    """After each call that donates, whether the arrays it donated were deleted."""

    def __init__(self) -> None:
        self.deleted: list[bool] = []
        self.args: list = []

    def before(self, index, ins, store):
        slots = [s for n in getattr(ins, "donated", ()) for s in slots_in(ins.args[n])]
        self.args = [store[s] for s in slots]

    def after(self, index, ins, result, store):
        jax.block_until_ready(result)
        self.deleted += [a.is_deleted() for a in self.args]


@pytest.mark.filterwarnings("ignore::nnx_mpmd.compiler.trace.trace_step.ReplicatedBatchWarning")
@pytest.mark.parametrize("data", [1, 2])
@pytest.mark.parametrize("schedule_cls", [schedules.OneFOneB, schedules.ZeroBubbleH1])
def test_the_middle_stages_backwards_consume_the_cotangents_they_receive(
    schedule_cls, data, monkeypatch
):
    step, _, _ = _run(schedule_cls, data, True, monkeypatch, steps=1)
    model, opt, _, kind = build("lm", "adamw", 4)
    args = (model, opt, make_batch(kind, 8 * data, seed=0))
    arguments = step._context.arguments  # the call's arguments, placed as a call places them
    flat = arguments.placed(arguments.read(args, {})).flat
    compiled = step.lower(*args).compiled
    donating = [ins for ins in compiled.instructions if isinstance(ins, Call) and ins.donated]
    # Stages 1 and 2 receive a cotangent of their input's type; stage 0 makes no
    # input cotangent and the last stage receives none.
    assert {ins.program.stage for ins in donating} == {1, 2}
    assert len(donating) == 2 * 4
    submeshes = list(step.mesh.submeshes)
    shardings = executor.Shardings(submeshes)
    prepared = interpreter.prepare(compiled.instructions, executor.DeviceOperations(shardings))
    inputs = [*compiled.consts, *flat.state_leaves, *flat.other_leaves]
    store = interpreter.load_store(compiled, inputs)
    consumed = _Consumed()
    interpreter.run(prepared, store, [consumed])
    assert len(consumed.deleted) == 8 and all(consumed.deleted)
