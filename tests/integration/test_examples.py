"""Smoke tests: every example runs with a small flag and passes its own checks."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
from mp_launch import codegen_flags

from nnx_mpmd.schedules.draw import matplotlib_missing

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"

# 09_plan.py profiles each microbatch count on its own: one count, no remat, two schedules.
PLAN_SMOKE = ["--schedules", "1f1b,zb-h1", "--no-remat", "--candidate-microbatches", "8"]

# (script, small flags, a line its own assertions print only when they passed)
CASES = [
    ("01_quickstart.py", ["--steps", "30"], "loss: step 0"),
    ("02_gpt_pipeline.py", ["--steps", "12"], "equals the unpipelined"),
    ("03_llama_interleaved.py", ["--steps", "2"], "equal the unpipelined run"),
    ("04_checkpoint_resume.py", ["--steps", "4"], "resumed losses match"),
    ("05_annotate_existing_model.py", ["--steps", "3"], "equal to nnx.jit at every step"),
    ("06_custom_schedule.py", ["--steps", "5"], "with and without overlapped pairs"),
    (
        "07_token_weighted_loss.py",
        ["--steps", "2"],
        "every sequence's loss, equals the whole batch's",
    ),
    ("08_generate.py", ["--steps", "2", "--new-tokens", "6"], "equal the one-device decoding"),
    ("09_plan.py", ["--steps", "2", *PLAN_SMOKE], "equal the unpipelined run"),
    ("10_scan_stack.py", ["--steps", "3"], "every step's loss equals the unpipelined reference"),
    ("11_measured_timeline.py", ["--steps", "2"], "profiled step included"),
    ("12_finetune_pretrained.py", ["--steps", "1"], "the exported checkpoint loads back"),
]


# Examples run at XLA's default optimization level, so that equality with the
# unpipelined run stays checked at O2; the others with this test run's code-generation
# flags (tests/conftest.py: O0, about a quarter less compile time).
AT_DEFAULT_LEVEL = {"01_quickstart.py", "02_gpt_pipeline.py"}


def test_every_example_is_smoke_tested():
    assert sorted(p.name for p in EXAMPLES.glob("[0-9]*.py")) == [c[0] for c in CASES]


@pytest.mark.slow  # a fresh process that compiles the example's steps: 10-30 s each
@pytest.mark.parametrize(("script", "flags", "expected"), CASES, ids=[c[0] for c in CASES])
def test_example_runs(script, flags, expected, tmp_path):
    # No device count in XLA_FLAGS: each example must ask for its 8 CPU devices itself.
    env = {
        k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")
    }
    if script not in AT_DEFAULT_LEVEL and codegen_flags():
        env["XLA_FLAGS"] = codegen_flags()
    if script == "04_checkpoint_resume.py":
        flags = [*flags, "--dir", str(tmp_path)]
    if script == "11_measured_timeline.py":
        flags = [*flags, "--out", str(tmp_path / "pictures" / "timeline.png")]
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *flags],
        capture_output=True,
        text=True,
        env={**env, "JAX_PLATFORMS": "cpu", "NNX_MPMD_COMPILE_CACHE": str(tmp_path / "cache")},
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert expected in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    # Each example turns JAX's persistent compilation cache on (here: under tmp_path).
    assert list((tmp_path / "cache").glob("*-cache")), "the example wrote no compilation cache"
    if script == "05_annotate_existing_model.py":
        _check_the_annotate_example_shows_the_paths_next_to_a_wrong_one(proc)
    if script == "11_measured_timeline.py" and matplotlib_missing() is None:
        # One picture per schedule; without matplotlib the example skips them.
        pictures = sorted(p.name for p in (tmp_path / "pictures").glob("*.png"))
        assert pictures == ["timeline-1f1b.png", "timeline-zb-h1.png"], pictures


def _check_the_annotate_example_shows_the_paths_next_to_a_wrong_one(proc):
    """05's stage table and its error for a pattern that matches no path, word for word."""
    lines = proc.stdout.splitlines()
    assert lines[:6] == [
        "stage  params  bytes  paths",
        "0        2528  10112  layers.0-2",
        "1        1120   4480  layers.3",
        "2        2240   8960  layers.4-5",
        "3        1153   4612  layers.6-7",
        "total    7041  28164",
    ]
    assert "pattern 'layers.8' matches no path of Sequential" in proc.stdout
    assert "Paths under 'layers': layers.0, layers.1," in proc.stdout
    assert proc.stderr == "", proc.stderr
