"""Batch leaves a process builds from its own rows only (placement/process_batch, apps/local_batches).

The row computation is checked without processes, on fake meshes whose devices
name their process; the leaves themselves in one process: a step fed
`MicrobatchedArray` leaves equals the step fed the NumPy batch (bit for bit)
and ``nnx.jit``, compiles nothing new and uses the leaves where they are.
The multi-process runs are in tests/integration/test_multiprocess_local_batches.py.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from pipeline_models import build, make_batch, make_mesh, params_of, train_step_fn

import nnx_mpmd as mp
from nnx_mpmd.aot.stats import count_compilations
from nnx_mpmd.apps import local_batches
from nnx_mpmd.apps.data import BatchIterator
from nnx_mpmd.apps.local_batches import ProcessLocalBatches, leaf_rows
from nnx_mpmd.compiler.ir import Transfer
from nnx_mpmd.errors import MpmdError, PlacementError
from nnx_mpmd.jit.batch_placement import batch_shardings
from nnx_mpmd.placement.process_batch import (
    MicrobatchedArray,
    make_microbatched_array,
    process_batch_rows,
    take_microbatched,
)
from nnx_mpmd.runtime.executor import Shardings, transfer_value

# -- the rows of each process (no processes: devices get a made-up process) ---------


DATA = P(None, "data")  # each microbatch split over the data axis


def _rows(*blocks):
    return [r for lo, hi in blocks for r in range(lo, hi)]


def _sharding(ids, spec=DATA, shape=None, names=("data",)):
    devices = [jax.devices()[i] for i in ids]
    mesh = jax.make_mesh(shape or (len(ids),), names, devices=devices)
    return NamedSharding(mesh, spec)


LAYOUTS = {
    # a data axis of 4 whose devices are all on process 0
    "4 on one process": (_sharding(range(4)), lambda d: d.id // 4, [_rows((0, 16)), []]),
    # a data axis of 8 over two processes: each the half of every microbatch
    "8 over two processes": (
        _sharding(range(8)),
        lambda d: d.id // 4,
        [_rows((0, 4), (8, 12)), _rows((4, 8), (12, 16))],
    ),
    # processes interleaved along the axis (not neighbours)
    "interleaved": (
        _sharding(range(4)),
        lambda d: d.id % 2,
        [_rows((0, 2), (4, 6), (8, 10), (12, 14)), _rows((2, 4), (6, 8), (10, 12), (14, 16))],
    ),
    # a (model, data) submesh: the rows follow the data axis only
    "model x data, process per model row": (
        _sharding(range(4), shape=(2, 2), names=("model", "data")),
        lambda d: d.id // 2,
        [_rows((0, 16)), _rows((0, 16))],
    ),
    "model x data, process per data column": (
        _sharding(range(4), shape=(2, 2), names=("model", "data")),
        lambda d: d.id % 2,
        [_rows((0, 4), (8, 12)), _rows((4, 8), (12, 16))],
    ),
    # replicated: every row on each process with a device there
    "replicated": (_sharding(range(2), spec=P()), lambda d: d.id, [_rows((0, 16))] * 2),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_rows_of_each_process(layout):
    sharding, owner, expected = LAYOUTS[layout]
    for process, rows in enumerate(expected):
        got = process_batch_rows(sharding, 16, 2, process=process, process_of=owner)
        assert got.tolist() == rows, (layout, process)
        assert got.dtype == np.int64


def test_rows_on_2x4_over_two_processes():
    mesh = make_mesh(2, 4)
    where = {
        "inputs": NamedSharding(mesh.submesh(0), P(None, "data")),
        "targets": NamedSharding(mesh.submesh(1), P(None, "data")),
    }
    owner = lambda d: d.id // 4  # noqa: E731 -- process p holds mesh p
    first = leaf_rows(where, 16, 2, process=0, process_of=owner)
    second = leaf_rows(where, 16, 2, process=1, process_of=owner)
    assert {k: v.tolist() for k, v in first.items()} == {"inputs": _rows((0, 16)), "targets": []}
    assert {k: v.tolist() for k, v in second.items()} == {"inputs": [], "targets": _rows((0, 16))}


@pytest.fixture(scope="module")
def four_stage_shardings():
    """Where the 4-stage LM under GPipe on 4 meshes x 2 data (Auto axes) reads its batch."""
    model, opt, loss_fn, kind = build("lm", "sgd", 4)
    mesh = make_mesh(4, 2, AxisType.Auto)
    step = mp.jit(train_step_fn(loss_fn), mesh=mesh, schedule=mp.GPipe(), num_microbatches=2)
    return mesh, batch_shardings(step, model, opt, make_batch(kind, 8))[2]


def test_the_step_says_where_it_reads_each_leaf(four_stage_shardings):
    mesh, where = four_stage_shardings
    assert where["inputs"] == NamedSharding(mesh.submesh(0), P(None, "data"))
    assert where["targets"] == NamedSharding(mesh.submesh(3), P(None, "data"))


def test_a_leaf_read_outside_the_pipelined_region_stays_whole():
    mesh = make_mesh(2, 2, AxisType.Auto)
    model, opt, loss_fn, kind = build("mlp", "sgd", 2)

    def step(model, opt, batch, scale):
        loss, grads = mp.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss * scale + 0.0 * batch["y"].sum()  # "y" is also read here, whole

    f = mp.jit(step, mesh=mesh, schedule=mp.GPipe(), num_microbatches=2)
    where = batch_shardings(f, model, opt, make_batch(kind, 8), np.float32(1.0))
    assert where[0] is None and where[3] is None  # the model; a scalar argument
    assert where[2]["x"] == _on(mesh, 0)
    assert where[2]["y"] is None


def test_rows_on_4x2_and_middle_stages_only(four_stage_shardings):
    _, where = four_stage_shardings
    everything = _rows((0, 8))

    def rows(process, owner):
        got = leaf_rows(where, 8, 2, process=process, process_of=owner)
        return {k: v.tolist() for k, v in got.items()}

    two = lambda d: d.id // 4  # noqa: E731 -- meshes 0, 1 on process 0; 2, 3 on process 1
    assert rows(0, two) == {"inputs": everything, "targets": []}
    assert rows(1, two) == {"inputs": [], "targets": everything}
    four = lambda d: d.id // 2  # noqa: E731 -- one mesh per process
    for middle in (1, 2):
        assert rows(middle, four) == {"inputs": [], "targets": []}
    assert rows(0, four)["inputs"] == rows(3, four)["targets"] == everything
    split = lambda d: d.id % 2  # noqa: E731 -- every data axis over two processes
    assert rows(1, split) == {"inputs": [2, 3, 6, 7], "targets": [2, 3, 6, 7]}


# -- the leaves in a step -----------------------------------------------------------


def _microbatched(batch, where, m):
    size = len(batch["inputs"])
    return {
        name: make_microbatched_array(value, where[name], size, m) for name, value in batch.items()
    }


@pytest.mark.parametrize(
    "axis_types,spec",
    [(AxisType.Auto, P(None, "data")), (None, P())],
    ids=["auto-sharded", "explicit-replicated"],
)
def test_a_step_fed_microbatched_leaves_equals_numpy_and_nnx_jit(axis_types, spec):
    mesh = make_mesh(2, 2, axis_types)
    ref_model, ref_opt, loss_fn, kind = build("lm", "adamw", 2)
    model, opt, _, _ = build("lm", "adamw", 2)
    twin, twin_opt, _, _ = build("lm", "adamw", 2)
    reference = nnx.jit(train_step_fn(loss_fn, num_microbatches=4))

    def make_step():
        return mp.jit(train_step_fn(loss_fn), mesh=mesh, schedule=mp.OneFOneB(), num_microbatches=4)

    step, numpy_step = make_step(), make_step()
    where = batch_shardings(step, model, opt, make_batch(kind, 16))[2]
    assert [where["inputs"].spec, where["targets"].spec] == [spec, spec]
    for i in range(3):
        batch = make_batch(kind, 16, seed=i)
        ref_loss = reference(ref_model, ref_opt, batch)
        numpy_loss = numpy_step(twin, twin_opt, batch)
        fed = _microbatched(batch, where, 4)
        with count_compilations() as counter:
            loss = step(model, opt, fed)
        # The step lowered for the NumPy batch's types serves: nothing compiles again.
        assert i == 0 or counter.names == [], f"step {i} compiled {counter.names}"
        assert float(loss) == float(numpy_loss)  # bit for bit
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert step.num_compiled_steps == 1
    expected, got, same = params_of(ref_model), params_of(model), params_of(twin)
    for path in expected:
        np.testing.assert_array_equal(got[path], same[path], err_msg=path)
        np.testing.assert_allclose(got[path], expected[path], atol=1e-5, err_msg=path)


def _batch_transfer(mesh_id, m, spec=DATA):
    return Transfer(0, 1, mesh_id, "inputs host->0", src_mesh=-1, reshape_microbatches=m, spec=spec)


def _on(mesh, q, spec=DATA):
    return NamedSharding(mesh.submesh(q), spec)


def test_a_leaf_where_the_step_reads_it_is_used_as_is():
    mesh = make_mesh(2, 2)
    leaf = make_microbatched_array(np.arange(16 * 3).reshape(16, 3), _on(mesh, 1), 16, 4)
    moved = transfer_value(_batch_transfer(1, 4), leaf, Shardings(list(mesh.submeshes)))
    assert moved is leaf.array
    expected = np.arange(16 * 3).reshape(4, 4, 3)
    np.testing.assert_array_equal(np.asarray(moved), expected)
    assert {s.device for s in moved.addressable_shards} == set(mesh.devices(1))


def test_a_leaf_elsewhere_is_refused():
    mesh = make_mesh(2, 2)
    shardings = Shardings(list(mesh.submeshes))
    leaf = make_microbatched_array(np.zeros((16, 3), np.int32), _on(mesh, 0), 16, 4)
    with pytest.raises(PlacementError, match=r"not where the step reads it.*make_microbatched"):
        transfer_value(_batch_transfer(1, 4), leaf, shardings)  # another submesh
    with pytest.raises(PlacementError, match=r"not where the step reads it"):
        transfer_value(_batch_transfer(0, 4, P()), leaf, shardings)  # replicated there
    with pytest.raises(PlacementError, match="splits it into 2 microbatches"):
        transfer_value(_batch_transfer(0, 2), leaf, shardings)
    with pytest.raises(PlacementError, match=r"read outside mp\.value_and_grad"):
        take_microbatched(leaf, None, _on(mesh, 0))


def test_a_step_refuses_a_leaf_on_the_wrong_submesh():
    mesh = make_mesh(2, 2, AxisType.Auto)
    model, opt, loss_fn, kind = build("lm", "sgd", 2)
    step = mp.jit(train_step_fn(loss_fn), mesh=mesh, schedule=mp.GPipe(), num_microbatches=2)
    batch = make_batch(kind, 8)
    fed = {name: make_microbatched_array(v, _on(mesh, 0), 8, 2) for name, v in batch.items()}
    with pytest.raises(PlacementError, match=r"not where the step reads it.*submesh of the stage"):
        step(model, opt, fed)  # the targets are read by the last stage, on mesh 1


def test_bad_leaves_are_refused():
    mesh = make_mesh(2, 2)
    with pytest.raises(PlacementError, match=r"gave 3 rows for .*devices hold 8 of the batch"):
        make_microbatched_array(np.zeros((3, 2)), _on(mesh, 0), 8, 2)
    with pytest.raises(PlacementError, match="does not split into 3 microbatches"):
        process_batch_rows(_on(mesh, 0), 8, 3)
    with pytest.raises(PlacementError, match=r"expected a jax.Array \[m, B/m, ...\]"):
        MicrobatchedArray(np.zeros((2, 4)))


# -- batch_at(rows) and the per-process source ------------------------------------


def test_batch_at_rows_gathers_those_rows_only():
    it = BatchIterator(np.arange(500), batch_size=8, seq_len=6, seed=3)
    whole = it.batch_at(5)
    rows = np.array([6, 1, 2])
    part = it.batch_at(5, rows=rows)
    for name in ("inputs", "targets"):
        np.testing.assert_array_equal(part[name], whole[name][rows])
        assert part[name].dtype == np.int32
    assert it.batch_at(5, rows=np.arange(0))["inputs"].shape == (0, 6)
    assert it.position == 0


@pytest.mark.parametrize(
    "rows,match",
    [(np.array([0, 8]), r"must lie in \[0, 8\)"), (np.zeros((2, 2), int), "1-D array of ints")],
)
def test_batch_at_refuses_bad_rows(rows, match):
    it = BatchIterator(np.arange(500), batch_size=8, seq_len=6)
    with pytest.raises(MpmdError, match=match):
        it.batch_at(0, rows=rows)


def test_process_local_batches_equal_the_whole_batch(tmp_path, monkeypatch):
    monkeypatch.setenv(local_batches.DEBUG_ROWS_ENV, str(tmp_path))
    mesh = make_mesh(2, 2)
    where = {"inputs": _on(mesh, 0), "targets": _on(mesh, 1, P())}
    source = BatchIterator(np.arange(500) % 11, batch_size=8, seq_len=6, seed=2)
    batches = ProcessLocalBatches(source, where, num_microbatches=2)
    for index in range(2):
        batch = next(batches)
        whole = source.batch_at(index)
        for name in ("inputs", "targets"):
            assert batch[name].array.sharding == where[name]
            np.testing.assert_array_equal(
                np.asarray(batch[name].array), whole[name].reshape(2, 4, 6)
            )
    assert batches.position == source.position == 2
    assert batches.state_dict()["position"] == 2
    logged = [json.loads(line) for line in (tmp_path / "rows-0.jsonl").read_text().splitlines()]
    assert [r["index"] for r in logged] == [0, 1]
    assert logged[0]["inputs"] == logged[0]["targets"] == list(range(8))
