"""Checkpoints of multi-process runs, restored into other layouts and process counts.

One chain of runs of tests/mp_scripts/checkpoint_roundtrip.py (a 4-block LM
with Adam), each restoring what the previous one saved, training one step and
saving again:

1. 2 processes x 4 devices, 2 stages, each stage on one process (saved arrays
   live on one process each: the case orbax refuses as they are);
2. 4 processes x 2 devices, 2 stages, each spanning 2 processes (saved as they
   are placed);
3. 1 process x 8 devices, 4 stages (another stage count), which also computes
   the one-process references of the steps of runs 2 and 4;
4. 4 processes x 2 devices again, restored from run 3.

Restored values must equal the saved ones bit for bit (a CRC per variable of
model and optimizer), and the step after a multi-process restore must match
the one-process step. Launches are bounded with ``timeout -k 5 N`` and listen
on 127.0.0.1 only (tests/mp_launch.py).
"""

from __future__ import annotations

import pytest
from mp_launch import check as _check
from mp_launch import launch as _launch
from mp_launch import read_json as _read
from mp_launch import run_single as _single

pytestmark = pytest.mark.multiprocess

SCRIPT = "checkpoint_roundtrip.py"


def _crcs(digest: dict[str, list]) -> dict[str, int]:
    return {path: crc for path, (crc, _) in digest.items()}


def _sums(digest: dict[str, list]) -> dict[str, float]:
    return {path: total for path, (_, total) in digest.items()}


def _spanning_run(out, restore, save, seed, fresh, *extra):
    args = ["--out", str(out), "--restore", str(restore), "--seed", str(seed), *extra]
    if save is not None:
        args += ["--save", str(save)]
    done, _ = _launch(
        SCRIPT, *args, processes=4, devices_per_process=2, timeout=240, fresh=fresh
    )  # fmt: skip
    _check(done)
    return [_read(out, f"ckpt_{p}.json") for p in range(4)]


@pytest.mark.slow  # four runs (2, 4, 1 and 4 processes): the fewest that cover the chain
def test_checkpoint_chain_across_process_counts_and_layouts(tmp_path):
    outs = [tmp_path / f"out{i}" for i in range(4)]
    for out in outs:
        out.mkdir()
    ckpts = [tmp_path / f"ckpt{i}" for i in range(3)]

    done, _ = _launch(  # 1. two processes, one stage each
        SCRIPT, "--out", str(outs[0]), "--save", str(ckpts[0]),
        fresh=((outs[0], True), (ckpts[0], False)),
    )  # fmt: skip
    _check(done)
    by_two = [_read(outs[0], f"ckpt_{p}.json") for p in range(2)]
    assert by_two[0]["submesh_processes"] == [[0], [1]]

    by_four = _spanning_run(  # 2. four processes, stages spanning two each
        outs[1], ckpts[0], ckpts[1], 1, fresh=((outs[1], True), (ckpts[1], False))
    )
    assert by_four[0]["submesh_processes"] == [[0, 1], [2, 3]]

    _check(  # 3. one process, four stages; references for the multi-process steps
        _single(
            SCRIPT, "--out", str(outs[2]), "--stages", "4", "--restore", str(ckpts[1]),
            "--save", str(ckpts[2]), "--seed", "2",
            "--reference", str(ckpts[0]), "--reference", str(ckpts[2]),
        )
    )  # fmt: skip
    by_one = _read(outs[2], "ckpt_0.json")
    assert by_one["submesh_processes"] == [[0]] * 4

    back = _spanning_run(  # 4. and back, trying mismatching targets first
        outs[3], ckpts[2], None, 3, ((outs[3], True),), "--mismatch"
    )
    for result in back:  # the same typed error on every process, naming path and fix
        missing, extra, shape = result["mismatch"]
        assert missing.startswith("CheckpointError: ")
        assert "has 'optimizer.opt_state.0.count' but the target does not" in missing
        assert "pass partial=True" in missing
        assert "target path 'extra' is not in checkpoint" in extra
        assert "shape mismatch at 'model.embed.embedding'" in shape
        assert "[33, 16]" in shape and "same model config" in shape

    # Every restore gives back exactly what was saved, on every process.
    for result in by_four:
        assert _crcs(result["restored"]) == _crcs(by_two[0]["trained"])
    assert _crcs(by_one["restored"]) == _crcs(by_four[0]["trained"])
    for result in back:
        assert _crcs(result["restored"]) == _crcs(by_one["trained"])
    # The step after a restore on stages spanning processes is the one-process step.
    for spanning, checkpoint in ((by_four, ckpts[0]), (back, ckpts[2])):
        reference = by_one["reference"][str(checkpoint)]
        assert _crcs(reference["restored"]) == _crcs(spanning[0]["restored"])
        for result in spanning:
            assert result["loss"] == pytest.approx(reference["loss"], rel=1e-5)
            assert _sums(result["trained"]) == pytest.approx(
                _sums(reference["trained"]), rel=1e-4, abs=1e-4
            )
