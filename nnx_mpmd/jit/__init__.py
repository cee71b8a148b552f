"""The user-facing entry: `mp.jit` (a `PipelinedFunction`, its options one frozen
`JitOptions`), `value_and_grad`, the `Traced`, `Lowered` and `Compiled` stages, argument
handling (static, donated, batch placement), precision, and pipelined generation.

It sits above the compiler, the runtime and ahead-of-time compilation that it drives,
as ``jax.jit``'s API sits above XLA. This package defines no names of its own: the
function ``mp.jit`` is `nnx_mpmd.jit.jit.jit`.
"""
