"""JAX's persistent compilation cache, as ``nnx-mpmd train``, the examples and ``make demo`` use it.

Time to first step is mostly XLA compilation. With the cache on, a process
that compiles a program another process (an earlier run, a resumed run)
already compiled loads the executable from disk instead. `enable_compile_cache`
turns it on for this process:

* the directory is ``$NNX_MPMD_COMPILE_CACHE`` if set (``off`` turns the
  cache off), else
  ``$XDG_CACHE_HOME/nnx_mpmd/jax`` (``~/.cache/nnx_mpmd/jax``): one cache for
  every run of this user, so a second run of the same configuration starts
  warm (a directory under each run's folder would only help resumed runs);
* every program is cached, however fast it compiled (JAX's default skips
  programs that compile in under a second, which on CPU is most of them);
* a cache that the environment or the caller already configured
  (``JAX_COMPILATION_CACHE_DIR``, ``jax.config``) is left as it is.

The cache must be trusted like code: loading an entry runs what it holds
(the step store, `nnx_mpmd.aot.step_store`, unpickles its files), so
whoever can write the directory can run code in your next run.
`enable_compile_cache` creates the directory readable by its owner only
(mode 0700) and refuses one that another user owns or that the group or
others may write (`check_cache_dir`).

Multi-process runs share one directory safely: JAX writes cache entries from
process 0 only, and every process reads them (a process whose read fails,
say an entry still being written, compiles instead). Each process must still
call `enable_compile_cache` itself, before its first compilation.
"""

from __future__ import annotations

import os
import pathlib
import stat

import jax

from nnx_mpmd._jax_compat import config_value
from nnx_mpmd.errors import CompileError

__all__ = [
    "ENV_VAR",
    "check_cache_dir",
    "default_cache_dir",
    "enable_compile_cache",
    "safe_to_load",
    "untrusted",
]

#: The environment variable that names the cache directory.
ENV_VAR = "NNX_MPMD_COMPILE_CACHE"


def default_cache_dir() -> pathlib.Path:
    """The cache directory used when none is given.

    ``$NNX_MPMD_COMPILE_CACHE`` (unless ``off``), else ``$XDG_CACHE_HOME/nnx_mpmd/jax``,
    else ``~/.cache/nnx_mpmd/jax``.

    Example:
      >>> default_cache_dir().name
      'jax'
    """
    named = os.environ.get(ENV_VAR, "").strip()
    if named and named.lower() != "off":
        return pathlib.Path(named).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return pathlib.Path(base).expanduser() / "nnx_mpmd" / "jax"


def enable_compile_cache(
    directory: str | os.PathLike[str] | None = None,
) -> pathlib.Path | None:
    """Turns on JAX's persistent compilation cache for this process.

    Call it before the first compilation (JAX reads the setting once).

    Args:
      directory: where executables are stored (default: `default_cache_dir`).
        Ignored when a cache directory is already configured.

    Returns:
      The cache directory in use; None when ``directory`` is None and
      ``$NNX_MPMD_COMPILE_CACHE`` is ``off`` (nothing is changed then).

    Example:
      >>> import jax, tempfile
      >>> before = jax.config.jax_compilation_cache_dir
      >>> path = enable_compile_cache(tempfile.mkdtemp())
      >>> path.is_dir()
      True
      >>> jax.config.update("jax_compilation_cache_dir", before)  # the tests' own cache
    """
    configured = config_value("jax_compilation_cache_dir")
    if configured:
        return pathlib.Path(configured)
    if directory is None and os.environ.get(ENV_VAR, "").strip().lower() == "off":
        return None
    path = pathlib.Path(directory) if directory is not None else default_cache_dir()
    path = check_cache_dir(path.expanduser())
    jax.config.update("jax_compilation_cache_dir", str(path))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def untrusted(path: pathlib.Path) -> str | None:
    """Why loading from ``path`` could run code another user planted; None if it could not.

    Example:
      >>> import tempfile
      >>> untrusted(pathlib.Path(tempfile.mkdtemp())) is None
      True
    """
    info = path.stat()
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return f"it belongs to user id {info.st_uid}, not to you (user id {os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"its group or other users may write it (mode {stat.filemode(info.st_mode)})"
    return None


def safe_to_load(entry: pathlib.Path) -> bool:
    """Whether ``entry`` (``DIR/folder/entry``), its folder and ``DIR`` are this user's alone.

    Entries are unpickled (which runs code), so nobody else may be able to plant one.

    Example:
      >>> import tempfile
      >>> entry = pathlib.Path(tempfile.mkdtemp()) / "steps" / "x.pkl"
      >>> entry.parent.mkdir(); entry.write_bytes(b"")
      0
      >>> safe_to_load(entry)
      True
    """
    try:
        return all(untrusted(p) is None for p in (entry, entry.parent, entry.parent.parent))
    except OSError:
        return False


def check_cache_dir(path: pathlib.Path) -> pathlib.Path:
    """Creates the cache directory (mode 0700), or checks that an existing one is safe.

    Raises:
      CompileError: not a directory, not writable, another user's, or group/other-writable.

    Example:
      >>> import tempfile
      >>> path = check_cache_dir(pathlib.Path(tempfile.mkdtemp()) / "jax")
      >>> oct(path.stat().st_mode & 0o777)
      '0o700'
    """
    where = f"the compilation cache {path}"
    fix = "pass --compile-cache with a directory of your own, or --no-compile-cache"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        raise CompileError(f"{where} is not a directory; {fix}.") from None
    except OSError as e:
        raise CompileError(f"cannot create {where} ({e.strerror}); {fix}.") from None
    reason = untrusted(path)
    if reason is not None:
        raise CompileError(
            f"{where} is not safe to load programs from: {reason}, and a cached entry runs "
            f"as code. Run `chmod go-w {path}` if you own it and trust its contents, or {fix}."
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise CompileError(f"{where} is not writable by you; {fix}.")
    return path
