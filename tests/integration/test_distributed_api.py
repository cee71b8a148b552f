"""`nnx_mpmd.distributed` on one process: the public names, the removed old
path, `initialize`'s checks, coordinator bind address and CPU transfer socket,
the launcher's environment, and the pieces of the multi-process runtime that
need no second process (the shard plan of a transfer, its errors, heartbeats).

The multi-process behaviour itself (remote arrays, transfers between processes,
the collective gather) is tested with real processes in tests/integration/test_multiprocess.py.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import nnx_mpmd as mp
from nnx_mpmd import distributed
from nnx_mpmd.apps import launch
from nnx_mpmd.compiler.ir import Transfer
from nnx_mpmd.runtime import coordination, cross_process, multi_process
from nnx_mpmd.runtime.executor import Shardings

# Names that moved to `nnx_mpmd.distributed` before 0.1.0: the runtime no longer forwards
# them (the forward imported a floor up and closed an import cycle).
MOVED = ("initialize_from_env", "gather", "global_view", "is_remote")
LAUNCH_ENV = ("NNX_MPMD_PROCESS_ID", "NNX_MPMD_NUM_PROCESSES", "NNX_MPMD_COORDINATOR")
TRANSFER_FLAGS = (
    "jax_cross_host_transfer_socket_address",
    "jax_cross_host_transport_addresses",
    "jax_cross_host_transfer_timeout_seconds",
)


def _mesh(n: int = 2) -> mp.MpmdMesh:
    return mp.MpmdMesh(jax.make_mesh((n,), ("stage",), devices=jax.devices()[:n]), "stage")


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


@pytest.mark.parametrize("old", MOVED)
def test_old_runtime_path_is_gone(old):
    assert hasattr(distributed, old.removesuffix("_from_env"))
    with pytest.raises(AttributeError, match=rf"has no attribute '{old}'"):
        getattr(multi_process, old)


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
        match=r"while gathering state: value 1 \(shape \(3,\).*no process holds all of it, even "
        r"after replicating it on its own submesh.*please report",
    ):
        multi_process.collect_local(["label", jnp.ones(3)], "gathering state")


# --- initialize ---------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables; jax's recoverability flag restored afterwards."""
    for name in (*LAUNCH_ENV, "NNX_MPMD_COORDINATOR_BIND", "NNX_MPMD_DEVICES_PER_PROCESS"):
        monkeypatch.delenv(name, raising=False)
    recoverable = jax.config.jax_enable_recoverability
    transfers = {name: jax.config.values.get(name) for name in TRANSFER_FLAGS}
    monkeypatch.delenv("NNX_MPMD_TRANSFER_ADDRESS", raising=False)
    for name in TRANSFER_FLAGS:
        jax.config.update(name, None if name.endswith("seconds") else "")
    yield monkeypatch
    jax.config.update("jax_enable_recoverability", recoverable)
    for name, value in transfers.items():
        jax.config.update(name, value)


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


def test_launch_names_a_failed_coordinator_as_the_cause():
    fail_0 = "import os, sys, time; p = os.environ['NNX_MPMD_PROCESS_ID']; "
    fail_0 += "sys.exit(5) if p == '0' else time.sleep(1)"
    out = io.StringIO()
    assert launch.launch([sys.executable, "-c", fail_0], 2, out=out, grace_s=5) == 5
    assert re.search(
        r"process 0 \(the coordinator\) failed first \(exit status 5\)\. It hosts the "
        r"coordination service, so JAX aborts the other processes",
        out.getvalue(),
    )
    assert "killed by signal 9" in launch.coordinator_lost_note(137)


def test_launched_scripts_dump_stacks_just_before_the_time_limit_and_beat_as_expected():
    # A hang dumps its stacks and exits at `dump_after_s`, which follows the launch's
    # time limit: a slow run on a loaded machine is not cut short before the limit.
    # Runs expected to succeed count a peer dead after 10 s, those that kill one after 3.
    from mp_launch import check, launch, launch_once

    show = (
        "import os; print(os.environ['NNX_MPMD_DUMP_AFTER_S'], os.environ['NNX_MPMD_HEARTBEAT_S'])"
    )
    for run, heartbeat in ((launch, "10"), (launch_once, "3")):
        done, _ = run([sys.executable, "-c", show], processes=2, devices_per_process=1, timeout=240)
        check(done)
        assert sorted(done.stdout.splitlines()) == [f"[p{p}] 220 {heartbeat}" for p in (0, 1)]


