"""Compiling each distinct program once: one XLA executable loaded on several submeshes.

A pipeline's middle stages are often the same code on equal-shaped submeshes
(the transformer blocks of stages 1 and 2, the virtual stages of an
interleaved schedule, the optimizer update of equal stages). ``jax.jit``
compiles each of them separately, since their device assignments differ.
Their lowered modules are identical except for the module's name
(``jit_F1``, ``jit_F2``): shardings in a module name devices by their position
in the device assignment, never by id. This module compiles the first one and
loads XLA's executable again for the other submesh's devices, in the same
positions (device ``k`` of one submesh's flattened device order takes the
place of device ``k`` of the other's).

Only an executable that XLA compiled is loaded again: one that JAX's
persistent compilation cache loaded is not serialized a second time
(`compile_fresh`). The fresh one is kept for later steps of the process
(`keep_fresh`: a weak reference, serialized only when `recall` asks; then
`remember` holds the bytes), so that a later step loads it for its own
submesh instead of compiling the same module again, and, with the persistent
cache on, in its directory (``nnx_mpmd_shared/``) for later processes; equals
with nothing kept compile.

Programs share an executable only when everything XLA compiles is the same:
the key is the whole lowered StableHLO text with the module's name removed
(compared as text, not as a hash), together with the submesh's axis names,
sizes and types and its platform; and every argument and result sharding of
the executable must be a ``NamedSharding`` on exactly the program's own
submesh, so that the devices it runs on are known. Anything else compiles as
usual.

Example:
  >>> share_key("module @jit_F1 attributes {}\\n", None) is None  # no submesh: never shared
  True
"""

from __future__ import annotations

import collections
import hashlib
import io
import operator
import os
import pathlib
import pickle
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import jax
from jax.experimental import serialize_executable
from jax.sharding import Mesh, NamedSharding

from nnx_mpmd._jax_compat import (
    RemappingUnpickler,
    argument_aval,
    config_value,
    has_host_callbacks,
    kept_arguments,
)
from nnx_mpmd.aot.compile_cache import safe_to_load
from nnx_mpmd.compiler.codegen import compile_program
from nnx_mpmd.errors import CompileError

__all__ = [
    "SHARED_PLATFORMS",
    "Serialized",
    "backend_environment",
    "SharedProgram",
    "compile_fresh",
    "forget_kept",
    "interface_key",
    "keep_fresh",
    "load_for_devices",
    "load_serialized",
    "normal_sharding",
    "recall",
    "recall_in_process",
    "remember",
    "runs_on",
    "same_devices",
    "serialized",
    "share_key",
    "write_whole",
]

#: Platforms whose executables are loaded on other devices. Others compile every
#: program: loading with a new device assignment is verified on CPU only.
SHARED_PLATFORMS = frozenset({"cpu"})

_HEADER = "module @"


def share_key(
    text: str, mesh: Mesh | None, interface: tuple[Any, ...] = ()
) -> tuple[Any, ...] | None:
    """The key under which a program's executable is shared, or None (never shared).

    ``interface`` (`interface_key`) is part of it: one text can read different arguments.
    None for no mesh, a platform not in `SHARED_PLATFORMS`, or no module header.

    Example:
      >>> import jax
      >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
      >>> a = share_key("module @jit_F1 attributes {x}\\n  body\\n", mesh)
      >>> a == share_key("module @jit_F2 attributes {x}\\n  body\\n", mesh)
      True
      >>> a == share_key("module @jit_F2 attributes {y}\\n  body\\n", mesh)
      False
    """
    if mesh is None or not text.startswith(_HEADER):
        return None
    platform = mesh.devices.flat[0].platform
    if platform not in SHARED_PLATFORMS:
        return None
    header, newline, body = text.partition("\n")
    name, space, attributes = header[len(_HEADER) :].partition(" ")
    if not name or not space:
        return None
    return (
        platform,
        tuple(mesh.axis_names),
        tuple(mesh.devices.shape),
        tuple(str(t) for t in mesh.axis_types),
        attributes + newline + body,
        interface,
    )


