"""nnx_mpmd.checkpoint.global_arrays on one process: shardings, moves and errors.

The multi-process behaviour (orbax writing global arrays from several
processes) is tested by tests/integration/test_multiprocess_checkpoint.py; here the pieces
run on one process with 8 CPU devices, a device standing in for "a device of
another process".
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from nnx_mpmd import CheckpointError
from nnx_mpmd.checkpoint import global_arrays
from nnx_mpmd.checkpoint.manifest import fingerprint


@pytest.fixture
def four_processes(monkeypatch):
    """Pretend the 8 devices belong to 4 processes: devices 2p and 2p + 1 to process p."""
    monkeypatch.setattr(global_arrays, "_process_of", lambda device: device.id // 2)


def _ids(sharding) -> list[int]:
    return [d.id for d in sharding.mesh.devices.flat]


def test_a_one_process_run_has_nothing_to_span():
    with pytest.raises(CheckpointError, match="a one-process run has no processes to spread"):
        global_arrays.spanning_sharding(SingleDeviceSharding(jax.devices()[0]))


def test_only_named_or_one_device_shardings_can_be_extended(four_processes):
    two_devices = SimpleNamespace(device_set=set(jax.devices()[:2]))
    with pytest.raises(CheckpointError, match="has no NamedSharding to extend"):
        global_arrays.spanning_sharding(two_devices)


def _mesh(ids, shape=(2, 2)):
    devices = np.array([jax.devices()[i] for i in ids]).reshape(shape)
    return Mesh(devices, ("a", "b"), axis_types=(AxisType.Explicit,) * 2)


def test_a_sharding_on_every_process_is_kept(four_processes):
    sharding = NamedSharding(_mesh([0, 2, 4, 6]), P("a"))
    assert global_arrays.spanning_sharding(sharding) is sharding


@pytest.mark.parametrize("turn, expected", [(0, [0, 6, 2, 4]), (1, [0, 7, 2, 5])])
def test_each_missing_process_swaps_in_one_device(four_processes, turn, expected):
    mesh = _mesh([0, 1, 2, 3])  # processes 0, 0, 1, 1: processes 2 and 3 hold nothing
    spanning = global_arrays.spanning_sharding(NamedSharding(mesh, P("a")), turn)
    assert _ids(spanning) == expected  # from the end, a device of a process that has two
    assert spanning.spec == P("a")
    assert spanning.mesh.axis_names == ("a", "b")
    assert spanning.mesh.axis_types == mesh.axis_types


def test_fewer_devices_than_processes_replicate_on_one_device_each(four_processes):
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    spanning = global_arrays.spanning_sharding(NamedSharding(mesh, P("data")))
    assert _ids(spanning) == [0, 2, 4, 6]
    assert spanning.spec == P()
    one_device = global_arrays.spanning_sharding(SingleDeviceSharding(jax.devices()[3]), turn=1)
    assert _ids(one_device) == [1, 3, 5, 7]


@pytest.mark.parametrize("spec", [P("a"), P(), P(None, "b")])
def test_moving_shards_keeps_the_values(four_processes, spec):
    x = jax.device_put(jnp.arange(24.0).reshape(4, 6), NamedSharding(_mesh([0, 1, 2, 3]), spec))
    target = global_arrays.spanning_sharding(x.sharding)
    moved = global_arrays._move_shards(x, target)
    assert moved.sharding == target
    np.testing.assert_array_equal(np.asarray(moved), np.asarray(x))


def test_fingerprints_on_one_process():
    rows = [fingerprint(jnp.arange(3.0)), [7, 8], fingerprint(np.ones(2))]
    fetched = global_arrays.fingerprints(rows)
    assert fetched[1] == [7, 8]
    assert fetched[0] == [int(v) for v in np.asarray(rows[0])]
    assert fetched[2] == rows[2]


def test_one_process_saves_and_moves_as_before():
    x = jnp.ones(4)
    assert global_arrays.savable(x) is x
    moved = global_arrays.move_to(x, SingleDeviceSharding(jax.devices()[3]))
    assert moved.devices() == {jax.devices()[3]}


def test_a_moved_shard_that_never_arrives_raises(monkeypatch):
    monkeypatch.setattr(global_arrays, "multi_process", lambda: True)
    monkeypatch.setattr(global_arrays, "peer_timeout_s", lambda: 0.0)
    never = SimpleNamespace(data=SimpleNamespace(is_ready=lambda: False), device=jax.devices()[2])
    kept = [SimpleNamespace(addressable_shards=[never])]
    with pytest.raises(
        CheckpointError, match=r"1 shard\(s\) moved .* did not arrive .* device cpu:2"
    ):
        global_arrays.settle_moves(kept)


def test_a_fingerprint_no_process_holds_raises(monkeypatch):
    monkeypatch.setattr(global_arrays, "multi_process", lambda: True)
    monkeypatch.setattr(global_arrays, "_known_here", lambda row: None)
    monkeypatch.setattr(global_arrays, "exchange", lambda table, where: table[None])
    with pytest.raises(CheckpointError, match="no process holds fingerprint row 0"):
        global_arrays.fingerprints([fingerprint(jnp.ones(2))])
