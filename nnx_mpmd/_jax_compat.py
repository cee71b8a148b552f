"""The one place that touches private JAX and Flax internals.

Everything here depends on implementation details of jax 0.10 / flax 0.12 that
have no public API. Keep it small; every function says what it relies on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from flax import nnx
from flax.nnx import tracers as nnx_tracers

__all__ = [
    "DIFFERENTIATION_FRAMES",
    "cluster_environment_present",
    "convert_constvars_jaxpr",
    "coordination_state",
    "dce_jaxpr",
    "explicit_sharding_rejection",
    "variable_belongs_to_current_trace",
    "variables_bound_to_current_trace",
]


def variable_belongs_to_current_trace(variable: nnx.Variable) -> bool:
    """Whether ``variable`` may be updated in the trace running now.

    Relies on: ``Variable._can_update`` (flax 0.12).
    """
    return bool(variable._can_update)


@contextlib.contextmanager
def variables_bound_to_current_trace(
    variables: Sequence[nnx.Variable], values: Sequence[Any]
) -> Iterator[None]:
    """Lets code traced now read and update Variables created in an outer trace.

    A Flax Variable remembers the JAX trace it was created in and refuses updates
    from any other (``TraceContextError``), so a loss function that closes over an
    ``nnx.Rngs`` cannot draw keys inside a transform. This binds each Variable to
    the current trace with ``values`` (tracers of that trace) for the duration of
    the block, and afterwards restores its original value and trace. Read the
    new values with ``get_raw_value()`` inside the block.

    Relies on: ``Variable._trace_state`` (a ``flax.nnx.tracers.TraceState``) and
    ``Variable._raw_value`` (set without the trace check when restoring).
    """
    saved = [(v.get_raw_value(), v._trace_state) for v in variables]
    try:
        for variable, value in zip(variables, values, strict=True):
            object.__setattr__(variable, "_trace_state", nnx_tracers.TraceState())
            variable.set_raw_value(value)
    except BaseException:
        _restore(variables, saved)
        raise
    try:
        yield
    finally:
        _restore(variables, saved)


def _restore(variables: Sequence[nnx.Variable], saved: list[tuple[Any, Any]]) -> None:
    for variable, (value, trace_state) in zip(variables, saved):
        object.__setattr__(variable, "_trace_state", trace_state)
        object.__setattr__(variable, "_raw_value", value)


def convert_constvars_jaxpr(jaxpr: Any) -> Any:
    """A jaxpr whose constants are leading input variables instead.

    Relies on: ``jax._src.interpreters.partial_eval.convert_constvars_jaxpr``.
    """
    from jax._src.interpreters import partial_eval as pe

    return pe.convert_constvars_jaxpr(jaxpr)


def dce_jaxpr(jaxpr: Any, used_outputs: list[bool], instantiate: bool | list[bool] = False) -> Any:
    """Dead-code elimination: ``(jaxpr, used_inputs)`` keeping ``used_outputs``.

    ``instantiate=True`` keeps every input variable (the jaxpr's signature).

    Relies on: ``jax._src.interpreters.partial_eval.dce_jaxpr``.
    """
    from jax._src.interpreters import partial_eval as pe

    return pe.dce_jaxpr(jaxpr, used_outputs, instantiate=instantiate)


def coordination_state() -> tuple[Any, Any]:
    """``(client, coordinator_address)`` of ``jax.distributed``; ``(None, None)`` if off.

    Relies on: ``jax._src.distributed.global_state`` (the client is not public).
    """
    from jax._src import distributed

    state = distributed.global_state
    if state.client is None:
        return None, None
    return state.client, state.coordinator_address


def cluster_environment_present() -> bool:
    """Whether one of jax's cluster environments (SLURM, MPI, TPU pod, ...) is detected.

    Relies on: ``jax._src.clusters.ClusterEnv._cluster_types``.
    """
    from jax._src.clusters import ClusterEnv

    return any(env.is_env_present() for env in ClusterEnv._cluster_types)


# Where JAX implements the differentiation transforms a user may wrap around Stage
# calls: (module, function) -> the public name. Only used to name the transform in
# an error message. Relies on: function names in ``jax._src.api``.
DIFFERENTIATION_FRAMES = {
    ("jax._src.api", "grad_f"): "jax.grad",
    ("jax._src.api", "grad_f_aux"): "jax.grad",
    ("jax._src.api", "value_and_grad_f"): "jax.value_and_grad",
    ("jax._src.api", "vjp"): "jax.vjp",
    ("jax._src.api", "jvp"): "jax.jvp",
    ("jax._src.api", "linearize"): "jax.linearize",
    ("jax._src.api", "jacfun"): "jax.jacfwd/jax.jacrev",
}


def explicit_sharding_rejection(fn: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    """``(fn(*args), None)``, or ``(None, error)`` when JAX's Explicit sharding rules
    reject an op of ``fn``.

    JAX reports such a rejection (an op whose output sharding is ambiguous on
    Explicit axes) only by raising its private ``ShardingTypeError``; this turns
    that one error into data for the caller to decide on. Other errors propagate.
    """
    from jax._src.core import ShardingTypeError

    try:
        return fn(*args), None
    except ShardingTypeError as error:
        return None, error
