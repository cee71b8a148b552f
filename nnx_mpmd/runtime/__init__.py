"""Execution only: the interpreter of compiled per-mesh instruction lists, its device
operations and transfers, the multi-process runtime, and the observers that profile it."""