def interface_key(lowered: Any) -> tuple[Any, ...]:
    """A lowered program's arguments as a key: their tree, types, donation and read positions.

    Modules equal only because they drop different unread arguments get different keys;
    a program with Python callbacks equals no other.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> f = jax.jit(lambda x, unused: x + 1)
      >>> a = interface_key(f.trace(jnp.ones(2), ()).lower())
      >>> a == interface_key(f.trace(jnp.ones(2), (jnp.ones(3),)).lower())
      False
      >>> first = jax.jit(lambda x, y: x * 2).trace(jnp.ones(2), jnp.ones(2)).lower()
      >>> second = jax.jit(lambda x, y: y * 2).trace(jnp.ones(2), jnp.ones(2)).lower()
      >>> first.as_text() == second.as_text(), interface_key(first) == interface_key(second)
      (True, False)
      >>> import numpy as np
      >>> called = jax.jit(lambda x: x + jax.pure_callback(
      ...     lambda: np.float32(1), jax.ShapeDtypeStruct((), jnp.float32)))
      >>> lowered = called.trace(jnp.ones(2)).lower()
      >>> interface_key(lowered) == interface_key(lowered)  # never shared
      False
    """
    leaves = []
    for info in jax.tree.leaves(lowered.args_info):
        aval = argument_aval(info)
        spec = getattr(getattr(aval, "sharding", None), "spec", None)
        leaves.append(
            (tuple(aval.shape), str(aval.dtype), bool(aval.weak_type), str(spec), info.donated)
        )
    kept = kept_arguments(lowered)
    # Unknown read positions, or Python callbacks (named by index in the text): a
    # key of its own (never shared) rather than a guess.
    if kept is None or has_host_callbacks(lowered) is not False:
        return (str(lowered.in_tree), tuple(leaves), object())
    return (str(lowered.in_tree), tuple(leaves), kept)


def runs_on(compiled: jax.stages.Compiled, mesh: Mesh) -> bool:
    """Whether every argument and result of ``compiled`` is a NamedSharding on ``mesh``.

    Then ``mesh``'s flattened devices are the executable's, in order.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
      >>> x = jax.device_put(jnp.ones(2), NamedSharding(mesh, P()))
      >>> runs_on(jax.jit(lambda v: v + 1).lower(x).compile(), mesh)
      True
    """
    shardings = jax.tree.leaves(
        (compiled.input_shardings, compiled.output_shardings),
        is_leaf=lambda s: isinstance(s, jax.sharding.Sharding),
    )
    return bool(shardings) and all(
        isinstance(s, NamedSharding) and same_devices(cast(Mesh, s.mesh), mesh) for s in shardings
    )


def same_devices(a: Mesh, b: Mesh) -> bool:
    """Whether two meshes have the same devices in the same positions.

    Example:
      >>> import jax
      >>> a = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
      >>> same_devices(a, jax.make_mesh((1,), ("model",), devices=jax.devices()[:1]))
      True
    """
    return a.devices.shape == b.devices.shape and all(
        x.id == y.id for x, y in zip(a.devices.flat, b.devices.flat, strict=True)
    )


_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_hits = threading.local()
_listening = threading.Lock()
_listener_installed = False


def _on_event(event: str, **kwargs: Any) -> None:
    if event == _CACHE_HIT_EVENT:
        _hits.count = getattr(_hits, "count", 0) + 1


def compile_fresh(lowered: Any) -> tuple[jax.stages.Compiled, bool]:
    """`compile_program` of ``lowered``, and whether XLA compiled it here (not a persistent-cache hit).

    A persistent-cache hit loses its kernels when serialized again (CPU, jax 0.10).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> compiled, fresh = compile_fresh(jax.jit(lambda v: v - 1).lower(jnp.ones(5)))
      >>> isinstance(fresh, bool)
      True
    """
    global _listener_installed
    with _listening:
        if not _listener_installed:
            jax.monitoring.register_event_listener(_on_event)
            _listener_installed = True
    before = getattr(_hits, "count", 0)
    compiled = compile_program(lowered)
    return compiled, getattr(_hits, "count", 0) == before


class Serialized(NamedTuple):
    """An executable serialized with the ids of the devices it was compiled for."""

    payload: bytes
    in_tree: Any
    out_tree: Any
    source_ids: tuple[int, ...]


def serialized(compiled: jax.stages.Compiled, source: Mesh) -> Serialized:
    """``compiled`` (fresh from XLA, running on ``source``) as bytes to load elsewhere.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
      >>> x = jax.device_put(jnp.ones(2), NamedSharding(mesh, P()))
      >>> serialized(jax.jit(lambda v: v + 1).lower(x).compile(), mesh).source_ids
      (0,)
    """
    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    return Serialized(payload, in_tree, out_tree, tuple(d.id for d in source.devices.flat))


