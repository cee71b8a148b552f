"""Multi-process runs: 2 processes x 4 CPU devices under `nnx-mpmd launch`.

Each test spawns real processes (bounded with ``timeout -k 5 N``, listening on
127.0.0.1 only) and compares with the same script run as one process (8 CPU
devices), which matches the one-device ``nnx.jit`` reference (tests/jit/test_jit_equivalence.py).
The layouts (tests/mp_scripts/train.py, ``mesh_devices``): one stage per process
(2 x 4), a process holding two stages (4 x 2), every stage spanning both
processes with the batch sharded over them (4 x 2, ``span``), and stages on
processes {0}, {0, 1}, {1}, {0, 1} (``mixed``: transfers between equal,
overlapping and disjoint process sets, with weights tied across stages).
One launch of 4 processes x 2 devices covers 2 stages each spanning two
processes (the batch split over 4 devices) and 4 stages where every process
holds a device of two stages (``pairs``, with weights tied across processes),
and a ring of 4 stages where stage i spans processes i and i + 1 (mod 4)
(``shift``: a process receives one shard of a transfer and sends another; it
hung every time while those moves were batched into one ``jax.device_put``).
The ``mixed`` and ``shift`` runs donate the model's and optimizer's state
(``mp.jit(donate_argnums=(0, 1))``): buffers of arrays that span processes are
reused in place, and moves between processes read none that were donated.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mp_launch import LAUNCH_TIMEOUT_S, dump_after_s
from mp_launch import check as _check
from mp_launch import launch as _launch
from mp_launch import launch_once as _launch_once
from mp_launch import read_json as _read
from mp_launch import run_single as _single
from shared_results import once_per_test_run

pytestmark = pytest.mark.multiprocess

RUNS = [
    "1f1b:2:2",
    "interleaved:2:4",
    "1f1b:4:4",
    "1f1b:4:4:span:mlp",
    "1f1b:4:4:mixed:lm_tied:donate",
]
# 4 processes x 2 devices, 2 steps: 2 stages on processes {0, 1} and {2, 3}; 4 stages
# where each process holds a device of two stages; a ring of 4 stages over the processes.
RUNS_4 = ["1f1b:2:2:proc:mlp", "1f1b:4:4:pairs:lm_tied", "1f1b:4:4:shift:mlp:donate"]
STEPS = {2: "3", 4: "2"}


def _run_as_one_process(directory, runs, processes):
    """The runs of one launch as one process with 8 devices, the same number of steps."""
    _check(
        _single(
            "train.py", "--out", str(directory), "--runs", ",".join(runs),
            "--steps", STEPS[processes],
        )
    )  # fmt: skip
    return _read(directory, "losses_0.json")


def _launched(directory, runs, processes):
    done, elapsed = _launch(
        "train.py",
        "--out",
        str(directory),
        "--runs",
        ",".join(runs),
        "--steps",
        STEPS[processes],
        processes=processes,
        devices_per_process=8 // processes,
        fresh=((directory, True),),
    )
    _check(done)
    print(f"{processes} processes: {elapsed:.1f} s")
    return [_read(directory, f"losses_{p}.json") for p in range(processes)]


def _launched_and_single(runs, processes):
    """(per-process results of the launch, results of the same runs as one process).

    Each computed once for all xdist workers (tests/shared_results.py), not once per
    worker. The launch comes first and each launch has its own one-process run: a
    worker that starts the 4-process fixture while another starts the 2-process one
    launches at once instead of waiting on the other's one-process run.
    """
    launched = once_per_test_run(
        f"multiprocess-{processes}", lambda d: _launched(d, runs, processes)
    )
    single = once_per_test_run(
        f"multiprocess-single-{processes}", lambda d: _run_as_one_process(d, runs, processes)
    )
    return launched, single


@pytest.fixture(scope="module")
def training_results():
    return _launched_and_single(RUNS, 2)


@pytest.fixture(scope="module")
def four_process_results():
    return _launched_and_single(RUNS_4, 4)


def _assert_trained_like_one(per_process, single, run, spans_every_process=False):
    for result in per_process:  # every process sees the loss and the gathered parameters
        if spans_every_process:  # every stage has devices of every process: nothing is remote
            assert result[run]["remote_before_gather"] == 0
        else:  # some stages live on other processes only
            assert result[run]["remote_before_gather"] > 0
        assert result[run]["local_after_gather"]  # mp.distributed.gather made them local
        assert result[run]["losses"] == pytest.approx(single[run]["losses"], rel=1e-5)
        assert result[run]["param_sums"].keys() == single[run]["param_sums"].keys()
        for path, total in single[run]["param_sums"].items():
            assert result[run]["param_sums"][path] == pytest.approx(total, rel=1e-4, abs=1e-4)
    assert len(set(single[run]["losses"])) > 1  # the steps trained (a few need not lower it)


@pytest.mark.parametrize("run", RUNS)
def test_two_processes_train_like_one(training_results, run):
    per_process, single = training_results
    _assert_trained_like_one(per_process, single, run, spans_every_process=":span" in run)


@pytest.mark.parametrize("run", RUNS_4)
def test_four_processes_train_like_one(four_process_results, run):
    per_process, single = four_process_results
    assert len(per_process) == 4
    _assert_trained_like_one(per_process, single, run)


def test_mp_gather_works_in_a_multi_process_run(training_results):
    per_process, single = training_results
    assert single[RUNS[0]]["mp_gather"] == "ok"
    for result in per_process:
        assert result[RUNS[0]]["mp_gather"] == "ok"


def test_profile_records_every_task_in_a_multi_process_run(training_results):
    per_process, single = training_results
    for run in RUNS:
        assert single[run]["profiled_tasks"]  # the schedule's tasks, once each
        for result in per_process:
            assert result[run]["profiled_tasks"] == single[run]["profiled_tasks"]


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


def _assert_ended_on_its_own(elapsed, done):
    """Bounded: the run ended before a hang's stacks would be dumped (`dump_after_s`).

    The clock only tells a hang from an end, however slow the machine: the bound is
    the time limit's, not the run's usual time.
    """
    hung_at = dump_after_s(LAUNCH_TIMEOUT_S)
    assert elapsed < hung_at, f"hung: ran {elapsed:.0f} s\n{done.stdout[-6000:]}"


# The runs that lose a process train the MLP: it compiles in half the time of the LM,
# and where a process dies (at the start of a step) does not depend on the model.
KILLED_RUN = "1f1b:2:2:proc:mlp"


def test_killed_peer_stops_the_others_with_distributed_error(tmp_path):
    # launch_once: a SIGKILLed process exits with 137, which `launch` takes for a timeout.
    done, elapsed = _launch_once(
        "train.py",
        "--out",
        str(tmp_path),
        "--runs",
        KILLED_RUN,
        "--steps",
        "6",
        NNX_MPMD_TEST_KILL_AT_STEP="2",
    )
    assert done.returncode != 0
    assert "[p0] DistributedError: " in done.stdout, done.stdout[-6000:]
    assert "died" in done.stdout or "failed" in done.stdout
    _assert_ended_on_its_own(elapsed, done)
    assert not (tmp_path / "losses_0.json").exists()


def test_killed_coordinator_is_named_as_the_cause(tmp_path):
    # Process 0 hosts the coordination service: JAX aborts the others within
    # milliseconds of losing it (no Python code runs first), so the launcher says
    # where the failure started.
    done, elapsed = _launch_once(
        "train.py",
        "--out",
        str(tmp_path),
        "--runs",
        KILLED_RUN,
        "--steps",
        "4",
        NNX_MPMD_TEST_KILL_AT_STEP="2",
        NNX_MPMD_TEST_KILL_PROCESS="0",
    )
    assert done.returncode == 128 + 9, done.stdout[-6000:]  # process 0's SIGKILL, first
    assert "[p0] killing process 0 at step 2" in done.stdout
    assert re.search(
        r"nnx-mpmd launch: process 0 \(the coordinator\) failed first \(killed by signal 9\)\. "
        r"It hosts the coordination service.*\[p0\] lines",
        done.stdout,
    ), done.stdout[-6000:]
    # Process 1 stopped on its own: JAX's abort (a FATAL log line) or, when a transfer
    # from process 0 fails first, the error that transfer raised, or, when a read of the
    # coordination service fails first, nnx_mpmd's DistributedError naming process 0
    # (a race between them; under load either error can end the process before the abort).
    stopped = re.search(
        r"^\[p1\] (F\d{4} |.*JaxRuntimeError|DistributedError: process 1 lost the "
        r"coordination service \(process 0\))",
        done.stdout,
        re.MULTILINE,
    )
    assert stopped, done.stdout[-6000:]
    _assert_ended_on_its_own(elapsed, done)
