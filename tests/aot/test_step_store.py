"""A step's executables stored under what the step is: a later step runs them untraced."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import threading

import jax
import numpy as np
import pytest
from flax import nnx
from mp_launch import codegen_flags
from pipeline_models import build, make_batch, make_mesh, params_of, train_step_fn

import nnx_mpmd as mp
from nnx_mpmd.aot import compile_jobs, step_store
from nnx_mpmd.aot.stats import count_compilations


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A fresh compilation cache directory of this test's own, with the step store on."""
    from jax.experimental.compilation_cache import compilation_cache

    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()
    monkeypatch.setattr(step_store, "ENABLED", True)
    try:
        yield tmp_path / step_store._STORE_FOLDER
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_enable_compilation_cache", before[1])
        compilation_cache.reset_cache()


def _stored_writes_done():
    for thread in threading.enumerate():
        if thread.name == "nnx-mpmd-store-step":
            thread.join(timeout=120)


def _counting_traces(monkeypatch):
    traced = []
    original = compile_jobs.ProgramCompiler._trace_and_compile

    def counted(self, fn, args, on_traced, name, *rest):
        traced.append(name)
        return original(self, fn, args, on_traced, name, *rest)

    monkeypatch.setattr(compile_jobs.ProgramCompiler, "_trace_and_compile", counted)
    return traced


CASES = {
    "1f1b-4": (mp.OneFOneB, 4, 2, 4),
    "interleaved-8": (mp.Interleaved1F1B, 8, 1, 4),
    "dualpipev-8": (mp.DualPipeV, 8, 1, 8),
}


def _step(schedule, num_stages, data, m, seed=0, axis_types=jax.sharding.AxisType.Auto):
    model, opt, loss_fn, kind = build("lm", "sgd", num_stages, seed=seed)
    step = mp.jit(
        train_step_fn(loss_fn),
        mesh=make_mesh(4, data, axis_types),
        schedule=schedule(),
        num_microbatches=m,
    )
    return model, opt, step, loss_fn, kind


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_stored_step_runs_untraced_and_equals_nnx_jit(case, store, monkeypatch):
    schedule, num_stages, data, m = CASES[case]
    model, opt, step, loss_fn, kind = _step(schedule, num_stages, data, m)
    batches = [make_batch(kind, 16, seed=s) for s in (0, 1)]
    first = [float(step(model, opt, b)) for b in batches]
    _stored_writes_done()
    assert len(list(store.glob("*.pkl"))) == 1

    # A new mp.jit of the same step (as a later process makes): nothing is
    # traced, lowered or compiled, and every number is the same.
    traced = _counting_traces(monkeypatch)
    again_model, again_opt, again, _, _ = _step(schedule, num_stages, data, m)
    with count_compilations() as compiled:
        losses = [float(again(again_model, again_opt, b)) for b in batches]
    assert traced == [] and compiled.count == 0
    assert losses == first
    for name, value in params_of(mp.gather(model)).items():  # bit for bit
        np.testing.assert_array_equal(params_of(mp.gather(again_model))[name], value, name)
    ref_model, ref_opt, _, _ = build("lm", "sgd", num_stages)
    ref_step = nnx.jit(train_step_fn(loss_fn, num_microbatches=m))
    want = [float(ref_step(ref_model, ref_opt, b)) for b in batches]
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    got, ref = params_of(mp.gather(again_model)), params_of(ref_model)
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], atol=1e-5, err_msg=name)


def _key(step, model, opt, batch):
    lowered = step.lower(model, opt, batch)
    inputs = lowered._abstract_inputs
    return step_store.step_key(
        lowered.compiled, inputs, step.mesh, step.schedule, step.num_microbatches
    )


def test_a_lowered_step_compiles_from_the_store_too(store, monkeypatch):
    model, opt, step, _, kind = _step(mp.OneFOneB, 4, 2, 4)
    batch = make_batch(kind, 16)
    lowered_key = _key(step, model, opt, batch)
    step(model, opt, batch)
    _stored_writes_done()
    assert [p.stem for p in store.glob("*.pkl")] == [lowered_key]
    traced = _counting_traces(monkeypatch)
    again_model, again_opt, again, _, _ = _step(mp.OneFOneB, 4, 2, 4)
    with count_compilations() as compiled:
        executables = again.lower(again_model, again_opt, batch).compile().executables()
    assert traced == [] and compiled.count == 0 and executables