def load_serialized(executable: Serialized, target: Mesh) -> jax.stages.Compiled:
    """Loads a `Serialized` executable on ``target``'s devices, position by position.

    Raises:
      CompileError: ``target`` has another number of devices than the source.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> a, b = (jax.make_mesh((1,), ("data",), devices=[d]) for d in jax.devices()[:2])
      >>> on = lambda m: jax.device_put(jnp.ones(2), NamedSharding(m, P()))
      >>> moved = load_serialized(serialized(jax.jit(lambda v: v + 1).lower(on(a)).compile(), a), b)
      >>> moved(on(b)).sharding.mesh.devices.tolist() == b.devices.tolist()
      True
    """
    targets = list(target.devices.flat)
    if len(targets) != len(executable.source_ids):
        raise CompileError(
            f"cannot load a program compiled for {len(executable.source_ids)} devices on "
            f"{target} ({len(targets)} devices); compile it for that submesh instead."
        )
    unpickler = RemappingUnpickler(io.BytesIO(executable.payload), executable.source_ids, targets)
    unloaded, args_info_flat, no_kwargs = unpickler.load()
    return jax.stages.Compiled(
        unloaded.load(),
        [],
        executable.in_tree.unflatten(args_info_flat),
        executable.out_tree,
        no_kwargs=no_kwargs,
    )


def load_for_devices(
    compiled: jax.stages.Compiled, source: Mesh, target: Mesh
) -> jax.stages.Compiled:
    """``compiled`` (fresh from XLA, `runs_on` ``source``) loaded to run on equal-shaped ``target``.

    Raises:
      CompileError: the submeshes differ in axis names, sizes or types.
      ValueError: the executable cannot be serialized (it closes over constants).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> a, b = (jax.make_mesh((2,), ("data",), devices=jax.devices()[i:i + 2]) for i in (0, 2))
      >>> on = lambda m: jax.device_put(jnp.arange(4.0), NamedSharding(m, P("data")))
      >>> compiled = jax.jit(lambda v: v * 2).lower(on(a)).compile()
      >>> moved = load_for_devices(compiled, a, b)
      >>> y = moved(on(b))
      >>> [int(v) for v in y], y.sharding.mesh.devices.tolist() == b.devices.tolist()
      ([0, 2, 4, 6], True)
    """
    if (
        source.axis_names != target.axis_names
        or source.devices.shape != target.devices.shape
        or source.axis_types != target.axis_types
    ):
        raise CompileError(
            f"cannot load a program compiled for {source} on {target}: the submeshes "
            "differ in axis names, sizes or types; compile it for that submesh instead."
        )
    return load_serialized(serialized(compiled, source), target)


#: Fresh executables of this process by `share_key`, so that a later step whose
#: own copy came from JAX's persistent cache can still load its equals.
_REMEMBERED: collections.OrderedDict[Any, Serialized] = collections.OrderedDict()
_REMEMBERED_MAX = 256
_remembering = threading.Lock()


def remember(key: Any, executable: Serialized) -> None:
    """Keeps ``executable`` for `recall` ``(key)`` (the most recent 256 keys).

    With JAX's persistent compilation cache on, it is also written next to it
    (``<cache dir>/nnx_mpmd_shared/``), so that a later process whose copy of
    the module comes from that cache can load its equals too.

    Example:
      >>> remember(("example",), Serialized(b"", None, None, (0,)))
      >>> recall(("example",)).source_ids
      (0,)
    """
    with _remembering:
        _REMEMBERED[key] = executable
        _REMEMBERED.move_to_end(key)
        while len(_REMEMBERED) > _REMEMBERED_MAX:
            _REMEMBERED.popitem(last=False)
    path = _stored_path(key)
    if path is not None:
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_whole(path, pickle.dumps((_full_key(key), executable)))
        except Exception:  # an optimisation only: this process has it in memory
            pass


#: Fresh executables of this process by `share_key`, held weakly (a step that is
#: dropped takes its executables with it): `recall` serializes one when asked.
_FRESH: collections.OrderedDict[Any, tuple[weakref.ref, Mesh]] = collections.OrderedDict()


def keep_fresh(key: Any, compiled: jax.stages.Compiled, source: Mesh) -> None:
    """Notes ``compiled``, fresh from XLA for ``source``, as `recall` ``(key)``'s source.

    Only a weak reference is kept, and nothing is serialized until `recall` asks.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
      >>> x = jax.device_put(jnp.ones(2), NamedSharding(mesh, P()))
      >>> compiled, fresh = compile_fresh(jax.jit(lambda v: v * 3.25 - 0.5).lower(x))
      >>> keep_fresh(("kept example",), compiled, mesh)
      >>> kept = recall_in_process(("kept example",))
      >>> kept.source_ids if fresh else (0,)  # JAX's disk cache may have held it: not kept
      (0,)
    """
    with _remembering:
        _FRESH[key] = (weakref.ref(compiled), source)
        _FRESH.move_to_end(key)
        while len(_FRESH) > _REMEMBERED_MAX:
            _FRESH.popitem(last=False)


