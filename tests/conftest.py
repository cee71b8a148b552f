"""Test set-up: 8 simulated CPU devices, configured before JAX starts."""

import atexit
import gc
import os
import shutil
import sys
import tempfile

# LLVM's O0 for XLA:CPU's generated code: compilation is most of this suite's time
# and O0 takes about a quarter off it. The HLO passes (fusion, sharding) are the
# same as at the default level; the results can differ from an O2 build in the
# last bits, which both sides of every comparison share since both are compiled
# here. Two examples (tests/integration/test_examples.py), the CLI runs that build their own
# environment and CI's plain-install run keep the default level, so equality at
# O2 stays checked too.
# A level already in XLA_FLAGS is kept (XLA_FLAGS=--xla_backend_optimization_level=2
# runs the suite at O2); 8 devices are always appended, as before.
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count=8" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if "--xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
# XLA:CPU's loop emitters (--xla_cpu_use_fusion_emitters=false): the suite in about 20%
# less CPU (the fusion emitters load every MLIR dialect into a new context per compile
# and spend about 10 ms per fusion). At b4975fe XLA segfaulted with them in concurrent
# compiles (tests/compiler + tests/aot in one process); since the first step stopped
# tracing and compiling equal programs twice, no run has. A value in XLA_FLAGS is kept.
# The runs named above that keep the default level get no flag either: there the
# nnx.jit references use the fusion emitters and nnx_mpmd's programs the loop emitters
# (its own choice on CPU, nnx_mpmd.compiler.codegen), so equality across the two is checked.
if "--xla_cpu_use_fusion_emitters" not in _flags:
    _flags += " --xla_cpu_use_fusion_emitters=false"
# One LLVM module per program (--xla_cpu_parallel_codegen_split_count=1), not XLA's
# split into parts compiled on a pool: each part builds its own target machine and
# round-trips through bitcode. On this suite's small O0 programs that is about a
# quarter less compile CPU, and the suite's two workers keep both cores busy anyway.
# Each kernel is its own function either way; only their grouping into modules
# differs. A value in XLA_FLAGS is kept.
if "--xla_cpu_parallel_codegen_split_count" not in _flags:
    _flags += " --xla_cpu_parallel_codegen_split_count=1"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Commands that tests start (nnx-mpmd train, examples) would otherwise write to
# ~/.cache/nnx_mpmd/jax; tests that check the cache turn it on explicitly.
os.environ.setdefault("NNX_MPMD_COMPILE_CACHE", "off")

# The tests live in folders that mirror the package (tests/jit/, tests/compiler/, ...);
# some import helpers from a test module of another folder (tests/compiler/test_overlap.py
# from tests/jit/test_jit_equivalence.py), so every folder is importable, as the flat
# tests/ was, whichever files a run collects. Helpers shared by all (pipeline_models.py,
# mp_launch.py, ...) stay in tests/ itself, which pytest puts on the path for this file.
_TESTS = os.path.dirname(os.path.abspath(__file__))
for _name in sorted(os.listdir(_TESTS)):
    _folder = os.path.join(_TESTS, _name)
    if not os.path.isdir(_folder) or _folder in sys.path:
        continue
    if any(f.startswith("test_") and f.endswith(".py") for f in os.listdir(_folder)):
        sys.path.append(_folder)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# One directory for this test run: the first process (pytest itself, or xdist's
# controller, which starts the workers after importing this file) makes it and
# removes it at exit; workers find it in the environment they inherit. It holds
# the compilation cache below and the results tests/shared_results.py computes
# once for all workers.
_run_dir = os.environ.get("NNX_MPMD_TEST_RUN_DIR", "")
if not os.path.isdir(_run_dir):
    _run_dir = tempfile.mkdtemp(prefix="nnx-mpmd-test-run-")
    os.environ["NNX_MPMD_TEST_RUN_DIR"] = _run_dir
    atexit.register(shutil.rmtree, _run_dir, ignore_errors=True)

