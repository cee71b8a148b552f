"""nnx_mpmd compiles its CPU programs with XLA:CPU's loop emitters, unless XLA_FLAGS chooses."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from pipeline_models import build, make_batch, make_mesh, train_step_fn

import nnx_mpmd as mp
from nnx_mpmd.compiler import codegen
from nnx_mpmd.compiler.codegen import CPU_EMITTER_OPTION, compile_program, program_compiler_options

LOOP = {CPU_EMITTER_OPTION: False}
# The suite's XLA_FLAGS name the emitters (tests/conftest.py), so these tests set their own.
NO_CHOICE = "--xla_force_host_platform_device_count=8"


@pytest.fixture
def no_emitter_choice(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", NO_CHOICE)
    yield
    codegen._unknown_to_xla.clear()


def test_cpu_programs_get_the_loop_emitters_and_other_platforms_nothing(no_emitter_choice):
    assert program_compiler_options("cpu") == LOOP
    assert program_compiler_options("gpu") == {}
    assert program_compiler_options("tpu") == {}
    assert program_compiler_options(None) == {}  # a lowered program of unknown platform


@pytest.mark.parametrize("choice", ["true", "false"])
def test_an_emitter_choice_in_xla_flags_wins(monkeypatch, choice):
    monkeypatch.setenv("XLA_FLAGS", f"{NO_CHOICE} --xla_cpu_use_fusion_emitters={choice}")
    assert program_compiler_options("cpu") == {}


@pytest.fixture
def compiler_options_seen(monkeypatch):
    """The ``compiler_options`` of every `jax.stages.Lowered.compile` call from now on."""
    seen = []
    compile_lowered = jax.stages.Lowered.compile

    def recording(self, compiler_options=None, **kwargs):
        seen.append(compiler_options)
        return compile_lowered(self, compiler_options, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", recording)
    return seen


class _Lowered:
    """A stand-in `jax.stages.Lowered` on CPU that records its compile calls."""

    def __init__(self, refuse_with: str | None = None):
        self._lowering = SimpleNamespace(compile_args={"backend": SimpleNamespace(platform="cpu")})
        self.calls: list[dict | None] = []
        self.refuse_with = refuse_with

    def compile(self, compiler_options=None):
        self.calls.append(compiler_options)
        if compiler_options and self.refuse_with:
            raise jax.errors.JaxRuntimeError(self.refuse_with)
        return "compiled"


def test_a_jaxlib_without_the_option_compiles_with_its_defaults_from_then_on(no_emitter_choice):
    lowered = _Lowered(
        refuse_with=f"INVALID_ARGUMENT: No such compile option: '{CPU_EMITTER_OPTION}'"
    )
    assert compile_program(lowered) == "compiled"
    assert lowered.calls == [LOOP, None]
    assert program_compiler_options("cpu") == {}  # not asked again
    again = _Lowered()
    assert compile_program(again) == "compiled" and again.calls == [None]


def test_other_compile_errors_are_raised(no_emitter_choice):
    lowered = _Lowered(refuse_with="RESOURCE_EXHAUSTED: out of memory while compiling")
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        compile_program(lowered)
    assert program_compiler_options("cpu") == LOOP


def test_a_real_program_compiles_with_the_option_and_computes_the_same(no_emitter_choice):
    x = jnp.linspace(-2.0, 2.0, 64).reshape(8, 8)
    lowered = jax.jit(lambda v: jnp.tanh(v @ v.T) * 3.0 + 1.0).lower(x)
    compiled = compile_program(lowered)
    np.testing.assert_array_equal(compiled(x), lowered.compile()(x))


def test_a_pipelined_step_compiles_every_program_with_the_loop_emitters(
    no_emitter_choice, compiler_options_seen
):
    model, opt, loss_fn, kind = build("mlp", "adamw", 2)
    ref_model, ref_opt, _, _ = build("mlp", "adamw", 2)
    step = mp.jit(
        train_step_fn(loss_fn), mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2
    )
    batch = make_batch(kind, 4)
    expected = float(nnx.jit(train_step_fn(loss_fn, 2))(ref_model, ref_opt, batch))
    compiler_options_seen.clear()
    loss = float(step(model, opt, batch))
    seen = compiler_options_seen
    assert seen and all(options == LOOP for options in seen), seen
    np.testing.assert_allclose(loss, expected, rtol=1e-5)


def test_the_batch_split_program_compiles_with_the_same_options(
    no_emitter_choice, compiler_options_seen
):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from nnx_mpmd.runtime import batch_split

    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[2:4])
    target = NamedSharding(mesh, P(None, "data"))
    batch = jax.device_put(jnp.arange(12 * 13, dtype=jnp.float32).reshape(12, 13), jax.devices()[0])
    split = batch_split.MicrobatchSplitter().split(batch, 3, target)
    assert compiler_options_seen == [LOOP]  # a shape no other test splits: its program is made here
    expected = jax.device_put(batch.reshape(3, 4, 13), target)
    assert split.sharding == expected.sharding
    np.testing.assert_array_equal(split, expected)