def recall_in_process(key: Any) -> Serialized | None:
    """The executable this process kept for ``key`` (`remember`, `keep_fresh`), or None.

    Example:
      >>> recall_in_process(("never kept",)) is None
      True
    """
    with _remembering:
        found = _REMEMBERED.get(key)
        fresh = _FRESH.get(key)
    if found is not None:
        return found
    compiled = fresh[0]() if fresh is not None else None
    if compiled is None or fresh is None:  # fresh is None: compiled is too
        return None
    try:
        executable = serialized(compiled, fresh[1])
    except Exception:  # an optimisation only: the caller compiles instead
        return None
    remember(key, executable)
    return executable


def forget_kept() -> None:
    """Drops what this process kept for `recall` (the cache directory's copies stay).

    Example:
      >>> remember(("forgotten",), Serialized(b"", None, None, (0,)))
      >>> forget_kept()
      >>> recall_in_process(("forgotten",)) is None
      True
    """
    with _remembering:
        _REMEMBERED.clear()
        _FRESH.clear()


def recall(key: Any) -> Serialized | None:
    """The executable kept for ``key`` (`remember`, `keep_fresh`, the cache directory), or None."""
    found = recall_in_process(key)
    if found is not None:
        return found
    path = _stored_path(key)
    if path is None or not path.is_file() or not safe_to_load(path):
        return None
    try:
        stored_key, executable = pickle.loads(path.read_bytes())
    except Exception:
        return None
    if stored_key != _full_key(key):  # the whole key, text included, not its hash alone
        return None
    with _remembering:
        _REMEMBERED[key] = executable
    return executable


def _full_key(key: Any) -> tuple[Any, ...]:
    """``key`` with what else decides the executable (`backend_environment`)."""
    return (key, *backend_environment())


def backend_environment() -> tuple[str, ...]:
    """What decides an executable besides its module: versions, platform, XLA_FLAGS.

    Example:
      >>> len(backend_environment())
      5
    """
    import jaxlib

    backend = jax.devices()[0].client
    return (
        jax.__version__,
        jaxlib.__version__,  # pyright: ignore[reportPrivateImportUsage]: public, not in __all__
        backend.platform,
        backend.platform_version,
        os.environ.get("XLA_FLAGS", ""),
    )


