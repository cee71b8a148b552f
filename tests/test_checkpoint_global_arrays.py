"""nnx_mpmd.checkpoint.global_arrays on one process: shardings, moves and errors.

The multi-process behaviour (orbax writing global arrays from several
processes) is tested by tests/test_multiprocess_checkpoint.py; here the pieces
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
def other_device(monkeypatch):
    """Device 7 plays the device of another process."""
    device = jax.devices()[7]
    monkeypatch.setattr(global_arrays, "_device_of_another_process", lambda processes: device)
    return device


def test_a_one_process_run_has_no_other_process_to_span():
    with pytest.raises(CheckpointError, match=r"held by processes \[0\] only: no other process"):
        global_arrays.spanning_sharding(SingleDeviceSharding(jax.devices()[0]))


def test_only_named_or_one_device_shardings_can_be_extended():
    two_devices = SimpleNamespace(device_set=set(jax.devices()[:2]))
    with pytest.raises(CheckpointError, match="has no NamedSharding to extend"):
        global_arrays.spanning_sharding(two_devices)


def test_spanning_sharding_swaps_the_last_device(other_device):
    mesh = Mesh(
        np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2
    )
    spanning = global_arrays.spanning_sharding(NamedSharding(mesh, P("a")))
    assert spanning.spec == P("a")
    assert spanning.mesh.axis_names == ("a", "b")
    assert spanning.mesh.axis_types == mesh.axis_types
    assert [d.id for d in spanning.mesh.devices.flat] == [0, 1, 2, other_device.id]


def test_a_one_device_array_is_replicated_on_a_pair(other_device):
    spanning = global_arrays.spanning_sharding(SingleDeviceSharding(jax.devices()[0]))
    assert spanning.spec == P()
    assert [d.id for d in spanning.mesh.devices.flat] == [0, other_device.id]


@pytest.mark.parametrize("spec", [P("a"), P(), P(None, "b")])
def test_moving_shards_keeps_the_values(other_device, spec):
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    x = jax.device_put(jnp.arange(24.0).reshape(4, 6), NamedSharding(mesh, spec))
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
