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

Multi-process runs share one directory safely: JAX writes cache entries from
process 0 only, and every process reads them (a process whose read fails,
say an entry still being written, compiles instead). Each process must still
call `enable_compile_cache` itself, before its first compilation.
"""

from __future__ import annotations

import os
import pathlib

import jax

__all__ = ["ENV_VAR", "default_cache_dir", "enable_compile_cache"]

#: The environment variable that names the cache directory.
ENV_VAR = "NNX_MPMD_COMPILE_CACHE"


def default_cache_dir() -> pathlib.Path:
    """The cache directory used when none is given.

    Returns:
      ``$NNX_MPMD_COMPILE_CACHE`` (unless it is ``off``), else
      ``$XDG_CACHE_HOME/nnx_mpmd/jax``, else ``~/.cache/nnx_mpmd/jax``.

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
    configured = jax.config.jax_compilation_cache_dir
    if configured:
        return pathlib.Path(configured)
    if directory is None and os.environ.get(ENV_VAR, "").strip().lower() == "off":
        return None
    path = pathlib.Path(directory) if directory is not None else default_cache_dir()
    path = path.expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path
