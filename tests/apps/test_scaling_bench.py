"""The scaling benchmarks run at a toy size and produce their tables and figures.

Each script runs in a fresh process (it asks for its own CPU device count).
No timing is asserted: only that every row, pass, table and PNG is there.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from mp_launch import codegen_flags

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def _run(script: str, args: list[str], tmp_path: pathlib.Path) -> tuple[str, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=codegen_flags())  # the script sets its devices
    out = tmp_path / "result.json"
    done = subprocess.run(
        [
            "timeout",
            "-k",
            "5",
            "240",
            sys.executable,
            str(BENCH / script),
            *args,
            "--plot-dir",
            str(tmp_path / "img"),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout, json.loads(out.read_text())


@pytest.mark.slow  # a fresh process that compiles 3 small pipelines: ~20 s on 2 cores
def test_host_bench_reports_every_row_the_fit_and_the_figures(tmp_path):
    sizes = ["--stages", "2,3", "--microbatches", "2,4", "--repeats", "2"]
    options = ["--profile", "--nice-other-threads", "5"]
    stdout, result = _run("scaling_host_bench.py", [*sizes, *options], tmp_path)
    pairs = [(r["stages"], r["microbatches"]) for r in result["rows"]]
    assert pairs == [(2, 4), (3, 2), (3, 4)]  # the cross through the largest sizes
    for row in result["rows"]:
        # 1F1B: a forward and a backward per stage and microbatch (the last stage's fused).
        assert row["tasks"] >= row["stages"] * row["microbatches"]
        assert row["instructions"] > row["tasks"] and row["us_per_task"] > 0
        # The copies run on XLA's worker threads: their CPU time is reported beside the host's.
        assert row["other_threads_cpu_us_per_task"] >= 0 <= row["preemptions_per_task"]
        assert row["other_threads_niceness"] == 5
    assert "| stages | microbatches | tasks |" in stdout
    assert "host µs/step =" in stdout and "growth exponent" in stdout
    assert "tottime" in result["profile"]
    names = sorted(os.path.basename(p) for p in result["plots"])
    assert names == ["scaling-host-per-step.png", "scaling-host-per-task.png"]
    assert all(os.path.getsize(p) > 1000 for p in result["plots"])


@pytest.mark.slow  # 3 fresh processes that compile: ~50 s on 2 cores
def test_compile_bench_times_each_pass_and_reports_every_part(tmp_path):
    stdout, result = _run(
        "scaling_compile_bench.py",
        [
            "--lowering-sizes",
            "2x2,2x4",
            "--lowering-repeats",
            "1",
            "--layers",
            "2",
            "--stages",
            "2",
            "--partition-sizes",
            "40,80",
        ],
        tmp_path,
    )
    lowering = result["lowering"]
    assert [r["tasks"] for r in lowering] == sorted(r["tasks"] for r in lowering)
    for name in ("trace_step", "lower_schedule", "insert_frees", "schedule_ticks", "(rest)"):
        assert name in lowering[-1]["passes_s"], sorted(lowering[-1]["passes_s"])
    assert sum(lowering[-1]["passes_s"].values()) == pytest.approx(lowering[-1]["lower_s"])
    assert "Growth exponent in tasks" in stdout and "| pass |" in stdout
    variants = [(r["layers"], r["variant"]) for r in result["layers"]]
    assert variants == [(2, "unrolled"), (2, "scanned")]  # each in a fresh process
    assert all(r["xla_compilations"] > 0 for r in result["layers"] + result["stages"])
    assert [r["stages"] for r in result["stages"]] == [2]
    assert "| layers | variant | lower s | compile s |" in stdout
    assert [(r["layers"], r["stages"]) for r in result["partitioner"]] == [
        (40, 32),
        (80, 32),
        (80, 64),
    ]
    names = sorted(os.path.basename(p) for p in result["plots"])
    assert names == ["scaling-compile-layers.png", "scaling-compile-stages.png",
                     "scaling-lowering.png", "scaling-partitioner.png"]  # fmt: skip


def test_pass_timer_counts_a_callee_once_and_restores_the_functions():
    sys.path.insert(0, str(BENCH))
    import itertools
    import types

    from scaling_compile_bench import PassTimer

    module = types.ModuleType("scaling_fake_passes")
    module.inner = lambda: 1
    module.outer = lambda: module.inner() + module.inner()
    sys.modules[module.__name__] = module
    original = module.inner
    ticks = itertools.count()  # a clock that advances by 1 each time it is read
    sites = {module.__name__: ["outer", "inner", "missing"]}
    with PassTimer(sites, clock=lambda: next(ticks)) as timer:
        assert module.outer() == 2
    # outer reads the clock at 0 and 5; each inner call spans one tick, its own.
    assert timer.seconds == {"outer": 3, "inner": 2}
    assert module.inner is original
