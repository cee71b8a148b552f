"""`nnx_mpmd.distributed` on one process: the public names, the deprecated old
path, `initialize`'s checks and coordinator bind address, the launcher's
environment, and the bounded per-step cache of the multi-process runtime.

The multi-process behaviour itself (remote arrays, the collective gather) is
tested with real processes in tests/test_multiprocess.py.
"""

from __future__ import annotations

import gc
import io
import sys
import weakref

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import nnx_mpmd as mp
from nnx_mpmd import distributed
from nnx_mpmd.apps import launch
from nnx_mpmd.runtime import multi_process

MOVED = {
    "initialize_from_env": "initialize",
    "gather": "gather",
    "global_view": "global_view",
    "is_remote": "is_remote",
}
LAUNCH_ENV = ("NNX_MPMD_PROCESS_ID", "NNX_MPMD_NUM_PROCESSES", "NNX_MPMD_COORDINATOR")


def _mesh(n: int = 2) -> mp.MpmdMesh:
    return mp.MpmdMesh(jax.make_mesh((n,), ("stage",), devices=jax.devices()[:n]), "stage")


class Two(mp.PipelinedModel):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.a = mp.Stage(nnx.Linear(8, 8, rngs=rngs), stage=0)
        self.b = mp.Stage(nnx.Linear(8, 1, rngs=rngs), stage=1)

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


def _train_step(model, opt, x):
    loss, grads = mp.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2))(model, x)
    opt.update(model, grads)
    return loss


# --- the public module ------------------------------------------------------------------


def test_public_names():
    assert mp.distributed is distributed
    assert "distributed" in mp.__all__
    assert distributed.DistributedError is mp.DistributedError
    assert issubclass(distributed.DistributedError, mp.MpmdError)
    for name in distributed.__all__:
        obj = getattr(distributed, name)
        assert obj.__doc__, name
        if callable(obj) and not isinstance(obj, type):
            assert "Example" in obj.__doc__ and "Args" in obj.__doc__, name


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_old_path_warns_and_names_the_new_one(old, new):
    with pytest.warns(DeprecationWarning, match=rf"use nnx_mpmd\.distributed\.{new} "):
        obj = getattr(multi_process, old)
    assert obj is getattr(distributed, new)


def test_from_import_of_old_path_warns():
    with pytest.warns(DeprecationWarning, match=r"multi_process\.initialize_from_env is deprec"):
        exec("from nnx_mpmd.runtime.multi_process import initialize_from_env", {})


def test_unknown_attribute_of_runtime_module_still_raises():
    with pytest.raises(AttributeError, match=r"has no attribute 'no_such_name'"):
        multi_process.no_such_name


def test_is_remote_on_one_process():
    placed = mp.place(mp.Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=1), _mesh())
    assert not distributed.is_remote(placed.kernel.get_value())
    assert not distributed.is_remote(jnp.ones(2)) and not distributed.is_remote("x")


def test_gather_on_one_process_is_mp_gather():
    model = mp.place(mp.Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=1), _mesh())
    state = nnx.state(model, nnx.Param)
    gathered = distributed.gather({"state": state, "x": model.bias.get_value()}, _mesh())
    expected = mp.gather({"state": state, "x": model.bias.get_value()})
    assert jax.tree.map(lambda a, b: bool((a == b).all()), gathered, expected)
    assert gathered["x"].devices() == {jax.devices()[0]}
    assert distributed.gather(model) is model
    assert model.kernel.get_value().devices() == {jax.devices()[0]}


def test_global_view_restores_placement_and_keeps_restored_values():
    mesh = _mesh()
    model = mp.place(mp.Stage(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), stage=1), mesh)
    placed = model.kernel.get_value()
    with distributed.global_view({"model": model}, mesh):
        view = model.kernel.get_value()
        assert view.sharding.device_set == set(jax.devices()[:2])
        model.bias.set_value(jnp.full((2,), 7.0, view.dtype))
    assert model.kernel.get_value() is placed
    assert model.bias.get_value().devices() == {jax.devices()[1]}
    assert model.bias.get_value().tolist() == [7.0, 7.0]


def test_collect_local_names_an_array_no_process_holds_whole(monkeypatch):
    monkeypatch.setattr(multi_process, "_whole_copies", lambda x, me: (set(), None))
    with pytest.raises(
        mp.DistributedError,
        match=r"while gathering state: value 1 \(shape \(3,\).*no process holds all of it.*"
        r"Keep each array on one process",
    ):
        multi_process.collect_local(["label", jnp.ones(3)], "gathering state")


# --- initialize ---------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables; jax's recoverability flag restored afterwards."""
    for name in (*LAUNCH_ENV, "NNX_MPMD_COORDINATOR_BIND", "NNX_MPMD_DEVICES_PER_PROCESS"):
        monkeypatch.delenv(name, raising=False)
    recoverable = jax.config.jax_enable_recoverability
    yield monkeypatch
    jax.config.update("jax_enable_recoverability", recoverable)


@pytest.fixture
def captured_initialize(clean_env):
    """Records the arguments of jax.distributed.initialize and fails it (nothing starts)."""
    calls = []

    def fake_initialize(**kwargs):
        calls.append(kwargs)
        raise RuntimeError("fake coordinator: not started")

    clean_env.setattr(jax.distributed, "initialize", fake_initialize)
    return calls


def test_initialize_without_launcher_is_one_process(clean_env):
    info = distributed.initialize()
    assert (info.process_id, info.num_processes, info.coordinator, info.is_main) == (
        0,
        1,
        None,
        True,
    )


