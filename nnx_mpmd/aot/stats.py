"""Counting XLA compilations (for tests and benchmarks).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from nnx_mpmd.aot.stats import count_compilations
    >>> with count_compilations() as counter:
    ...     _ = jax.jit(lambda x: x * 3 + 1)(jnp.ones(7))
    >>> counter.count >= 1
    True
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import jax

__all__ = ["CompilationCounter", "count_compilations"]

_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_active: list[CompilationCounter] = []
_installed = False


class CompilationCounter:
    """Counts backend (XLA) compilations while active.

    Attributes:
      count: how many compilations ran.
      names: the compiled functions' names, in order (``jit(F0)``, ...).
    """

    def __init__(self) -> None:
        self.count = 0
        self.names: list[str] = []


def _listener(event: str, duration_secs: float, **kwargs: object) -> None:
    del duration_secs
    if event == _EVENT:
        with _lock:
            for counter in _active:
                counter.count += 1
                counter.names.append(str(kwargs.get("fun_name", "?")))


@contextlib.contextmanager
def count_compilations() -> Iterator[CompilationCounter]:
    """Counts XLA compilations in the ``with`` block (yields a `CompilationCounter`)."""
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            _installed = True
    counter = CompilationCounter()
    _active.append(counter)
    try:
        yield counter
    finally:
        _active.remove(counter)
