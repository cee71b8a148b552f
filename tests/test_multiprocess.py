"""Multi-process runs: 2 processes x 4 CPU devices under `nnx-mpmd launch`.

Each test spawns real processes (bounded with ``timeout -k 5 N``, listening on
127.0.0.1 only) and compares with the same script run as one process (8 CPU
devices), which matches the one-device ``nnx.jit`` reference (tests/test_jit_equivalence.py).
The layouts (tests/mp_scripts/train.py, ``mesh_devices``): one stage per process
(2 x 4), a process holding two stages (4 x 2), every stage spanning both
processes with the batch sharded over them (4 x 2, ``span``), and stages on
processes {0}, {0, 1}, {1}, {0, 1} (``mixed``: transfers between equal,
overlapping and disjoint process sets, with weights tied across stages).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mp_launch import check as _check
from mp_launch import launch as _launch
from mp_launch import read_json as _read
from mp_launch import run_single as _single

pytestmark = pytest.mark.multiprocess

RUNS = ["1f1b:2:2", "interleaved:2:4", "1f1b:4:4", "1f1b:4:4:span:mlp", "1f1b:4:4:mixed:lm_tied"]


@pytest.fixture(scope="module")
def training_results(tmp_path_factory):
    multi, single = tmp_path_factory.mktemp("multi"), tmp_path_factory.mktemp("single")
    runs = ",".join(RUNS)
    done, _ = _launch(
        "train.py", "--out", str(multi), "--runs", runs, "--steps", "3", fresh=((multi, True),)
    )
    _check(done)
    _check(_single("train.py", "--out", str(single), "--runs", runs, "--steps", "3"))
    return [_read(multi, "losses_0.json"), _read(multi, "losses_1.json")], _read(
        single, "losses_0.json"
    )


@pytest.mark.parametrize("run", RUNS)
def test_two_processes_train_like_one(training_results, run):
    per_process, single = training_results
    for result in per_process:  # every process sees the loss and the gathered parameters
        if ":span" in run:  # every stage has devices of both processes: nothing is remote
            assert result[run]["remote_before_gather"] == 0
        else:  # some stages live on the other process only
            assert result[run]["remote_before_gather"] > 0
        assert result[run]["local_after_gather"]  # mp.distributed.gather made them local
        assert result[run]["losses"] == pytest.approx(single[run]["losses"], rel=1e-5)
        assert result[run]["param_sums"].keys() == single[run]["param_sums"].keys()
        for path, total in single[run]["param_sums"].items():
            assert result[run]["param_sums"][path] == pytest.approx(total, rel=1e-4, abs=1e-4)
    assert len(set(single[run]["losses"])) > 1  # the steps trained (3 steps need not lower it)


def test_mp_gather_works_in_a_multi_process_run(training_results):
    per_process, single = training_results
    assert single[RUNS[0]]["mp_gather"] == "ok"
    for result in per_process:
        assert result[RUNS[0]]["mp_gather"] == "ok"


# How /proc/net/tcp{,6} write the loopback address (IPv4, IPv4-mapped IPv6, ::1).
LOOPBACK_HEX = ("0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000")


def test_launched_coordinator_listens_on_loopback_only(training_results):
    per_process, _ = training_results
    listening = per_process[0]["coordinator_listens_on"]
    if not Path("/proc/net/tcp").exists():
        pytest.skip("no /proc/net/tcp to read listening sockets from")
    assert listening, "process 0 found no socket listening on the coordinator's port"
    for address in listening:  # "[::]:port" would be 000...0:PORT
        assert address.rsplit(":", 1)[0] in LOOPBACK_HEX, listening


def test_killed_peer_stops_the_others_with_distributed_error(tmp_path):
    done, elapsed = _launch(
        "train.py",
        "--out",
        str(tmp_path),
        "--runs",
        "1f1b:2:2",
        "--steps",
        "6",
        NNX_MPMD_TEST_KILL_AT_STEP="2",
    )
    assert done.returncode != 0
    assert "[p0] DistributedError: " in done.stdout, done.stdout[-6000:]
    assert "died" in done.stdout or "failed" in done.stdout
    assert elapsed < 100  # bounded: no hang until the outer timeout
    assert not (tmp_path / "losses_0.json").exists()