def test_the_key_changes_with_anything_that_changes_the_programs(store):
    import optax

    model, opt, step, _loss_fn, kind = _step(mp.OneFOneB, 4, 2, 4)
    batch = make_batch(kind, 16)
    key = _key(step, model, opt, batch)
    assert key is not None
    _, _, same, _, _ = _step(mp.OneFOneB, 4, 2, 4)
    assert _key(same, model, opt, batch) == key
    others = {
        "microbatches": _step(mp.OneFOneB, 4, 2, 2)[2],
        "schedule": _step(mp.GPipe, 4, 2, 4)[2],
        "submeshes": mp.jit(
            step.fn,
            mesh=mp.MpmdMesh(
                jax.make_mesh(
                    (4, 2),
                    ("stage", "data"),
                    devices=jax.devices()[::-1],
                    axis_types=(jax.sharding.AxisType.Auto,) * 2,
                ),
                "stage",
            ),
            schedule=mp.OneFOneB(),
            num_microbatches=4,
        ),
    }
    for what, other in others.items():
        assert _key(other, model, opt, batch) not in (key, None), what
    slower = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
    assert _key(step, model, slower, batch) not in (key, None)
    assert _key(step, model, opt, make_batch(kind, 8)) not in (key, None)


def test_a_users_remat_policy_is_not_stored(store):
    def policy(*args, **kwargs):
        return False

    model, opt, step, _, kind = _step(mp.OneFOneB, 4, 2, 4)
    model.blocks[1].remat, model.blocks[1].policy = True, policy
    assert _key(step, model, opt, make_batch(kind, 16)) is None


def test_no_key_without_a_compilation_cache_or_with_the_store_off(store, monkeypatch):
    model, opt, step, _, kind = _step(mp.OneFOneB, 4, 2, 4)
    batch = make_batch(kind, 16)
    assert _key(step, model, opt, batch) is not None
    monkeypatch.setattr(step_store, "ENABLED", False)
    assert _key(step, model, opt, batch) is None
    monkeypatch.setattr(step_store, "ENABLED", True)
    jax.config.update("jax_enable_compilation_cache", False)
    assert _key(step, model, opt, batch) is None


def test_an_unreadable_store_entry_compiles_as_usual(store, monkeypatch):
    model, opt, step, _loss_fn, kind = _step(mp.OneFOneB, 4, 2, 4)
    batch = make_batch(kind, 16)
    want = float(step(model, opt, batch))
    _stored_writes_done()
    (entry,) = store.glob("*.pkl")
    entry.write_bytes(b"not a pickle")
    traced = _counting_traces(monkeypatch)
    again_model, again_opt, again, _, _ = _step(mp.OneFOneB, 4, 2, 4)
    assert float(again(again_model, again_opt, batch)) == want
    assert traced  # compiled as usual


def _gpt_step():
    """GPT tiny on Explicit axes: its embedding replicates the batch, and B0 then
    reads a residual typed on an Auto copy of its submesh."""
    import optax

    from nnx_mpmd.models import build_model, lm_loss

    model = build_model("gpt", "tiny", num_stages=4, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = mp.jit(
        train_step_fn(lm_loss), mesh=make_mesh(4, 2), schedule=mp.OneFOneB(), num_microbatches=2
    )
    return model, opt, step, lm_loss, "tokens"


@pytest.mark.parametrize("model_name", ["lm-auto", "gpt-explicit"])
@pytest.mark.filterwarnings("ignore::nnx_mpmd.ReplicatedBatchWarning")
def test_a_changed_step_whose_programs_jax_cached_is_stored_again(model_name, store, monkeypatch):
    # After nnx_mpmd (or the learning rate, ...) changes, the step's key is new
    # while JAX's cache still holds its programs; such executables cannot be
    # serialized again, but the programs kept one by one (nnx_mpmd_shared) can,
    # B0's too (`compile_jobs.on_devices_of`).
    if model_name == "gpt-explicit":
        make = _gpt_step
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, 60, size=(8, 17)).astype(np.int32)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    else:
        make = functools.partial(_step, mp.OneFOneB, 4, 2, 4)
        batch = make_batch("tokens", 16)
    model, opt, step, _, _ = make()
    want = float(step(model, opt, batch))
    _stored_writes_done()
    monkeypatch.setattr(step_store, "_library_text", lambda: "another nnx_mpmd")
    for expect_traced in (True, False):
        traced = _counting_traces(monkeypatch)
        again_model, again_opt, again, _, _ = make()
        assert float(again(again_model, again_opt, batch)) == want
        _stored_writes_done()
        assert bool(traced) == expect_traced
        assert len(list(store.glob("*.pkl"))) == 2


