"""The one place that touches private JAX and Flax internals.

Everything here depends on implementation details of jax 0.10 / flax 0.12 that
have no public API. Keep it small; every function says what it relies on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from flax import nnx
from flax.nnx import graphlib
from flax.nnx import tracers as nnx_tracers

__all__ = [
    "DIFFERENTIATION_FRAMES",
    "FAST_COPY_AVAILABLE",
    "RemappingUnpickler",
    "argument_aval",
    "kept_arguments",
    "has_host_callbacks",
    "lowered_platform",
    "batched_copy",
    "batched_copy_prepared",
    "copy_semantics",
    "compile_options_for_devices",
    "sharding_device_list",
    "cluster_environment_present",
    "config_value",
    "take_cached_partial_nodes",
    "convert_constvars_jaxpr",
    "coordination_state",
    "dce_jaxpr",
    "jaxpr_value_types",
    "primitive_rules",
    "explicit_sharding_rejection",
    "variable_belongs_to_current_trace",
    "variables_bound_to_current_trace",
]


def config_value(name: str) -> Any:
    """The current value of the JAX config option ``name`` (``"jax_platforms"``...).

    ``jax.config`` sets its options as attributes at run time, which a type
    checker cannot see; reading them by name here keeps that in one place.
    """
    import jax

    return getattr(jax.config, name)


def take_cached_partial_nodes() -> Any | None:
    """Takes out the node cache ``nnx.cached_partial`` set for this call (it raises otherwise)."""
    cache = graphlib.GRAPH_CONTEXT.tmp_static_cache
    graphlib.GRAPH_CONTEXT.tmp_static_cache = None
    return cache


def variable_belongs_to_current_trace(variable: nnx.Variable) -> bool:
    """Whether ``variable`` may be updated in the trace running now (``Variable._can_update``)."""
    return bool(variable._can_update)


@contextlib.contextmanager
def variables_bound_to_current_trace(
    variables: Sequence[nnx.Variable], values: Sequence[Any]
) -> Iterator[None]:
    """Lets code traced now read and update Variables created in an outer trace.

    A Variable refuses updates from other traces (a loss closing over ``nnx.Rngs``);
    this binds each to ``values`` for the block, then restores it. Relies on: ``_trace_state``.
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
    """A jaxpr whose constants are leading input variables (``pe.convert_constvars_jaxpr``)."""
    from jax._src.interpreters import partial_eval as pe

    return pe.convert_constvars_jaxpr(jaxpr)


def dce_jaxpr(jaxpr: Any, used_outputs: list[bool], instantiate: bool | list[bool] = False) -> Any:
    """``(jaxpr, used_inputs)`` keeping ``used_outputs`` (``pe.dce_jaxpr``)."""
    from jax._src.interpreters import partial_eval as pe

    return pe.dce_jaxpr(jaxpr, used_outputs, instantiate=instantiate)


def jaxpr_value_types() -> tuple[type, type]:
    """``(AbstractValue, JaxprEqnContext)``: the avals' base class and an equation's context."""
    from jax._src import core

    return core.AbstractValue, core.JaxprEqnContext


def primitive_rules(primitive: Any) -> list[Any]:
    """The jvp, transpose and lowering rules (every platform) JAX has for ``primitive``.

    Relies on: ``ad.primitive_jvps``, ``ad.primitive_transposes`` and ``mlir``'s lowering tables.
    """
    from jax._src.interpreters import ad, mlir

    rules = [ad.primitive_jvps.get(primitive), ad.primitive_transposes.get(primitive)]
    tables = [mlir._lowerings, *mlir._platform_specific_lowerings.values()]
    rules += [getattr(table.get(primitive), "rule", None) for table in tables]
    return [rule for rule in rules if rule is not None]


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

    Opt-in-only environments (mpi4py) are left out, as ``jax.distributed.initialize()`` does.
    Relies on: ``jax._src.clusters.ClusterEnv._cluster_types``.
    """
    from jax._src.clusters import ClusterEnv

    return any(
        not getattr(env, "opt_in_only_method", False) and env.is_env_present()
        for env in ClusterEnv._cluster_types
    )


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
    """``(fn(*args), None)``, or ``(None, error)`` when Explicit sharding rejects an op of ``fn``.

    JAX signals that only with its private ``ShardingTypeError``; other errors propagate.
    """
    from jax._src.core import ShardingTypeError

    try:
        return fn(*args), None
    except ShardingTypeError as error:
        return None, error


# -- Moving arrays without jax.device_put's Python (runtime/batched_copy.py) ----------

_batched_copy: Any  # None where this jaxlib lacks it (FAST_COPY_AVAILABLE is False)
try:  # private jaxlib API: batched_copy and sharding_device_list say what they rely on
    import jaxlib.xla_client as _xla_client
    from jax.sharding import NamedSharding as _NamedSharding

    _batched_copy = _xla_client.batched_copy_array_to_devices_with_sharding
    _REUSE_INPUT = _xla_client.ArrayCopySemantics.REUSE_INPUT
    FAST_COPY_AVAILABLE = hasattr(_NamedSharding, "_internal_device_list")
except (ImportError, AttributeError):  # pragma: no cover - another jaxlib
    _batched_copy, _REUSE_INPUT, FAST_COPY_AVAILABLE = None, None, False


def argument_aval(info: Any) -> Any:
    """The aval (weak type, sharding) of a lowered program's argument (``ArgInfo._aval``)."""
    return info._aval


