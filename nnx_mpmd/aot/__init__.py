"""Ahead-of-time compilation: precompiling a step's programs, sharing one executable
between submeshes, the step store and JAX's persistent cache, step fingerprints, and
compilation counts."""
