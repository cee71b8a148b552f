"""The instruction IR's text form round-trips: print, parse, equal."""

from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from pipeline_models import MLP, WIDTH, make_mesh, mlp_loss

import nnx_mpmd as mp
from nnx_mpmd.compiler.ir import (
    Call,
    Free,
    ProgramKey,
    Transfer,
    format_instructions,
    parse_instructions,
)


def _program(x):
    return x


HANDWRITTEN = [
    Call(0, ProgramKey("init", 0), _program, ((0, 1), ()), ((2, 3), (4,)), "init0"),
    Call(1, ProgramKey("F", 1), _program, (5, (6, 7)), 8, "F1.3", mp.Task(1, 3, "F")),
    Call(2, ProgramKey("post", index=0, mesh=2), _program, (), (), "label 'quoted' spaces"),
    Transfer(8, 9, 1, "act s0->s1 mb0", src_mesh=0, nbytes=512, per_microbatch=True),
    Transfer(10, 11, 0, "argument leaf 0 host->0", reshape_microbatches=4, spec=P(None, "data")),
    Transfer(12, 13, 2, "grad", src_mesh=1, spec=P(("data", "model"), None, ("x",))),
    Transfer(14, 15, 3, "replicated", src_mesh=2, spec=P()),
    Transfer(
        16, 17, 0, "3 packed values 1->0", 1, 12, spec=P(None), value_type=((3,), "float32", False)
    ),
    Transfer(18, 19, 0, "scalar", 1, 4, spec=P(), value_type=((), "float32", True)),
    Transfer(20, 21, 0, "matrix", 1, 24, spec=P(), value_type=((2, 3), "int32", False)),
    Free((3, 4, 5)),
    Free(()),
]


def test_handwritten_instructions_round_trip():
    programs = {"init0": _program, "F1": _program, "post.L0.mesh2": _program}
    text = format_instructions(HANDWRITTEN)
    assert parse_instructions(text, programs) == HANDWRITTEN
    assert "transfer 10@-1 -> 11@0" in text and "spec=[None,data]" in text
    assert "spec=[None] type=float32[3]\n" in text and "type=float32[] weak_type\n" in text


def test_comments_and_blank_lines_are_skipped():
    text = "# a comment\n\nfree 1 2\n"
    assert parse_instructions(text, {}) == [Free((1, 2))]


@pytest.mark.parametrize(
    "text,message",
    [
        ("call 0 missing args=() outs=() label=x", r"program 'missing'.*pass it in programs"),
        ("jump 3", r"line 1 .*is not an instruction"),
        ("transfer 1@0 -> 2@1 label=x spec=None", r"spec='None' is not of the form"),
        ("call 0 F0 args=(1 outs=() label=x", r"args='\(1' is not a Python literal"),
        ("call 0 F0 args=() outs=() oops", r"cannot read 'oops'"),
        ("call 0 F-0 args=() outs=() label=x", r"'F-0' is not a program name"),
        ("transfer 1@0 -> 2@1 label=x type=float32", r"transfer type 'float32'.*DTYPE\[D0"),
        ("transfer 1@0 -> 2@1 label=x type=f32[a]", r"transfer type 'f32\[a\]'"),
    ],
)
def test_bad_text_is_a_compile_error(text, message):
    with pytest.raises(mp.CompileError, match=message):
        parse_instructions(text, {"F0": _program, "F-0": _program})


def _step(model, opt, batch):
    loss, grads = mp.value_and_grad(mlp_loss)(model, batch)
    opt.update(model, grads)
    return loss


@pytest.mark.parametrize(
    "schedule,stages",
    [(mp.OneFOneB(), 2), (mp.ZeroBubbleH1(), 2), (mp.Interleaved1F1B(), 4), (mp.DualPipeV(), 4)],
    ids=["1f1b", "zb-h1", "interleaved", "dualpipev"],
)
def test_compiled_step_instructions_round_trip(schedule, stages):
    model = MLP(stages, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    step = mp.jit(_step, mesh=make_mesh(2, 2), schedule=schedule, num_microbatches=4)
    compiled = step.lower(model, opt, {"x": jnp.ones((8, WIDTH)), "y": jnp.ones((8, WIDTH))})
    program = compiled.compiled.instructions
    text = format_instructions(program)
    assert parse_instructions(text, compiled.programs) == program
    called = {str(i.program) for i in program if isinstance(i, Call)}
    assert called <= set(compiled.programs), called - set(compiled.programs)
    assert len(text.splitlines()) == len(program)
    assert compiled.ir_text() == text


def test_programs_are_named_by_label_in_their_xla_modules():
    """Profiler traces and HLO dumps read like the instruction list: jit_F0, jit_post_...

    (``named_jit``'s doctest checks that the name reaches the lowered module.)
    """
    model = MLP(2, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = mp.jit(_step, mesh=make_mesh(2, 1), schedule=mp.ZeroBubbleH1(), num_microbatches=2)
    lowered = step.lower(model, opt, {"x": jnp.ones((4, WIDTH)), "y": jnp.ones((4, WIDTH))})
    names = {label: fn.__name__ for label, fn in lowered.programs.items()}
    assert names == {label: label.replace(".", "_") for label in names}
    assert {"F0", "BW0", "BI1", "init0", "init1"} <= set(names)
    assert any(name.startswith("post_L") for name in names.values()), names
