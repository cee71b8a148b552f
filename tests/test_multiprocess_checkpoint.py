"""Checkpoints of multi-process runs, restored into other layouts and process counts.

Each test spawns real processes through tests/mp_launch.py (bounded with
``timeout -k 5 N``, listening on 127.0.0.1 only) and compares with the same
script run as one process (8 CPU devices).
"""

from __future__ import annotations

import pytest
from mp_launch import check as _check
from mp_launch import launch as _launch
from mp_launch import read_json as _read
from mp_launch import run_single as _single

pytestmark = pytest.mark.multiprocess


def test_checkpoint_round_trip_between_layouts(tmp_path):
    outs = [tmp_path / f"out{i}" for i in range(4)]
    for out in outs:
        out.mkdir()
    two_ckpt, one_ckpt = tmp_path / "two", tmp_path / "one"
    done, _ = _launch(
        "checkpoint_roundtrip.py", "--out", str(outs[0]), "--save", str(two_ckpt),
        fresh=((outs[0], True), (two_ckpt, False)),
    )  # fmt: skip
    _check(done)
    _check(
        _single(
            "checkpoint_roundtrip.py",
            "--out",
            str(outs[1]),
            "--restore",
            str(two_ckpt),
            "--save",
            str(one_ckpt),
            "--seed",
            "1",
        )
    )
    done, _ = _launch(  # restored into stages that span both processes
        "checkpoint_roundtrip.py", "--out", str(outs[2]), "--restore", str(one_ckpt),
        "--seed", "2", "--layout", "span", fresh=((outs[2], True),),
    )  # fmt: skip
    _check(done)
    saved_by_two = _read(outs[0], "ckpt_0.json")
    restored_by_one = _read(outs[1], "ckpt_0.json")
    assert restored_by_one["restored"] == pytest.approx(saved_by_two["trained"], rel=1e-6)
    for process in (0, 1):
        restored_by_two = _read(outs[2], f"ckpt_{process}.json")
        assert restored_by_two["restored"] == pytest.approx(restored_by_one["trained"], rel=1e-6)
    # The step after the restore, on stages spanning both processes, is one process's step.
    _check(_single("checkpoint_roundtrip.py", "--out", str(outs[3]), "--restore", str(one_ckpt)))
    reference = _read(outs[3], "ckpt_0.json")
    for process in (0, 1):
        spanning = _read(outs[2], f"ckpt_{process}.json")
        assert spanning["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert spanning["trained"] == pytest.approx(reference["trained"], rel=1e-4, abs=1e-4)