def kept_arguments(lowered: Any) -> tuple[int, ...] | None:
    """The positions of the flat arguments a lowered program's module reads, or None if unknown.

    ``jax.jit`` drops unread arguments, so one module text can read different arguments.
    Relies on: ``Lowered._lowering.compile_args["kept_var_idx"]`` (jax 0.10).
    """
    try:
        kept = lowered._lowering.compile_args["kept_var_idx"]
    except (AttributeError, KeyError, TypeError):
        return None
    return tuple(sorted(kept))


def lowered_platform(lowered: Any) -> str | None:
    """The platform (``"cpu"``, ``"gpu"``...) a lowered program compiles for, or None if unknown.

    Relies on: ``Lowered._lowering.compile_args["backend"].platform`` (jax 0.10).
    """
    try:
        return str(lowered._lowering.compile_args["backend"].platform)
    except (AttributeError, KeyError, TypeError):
        return None


def has_host_callbacks(lowered: Any) -> bool | None:
    """Whether a lowered program calls back into Python, or None if unknown.

    The module text names callbacks by index only. Relies on: ``compile_args["host_callbacks"]``.
    """
    try:
        return bool(lowered._lowering.compile_args["host_callbacks"])
    except (AttributeError, KeyError, TypeError):
        return None


def concrete_mesh(mesh: Any) -> contextlib.AbstractContextManager[Any]:
    """A context making ``mesh`` the concrete mesh inside a trace (no-op without the hook).

    ``jax.set_mesh`` refuses to run under a trace; eager evaluation there may still compile.
    Relies on: ``jax._src.sharding_impls._internal_use_concrete_mesh`` (jax 0.10).
    """
    try:
        from jax._src.sharding_impls import _internal_use_concrete_mesh
    except ImportError:
        return contextlib.nullcontext()
    return _internal_use_concrete_mesh(mesh)


def sharding_device_list(sharding: Any) -> Any:
    """The device list a batched copy wants (``NamedSharding._internal_device_list``)."""
    return sharding._internal_device_list


def copy_semantics(count: int) -> list[Any]:
    """The per-array copy semantics `batched_copy_prepared` takes: ``jax.device_put``'s.

    Relies on: ``jaxlib.xla_client.ArrayCopySemantics.REUSE_INPUT`` (jax 0.10).
    """
    return [_REUSE_INPUT] * count


def batched_copy_prepared(
    values: list[Any], device_lists: list[Any], targets: list[Any], semantics: list[Any]
) -> list[Any]:
    """`batched_copy` with its lists built once by the caller (no per-call copies).

    Relies on: ``jaxlib.xla_client.batched_copy_array_to_devices_with_sharding``
    (jax 0.10); ``semantics`` from `copy_semantics`. Only called where
    `FAST_COPY_AVAILABLE` (a `BatchPlan` is made only then).
    """
    return _batched_copy(values, device_lists, targets, semantics)  # pyright: ignore[reportOptionalCall]


def batched_copy(values: Sequence[Any], device_lists: Sequence[Any], targets: Sequence[Any]) -> Any:
    """Copies arrays to shardings in one call, as ``jax.device_put`` does (``REUSE_INPUT``)."""
    return _batched_copy(
        list(values), list(device_lists), list(targets), [_REUSE_INPUT] * len(values)
    )


# -- Loading one compiled executable on other devices (aot/program_sharing.py) ----


def compile_options_for_devices(devices: Sequence[Any]) -> Any:
    """Compile options whose device assignment is ``devices`` as SPMD partitions.

    Relies on: ``jaxlib._jax.CompileOptions`` and ``DeviceAssignment.create`` of
    a ``[replicas, partitions]`` id array (jax programs on a mesh are one
    replica with one partition per device).
    """
    import numpy as np
    from jaxlib import _jax  # pyright: ignore[reportAttributeAccessIssue]: private, untyped

    options = _jax.CompileOptions()
    options.num_replicas = 1
    options.num_partitions = len(devices)
    options.device_assignment = _jax.DeviceAssignment.create(
        np.array([[d.id for d in devices]], dtype=np.int64)
    )
    return options


def _unpickler_base() -> Any:
    from jax.experimental import serialize_executable

    return serialize_executable._JaxPjrtUnpickler


class RemappingUnpickler(_unpickler_base()):
    """Unpickles an executable for other devices: device ``k`` of ``source`` is ``target[k]``.

    Relies on: ``jax.experimental.serialize_executable._JaxPjrtUnpickler`` (its
    ``persistent_load`` of ``("device", id)`` and ``("exec", bytes)`` records) and
    ``Client.deserialize_executable(bytes, devices, compile_options)``, whose
    compile options carry the new device assignment (jax 0.10).
    """

    def __init__(self, file: Any, source_ids: Sequence[int], target: Sequence[Any]) -> None:
        backend = target[0].client
        super().__init__(file, backend, list(target))
        self.by_source_id = dict(zip(source_ids, target, strict=True))
        self.options = compile_options_for_devices(target)

    def persistent_load(self, pid: Any) -> Any:
        if pid[0] == "device":
            return self.by_source_id[pid[1]]
        if pid[0] == "exec":
            return self.backend.deserialize_executable(pid[1], self.execution_devices, self.options)
        return super().persistent_load(pid)