def test_a_launch_that_hits_its_time_limit_says_so():
    from mp_launch import check, launch_once

    sleep = "import time; time.sleep(60)"
    done, _ = launch_once(
        [sys.executable, "-c", sleep], processes=2, devices_per_process=1, timeout=3
    )
    assert done.returncode == 124, done.stdout + done.stderr
    with pytest.raises(
        AssertionError, match=r"^the run hit its time limit of 3 s \(`timeout -k 5 3`, exit 124;"
    ):
        check(done)
    # A hang's stacks, dumped just before the limit (faulthandler's header), say so too.
    dumped = subprocess.CompletedProcess(done.args, 1, "[p1] Timeout (0:04:40)!\n[p1] Thread", "")
    with pytest.raises(AssertionError, match=r"^a process ran past NNX_MPMD_DUMP_AFTER_S"):
        check(dumped)


def test_launch_env_has_no_bind_for_a_remote_coordinator():
    stale = {"NNX_MPMD_COORDINATOR_BIND": "127.0.0.1:1"}
    env = multi_process.launch_env(0, 2, "10.1.2.3:4321", base=stale)
    assert "NNX_MPMD_COORDINATOR_BIND" not in env


def test_launched_and_trained_subprocesses_compile_with_the_test_runs_codegen_flags(
    monkeypatch,
):
    from mp_launch import env_for_launch, train_env

    codegen = (
        "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
        " --xla_cpu_parallel_codegen_split_count=1"
    )
    monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {codegen}")
    assert env_for_launch()["XLA_FLAGS"] == codegen  # the launcher adds the device count
    assert train_env()["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=2 {codegen}"
    launched = multi_process.launch_env(0, 2, "127.0.0.1:1", devices_per_process=4)
    assert launched["XLA_FLAGS"] == f"{codegen} --xla_force_host_platform_device_count=4"


def test_initialize_sets_up_cpu_transfers_on_the_coordinators_interface(
    clean_env, captured_initialize
):
    for name, value in zip(LAUNCH_ENV, ("1", "2", "127.0.0.1:4321")):
        clean_env.setenv(name, value)
    clean_env.setenv("NNX_MPMD_PEER_TIMEOUT", "42")
    with pytest.raises(mp.DistributedError, match=r"failed: fake coordinator"):
        distributed.initialize()
    socket_address = jax.config.values["jax_cross_host_transfer_socket_address"]
    host, port = socket_address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0  # a real port: JAX cannot use port 0
    assert jax.config.values["jax_cross_host_transport_addresses"] == "127.0.0.1:0"
    assert jax.config.values["jax_cross_host_transfer_timeout_seconds"] == 42


def test_initialize_keeps_a_configured_transfer_socket(clean_env, captured_initialize):
    for name, value in zip(LAUNCH_ENV, ("1", "2", "127.0.0.1:4321")):
        clean_env.setenv(name, value)
    jax.config.update("jax_cross_host_transfer_socket_address", "127.0.0.1:5555")
    with pytest.raises(mp.DistributedError, match=r"failed: fake coordinator"):
        distributed.initialize()
    assert jax.config.values["jax_cross_host_transfer_socket_address"] == "127.0.0.1:5555"


def test_transfer_address_follows_the_coordinator_or_the_override(monkeypatch):
    monkeypatch.delenv("NNX_MPMD_TRANSFER_ADDRESS", raising=False)
    assert coordination.transfer_address("localhost:1") == "127.0.0.1:0"
    assert coordination.transfer_address("127.0.0.1:9").endswith(":0")
    monkeypatch.setenv("NNX_MPMD_TRANSFER_ADDRESS", "10.0.0.7:0")
    assert coordination.transfer_address("10.9.9.9:1") == "10.0.0.7:0"


# --- transfers between submeshes (the parts one process can check) -----------------------


class FakeDevice(NamedTuple):
    id: int
    process_index: int


class FakeSharding:
    """Stands for a sharding in `shard_plan`: which index each device holds."""

    def __init__(self, indices):
        self.indices = indices

    def devices_indices_map(self, shape):
        return self.indices


ROWS = [(slice(0, 2, None),), (slice(2, 4, None),)]


def test_shard_plan_copies_locally_where_it_can_and_moves_the_rest():
    # Source: rows 0-1 on process 0, rows 2-3 on process 1. Destination: rows 0-1 on
    # process 0 (local copy), rows 2-3 on process 0 too (from process 1).
    src = FakeSharding({FakeDevice(0, 0): ROWS[0], FakeDevice(4, 1): ROWS[1]})
    dst = FakeSharding({FakeDevice(1, 0): ROWS[0], FakeDevice(2, 0): ROWS[1]})
    local, cross = cross_process.shard_plan(src, dst, (4,), 0)
    assert local == ((FakeDevice(0, 0), FakeDevice(1, 0)),)
    assert cross == ((FakeDevice(4, 1), FakeDevice(2, 0)),)
    local_on_1, cross_on_1 = cross_process.shard_plan(src, dst, (4,), 1)
    assert local_on_1 == () and cross_on_1 == cross  # every process lists the same moves


def test_shard_plan_of_a_stage_spanning_processes_is_all_local():
    # Stage i holds device i of each process (data axis over the processes).
    src = FakeSharding({FakeDevice(0, 0): ROWS[0], FakeDevice(4, 1): ROWS[1]})
    dst = FakeSharding({FakeDevice(1, 0): ROWS[0], FakeDevice(5, 1): ROWS[1]})
    assert cross_process.shard_plan(src, dst, (4,), 1) == (
        ((FakeDevice(4, 1), FakeDevice(5, 1)),),
        (),
    )


def _submeshes(*sizes):
    start, meshes = 0, []
    for size in sizes:
        meshes.append(
            jax.make_mesh((size,), ("data",), devices=jax.devices()[start : start + size])
        )
        start += size
    return meshes


def test_put_between_meshes_keeps_values_and_takes_the_destination_spec():
    a, b = _submeshes(2, 2)
    x = cross_process.put_from_host(np.arange(8.0).reshape(4, 2), NamedSharding(a, P("data")))
    y = cross_process.put_between_meshes(x, NamedSharding(b, P(None, "data")))
    assert y.sharding == NamedSharding(b, P(None, "data"))
    np.testing.assert_array_equal(np.asarray(y), np.arange(8.0).reshape(4, 2))
    assert cross_process.put(3, NamedSharding(b, P()), from_host=True).dtype == jnp.int32


def test_put_between_meshes_of_different_shapes_is_refused():
    a, b = _submeshes(2, 4)
    x = cross_process.put_from_host(np.ones(4), NamedSharding(a, P()))
    with pytest.raises(
        mp.DistributedError,
        match=r"from a submesh of shape \{'data': 2\} to one of shape \{'data': 4\}.*same shape",
    ):
        cross_process.put_between_meshes(x, NamedSharding(b, P()))


def test_put_between_meshes_needs_a_named_source():
    (b,) = _submeshes(2)
    x = jax.device_put(np.ones(4), SingleDeviceSharding(jax.devices()[0]))
    with pytest.raises(mp.DistributedError, match=r"the source has no NamedSharding"):
        cross_process.put_between_meshes(x, NamedSharding(b, P()))


def test_one_receiver_each_is_what_a_whole_array_move_needs():
    two, three = FakeDevice(4, 2), FakeDevice(6, 3)
    zero, one = FakeDevice(0, 0), FakeDevice(2, 1)
    assert cross_process.one_receiver_each([two, two, three, three], [zero, zero, one, one])
    assert cross_process.one_receiver_each([two, three], [zero, zero])  # two senders, one receiver
    # JAX 0.10.2 refuses these ("PjRtArray has different number of buffers than buffer_idxs").
    assert not cross_process.one_receiver_each([two, two], [zero, one])
    assert not cross_process.one_receiver_each([two, two, three, three], [zero, one, zero, one])


def _refusing_put(value, sharding, from_host):
    raise RuntimeError("UNAVAILABLE: socket closed")


def test_a_failed_transfer_says_which_one():
    meshes = _submeshes(2, 2)
    blamed = []
    ops = multi_process.ProcessOperations(
        Shardings(meshes), put=_refusing_put, on_failure=blamed.append
    )
    transfer = Transfer(0, 1, dst_mesh=1, label="act s0->s1 mb3", src_mesh=0)
    step = ops.transfer(5, transfer)
    with pytest.raises(
        mp.DistributedError,
        match=r"transfer 5 'act s0->s1 mb3' from mesh 0 \(processes \[0\]\) to mesh 1 "
        r"\(processes \[0\]\) failed on process 0: RuntimeError: UNAVAILABLE: socket closed\. "
        r"If a process died",
    ):
        step([jnp.ones(4), None])
    assert blamed == [
        "making transfer 5 'act s0->s1 mb3' from mesh 0 (processes [0]) to mesh 1 (processes [0])"
    ]  # a dead peer would have been named first


def test_a_failed_transfer_from_the_host_says_so():
    ops = multi_process.ProcessOperations(Shardings(_submeshes(2)), put=_refusing_put)
    step = ops.transfer(0, Transfer(0, 1, dst_mesh=0, label="batch['x']"))
    with pytest.raises(
        mp.DistributedError,
        match=r"transfer 0 \"batch\['x'\]\" from the host to mesh 0 \(processes \[0\]\) failed",
    ):
        step([np.ones(4), None])


def test_a_refused_move_is_named_without_waiting_for_peers():
    a, b = _submeshes(2, 4)  # different shapes: put_between_meshes refuses at once
    blamed = []
    ops = multi_process.ProcessOperations(Shardings([a, b]), on_failure=blamed.append)
    step = ops.transfer(2, Transfer(0, 1, dst_mesh=1, label="grad s0->s1", src_mesh=0))
    x = cross_process.put_from_host(np.ones(4), NamedSharding(a, P()))
    with pytest.raises(mp.DistributedError, match=r"transfer 2 'grad s0->s1' .*failed.*same shape"):
        step([x, None])
    assert blamed == []  # our own refusal: no dead peer to look for


def test_to_every_process_on_one_process_is_the_value():
    x = jnp.ones(3)
    assert cross_process.to_every_process(x) is x
    assert cross_process.to_every_process("a label") == "a label"


# --- heartbeats -------------------------------------------------------------------------


class FakeClient:
    """A coordination client whose key-value store the test fills."""

    def __init__(self):
        self.store = {}
        self.gone = False

    def key_value_try_get(self, key):
        if self.gone:
            raise RuntimeError("UNAVAILABLE: failed to connect to the coordination service")
        if key not in self.store:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.store[key]


def _watcher(client, clock, monkeypatch, heartbeat_s=3.0):
    monkeypatch.setattr(coordination.time, "monotonic", lambda: clock[0])
    return coordination.Coordination(client, 0, 3, heartbeat_s=heartbeat_s, start=False)


def test_a_peer_whose_heartbeat_stops_is_dead(monkeypatch):
    client, clock = FakeClient(), [100.0]
    client.store = {"nnx_mpmd/alive/1": "5", "nnx_mpmd/alive/2": "7"}
    watcher = _watcher(client, clock, monkeypatch)
    assert watcher.dead_peers() == []
    clock[0] += 2.0
    client.store["nnx_mpmd/alive/1"] = "6"  # process 1 still beats, process 2 stopped
    assert watcher.dead_peers() == []
    clock[0] += 2.0  # 4 s since process 2 last moved
    assert watcher.dead_peers() == [2]
    with pytest.raises(
        mp.DistributedError, match=r"^process 2 died while process 0 was running a step"
    ):
        watcher.check_peers("running a step", force=True)


def test_a_peer_that_never_beats_is_dead_after_the_timeout(monkeypatch):
    client, clock = FakeClient(), [0.0]
    client.store = {"nnx_mpmd/alive/1": "1"}
    watcher = _watcher(client, clock, monkeypatch)
    assert watcher.dead_peers() == []
    clock[0] += 3.5
    client.store["nnx_mpmd/alive/1"] = "2"
    assert watcher.dead_peers() == [2]


def test_losing_the_coordination_service_is_a_distributed_error(monkeypatch):
    client, clock = FakeClient(), [0.0]
    client.gone = True
    watcher = _watcher(client, clock, monkeypatch)
    with pytest.raises(mp.DistributedError, match=r"lost the coordination service \(process 0\)"):
        watcher.dead_peers()


def test_blame_peers_names_the_dead_process(monkeypatch):
    client, clock = FakeClient(), [0.0]
    client.store = {"nnx_mpmd/alive/1": "1", "nnx_mpmd/alive/2": "1"}
    watcher = _watcher(client, clock, monkeypatch, heartbeat_s=1.0)

    def sleep(seconds):
        clock[0] += seconds
        client.store["nnx_mpmd/alive/1"] = str(int(client.store["nnx_mpmd/alive/1"]) + 1)

    monkeypatch.setattr(coordination.time, "sleep", sleep)
    with pytest.raises(mp.DistributedError, match=r"^process 2 died while process 0 was moving"):
        watcher.blame_peers("moving an activation")
    client.store["nnx_mpmd/alive/2"] = "9"  # both beat again: nothing to blame
    watcher._seen.clear()

    def both(seconds):
        clock[0] += seconds
        for key in client.store:
            client.store[key] = str(int(client.store[key]) + 1)

    monkeypatch.setattr(coordination.time, "sleep", both)
    watcher.blame_peers("moving an activation")


def test_fetch_waits_as_long_as_asked_while_the_peer_lives(monkeypatch):
    monkeypatch.setenv(coordination.ENV_TIMEOUT, "30")
    client, clock = FakeClient(), [0.0]
    client.store = {"nnx_mpmd/alive/1": "1", "nnx_mpmd/alive/2": "1"}
    watcher = _watcher(client, clock, monkeypatch)
    waited = []

    def blocking_get(key, timeout_ms):
        clock[0] += 10.0  # nothing yet; the peers keep beating
        for peer in (1, 2):
            client.store[f"nnx_mpmd/alive/{peer}"] += "1"
        waited.append(clock[0])
        if clock[0] >= 100.0:
            return '"done"'
        raise RuntimeError("DEADLINE_EXCEEDED: no value")

    client.blocking_key_value_get = blocking_get
    assert watcher.fetch("k", 1, "waiting", timeout_s=200.0) == "done"  # past the 30 s default
    assert waited[-1] == 100.0
    clock[0] = 0.0
    with pytest.raises(mp.DistributedError, match=r"process 1 did not publish .*k' within 50 s"):
        watcher.fetch("k", 1, "waiting", timeout_s=50.0)
    clock[0] = 0.0
    with pytest.raises(mp.DistributedError, match=r"within 30 s .* raise NNX_MPMD_PEER_TIMEOUT"):
        watcher.fetch("k", 1, "waiting")  # the default bound


class _OptInCluster:
    """Like JAX's mpi4py environment: present wherever its package is installed."""

    opt_in_only_method = True

    @classmethod
    def is_env_present(cls):
        return True


class _PresentCluster(_OptInCluster):
    opt_in_only_method = False


def test_an_installed_mpi4py_is_not_a_cluster(clean_env):
    # Found on a GPU machine with mpi4py installed: every `nnx-mpmd train` failed with
    # "coordinator_address should be defined", since JAX itself leaves opt-in
    # environments out of its detection.
    from jax._src.clusters import ClusterEnv

    clean_env.setattr(ClusterEnv, "_cluster_types", [_OptInCluster])
    assert not multi_process.cluster_detected()
    assert distributed.initialize() == multi_process.ProcessInfo(0, 1, None)
    clean_env.setattr(ClusterEnv, "_cluster_types", [_OptInCluster, _PresentCluster])
    assert multi_process.cluster_detected()
