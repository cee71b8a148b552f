"""The XLA options nnx_mpmd compiles its programs with: XLA:CPU's loop emitters on CPU.

A pipelined step is several XLA programs where the one-device jit is one, and
XLA deduplicates kernels only within a program: the GPT row of ``make
bench-peers`` compiles 198 kernels (132 distinct) against the one-device
program's 94. XLA:CPU's default fusion emitters spend about 10 ms setting up
each kernel (a fresh MLIR context with every dialect), its loop emitters about
1.5 ms. So programs nnx_mpmd compiles for CPU devices get
``xla_cpu_use_fusion_emitters=False``: the GPT row's first step in about 0.7×
the time (see BENCHMARKS.md). Other platforms get no option.

An ``XLA_FLAGS`` that names ``--xla_cpu_use_fusion_emitters`` is the user's
choice and wins (``=true`` restores XLA's default), and a jaxlib without the
option compiles with its defaults.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import jax

from nnx_mpmd._jax_compat import lowered_platform

__all__ = ["CPU_EMITTER_OPTION", "compile_program", "program_compiler_options"]

#: The XLA debug option nnx_mpmd sets to False for its CPU programs.
CPU_EMITTER_OPTION = "xla_cpu_use_fusion_emitters"

_unknown_to_xla = threading.Event()  # set once XLA answered "No such compile option"


def program_compiler_options(platform: str | None) -> dict[str, Any]:
    """The ``compiler_options`` nnx_mpmd compiles a program for ``platform`` with.

    Example:
      >>> program_compiler_options("gpu")
      {}
    """
    if platform != "cpu" or _unknown_to_xla.is_set():
        return {}
    if CPU_EMITTER_OPTION in os.environ.get("XLA_FLAGS", ""):
        return {}  # the user chose the emitters
    return {CPU_EMITTER_OPTION: False}


def compile_program(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    """``lowered.compile()`` with `program_compiler_options` for its platform.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> compiled = compile_program(jax.jit(lambda v: v * 2).lower(jnp.ones(3)))
      >>> compiled(jnp.ones(3)).tolist()
      [2.0, 2.0, 2.0]
    """
    options = program_compiler_options(lowered_platform(lowered))
    if not options:
        return lowered.compile()
    try:
        return lowered.compile(compiler_options=options)
    except jax.errors.JaxRuntimeError as error:
        if "No such compile option" not in str(error):
            raise
        _unknown_to_xla.set()  # a newer jaxlib: its defaults, from now on
        return lowered.compile()
