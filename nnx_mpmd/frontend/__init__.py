"""What users write: `Stage`, `PipelinedModel`, `assign_stages`, stage markers, and the
`jit` / `value_and_grad` entry with its `Lowered` and `Compiled` stages.

The annotation modules (`stage`, `annotate`, `markers`) sit at the bottom of the
package's layers; the entry (`jit`) sits above the compiler and runtime it drives,
as ``jax.jit``'s API module sits above XLA's compiler.
"""