def write_whole(path: pathlib.Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` so that readers see the old file or the whole new one.

    Example:
      >>> import pathlib, tempfile
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "entry.pkl"
      >>> write_whole(path, b"abc"); path.read_bytes()
      b'abc'
    """
    partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    partial.write_bytes(data)
    os.replace(partial, path)


#: The folder of the cache directory that `remember` stores executables in.
_STORE_FOLDER = "nnx_mpmd_shared"


def _stored_path(key: Any) -> pathlib.Path | None:
    """Where `remember` stores ``key``'s executable, or None (no persistent cache)."""
    directory = config_value("jax_compilation_cache_dir")
    if not directory or not config_value("jax_enable_compilation_cache") or jax.process_count() > 1:
        return None
    digest = hashlib.sha256(repr(_full_key(key)).encode()).hexdigest()
    return pathlib.Path(directory) / _STORE_FOLDER / f"{digest}.pkl"


_SHARDING = operator.attrgetter("sharding")


class SharedProgram:
    """A program's callable that runs executables loaded from another submesh's program.

    Calls go to the first executable compiled for the call's argument types
    (on Explicit axes a PartitionSpec is part of the type; up to trailing
    Nones) and shardings (equivalent ones such as ``P()`` and ``P(None,
    None)`` match), which is tried first next time; calls that match none go
    to the program's own ``jit`` function, which compiles for them as usual.

    Args:
      fn: the program's jitted function.
      loaded: executables for this program's submesh: compiled for it, or
        loaded from an equal program's (`load_for_devices`).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> fn = jax.jit(lambda v: v + 1)
      >>> shared = SharedProgram(fn, [fn.lower(jnp.ones(3)).compile()])
      >>> [float(v) for v in shared(jnp.ones(2))]  # no executable for 2 elements: fn runs
      [2.0, 2.0]
      >>> [float(v) for v in shared(jnp.zeros(3))]
      [1.0, 1.0, 1.0]
    """

    def __init__(self, fn: Callable[..., Any], loaded: Sequence[jax.stages.Compiled]) -> None:
        self.fn = fn
        self.loaded = list(loaded)
        self._expected = [_argument_types(executable) for executable in self.loaded]
        self._chosen: dict[tuple[Any, ...], Callable[..., Any]] = {}

    def __call__(self, *args: Any) -> Any:
        leaves = jax.tree.leaves(args)
        try:  # every leaf an array: one C-level map (this runs once per task)
            key = tuple(map(_SHARDING, leaves))
        except AttributeError:
            key = tuple(getattr(a, "sharding", None) for a in leaves)
        run = self._chosen.get(key)
        if run is None:
            run = self._chosen[key] = self._choose(key)
        return run(*args)

    def _choose(self, shardings: tuple[Any, ...]) -> Callable[..., Any]:
        # XLA accepts an argument whose sharding is equivalent as a device layout
        # (P("data", "model") for P("data", None) when "model" has size 1), but the
        # executable's results would then carry the other Explicit type. Only an
        # executable compiled for the same types (its typed input avals, unused
        # arguments included) is used.
        actual = [normal_sharding(s) for s in shardings]
        for executable, expected in zip(self.loaded, self._expected, strict=True):
            if expected is not None and _same_types(actual, expected):
                return _checked(executable, self.fn)
        return self.fn

    def __repr__(self) -> str:
        return f"SharedProgram({self.fn!r}, {len(self.loaded)} loaded)"


def _argument_types(executable: Any) -> tuple[Any, ...] | None:
    """Each argument's type as compiled: its Explicit spec, or its sharding on Auto axes.

    ``input_shardings`` leaves out arguments the program does not read, so
    the types come from ``in_avals`` (Explicit parts of the spec), and the
    layout from ``input_shardings`` where the mesh has Auto axes.
    """
    in_avals = getattr(executable, "in_avals", None)
    shardings = getattr(executable, "input_shardings", None)
    if not in_avals or not shardings:
        return None
    avals = jax.tree.leaves(in_avals[0])
    layouts = jax.tree.leaves(shardings[0], is_leaf=lambda x: x is None)
    if len(avals) != len(layouts):
        return None
    return tuple(
        (_typed_spec(aval), normal_sharding(layout) if layout is not None else None)
        for aval, layout in zip(avals, layouts, strict=True)
    )


def _typed_spec(aval: Any) -> Any:
    sharding = getattr(aval, "sharding", None)
    if not isinstance(sharding, NamedSharding) or not _has_explicit_axes(sharding.mesh):
        return None
    return normal_sharding(sharding)[1:4]


def _has_explicit_axes(mesh: Any) -> bool:
    return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def _explicit_spec(normal: Any) -> Any:
    """The Explicit part of a normalized concrete sharding (see `_normal_spec`)."""
    mesh, parts, unreduced, reduced, _ = normal
    explicit = {
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types)
        if kind == jax.sharding.AxisType.Explicit
    }
    if not explicit:
        return None
    kept = []
    for part in parts:
        names = tuple(n for n in (part if isinstance(part, tuple) else (part,)) if n in explicit)
        kept.append(None if not names else names[0] if len(names) == 1 else names)
    while kept and kept[-1] is None:
        kept.pop()
    return (tuple(kept), unreduced, reduced)


def normal_sharding(sharding: Any) -> Any:
    """A key of ``sharding`` that equivalent specs share (trailing Nones dropped); others as is.

    ``P()`` and ``P(None, None)`` give one key: `SharedProgram` runs an executable
    compiled for either on both, so `nnx_mpmd.aot.compile_jobs` compiles one of them.

    Example:
      >>> import jax
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
      >>> keys = [normal_sharding(NamedSharding(mesh, s)) for s in (P(), P(None, None), P("data"))]
      >>> keys[0] == keys[1], keys[0] == keys[2]
      (True, False)
    """
    if not isinstance(sharding, NamedSharding):
        return sharding
    parts = list(sharding.spec.partitions)
    while parts and parts[-1] is None:
        parts.pop()
    spec = sharding.spec
    return (sharding.mesh, tuple(parts), spec.unreduced, spec.reduced, sharding.memory_kind)


def _same_types(actual: Sequence[Any], expected: Sequence[Any]) -> bool:
    if len(actual) != len(expected):
        return False
    for a, (typed, layout) in zip(actual, expected):
        if a is None:  # a host value: the executable checks its type itself
            continue
        is_named = isinstance(a, tuple) and len(a) == 5
        if typed is not None and (not is_named or _explicit_spec(a) != typed):
            return False
        if layout is not None and a != layout:
            return False
    return True


def _checked(executable: Any, fallback: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        try:
            return executable(*args)
        except (TypeError, ValueError):  # another shape or dtype: checked before running
            return fallback(*args)

    return run