def test_initialize_with_one_launched_process_starts_no_service(clean_env):
    for name, value in zip(LAUNCH_ENV, ("0", "1", "127.0.0.1:1")):
        clean_env.setenv(name, value)
    assert distributed.initialize() == multi_process.ProcessInfo(0, 1, None)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"NNX_MPMD_PROCESS_ID": "0"},
            r"incomplete multi-process environment: \['NNX_MPMD_COORDINATOR', "
            r"'NNX_MPMD_PROCESS_ID'\] are set but \['NNX_MPMD_NUM_PROCESSES'\].*nnx-mpmd launch",
        ),
        (
            {"NNX_MPMD_PROCESS_ID": "x", "NNX_MPMD_NUM_PROCESSES": "2"},
            r"NNX_MPMD_PROCESS_ID='x' is not an integer",
        ),
        (
            {"NNX_MPMD_PROCESS_ID": "2", "NNX_MPMD_NUM_PROCESSES": "2"},
            r"NNX_MPMD_PROCESS_ID=2 is outside \[0, NNX_MPMD_NUM_PROCESSES=2\)",
        ),
    ],
)
def test_initialize_rejects_a_bad_environment(clean_env, env, message):
    env = {"NNX_MPMD_COORDINATOR": "127.0.0.1:1", **env}
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(mp.DistributedError, match=message):
        distributed.initialize()


@pytest.mark.parametrize(
    ("coordinator", "configured", "bind"),
    [
        ("127.0.0.1:4321", None, "127.0.0.1:4321"),
        ("localhost:4321", None, "localhost:4321"),
        ("[::1]:4321", None, "[::1]:4321"),
        ("10.1.2.3:4321", None, None),  # another host: jax's default (every interface)
        ("10.1.2.3:4321", "10.1.2.3:4321", "10.1.2.3:4321"),
    ],
)
def test_initialize_binds_a_loopback_coordinator_to_loopback(
    clean_env, captured_initialize, coordinator, configured, bind
):
    env = dict(zip(LAUNCH_ENV, ("1", "2", coordinator)))
    if configured:
        env["NNX_MPMD_COORDINATOR_BIND"] = configured
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(
        mp.DistributedError, match=r"jax\.distributed\.initialize\(.*\) failed: fake coordinator"
    ):
        distributed.initialize()
    (kwargs,) = captured_initialize
    assert kwargs["coordinator_address"] == coordinator
    assert (kwargs["process_id"], kwargs["num_processes"]) == (1, 2)
    assert kwargs.get("coordinator_bind_address") == bind


def test_launch_gives_every_process_a_loopback_bind_address():
    show = "import os; print(os.environ['NNX_MPMD_COORDINATOR'], os.environ['NNX_MPMD_COORDINATOR_BIND'])"
    out = io.StringIO()
    assert launch.launch([sys.executable, "-c", show], 2, out=out) == 0
    lines = sorted(out.getvalue().splitlines())
    assert len(lines) == 2
    for i, line in enumerate(lines):
        prefix, coordinator, bind = line.split()
        assert prefix == f"[p{i}]"
        assert coordinator.startswith("127.0.0.1:") and bind == coordinator


def test_launch_env_has_no_bind_for_a_remote_coordinator():
    stale = {"NNX_MPMD_COORDINATOR_BIND": "127.0.0.1:1"}
    env = multi_process.launch_env(0, 2, "10.1.2.3:4321", base=stale)
    assert "NNX_MPMD_COORDINATOR_BIND" not in env


# --- the runtime's per-step cache ---------------------------------------------------


class _Step:
    """Stands for a CompiledStep: the cache only needs identity and a weak reference."""


@pytest.fixture
def empty_step_cache(monkeypatch):
    monkeypatch.setattr(multi_process, "_STEPS", type(multi_process._STEPS)())
    return multi_process._STEPS


def test_step_cache_is_bounded_least_recently_run_first(empty_step_cache):
    steps = [_Step() for _ in range(multi_process.MAX_CACHED_STEPS + 8)]
    states = [multi_process._step_state(s) for s in steps]
    numbers = [s.number for s in states]
    assert numbers == sorted(set(numbers))  # unique, in first-run order
    assert len(empty_step_cache) == multi_process.MAX_CACHED_STEPS
    assert multi_process._step_state(steps[-1]) is states[-1]  # still cached
    renewed = multi_process._step_state(steps[0])  # evicted: a fresh number and state
    assert renewed is not states[0] and renewed.number > numbers[-1]
    assert len(empty_step_cache) == multi_process.MAX_CACHED_STEPS


def test_dropped_steps_and_models_are_released(empty_step_cache):
    mesh = _mesh()
    model_refs, step_refs = [], []
    for seed in range(30):
        model = Two(nnx.Rngs(seed))
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        # compile_threads=1: lower() only traces; nothing here needs XLA programs.
        fn = mp.jit(
            _train_step, mesh=mesh, schedule=mp.GPipe(), num_microbatches=2, compile_threads=1
        )
        compiled = fn.lower(model, opt, jnp.ones((4, 8))).compiled
        multi_process._step_state(compiled)
        model_refs.append(weakref.ref(model))
        step_refs.append(weakref.ref(compiled))
        del model, opt, fn, compiled
    gc.collect()
    assert len(empty_step_cache) <= multi_process.MAX_CACHED_STEPS
    assert not [r for r in step_refs if r() is not None]
    assert not [r for r in model_refs if r() is not None]
    assert len(empty_step_cache) == 0  # a dead step's entry goes with it
