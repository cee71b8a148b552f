"""A step's executables kept across processes, under what the step is.

With JAX's persistent compilation cache on, a later process still traces and
lowers every stage program of a step before the cache can answer for it (the
cache is keyed by the lowered module). On a step of a small model that Python
work is most of the first step. This store skips it: once a step's programs
are compiled, their executables are written in one file of the cache
directory (``nnx_mpmd_steps/``), under the text of everything the step's
programs are made from (`step_key`):

* the traced step itself (`nnx_mpmd.aot.fingerprint`, which refuses
  what it cannot write down completely: then nothing is stored);
* the instruction list the passes made of it;
* each input's shape, dtype and placement; the submeshes' devices, axis names,
  sizes and types; the schedule, the number of microbatches, the batch axis;
* the versions of Python, JAX, jaxlib, Flax, optax and NumPy, the bytes of
  nnx_mpmd's own sources, the backend, ``XLA_FLAGS`` and JAX's configuration.

A later process whose step has the same key loads those executables for its
calls (`load_step`) and compiles nothing; every call still checks that its
arguments have the types the executable was compiled for, and calls with
others compile as usual (`nnx_mpmd.aot.program_sharing.SharedProgram`).

A step is stored only if every executable of it can be serialized: compiled
by XLA in this process, or loaded from an executable kept on its own
(`nnx_mpmd.aot.program_sharing.recall`, which writing a step fills); one
that JAX's own cache loaded cannot be serialized again. So a run whose step
changed (a new learning rate, a new nnx_mpmd) stores it as soon as its
unchanged programs come from those kept ones. Only single-process steps are
stored, and only on the platforms of
`nnx_mpmd.aot.program_sharing.SHARED_PLATFORMS`. Set `ENABLED` to False,
or turn the compilation cache off, to do without it.

Example:
  >>> import jax
  >>> jax.config.jax_enable_compilation_cache in (True, False)
  True
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import pickle
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax

from nnx_mpmd._jax_compat import config_value
from nnx_mpmd.aot import program_sharing
from nnx_mpmd.aot.compile_cache import safe_to_load
from nnx_mpmd.aot.fingerprint import jaxpr_fingerprint, value_fingerprint
from nnx_mpmd.compiler.ir import format_instructions
from nnx_mpmd.placement.abstract import PlacedAval, placed_aval

__all__ = [
    "ENABLED",
    "MAX_STORED_BYTES",
    "StepSources",
    "load_step",
    "lookup",
    "step_key",
    "store_step",
    "stored_program",
]

#: Whether steps are stored and loaded at all (the test suite turns it off).
ENABLED = True

#: The stored steps of one cache directory take at most this many bytes: writing
#: a step deletes the least recently used others beyond it.
MAX_STORED_BYTES = 1 << 30

#: The folder of the compilation cache directory that holds the stored steps.
_STORE_FOLDER = "nnx_mpmd_steps"

_FORMAT = 1

# Loading GPT tiny's 24 stored executables took 0.33 s one after the other and
# 0.24 s four at a time (2 cores); 8 at a time was no faster.
_LOAD_THREADS = 4

# JAX options that cannot change a compiled program (where caches and logs go).
_IGNORED_OPTIONS = (
    "compilation_cache",
    "persistent_cache",
    "log",
    "dump",
    "transfer_socket",
    "transport_addresses",
    "timeout",
)

#: How a stored program is made again: ``(serialize, target mesh)``, by ``id`` of
#: the executable (`nnx_mpmd.aot.compile_jobs.ProgramCompiler.sources`).
StepSources = dict[int, tuple[Callable[[], Any], Any]]


def _directory() -> pathlib.Path | None:
    directory = config_value("jax_compilation_cache_dir")
    if not ENABLED or not directory or not config_value("jax_enable_compilation_cache"):
        return None
    if jax.process_count() > 1:
        return None
    return pathlib.Path(directory) / _STORE_FOLDER


def step_key(
    compiled: Any,
    inputs: Sequence[Any],
    mesh: Any,
    schedule: Any,
    num_microbatches: int,
) -> str | None:
    """The hex key ``compiled``'s programs are stored under, or None (not stored).

    None when the store is off (no compile cache, several processes, another platform)
    or some part cannot be written down completely (`nnx_mpmd.aot.fingerprint`).

    Example:
      >>> step_key(None, [], None, None, 1) is None  # nothing compiled: no key
      True
    """
    if _directory() is None or compiled is None or getattr(compiled, "jaxpr", None) is None:
        return None
    submeshes = list(mesh.submeshes)
    if any(m.devices.flat[0].platform not in program_sharing.SHARED_PLATFORMS for m in submeshes):
        return None
    step = jaxpr_fingerprint(compiled.jaxpr)
    if step is None:
        return None
    try:
        avals = [(x if isinstance(x, PlacedAval) else placed_aval(x, mesh)).key() for x in inputs]
    except Exception:
        return None
    rest = value_fingerprint(
        (
            _FORMAT,
            _library_text(),
            program_sharing.backend_environment(),
            _options(),
            submeshes,
            schedule,
            num_microbatches,
            compiled.batch_axis,
            avals,
            format_instructions(compiled.instructions),
        )
    )
    if rest is None:
        return None
    digest = hashlib.sha256(rest.encode())
    digest.update(step.encode())
    return digest.hexdigest()


def lookup(
    compiled: Any, inputs: Sequence[Any], mesh: Any, schedule: Any, num_microbatches: int
) -> tuple[str | None, dict[str, list[Any]] | None]:
    """``(step_key, load_step's executables)`` of a step; either may be None.

    Example:
      >>> lookup(None, [], None, None, 1)
      (None, None)
    """
    key = step_key(compiled, inputs, mesh, schedule, num_microbatches)
    return key, (load_step(key, list(mesh.submeshes)) if key is not None else None)


def stored_program(fn: Callable[..., Any], stored: dict[str, list[Any]], name: str) -> Any:
    """A `program_sharing.SharedProgram` for stored program ``name``, else ``fn`` itself.

    Example:
      >>> stored_program(abs, {}, "F0") is abs
      True
    """
    found = stored.get(name)
    return program_sharing.SharedProgram(fn, found) if found else fn


def load_step(key: str, submeshes: Sequence[Any]) -> dict[str, list[Any]] | None:
    """``{program name: [executables]}`` stored under ``key``, loaded on their submeshes, or None.

    Example:
      >>> load_step("0" * 64, []) is None
      True
    """
    directory = _directory()
    path = directory / f"{key}.pkl" if directory is not None else None
    if path is None or not path.is_file() or not safe_to_load(path):
        return None
    try:
        os.utime(path)  # recently used: evicted last
        version, stored_key, entries = pickle.loads(path.read_bytes())
        if version != _FORMAT or stored_key != key:
            return None
        by_devices = {tuple(d.id for d in m.devices.flat): m for m in submeshes}
        targets = [by_devices[tuple(target_ids)] for _, _, target_ids in entries]
        # XLA's threads do most of the loading: a few at once overlap.
        with ThreadPoolExecutor(max_workers=_LOAD_THREADS) as pool:
            executables = list(
                pool.map(program_sharing.load_serialized, [e for _, e, _ in entries], targets)
            )
    except Exception:  # an optimisation only: the step compiles as usual
        return None
    loaded: dict[str, list[Any]] = {}
    for (name, _, _), executable in zip(entries, executables, strict=True):
        loaded.setdefault(name, []).append(executable)
    return loaded


def store_step(
    key: str, executables: dict[str, list[Any]], sources: StepSources
) -> threading.Thread | None:
    """Writes ``executables`` under ``key`` in a started non-daemon thread; None if not all can be.

    ``sources`` says how to serialize each by ``id`` (a program JAX's cache loaded has none).

    Example:
      >>> store_step("0" * 64, {"F0": [object()]}, {}) is None  # no source: not stored
      True
    """
    directory = _directory()
    if directory is None or not executables:
        return None
    plan = []
    for name, programs in executables.items():
        for compiled in programs:
            source = sources.get(id(compiled))
            if source is None:
                return None
            serialize, target = source
            plan.append((name, serialize, tuple(d.id for d in target.devices.flat)))

    def write() -> None:
        try:
            entries = []
            for name, serialize, target_ids in plan:
                executable = serialize()
                if executable is None:
                    return
                entries.append((name, executable, target_ids))
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            path = directory / f"{key}.pkl"
            program_sharing.write_whole(path, pickle.dumps((_FORMAT, key, entries)))
            _evict(directory, MAX_STORED_BYTES)
        except Exception:  # an optimisation only
            pass

    thread = threading.Thread(target=write, name="nnx-mpmd-store-step")
    thread.start()
    return thread


def _evict(directory: pathlib.Path, limit: int) -> None:
    """Deletes the least recently used stored steps until they take at most ``limit`` bytes."""
    entries = []
    for path in directory.glob("*.pkl"):
        try:
            stat = path.stat()
        except OSError:  # deleted meanwhile by another process
            continue
        entries.append((stat.st_mtime, stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= limit:
            break
        path.unlink(missing_ok=True)
        total -= size


@functools.cache
def _library_text() -> str:
    """Versions of the libraries above JAX, and a digest of nnx_mpmd's own sources."""
    import flax
    import numpy
    import optax

    sources = hashlib.sha256()
    root = pathlib.Path(__file__).resolve().parents[1]  # the nnx_mpmd package
    for path in sorted(root.rglob("*.py")):
        sources.update(str(path.relative_to(root)).encode())
        sources.update(path.read_bytes())
    versions = (flax.__version__, optax.__version__, numpy.__version__)
    return f"{sys.version} {versions} nnx_mpmd {sources.hexdigest()}"


def _options() -> tuple[tuple[str, Any], ...]:
    """JAX's configuration, but for where caches and logs go."""
    return tuple(
        (name, value)
        for name, value in sorted(jax.config.values.items())
        if isinstance(value, bool | int | float | str | type(None))
        and not any(word in name for word in _IGNORED_OPTIONS)
    )