# Many tests compile the same stage programs (the same model and schedule with a
# different optimizer, say). A compilation cache shared by this test run (and its
# xdist workers) turns those repeats into cache hits. A cache hit still counts as
# a compilation in nnx_mpmd.aot.stats, so recompilation tests stay exact.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = os.path.join(_run_dir, "jax-cache")
    # Private, as nnx_mpmd makes its own (stored steps load only from such a cache).
    os.makedirs(_cache_dir, mode=0o700, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", _cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # Not exported to subprocesses: two processes of one jax.distributed run that
    # share a persistent cache here deadlocked (tests/integration/test_multiprocess.py).


@pytest.fixture(autouse=True)
def _no_executables_kept_by_earlier_tests(monkeypatch):
    """Each test starts without the executables earlier tests' steps left for reuse.

    A step loads a module that an earlier step compiled (for any equal-shaped
    submesh: kept by its process, or stored in the cache directory) instead of
    compiling it; tests that count compilations must not depend on which tests
    ran before, in their worker or another. Each test stores in a folder of its own.
    """
    import uuid

    from nnx_mpmd.aot import program_sharing, step_store

    program_sharing.forget_kept()
    monkeypatch.setattr(program_sharing, "_STORE_FOLDER", f"nnx_mpmd_shared-{uuid.uuid4().hex}")
    # Whole steps are stored only where a test asks (tests/aot/test_step_store.py): a
    # step stored by an earlier test would compile nothing in a later one.
    monkeypatch.setattr(step_store, "ENABLED", False)


@pytest.fixture(autouse=True)
def _every_call_runs_an_executable_made_for_it(monkeypatch, request):
    """Fails a test in which a program call matched none of its ahead-of-time executables.

    Such a call falls back to the program's ``jit``, which compiles it again
    inside the step: a twin loaded with another program's arguments, or a type
    the ahead-of-time pass did not predict. Results stay right; the first step
    pays a compile. ``@pytest.mark.fallback_compiles`` allows it in a test.
    """
    from nnx_mpmd.aot import program_sharing

    missed = []
    choose = program_sharing.SharedProgram._choose

    def recording(self, shardings):
        run = choose(self, shardings)
        if run is self.fn:
            missed.append(str(self.fn))
        return run

    monkeypatch.setattr(program_sharing.SharedProgram, "_choose", recording)
    yield
    if missed and request.node.get_closest_marker("fallback_compiles") is None:
        pytest.fail(f"calls matched no executable compiled ahead of time for them: {missed}")


_CACHE_SETTINGS = (
    "jax_enable_compilation_cache",
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)


@pytest.fixture(autouse=True)
def _compile_cache_settings_restored():
    """An in-process ``nnx-mpmd train`` (``--no-compile-cache``, ``--compile-cache DIR``)
    sets JAX's persistent cache for the whole process; the tests after it get this run's
    settings back, or whether they hit the cache would depend on which tests ran before."""
    before = {name: getattr(jax.config, name) for name in _CACHE_SETTINGS}
    yield
    changed = {name: v for name, v in before.items() if getattr(jax.config, name) != v}
    if changed:
        from jax.experimental.compilation_cache import compilation_cache

        for name, value in changed.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


@pytest.fixture
def compiled_here():
    """XLA compiles in this process: JAX's persistent cache, which the test workers
    share, would otherwise hand out an executable another worker (or test) wrote.
    Such an executable cannot be serialized again (`program_sharing.compile_fresh`),
    so how many programs a step compiles would depend on which tests ran before."""
    from jax.experimental.compilation_cache import compilation_cache

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides once per process unless reset
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        compilation_cache.reset_cache()


def pytest_collection_finish(session):
    """Moves everything alive after collection (JAX, Flax, the test modules) out of the
    collector's reach: Python's full collections otherwise walk those millions of
    long-lived objects again and again. About 12% less CPU for the suite (measured on
    tests/aot/test_jit_compile.py + tests/placement/test_explicit_axes.py and
    tests/jit/test_losses.py + tests/compiler/test_overlap.py, alternated). Garbage
    made by the tests is collected as before, in rarer, larger young collections
    (20,000 new objects, not 700): tracing allocates objects by the million, and the
    full collections that many young ones trigger walk every object the tests' caches
    keep (tests/jit/test_jit_equivalence.py: 9.9 s of collection in 90 s, 6.1 s after)."""
    del session
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)


def pytest_collection_modifyitems(config, items):
    """Runs the longest tests (marked ``multiprocess`` or ``slow``) first.

    With xdist, a long test that starts last keeps one worker busy after the
    others have finished; started first, it runs beside the short ones.
    """
    del config

    def heavy(item):
        return item.get_closest_marker("multiprocess") or item.get_closest_marker("slow")

    items.sort(key=lambda item: 0 if heavy(item) else 1)