def test_a_stored_step_profiles_and_measures_memory(store):
    model, opt, step, _, kind = _step(mp.OneFOneB, 4, 2, 4)
    batch = make_batch(kind, 16)
    step(model, opt, batch)
    _stored_writes_done()
    again_model, again_opt, again, _, _ = _step(mp.OneFOneB, 4, 2, 4)
    again(again_model, again_opt, batch, profile=True)
    assert len(again.last_profile) > 0 and again.last_profile.timeline().makespan > 0
    again(again_model, again_opt, batch, memory=True)
    assert again.last_memory


def test_stored_steps_beyond_the_limit_go_least_recently_used_first(store, monkeypatch):
    import time

    store.mkdir(parents=True)
    for i, name in enumerate(["old", "used", "new"]):
        (store / f"{name}.pkl").write_bytes(b"x" * 100)
        os.utime(store / f"{name}.pkl", (1000 + i, 1000 + i))
    assert step_store.load_step("used", []) is None  # unreadable, yet touched on reading
    time.sleep(0.01)
    step_store._evict(store, 250)
    assert sorted(p.stem for p in store.glob("*.pkl")) == ["new", "used"]
    step_store._evict(store, 100)
    assert [p.stem for p in store.glob("*.pkl")] == ["used"]


def test_a_step_with_executables_from_jaxs_own_cache_is_not_stored(store):
    assert step_store.store_step("0" * 64, {"F0": [object()]}, {}) is None
    assert not store.exists()


@pytest.mark.parametrize("donate", ["", "0,1"], ids=["plain", "donating"])
def test_a_later_process_runs_the_stored_step(tmp_path, donate):
    # The real use: the text of the step must be the same in another process. A
    # donating step's stored programs donate as the traced ones did (two steps).
    script = textwrap.dedent(
        """
        import os, sys
        sys.path.insert(0, sys.argv[2])
        import jax
        jax.config.update("jax_compilation_cache_dir", sys.argv[1])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        import nnx_mpmd as mp
        from nnx_mpmd.aot import compile_jobs
        from pipeline_models import build, make_batch, make_mesh, train_step_fn
        traced = []
        original = compile_jobs.ProgramCompiler._trace_and_compile
        def counted(self, fn, args, on_traced, name, *rest):
            traced.append(name)
            return original(self, fn, args, on_traced, name, *rest)
        compile_jobs.ProgramCompiler._trace_and_compile = counted
        model, opt, loss_fn, kind = build("lm", "adamw", 4)
        donate = tuple(int(i) for i in sys.argv[3].split(",") if i)
        step = mp.jit(train_step_fn(loss_fn), mesh=make_mesh(4, 2),
                      schedule=mp.OneFOneB(), num_microbatches=2, donate_argnums=donate)
        losses = [float(step(model, opt, make_batch(kind, 8, seed=i))) for i in range(2)]
        print(len(traced), repr(losses).replace(" ", ""))
        """
    )
    tests = os.path.dirname(os.path.dirname(__file__))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "NNX_"))}
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=8 {codegen_flags()}"
    runs = [
        subprocess.run(
            [
                "timeout",
                "-k",
                "5",
                "300",
                sys.executable,
                "-c",
                script,
                str(tmp_path),
                tests,
                donate,
            ],
            capture_output=True,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    (first_traced, first_loss), (second_traced, second_loss) = (
        run.stdout.split()[-2:] for run in runs
    )
    assert int(first_traced) > 0 and int(second_traced) == 0
    assert first_loss == second_loss
